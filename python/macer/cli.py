"""Command line: ``macer demo`` (staged pruning end to end) and ``macer bench`` (end-to-end benchmarks).

``macer demo`` builds a Qwen2.5-Omni thinker with random weights in code (no download), a synthetic clip at the
paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), and runs full prefill vs MACER
with the 7B defaults at keep ratio 0.25, then a short ``generate``. ``macer demo --model PATH --video FILE
--question TEXT`` runs a real local checkpoint through its processor instead (see ``docs/integration.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["main"]

DEMO_SHAPE = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1536}
"""Default random thinker of the demo: deep enough for the 7B readout layers (3, 5) and wide enough that the
decoder, not the tiny encoders, dominates prefill time on a 2-core CPU (about 2-4 s per full prefill)."""

REAL_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                      "auditory and visual inputs, as well as generating text and speech.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``macer`` console script."""
    parser = argparse.ArgumentParser(prog="macer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="full prefill vs MACER on a random thinker (default) or a local checkpoint")
    demo.add_argument("--keep-ratio", type=float, default=0.25, help="rho, share of audio+video tokens kept")
    demo.add_argument("--layers", type=int, default=DEMO_SHAPE["num_layers"], help="decoder layers (random model)")
    demo.add_argument("--hidden", type=int, default=DEMO_SHAPE["hidden_size"], help="hidden size (random model)")
    demo.add_argument("--heads", type=int, default=DEMO_SHAPE["num_heads"], help="attention heads (random model)")
    demo.add_argument("--kv-heads", type=int, default=DEMO_SHAPE["num_kv_heads"], help="KV heads (random model)")
    demo.add_argument("--frames", type=int, default=12, help="video frames of the synthetic clip (2 per grid)")
    demo.add_argument("--audio-tokens", type=int, default=1460, help="audio tokens of the synthetic clip")
    demo.add_argument("--blocks", action="store_true", help="video block then audio block (use_audio_in_video=False)")
    demo.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    demo.add_argument("--new-tokens", type=int, default=8, help="tokens to generate")
    demo.add_argument("--repeats", type=int, default=2, help="timed prefills of each kind (median reported)")
    demo.add_argument("--out", default="out", help="directory for the PNG of kept tokens")
    demo.add_argument("--model", help="path of a local Qwen2.5-Omni (thinker) checkpoint")
    demo.add_argument("--video", help="video file for --model (its audio track is used)")
    demo.add_argument("--question", help="question about the video for --model")
    demo.add_argument("--fps", type=float, default=2.0, help="video sampling fps for --model (processor default 2)")

    bench = sub.add_parser("bench", help="end-to-end benchmarks: full vs MACER (module macer.bench)")
    try:
        import macer.bench as bench_module
    except ImportError as exc:  # macer.bench belongs to the benchmarks; the CLI must not depend on it being present
        bench_module = None
        bench_error = str(exc)
        bench.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        bench_module.add_arguments(bench)

    sub.add_parser("diagnose", add_help=False, help="attention diagnostics of one prompt: JSON + PNG figures")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["diagnose"]:  # macer.diagnostics parses its own arguments
        from macer.diagnostics import main as diagnose_main

        return diagnose_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "bench":
        if bench_module is None:
            print(f"macer bench is not available: the module macer.bench could not be imported ({bench_error})",
                  file=sys.stderr)
            return 2
        return int(bench_module.run(args) or 0)
    if args.model or args.video or args.question:
        if not (args.model and args.video and args.question):
            parser.error("--model, --video and --question go together")
        return _demo_real(args)
    return _demo_random(args)


# ------------------------------------------------------------------------------------------------ random model
def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _demo_random(args: argparse.Namespace) -> int:
    import macer
    from macer.adapters import get_adapter
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    torch.manual_seed(0)
    shape = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "intermediate_size": 3 * args.hidden}
    model = build_thinker(attn_implementation=args.attn, **shape)
    inputs = clip_inputs(model, frames=args.frames, audio_tokens=args.audio_tokens,
                         use_audio_in_video=not args.blocks and args.frames > 0 and args.audio_tokens > 0)
    # The paper's 7B readout layers and shares; the vocabulary is synthetic, hence its own <|im_end|> id.
    config = macer_config_for(model, keep_ratio=args.keep_ratio)
    ids = inputs["input_ids"][0]
    n = ids.numel()
    print(f"Qwen2.5-Omni thinker, random weights: {args.layers} layers, hidden {args.hidden}, {args.heads}/"
          f"{args.kv_heads} heads, attention {args.attn}, {torch.get_num_threads()} CPU threads")
    config_text = ", ".join(f"{k}={getattr(config, k)}" for k in
                            ("keep_ratio", "audio_layer", "video_layer", "audio_share", "coverage_weight",
                             "num_chunks", "query_tokens"))
    print(f"MACER config: {config_text}")
    layout = "interleaved 2-s chunks" if inputs["use_audio_in_video"] else "blocks"
    print(f"prompt: {n} tokens ({args.frames} frames, {layout})")

    with torch.no_grad():
        llm = _LLMTimer(get_adapter(model).parts(model).decoder)
        full_times, macer_times, full_llm, macer_llm = [], [], [], []
        model(**inputs)  # warm-up
        for _ in range(max(1, args.repeats)):  # alternate so that machine noise hits both alike
            seconds, full = _timed(lambda: model(**inputs, use_cache=True))
            full_times.append(seconds)
            full_llm.append(llm.seconds)
            with macer.compress(model, config, profile=True) as trace:
                seconds, pruned = _timed(lambda: model(**inputs, use_cache=True))
            macer_times.append(seconds)
            macer_llm.append(llm.seconds)
        llm.remove()
        record = trace.last
        print(f"tokens: text {n - record.n_audio - record.n_video}, audio {record.n_audio}, video {record.n_video}")
        budget = record.budget
        print(f"budget (split_budget): K_mm={budget.total}  K_a={budget.audio}  K_v={budget.video}")
        _print_stages(record)
        print(f"tokens per layer (1..{len(record.layer_tokens)}): {record.layer_tokens}")
        _print_caches(full.past_key_values, pruned.past_key_values)
        proxy = sum(record.layer_tokens) / (n * len(record.layer_tokens))
        f_all, m_all = statistics.median(full_times), statistics.median(macer_times)
        f_llm, m_llm = statistics.median(full_llm), statistics.median(macer_llm)
        print(f"prefill time (median of {len(full_times)}): full {f_all:.2f} s, MACER {m_all:.2f} s "
              f"(x{f_all / m_all:.2f}); decoder only: full {f_llm:.2f} s, MACER {m_llm:.2f} s (x{f_llm / m_llm:.2f}); "
              f"token-layer proxy {proxy:.3f} (ideal x{1 / proxy:.2f}); MACER's own work {record.overhead_s:.3f} s")

        new = args.new_tokens
        seconds_full, out_full = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        with macer.compress(model, config) as trace:
            seconds_macer, out_macer = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        answer_full, answer_macer = out_full[0, n:].tolist(), out_macer[0, n:].tolist()
        print(f"generate {new} tokens: full {seconds_full:.2f} s -> {answer_full}")
        print(f"                  MACER {seconds_macer:.2f} s -> {answer_macer} (random weights: ids, not words)")

    path = _plot_timeline(Path(args.out), ids, record, inputs, model)
    print(f"kept tokens along the timeline: {path}")
    return 0


