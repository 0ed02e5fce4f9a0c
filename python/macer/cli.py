"""Command line of MACER: ``macer demo`` runs staged pruning end to end (``macer bench`` says where it moved).

``macer demo`` builds a Qwen2.5-Omni thinker with random weights in code (no download), a synthetic clip at the
paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), and runs full prefill vs MACER
with the 7B defaults at keep ratio 0.25, then a short ``generate``. ``macer demo --model PATH --video FILE
--question TEXT`` runs a real local checkpoint through its processor instead (see ``docs/integration.md``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from macer import _cli_args as flags

__all__ = ["main"]

DEMO_SHAPE = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2}
"""Default random thinker of the demo: deep enough for the 7B readout layers (3, 5) and wide enough that the
decoder, not the tiny encoders, dominates prefill time on a 2-core CPU (about 1 s per full prefill when idle)."""
DIAGNOSE_SHAPE = {"num_layers": 8, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 2}
"""Default random thinker of ``macer diagnose`` (narrower: it runs six forwards with every layer tapped)."""

REAL_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
                      "auditory and visual inputs, as well as generating text and speech.")


DESCRIPTION = ("MACER: training-free pruning of audio and video tokens inside a Qwen2.5-Omni thinker. "
               "`macer <command> --help` describes each command.")

DEMO_DESCRIPTION = """Full prefill vs MACER on one prompt, then a short generate.

Without --model: a Qwen2.5-Omni thinker with random weights built in code (no download) and a synthetic clip at the
paper's token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved), MACER with the 7B defaults.
It prints the budget, the tokens per layer, the KV caches and the times, and draws the kept tokens on the clip's
timeline (macer_kept_tokens.png in --out). With --model, --video and --question: a local checkpoint through its
processor (docs/integration.md)."""

DIAGNOSE_DESCRIPTION = """The paper's attention diagnostics (Sec. 3) of one prompt, as diagnostics.json and PNG figures
in --out: per decoder layer the log ratio of the attention per audio and per video token of the question rows, the
cosines of the question query with the modality key centroids, the readout-layer sweep, and the temporal Gini of the
tokens each policy keeps (docs/diagnostics.md).

Without --model: a Qwen2.5-Omni thinker with random weights built in code (no download) and a synthetic clip with
audio and video. With --model, --video and --question: a local checkpoint through its processor."""


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``macer`` argument parser and its subcommands' parsers (``bench`` only points to the benchmark)."""
    parser = flags.Parser(prog="macer", description=DESCRIPTION, formatter_class=flags.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,diagnose,bench}")
    commands = {}
    common = {"formatter_class": flags.HelpFormatter}

    demo = sub.add_parser("demo", help="full prefill vs MACER on a random thinker (default) or a local checkpoint",
                          description=DEMO_DESCRIPTION, **common)
    flags.add_macer_flags(demo, keep_ratio_help="rho in (0, 1], the share of audio+video tokens kept")
    flags.add_random_model_flags(demo, shape=DEMO_SHAPE)
    demo.add_argument("--blocks", action="store_true", help="video block then audio block (use_audio_in_video=False)")
    demo.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    demo.add_argument("--new-tokens", type=flags.int_in(*flags.RANGES["new_tokens"]), default=8,
                      help=f"tokens to generate, in {list(flags.RANGES['new_tokens'])}")
    demo.add_argument("--repeats", type=flags.int_in(*flags.RANGES["repeats"]), default=5,
                      help=f"timed prefills of each kind after one warm-up of each, in {list(flags.RANGES['repeats'])}")
    demo.add_argument("--out", type=flags.out_dir, default="out", help="folder of the PNG of kept tokens")
    flags.add_checkpoint_flags(demo)
    commands["demo"] = demo

    diagnose = sub.add_parser("diagnose", help="the paper's attention diagnostics of one prompt: JSON + PNG figures",
                              description=DIAGNOSE_DESCRIPTION, **common)
    flags.add_macer_flags(diagnose, keep_ratio_help="rho in (0, 1] of the compared policies and of the readout "
                                                    "sweep's budget")
    flags.add_random_model_flags(diagnose, shape=DIAGNOSE_SHAPE)
    diagnose.add_argument("--seed", type=flags.int_in(*flags.RANGES["seed"]), default=0,
                          help=f"seed of the random model and clip, in {list(flags.RANGES['seed'])}")
    diagnose.add_argument("--out", type=flags.out_dir, default="out/diagnose",
                          help="folder of diagnostics.json and the PNG figures")
    diagnose.add_argument("--no-plot", action="store_true", help="write the JSON only")
    flags.add_checkpoint_flags(diagnose)
    commands["diagnose"] = diagnose

    sub.add_parser("bench", add_help=False, help="moved: python -m benchmarks.bench_e2e (from a clone)")
    return parser, commands


