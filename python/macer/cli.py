"""Command line of MACER: ``macer demo`` runs staged pruning end to end (``macer bench`` says where it moved).

``macer demo`` builds a Qwen2.5-Omni thinker with random weights in code (no download), a synthetic clip at the
paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), and runs full prefill vs MACER
with the 7B defaults at keep ratio 0.25, then a short ``generate``. ``macer demo --model PATH --video FILE
--question TEXT`` runs a real local checkpoint through its processor instead (see ``docs/integration.md``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

__all__ = ["main"]

DEMO_SHAPE = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 1536}
"""Default random thinker of the demo: deep enough for the 7B readout layers (3, 5) and wide enough that the
decoder, not the tiny encoders, dominates prefill time on a 2-core CPU (about 1 s per full prefill when idle)."""

REAL_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                      "auditory and visual inputs, as well as generating text and speech.")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``macer demo: error: <what, naming the flag and the allowed range>``, exit 2
    (argparse's default prints the whole usage block first, which buries the reason)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value

    return parse


def _even_count(text: str) -> int:
    value = _int_at_least(0)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be an even integer >= 0 (Qwen2.5-Omni groups 2 frames), got {value}")
    return value


def _float_in(lo: float, hi: float, *, lo_open: bool) -> Callable[[str], float]:
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if math.isinf(hi) else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text!r}") from None
        if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text}")
        return value

    return parse


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``macer`` argument parser and its ``demo`` subparser (``bench`` only points to the benchmark)."""
    parser = _Parser(prog="macer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="full prefill vs MACER on a random thinker (default) or a local checkpoint")
    count = _int_at_least
    demo.add_argument("--keep-ratio", type=_float_in(0, 1, lo_open=True), default=0.25,
                      help="rho in (0, 1], share of audio+video tokens kept (default 0.25)")
    demo.add_argument("--layers", type=count(2), default=DEMO_SHAPE["num_layers"],
                      help="decoder layers of the random model, >= 2 (default 8)")
    demo.add_argument("--audio-layer", type=count(1), default=None,
                      help="l_a: audio is scored inside this layer (counted from 1) and pruned after it; in "
                           "[1, layers - 1]; default the paper's 7B value 3 (--model: the checkpoint's scale)")
    demo.add_argument("--video-layer", type=count(1), default=None,
                      help="l_v, the same for video; default the paper's 7B value 5")
    demo.add_argument("--hidden", type=count(2), default=DEMO_SHAPE["hidden_size"],
                      help="hidden size of the random model (default 512); hidden / heads must be even")
    demo.add_argument("--heads", type=count(1), default=DEMO_SHAPE["num_heads"],
                      help="attention heads of the random model (default 8); must divide --hidden")
    demo.add_argument("--kv-heads", type=count(1), default=DEMO_SHAPE["num_kv_heads"],
                      help="KV heads of the random model (default 2); must divide --heads")
    demo.add_argument("--frames", type=_even_count, default=12,
                      help="video frames of the synthetic clip, even (2 per temporal group), 0 = no video")
    demo.add_argument("--audio-tokens", type=count(0), default=1460,
                      help="audio tokens of the synthetic clip (25 per second), 0 = no audio")
    demo.add_argument("--blocks", action="store_true", help="video block then audio block (use_audio_in_video=False)")
    demo.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    demo.add_argument("--new-tokens", type=count(1), default=8, help="tokens to generate (>= 1)")
    demo.add_argument("--repeats", type=count(1), default=5,
                      help="timed prefills of each kind after one warm-up of each (>= 1, default 5)")
    demo.add_argument("--out", default="out", help="directory for the PNG of kept tokens")
    demo.add_argument("--model", help="path of a local Qwen2.5-Omni (thinker) checkpoint directory")
    demo.add_argument("--video", help="video file for --model (its audio track is used)")
    demo.add_argument("--question", help="question about the video for --model")
    demo.add_argument("--fps", type=_float_in(0, math.inf, lo_open=True), default=2.0,
                      help="video sampling fps for --model (> 0; processor default 2)")

    sub.add_parser("bench", add_help=False, help="moved: python -m benchmarks.bench_e2e (from a clone)")
    sub.add_parser("diagnose", add_help=False, help="attention diagnostics of one prompt: JSON + PNG figures")
    return parser, demo


BENCH_MOVED = ("macer bench: the end-to-end benchmark is no longer part of the installed package; from a clone of the "
               "repository run `python -m benchmarks.bench_e2e` (results in out/bench/; --record writes the committed "
               "benchmarks/results/)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``macer`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # whatever its arguments were (they belonged to the moved harness)
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    if argv[:1] == ["diagnose"]:  # macer.diagnostics parses its own arguments
        from macer.diagnostics import main as diagnose_main

        return diagnose_main(argv[1:])
    parser, demo = _build_parser()
    args = parser.parse_args(argv)
    if args.model or args.video or args.question:
        if not (args.model and args.video and args.question):
            demo.error("--model, --video and --question go together")
        if not Path(args.model).is_dir():
            what = "is not a directory" if Path(args.model).exists() else "does not exist"
            demo.error(f"--model {args.model}: the local path {what} (macer demo reads a checkpoint directory "
                       "from disk; it does not download)")
        if not Path(args.video).is_file():
            what = "is not a file" if Path(args.video).exists() else "does not exist"
            demo.error(f"--video {args.video}: the file {what}")
        return _demo_real(args)
    _check_random_model_args(demo, args)
    return _demo_random(args)


def _check_random_model_args(demo: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks between flags (each flag's own range is checked by its ``type=``)."""
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        demo.error(f"--heads {args.heads} must divide --hidden {args.hidden} into an even head size "
                   f"(e.g. --heads {_even_divisor_hint(args.hidden)})")
    if args.heads % args.kv_heads:
        demo.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    bad = [f"{flag} {value}" if value else f"{flag} (default {default}, the paper's 7B layer)"
           for flag, value, default in (("--audio-layer", args.audio_layer, 3), ("--video-layer", args.video_layer, 5))
           if (value or default) > args.layers - 1]
    if bad:
        demo.error(f"{' and '.join(bad)} must be in [1, {args.layers - 1}] for --layers {args.layers} (layers count "
                   "from 1; the pruned sequence needs a later layer)")
    if args.frames == 0 and args.audio_tokens == 0:
        demo.error("--frames 0 with --audio-tokens 0 leaves no audio or video tokens, so MACER has nothing to prune: "
                   "give --frames (even, > 0) or --audio-tokens (> 0)")


def _even_divisor_hint(hidden: int) -> str:
    heads = [h for h in range(1, 65) if hidden % h == 0 and (hidden // h) % 2 == 0]
    return ", ".join(map(str, heads[-4:])) if heads else "1"


# ------------------------------------------------------------------------------------------------ random model
def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _demo_random(args: argparse.Namespace) -> int:
    import macer
    from macer.adapters import get_adapter
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    load_before = _load_average()  # before this process adds its own load
    torch.manual_seed(0)
    shape = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "intermediate_size": 3 * args.hidden}
    model = build_thinker(attn_implementation=args.attn, **shape)
    inputs = clip_inputs(model, frames=args.frames, audio_tokens=args.audio_tokens,
                         use_audio_in_video=not args.blocks and args.frames > 0 and args.audio_tokens > 0)
    # The paper's 7B readout layers and shares unless given; the vocabulary is synthetic, hence its own <|im_end|> id.
    layers = {"audio_layer": args.audio_layer or 3, "video_layer": args.video_layer or 5}
    config = macer_config_for(model, keep_ratio=args.keep_ratio, **layers)
    ids = inputs["input_ids"][0]
    n = ids.numel()
    print(f"Qwen2.5-Omni thinker, random weights: {args.layers} layers, hidden {args.hidden}, {args.heads}/"
          f"{args.kv_heads} heads, attention {args.attn}, {torch.get_num_threads()} CPU threads")
    config_text = ", ".join(f"{k}={getattr(config, k)}" for k in
                            ("keep_ratio", "audio_layer", "video_layer", "audio_share", "coverage_weight",
                             "num_chunks", "query_tokens"))
    print(f"MACER config: {config_text}")
    if args.frames and args.audio_tokens:
        layout = "interleaved 2-s chunks" if inputs["use_audio_in_video"] else "blocks"
    else:
        layout = "audio only" if args.audio_tokens else "video only"
    print(f"prompt: {n} tokens ({args.frames} frames, {layout})")

    with torch.no_grad():
        llm = _LLMTimer(get_adapter(model).parts(model).decoder)

        def full_prefill():
            return model(**inputs, use_cache=True)

        def macer_prefill():
            with macer.compress(model, config, profile=True) as trace:
                out = model(**inputs, use_cache=True)
            return out, trace.last

        # One untimed run of each first: the first calls pay for lazy initialisation and cold caches (on a fresh
        # install the first two runs looked no faster with MACER).
        full_prefill()
        macer_prefill()
        times: dict[str, list[float]] = {"full": [], "MACER": [], "full decoder": [], "MACER decoder": []}
        for round_ in range(args.repeats):  # alternate the order so that machine noise hits both alike
            for kind in (("full", "MACER") if round_ % 2 == 0 else ("MACER", "full")):
                seconds, result = _timed(full_prefill if kind == "full" else macer_prefill)
                times[kind].append(seconds)
                times[f"{kind} decoder"].append(llm.seconds)
                if kind == "full":
                    full = result
                else:
                    pruned, record = result
        llm.remove()
        print(f"tokens: text {n - record.n_audio - record.n_video}, audio {record.n_audio}, video {record.n_video}")
        budget = record.budget
        print(f"budget (split_budget): K_mm={budget.total}  K_a={budget.audio}  K_v={budget.video}")
        _print_stages(record)
        print(f"tokens per layer (1..{len(record.layer_tokens)}): {record.layer_tokens}")
        _print_caches(full.past_key_values, pruned.past_key_values)
        _print_times(times, record, n, load_before)

        new = args.new_tokens
        seconds_full, out_full = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        with macer.compress(model, config):
            seconds_macer, out_macer = _timed(lambda: model.generate(**inputs, max_new_tokens=new, do_sample=False))
        answer_full, answer_macer = out_full[0, n:].tolist(), out_macer[0, n:].tolist()
        print(f"generate {new} tokens (one run each): full {seconds_full:.2f} s -> {answer_full}")
        print(f"                  MACER {seconds_macer:.2f} s -> {answer_macer} (random weights: ids, not words)")

    path = _plot_kept_tokens(Path(args.out), model, inputs, record, config)
    print(f"kept tokens along the timeline: {path}")
    return 0


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        return None


def _print_times(times: dict[str, list[float]], record, n: int, load_before: float | None) -> None:
    """Wall times with their spread, and whether the machine was busy: a reader judges the ratio from both."""
    def spread(name: str) -> str:
        values = times[name]
        return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"

    runs = len(times["full"])
    f_all, m_all = statistics.median(times["full"]), statistics.median(times["MACER"])
    f_llm, m_llm = statistics.median(times["full decoder"]), statistics.median(times["MACER decoder"])
    proxy = sum(record.layer_tokens) / (n * len(record.layer_tokens))
    print(f"prefill time, {runs} run{'s' if runs > 1 else ''} of each after a warm-up, min / median / max: "
          f"full {spread('full')} s, MACER {spread('MACER')} s (median x{f_all / m_all:.2f})")
    print(f"decoder only, min / median / max: full {spread('full decoder')} s, MACER {spread('MACER decoder')} s "
          f"(median x{f_llm / m_llm:.2f}); token-layer proxy {proxy:.3f} (ideal x{1 / proxy:.2f}); "
          f"MACER's own work {record.overhead_s:.3f} s")
    worst = max(max(v) / min(v) - 1 for v in times.values())
    cores = os.cpu_count() or 1
    load = "unknown" if load_before is None else f"{load_before:.1f}"
    busy = load_before is not None and load_before >= 0.5 * cores
    noisy = worst > 0.15
    if busy or noisy:
        reasons = []
        if busy:
            reasons.append(f"load average {load} on {cores} cores before the demo started: other processes share "
                           "the CPUs")
        if noisy:
            reasons.append(f"repeated runs differ by up to {100 * worst:.0f}%")
        print(f"machine busy: {'; '.join(reasons)}. The times are slower and noisier than on an idle machine; "
              "the counts above are exact either way")
    else:
        print(f"machine quiet: load average {load} on {cores} cores before the demo started, runs within "
              f"{100 * worst:.0f}% of each other")


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


def _plot_kept_tokens(out_dir: Path, model, inputs: dict[str, Any], record, config) -> Path:
    """PNG of the kept and dropped audio/video tokens at their clip time, readable without the README.

    Times come from the temporal M-RoPE row (``position_id_per_seconds`` units per second, 25 in Qwen2.5-Omni): an
    audio token is one tick at its 40 ms step; a video token stands for one patch of a 2-frame group and is drawn as a
    bar over the seconds its group covers, at row = its patch index in the group (row-major), so each group is a
    column whose kept share can be read off. The video panel also shows the C temporal chunks of the coverage greedy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from macer_kernels import temporal_chunks

    thinker_config = model.config
    ids = inputs["input_ids"][0].cpu()
    feature_mask = inputs.get("feature_attention_mask")
    rope, _ = model.get_rope_index(
        inputs["input_ids"], None, inputs.get("video_grid_thw"), inputs["attention_mask"], inputs["use_audio_in_video"],
        feature_mask.sum(-1) if feature_mask is not None else None, inputs.get("video_second_per_grid"))
    rope = rope[:, 0].cpu().double()
    per_second = float(thinker_config.position_id_per_seconds)
    is_audio, is_video = ids == thinker_config.audio_token_id, ids == thinker_config.video_token_id
    # Each stream from its own first token: interleaved, both start at the same position; in the block layout the
    # audio positions continue after the video block's, which is prompt order, not clip time.
    seconds = torch.zeros(ids.numel(), dtype=torch.float64)
    for stream in (is_audio, is_video):
        if stream.any():
            seconds[stream] = (rope[0][stream] - rope[0][stream].min()) / per_second
    kept = torch.zeros(ids.numel(), dtype=torch.bool)
    kept[list(record.audio_kept) + list(record.video_kept)] = True

    fig, (ax_a, ax_v) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True, height_ratios=(1, 3))
    audio_pos = is_audio.nonzero().reshape(-1)
    if audio_pos.numel():
        for row, mask, color, name in ((1, kept, "tab:red", "kept"), (0, ~kept, "lightgray", "dropped")):
            chosen = audio_pos[mask[audio_pos]]
            ax_a.eventplot(seconds[chosen].numpy(), lineoffsets=row, linelengths=0.8, linewidths=0.6, colors=color)
            ax_a.text(1.005, row, f"{name} {chosen.numel()}", transform=ax_a.get_yaxis_transform(), va="center",
                      fontsize=8)
        ax_a.set_yticks([0, 1], ["dropped", "kept"])
    else:
        ax_a.set_yticks([])
        ax_a.text(0.5, 0.5, "no audio tokens in this prompt", transform=ax_a.transAxes, ha="center", va="center")
    ax_a.set_ylim(-0.6, 1.6)
    ax_a.set_ylabel(f"audio tokens\n(one tick = {1000 / per_second:.0f} ms)")

    video_pos = is_video.nonzero().reshape(-1)
    if video_pos.numel():
        t_video = rope[0][video_pos]
        h, w = rope[1][video_pos], rope[2][video_pos]
        patch = (h - h.min()) * (w.max() - w.min() + 1) + (w - w.min())
        group_starts = seconds[video_pos].unique()
        group_s = float(group_starts.diff().min()) if group_starts.numel() > 1 else 2.0
        if inputs.get("video_second_per_grid") is not None:
            group_s = float(inputs["video_second_per_grid"].reshape(-1)[0])
        x0 = seconds[video_pos]
        for mask, color, name in ((~kept[video_pos], "lightgray", "dropped"), (kept[video_pos], "tab:blue", "kept")):
            ax_v.hlines(patch[mask], x0[mask], x0[mask] + 0.9 * group_s, colors=color, linewidth=1.2,
                        label=f"{name} ({int(mask.sum())})")
        lo, hi = float(t_video.min()), float(t_video.max())
        span, chunks = hi - lo + 1, config.num_chunks
        sizes = torch.bincount(temporal_chunks(t_video.long(), chunks), minlength=chunks)
        bounds = [c * span / chunks / per_second for c in range(chunks + 1)]
        for c in range(chunks + 1):
            ax_v.axvline(bounds[c], color="tab:green", linestyle="--", linewidth=0.8,
                         label="coverage chunk boundary" if c == 0 else None)
        top = float(patch.max())
        for c in range(chunks):
            ax_v.text((bounds[c] + bounds[c + 1]) / 2, top * 1.03 + 1, f"c{c}" + ("" if sizes[c] else "\nempty"),
                      ha="center", va="bottom", fontsize=7, color="tab:green")
        ax_v.set_ylim(-1, top * 1.15 + 3)
        ax_v.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)
        ax_v.set_ylabel(f"video patch index in its 2-frame\ngroup of {group_s:.1f} s (row-major)")
    else:
        ax_v.set_yticks([])
        ax_v.text(0.5, 0.5, "no video tokens in this prompt", transform=ax_v.transAxes, ha="center", va="center")
    ax_v.set_xlabel(f"clip time (s) = temporal M-RoPE position / {per_second:g}, from each stream's first token; "
                    "a video bar spans its frame group")
    budget = record.budget
    ax_a.set_title(
        f"MACER kept tokens: keep ratio {config.keep_ratio:g} of {record.n_audio + record.n_video} audio+video tokens "
        f"-> K_mm={budget.total}\naudio: K_a={budget.audio}, kept {len(record.audio_kept)}/{record.n_audio} after "
        f"layer {config.audio_layer}    video: K_v={budget.video}, kept {len(record.video_kept)}/{record.n_video} "
        f"after layer {config.video_layer}, coverage over C={config.num_chunks} chunks (lambda_c="
        f"{config.coverage_weight:g})", fontsize=9)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
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
    try:
        processor = Qwen2_5OmniProcessor.from_pretrained(args.model)
        # The thinker alone: on transformers 5.23 the full model's generate() cannot return text only.
        model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(args.model, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as exc:  # transformers' errors for a folder without the checkpoint's files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"macer demo: error: --model {args.model}: not a loadable Qwen2.5-Omni checkpoint directory ({reason})",
              file=sys.stderr)
        return 2
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
    for name in ("audio_layer", "video_layer"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    try:
        config = macer.MacerConfig.for_model(model, keep_ratio=args.keep_ratio, **overrides)
    except ValueError as exc:  # e.g. a depth without the paper's defaults: the flags to pass are named
        print(f"macer demo: error: {exc} (--audio-layer / --video-layer set them)", file=sys.stderr)
        return 2
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
    if record.budget is None:  # the processor produced no audio or video tokens: nothing was pruned, nothing to draw
        print("the prompt has no audio or video tokens: MACER kept it whole")
        return 0
    print(f"kept tokens along the timeline: {_plot_kept_tokens(Path(args.out), model, inputs, record, config)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