class _LLMTimer:
    """Wall time of the decoder (text model) forward, to separate it from the encoders."""

    def __init__(self, decoder: torch.nn.Module):
        self.seconds = 0.0
        self._start = 0.0
        self._handles = [decoder.register_forward_pre_hook(self._pre), decoder.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds = time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _print_stages(record) -> None:
    audio_left, video_left = record.n_audio, record.n_video
    for stage in record.stages:
        if "audio" in stage.modalities:
            audio_left = len(record.audio_kept)
        if "video" in stage.modalities:
            video_left = len(record.video_kept)
        print(f"after layer {stage.layer} ({'+'.join(stage.modalities)} pruned): audio {audio_left}/{record.n_audio}, "
              f"video {video_left}/{record.n_video}, sequence {stage.tokens_before} -> {stage.tokens_after}")


def _print_caches(full_cache, pruned_cache) -> None:
    def sizes(cache):
        lengths = [layer.get_seq_length() for layer in cache.layers]
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        return lengths, nbytes

    full_len, full_bytes = sizes(full_cache)
    macer_len, macer_bytes = sizes(pruned_cache)
    print(f"KV cache per layer, full:  {full_len} ({full_bytes / 2**20:.1f} MiB)")
    print(f"KV cache per layer, MACER: {macer_len} ({macer_bytes / 2**20:.1f} MiB, "
          f"{100 * macer_bytes / full_bytes:.0f}% of full)")


def _plot_timeline(out_dir: Path, ids: torch.Tensor, record, inputs: dict[str, Any], model) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from macer.testing import SYNTHETIC_TOKENS

    out_dir.mkdir(parents=True, exist_ok=True)
    rope, _ = model.get_rope_index(
        inputs["input_ids"], None, inputs.get("video_grid_thw"), inputs["attention_mask"], inputs["use_audio_in_video"],
        inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None,
        inputs.get("video_second_per_grid"))
    temporal = rope[0, 0].double()
    media = (ids == SYNTHETIC_TOKENS.audio) | (ids == SYNTHETIC_TOKENS.video)
    seconds = (temporal - temporal[media].min()) / model.config.position_id_per_seconds
    generator = torch.Generator().manual_seed(0)
    # Video: each temporal grid drawn as a small image (x = grid time + width index, y = height index) so that the
    # spatial pattern of kept tokens shows; audio: one point per token at its time, with a fixed vertical jitter.
    is_video = ids == SYNTHETIC_TOKENS.video
    x, y = seconds.clone(), torch.rand(ids.numel(), generator=generator, dtype=torch.float64)
    if bool(is_video.any()):
        height = rope[1, 0].double() - rope[1, 0][is_video].min()
        width = rope[2, 0].double() - rope[2, 0][is_video].min()
        times = seconds[is_video].unique()
        gap = float(times.diff().min()) if times.numel() > 1 else 1.0
        x[is_video] += width[is_video] * 0.8 * gap / (float(width[is_video].max()) + 1)
        y[is_video] = -height[is_video]
    fig, axes = plt.subplots(2, 1, figsize=(11, 4), sharex=True)
    for ax, token, kept, name in ((axes[0], SYNTHETIC_TOKENS.audio, record.audio_kept, "audio"),
                                  (axes[1], SYNTHETIC_TOKENS.video, record.video_kept, "video")):
        members = (ids == token).nonzero().reshape(-1)
        kept_mask = torch.zeros(ids.numel(), dtype=torch.bool)
        kept_mask[kept] = True
        dropped = members[~kept_mask[members]]
        keep = members[kept_mask[members]]
        ax.scatter(x[dropped], y[dropped], s=2, c="lightgray", label="dropped")
        ax.scatter(x[keep], y[keep], s=4, c="tab:red" if name == "audio" else "tab:blue", label="kept")
        ax.set_yticks([])
        ax.set_ylabel(f"{name}\n{len(kept)}/{members.numel()}")
        ax.legend(loc="upper right", fontsize=7, markerscale=3)
    axes[1].set_xlabel("clip time (s, from the temporal M-RoPE position ids)")
    axes[0].set_title(f"MACER kept tokens (keep ratio {record.budget.total / (record.n_audio + record.n_video):.2f})")
    fig.tight_layout()
    path = out_dir / "macer_kept_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ real checkpoint
def _demo_real(args: argparse.Namespace) -> int:
    """A local Qwen2.5-Omni checkpoint through its processor. Needs transformers 5.23, torchvision (video
    decoding), torchcodec >= 0.17 (audio from the video file) and the weights on disk."""
    import macer

    try:
        from transformers import Qwen2_5OmniProcessor, Qwen2_5OmniThinkerForConditionalGeneration
    except ImportError as exc:
        print(f"macer demo --model needs transformers with Qwen2.5-Omni (pip install 'macer-kernels[models]'): {exc}",
              file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    processor = Qwen2_5OmniProcessor.from_pretrained(args.model)
    # The thinker alone: on transformers 5.23 the full model's generate() cannot return text only.
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(args.model, dtype=dtype).to(device).eval()
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": REAL_SYSTEM_PROMPT}]},
        {"role": "user", "content": [{"type": "video", "video": args.video}, {"type": "audio"},
                                     {"type": "text", "text": args.question}]},
    ]
    try:
        inputs = processor.apply_chat_template(
            conversation, load_audio_from_video=True, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt", processor_kwargs={"videos_kwargs": {"fps": args.fps}})
    except (ImportError, RuntimeError, ValueError) as exc:
        print(f"the processor could not read {args.video}: {exc}\n(video decoding needs torchvision, the audio track "
              "torchcodec >= 0.17)", file=sys.stderr)
        return 2
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["use_audio_in_video"] = True
    # The question span ends at the last <|im_end|>: take its id from this checkpoint's tokenizer (151645 for the
    # released Qwen2.5-Omni vocabulary), so that another vocabulary cannot silently move the span to the prompt's end.
    tokenizer = getattr(processor, "tokenizer", None)
    overrides = {}
    if tokenizer is not None:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
            overrides["end_of_turn_token_id"] = im_end
    config = macer.MacerConfig.for_model(model, keep_ratio=args.keep_ratio, **overrides)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        seconds_full, full = _timed(lambda: model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False))
        with macer.compress(model, config) as trace:
            seconds_macer, pruned = _timed(
                lambda: model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False))
    record = trace.last
    print(f"{config}\nprompt {n} tokens: audio {record.n_audio}, video {record.n_video}; budget {record.budget}")
    _print_stages(record)
    print(f"tokens per layer: {record.layer_tokens}")
    print(f"KV cache per layer after prefill: {record.cache_lengths}")
    decode = processor.batch_decode
    print(f"full  ({seconds_full:.1f} s): {decode(full[:, n:], skip_special_tokens=True)[0]}")
    print(f"MACER ({seconds_macer:.1f} s): {decode(pruned[:, n:], skip_special_tokens=True)[0]}")
    _plot_timeline_real(Path(args.out), inputs, record, model)
    return 0


def _plot_timeline_real(out_dir: Path, inputs: dict[str, Any], record, model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    n = inputs["input_ids"].shape[1]
    fig, ax = plt.subplots(figsize=(11, 2.5))
    ax.eventplot([record.audio_kept, record.video_kept], colors=["tab:red", "tab:blue"], lineoffsets=[1, 0])
    ax.set_yticks([0, 1], ["video", "audio"])
    ax.set_xlim(0, n)
    ax.set_xlabel("prompt position")
    fig.tight_layout()
    path = out_dir / "macer_kept_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"kept tokens along the prompt: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