CACHE_SLACK = 1.25
"""How far above the decoder-FLOPs ideal a measured speedup may be before the demo calls it timing noise."""
ROUNDING_SLACK = 1.05
"""A measured speedup within 5 % of the ideal is the ideal, as far as a few timed runs can tell: nothing is said."""

BENCH_MOVED = ("macer bench: the end-to-end benchmark is no longer part of the installed package; from a clone of the "
               "repository run `python -m benchmarks.bench_e2e` (results in out/bench/; --record writes the committed "
               "benchmarks/results/)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``macer`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # whatever its arguments were (they belonged to the moved harness)
        print(BENCH_MOVED, file=sys.stderr)
        return 2
    parser, commands = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = commands[args.command]
    if unknown:  # argparse would name the top-level parser ("macer: error") for a flag the command does not take
        (command if argv.index(args.command) < argv.index(unknown[0]) else parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    checkpoint = flags.uses_checkpoint(command, args)
    if not checkpoint:
        # The full-length prefills each command runs, at least: the demo's warm-up, timed and generate prefills (a
        # MACER prefill runs its layers before the first stage at full length); diagnose's tapped forward and the
        # first layers of its MACER, no-coverage and shared top-K forwards.
        first = min(flags.readout_layers(args).values())
        video = flags.readout_layers(args)["video_layer"]
        threads = torch.get_num_threads()
        if args.command == "demo":
            seconds = flags.check_random_model(command, args, both_modalities=False, attn=args.attn, threads=threads,
                                               forwards=(args.repeats + 2) * (1 + first / args.layers))
        else:
            seconds = flags.check_random_model(command, args, both_modalities=True, threads=threads,
                                               forwards=1 + (2 * first + video) / args.layers)
        notice = flags.long_run_notice(command.prog, seconds)
        if notice:
            print(notice, file=sys.stderr, flush=True)
    if args.command == "diagnose":
        from macer.diagnostics import command as diagnose_command

        try:
            return diagnose_command(args, checkpoint)
        except flags.CommandError as exc:
            print(f"{command.prog}: error: {exc}", file=sys.stderr)
            return 2
    return _demo_real(args) if checkpoint else _demo_random(args)


# ------------------------------------------------------------------------------------------------ random model
def _timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _demo_random(args: argparse.Namespace) -> int:
    import macer
    from macer.cost import run_cost
    from macer.hf.adapters import get_adapter
    from macer.hf.cache import output_cache
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    load_before = _load_average()  # before this process adds its own load
    torch.manual_seed(0)
    shape = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "intermediate_size": 3 * args.hidden}
    model = build_thinker(attn_implementation=args.attn, **shape)
    inputs = clip_inputs(model, frames=args.frames, audio_tokens=args.audio_tokens,
                         use_audio_in_video=not args.blocks and args.frames > 0 and args.audio_tokens > 0)
    # The paper's 7B readout layers and shares unless given; the vocabulary is synthetic, hence its own <|im_end|> id.
    config = macer_config_for(model, keep_ratio=args.keep_ratio, **flags.readout_layers(args))
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
        _print_caches(output_cache(full), output_cache(pruned))
        flops_ratio = run_cost(record.layer_tokens, model, record.n_audio + record.n_video, n).flops_ratio
        _print_times(times, record, n, load_before, flops_ratio)

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


def _print_times(times: dict[str, list[float]], record, n: int, load_before: float | None,
                 flops_ratio: float) -> None:
    """Wall times with their spread, and whether the machine was busy: a reader judges the ratio from both.

    ``flops_ratio``: MACER's decoder prefill FLOPs over the full model's (``macer.cost.run_cost``). Its inverse is
    the ideal speedup: pruning removes work, so a measured speedup above it is timing noise, and is said to be."""
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
          f"(median x{f_llm / m_llm:.2f}); ideal x{1 / flops_ratio:.2f} (decoder FLOPs ratio {flops_ratio:.3f}, "
          f"token-layer proxy {proxy:.3f}); MACER's own work {record.overhead_s:.3f} s")
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
    # Fewer FLOPs bound the speedup; a shorter sequence can also run faster per FLOP (it fits the CPU's caches:
    # x1.61 against an ideal of x1.38 on an idle 2-core VM, video only), so up to CACHE_SLACK above is not called noise.
    ratios = (("prefill", f_all / m_all), ("decoder", f_llm / m_llm))
    noise = [f"x{ratio:.2f} ({what})" for what, ratio in ratios if ratio * flops_ratio > CACHE_SLACK]
    above = [f"x{ratio:.2f} ({what})" for what, ratio in ratios
             if ROUNDING_SLACK < ratio * flops_ratio <= CACHE_SLACK]
    ideal = f"the ideal x{1 / flops_ratio:.2f}"
    if noise:
        print(f"timing noise: the measured speedup {' and '.join(noise)} is more than {CACHE_SLACK - 1:.0%} above "
              f"{ideal}, which pruning cannot give; rerun on a quiet machine or with more --repeats")
    if above:
        print(f"above the FLOPs ideal: the measured speedup {' and '.join(above)} exceeds {ideal} by "
              f"{ROUNDING_SLACK - 1:.0%} to {CACHE_SLACK - 1:.0%}: a shorter sequence can run faster per FLOP "
              "(caches), or it is noise")


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
    """One line per stage; a modality whose budget holds all its tokens is said to be kept whole, not pruned."""
    left = {"audio": record.n_audio, "video": record.n_video}
    total = dict(left)
    for stage in record.stages:
        done = []
        for name in stage.modalities:
            left[name] = len(record.audio_kept if name == "audio" else record.video_kept)
            done.append(f"{name} pruned" if left[name] < total[name] else
                        f"{name} kept whole: its budget holds all {total[name]} tokens")
        print(f"after layer {stage.layer} ({', '.join(done)}): audio {left['audio']}/{total['audio']}, "
              f"video {left['video']}/{total['video']}, sequence {stage.tokens_before} -> {stage.tokens_after}")


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
    """``macer_kept_tokens.png`` in ``out_dir`` (``_kept_tokens_figure``)."""
    import matplotlib.pyplot as plt

    fig = _kept_tokens_figure(model, inputs, record, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "macer_kept_tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _kept_tokens_figure(model, inputs: dict[str, Any], record, config):
    """The kept and dropped audio/video tokens at their clip time, readable without the README.

    Times come from the temporal M-RoPE row (``position_id_per_seconds`` units per second, 25 in Qwen2.5-Omni): an
    audio token is one tick at its 40 ms step; a video token stands for one patch of a 2-frame group and is drawn as a
    bar over the seconds its group covers, at row = its patch index in the group (row-major), so each group is a
    column whose kept share can be read off. The coverage greedy's C temporal chunks are shaded behind the groups
    they hold: a group's chunk is ``temporal_chunks`` of its start (the one temporal position all its tokens share),
    so a chunk is drawn from its first group's start to its last group's end, and chunks no group starts in are named
    as empty.
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
        h, w = rope[1][video_pos], rope[2][video_pos]
        patch = (h - h.min()) * (w.max() - w.min() + 1) + (w - w.min())
        group_starts = seconds[video_pos].unique()
        group_s = float(group_starts.diff().min()) if group_starts.numel() > 1 else 2.0
        if inputs.get("video_second_per_grid") is not None:
            group_s = float(inputs["video_second_per_grid"].reshape(-1)[0])
        x0 = seconds[video_pos]
        chunk = temporal_chunks(rope[0][video_pos].long(), config.num_chunks)
        top = float(patch.max())
        for drawn, c in enumerate(chunk.unique().tolist()):  # alternate the shade so that neighbours stand apart
            members = chunk == c
            left, right = float(x0[members].min()), float(x0[members].max()) + group_s
            span = ax_v.axvspan(left, right, color="tab:green", alpha=0.07 if drawn % 2 else 0.16, lw=0,
                                label=None if drawn else "coverage chunk (shaded)")
            span.set_gid(f"chunk {c}")
            ax_v.text((left + right) / 2, top * 1.03 + 1, f"c{c}", ha="center", va="bottom", fontsize=7,
                      color="tab:green")
        for mask, color, name in ((~kept[video_pos], "lightgray", "dropped"), (kept[video_pos], "tab:blue", "kept")):
            ax_v.hlines(patch[mask], x0[mask], x0[mask] + group_s, colors=color, linewidth=1.2,
                        label=f"{name} ({int(mask.sum())})")
        # A thin gap between consecutive groups, so that each group reads as one column.
        for start in group_starts.tolist()[1:]:
            ax_v.axvline(start, color="white", linewidth=1.5)
        empty = [f"c{c}" for c in range(config.num_chunks) if not (chunk == c).any()]
        if empty:
            ax_v.text(1.005, 0.02, "empty chunks\n(no group\nstarts in them):\n" + textwrap.fill(", ".join(empty), 20),
                      transform=ax_v.transAxes, fontsize=7, color="tab:green", va="bottom")
        ax_v.set_ylim(-1, top * 1.15 + 3)
        ax_v.legend(loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)
        ax_v.set_ylabel(f"video patch index in its 2-frame\ngroup of {group_s:.1f} s (row-major)")
    else:
        ax_v.set_yticks([])
        ax_v.text(0.5, 0.5, "no video tokens in this prompt", transform=ax_v.transAxes, ha="center", va="center")
    ax_v.set_xlabel(f"clip time (s) = temporal M-RoPE position / {per_second:g}, from each stream's first token; "
                    "a video bar spans its frame group, whose chunk is read at its start")
    budget = record.budget
    ax_a.set_title(
        f"MACER kept tokens: keep ratio {config.keep_ratio:g} of {record.n_audio + record.n_video} audio+video tokens "
        f"-> K_mm={budget.total}\n{_stage_title(record, 'audio', budget.audio)}    "
        f"{_stage_title(record, 'video', budget.video)}"
        + (f", coverage over C={config.num_chunks} chunks (lambda_c={config.coverage_weight:g})"
           if record.n_video else ""), fontsize=9)
    fig.tight_layout()
    return fig


def _stage_title(record, name: str, budget: int) -> str:
    """What happened to one modality: absent, kept whole by its budget, or pruned to ``kept/n`` after a layer."""
    n = record.n_audio if name == "audio" else record.n_video
    if not n:
        return f"{name}: none in the prompt (no {name} stage)"
    symbol = "K_a" if name == "audio" else "K_v"
    kept = len(record.audio_kept if name == "audio" else record.video_kept)
    layer = next((stage.layer for stage in record.stages if name in stage.modalities), None)
    if kept == n:
        return f"{name}: {symbol}={budget}, all {n} kept (the budget holds them all)"
    return f"{name}: {symbol}={budget}, kept {kept}/{n} after layer {layer}"


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
        print(f"macer demo: error: {flags.unloadable(args.model, exc)}", file=sys.stderr)
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
