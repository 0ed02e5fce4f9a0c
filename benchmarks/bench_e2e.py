"""End-to-end benchmark: the full model and every selection policy side by side, on Qwen2.5-Omni thinkers with random
weights.

    python -m benchmarks.bench_e2e --mode cpu --threads 1          # CPU: mid-size decoder, the paper's 2.4k clip
    python -m benchmarks.bench_e2e --mode gpu                      # GPU: 7B and 3B text shapes, 2.4k and 16.3k clips
    python -m benchmarks.bench_e2e --mode gpu --attn flash_attention_2  # the same with FlashAttention-2
    python -m benchmarks.bench_e2e --mode cpu --threads 1 --record # write the committed benchmarks/results/ files
    python -m benchmarks.bench_e2e --mode gpu --text-shapes 7B --policies macer --keep-ratios 0.25 --compile both
                                                                   # compiled decoder layers beside eager ones

For each synthetic clip (``--clips``: ``paper``, 12 frames -> 864 video + 1460 audio tokens, 2.4k tokens in all;
``long``, 192 frames + 2400 audio tokens, 16.3k tokens) it runs ``model.generate`` unpatched ("full") and inside
``macer.compress(model, policy)`` for each policy (``--policies``) at each keep ratio, alternating the configurations
in one process (the order rotates each round) so that machine noise hits all of them alike, and reports medians after
warm-up rounds:

* ``prefill_ms``: from the ``generate`` call to the first new token (encoders, decoder, LM head, sampling);
* ``llm_prefill_ms``: the decoder alone (the text model's first call in that ``generate``), timed by hooks;
  ``encoders_ms`` likewise for the audio and vision encoders; on CPU also ``prefill_cpu_ms``,
  ``llm_prefill_cpu_ms`` and ``decode_cpu_ms_per_token``, the process's CPU time over the same spans (steady on a
  machine shared with other work, where wall time is not);
* ``decode_ms_per_token``: mean time between the new tokens after the first;
* ``kv_cache_mib``: bytes of the KV cache after prefill (read from the returned cache, minus the decode steps);
* in ``profile_reps`` extra runs of each configuration, which are not timed because measuring disturbs the timing:
  ``peak_extra_mib``, the peak memory above what was resident before the call (weights, inputs), from the CUDA
  allocator's peak or, on CPU, from the process RSS sampled every 2 ms after ``malloc_trim`` (coarser); and
  ``overhead_ms``, the policy's own work (scoring + selection + compaction, ``compress(..., profile=True)``), split
  by op into ``scoring_ms`` / ``selection_ms`` / ``compaction_ms`` and ``stage_ms`` (the fused stage: scores and
  selections of a readout in one call, ``select_stage`` or, since issue 37, a prepared stage's call),
  with ``overhead_share`` = overhead / full ``prefill_ms``; and ``decode_host_us_per_step``, the host time MACER's
  runtime spends in each decode step (its decoder pre-hook's decode branch and per-layer decode hooks);
* on a GPU, ``host_syncs`` per prefill: the CUDA runtime calls in which the host waits (``measure.SYNC_EVENTS``),
  counted by ``torch.profiler`` over one ``model(**inputs)`` prefill, and ``extra_host_syncs`` = policy - full;
* next to the measured ``llm_prefill_ratio`` (policy / full, the median of per-round ratios;
  ``llm_prefill_cpu_ratio`` on CPU): the run's exact ``token_layer_ratio`` and decoder ``flops_ratio`` (from the
  per-layer lengths and ``macer.cost``), the paper's proxy (``eq:appendix_efficiency``, for policies that prune
  after layer 1) and ``ratio_over_proxy`` = measured / token-layer ratio.

``--compile on`` runs every configuration with the decoder layers compiled (``macer.compress(..., compile=...)``:
regional ``torch.compile``, the full model as ``macer.FullConfig()``), ``--compile both`` each one eager and compiled
(column ``compiled``; each policy's ratios are to the full model of the same setting, ``speedup_vs_eager_full`` to the
eager full model). Compilation happens in the warm-up rounds (``first_prefill_ms`` shows the first round's prefill).
Beside each compiled MACER row at rho = 0.25 the prefill-speedup target of issue 37 (``target_speedup``: >= 2.4x at the
2.4k clip, >= 2.85x at 16.3k) and whether it is met: by the smaller of ``speedup`` (full / policy decoder prefill,
same setting) and ``speedup_vs_eager_full``, i.e. against the faster full model. On CPU ``speedup_cpu`` gives the
like-for-like ratio of process CPU times (wall time on a shared machine measures the other processes too).

Modes:

* ``cpu``: a mid-size thinker (12 layers, hidden 1024, 16 heads, 2 KV heads, MLP 2816; float32, sdpa) so that the
  decoder dominates; full + MACER at three keep ratios took about 4 minutes on an idle 2-core machine with
  ``--threads 1``, each further policy adds about as much as MACER. Target:
  ``llm_prefill_ratio`` within 1.15x of ``token_layer_ratio``.
* ``gpu``: the real Qwen2.5-Omni-7B and 3B text shapes (``macer.testing.TEXT_SHAPES``, real vocabulary sizes;
  bf16, sdpa, random weights; the encoders stay tiny, their time is reported apart). Also the naive way of getting
  the scores (``benchmarks.e2e.naive``) at N = 2.4k and 20k tokens, with out-of-memory recorded as such.

Results go to ``out/bench/`` (ignored by git) unless ``--record`` (``benchmarks/results/``) or ``--out``: CSV + JSON
naming the device, the host CPU model, torch threads, torch/transformers versions, git SHA and the settings, with a
PNG of time and memory against the keep ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from macer import cost

from benchmarks.e2e import measure, output
from benchmarks.e2e.measure import COMPACTION_OPS, SCORING_OPS, SELECTION_OPS, STAGE_OPS, Measurement, thinker_of

CPU_SHAPE: dict[str, int] = {"num_layers": 12, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 2,
                             "intermediate_size": 2816}
"""The CPU mode's decoder: deep and wide enough that the decoder dominates the prefill, small enough for 2 cores."""

REAL_VOCAB: dict[str, int] = {"7B": 152064, "3B": 151936}
"""Vocabulary sizes of the real checkpoints: the thinker runs its LM head on every prompt position, so it counts."""

CLIPS: dict[str, dict[str, int]] = {
    "paper": {"frames": 12, "audio_tokens": 1460},  # the paper's clip: 864 video + 1460 audio tokens, 2385 in all
    "long": {"frames": 192, "audio_tokens": 2400},  # 13824 video + 2400 audio tokens, 16.3k in all (long context)
}
"""Synthetic clips (24 x 24 patches per frame). ``--frames`` / ``--audio-tokens`` define a ``custom`` clip instead."""

POLICIES = ("macer", "fastv", "random")
"""Policies the benchmark knows, besides the full model; ``--policies`` picks from those the installed ``macer`` has."""

TARGET_SPEEDUP: dict[str, float] = {"paper": 2.4, "long": 2.85}
"""Issue 37's decoder-prefill speedups for MACER at rho = 0.25 with compiled layers, per clip."""

COMPILE = ("off", "on", "both")
"""``--compile``: eager layers only, compiled only, or both side by side."""

ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""The thinker's attention choices (``--attn``; default sdpa), as ``macer.compress`` accepts them."""

GPU_DEVICE = "cuda"
"""Device of the gpu mode. Only the tests change it (with ``measure.uses_cuda`` and stand-ins for ``torch.cuda``), to
run every gpu-mode code path with a tiny model on a machine without a GPU."""

_MIB = 2.0**20


def available_policies() -> list[str]:
    """The policies of ``POLICIES`` that the installed ``macer`` provides."""
    import macer

    names = ["macer"]
    names += [name for name, cls in (("fastv", "FastVConfig"), ("random", "RandomConfig")) if hasattr(macer, cls)]
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks.bench_e2e``."""
    parser.add_argument("--mode", choices=("auto", "cpu", "gpu"), default="auto",
                        help="cpu: mid-size model on CPU; gpu: real 7B/3B text shapes in bf16 on CUDA "
                             "(default: gpu when CUDA is available)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=None,
                        help="policies to compare with the full model (default: every one macer provides)")
    parser.add_argument("--keep-ratios", type=float, nargs="+", default=[0.25, 0.35, 0.45],
                        help="keep ratios rho of every policy")
    parser.add_argument("--clips", nargs="+", choices=sorted(CLIPS), default=None,
                        help="synthetic clips (default cpu: paper; gpu: paper long)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default cpu 1, gpu 3)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default cpu 7, gpu 10)")
    parser.add_argument("--profile-reps", type=int, default=3,
                        help="extra generates per configuration that measure its own overhead (synchronised)")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help="new tokens per generate, >= 2 (default cpu 8, gpu 32)")
    parser.add_argument("--text-shapes", nargs="+", choices=sorted(REAL_VOCAB), default=["7B", "3B"],
                        help="gpu mode: real text-model shapes to run")
    parser.add_argument("--attn", choices=ATTENTION, default="sdpa",
                        help="the thinker's attn_implementation (flash_attention_2: gpu mode, flash-attn installed)")
    parser.add_argument("--num-layers", type=int, default=CPU_SHAPE["num_layers"], help="cpu mode: decoder depth")
    parser.add_argument("--hidden-size", type=int, default=CPU_SHAPE["hidden_size"], help="cpu mode: decoder width")
    parser.add_argument("--num-heads", type=int, default=CPU_SHAPE["num_heads"], help="cpu mode: query heads")
    parser.add_argument("--num-kv-heads", type=int, default=CPU_SHAPE["num_kv_heads"], help="cpu mode: KV heads")
    parser.add_argument("--intermediate-size", type=int, default=CPU_SHAPE["intermediate_size"],
                        help="cpu mode: MLP width")
    parser.add_argument("--audio-tokens", type=int, default=None,
                        help="audio tokens of a custom clip (with --frames; replaces --clips)")
    parser.add_argument("--frames", type=int, default=None, help="video frames of a custom clip (with --audio-tokens)")
    parser.add_argument("--grid", type=int, nargs=2, default=[24, 24], metavar=("H", "W"),
                        help="14-pixel patches per frame")
    parser.add_argument("--audio-layer", type=int, default=None,
                        help="l_a (default: the paper's value for 28/36-layer models, else 3)")
    parser.add_argument("--video-layer", type=int, default=None,
                        help="l_v (default: the paper's value for 28/36-layer models, else 5)")
    parser.add_argument("--fastv-layer", type=int, default=None,
                        help="FastV's readout layer (default 5, the L_p that tab:main charges FastV with)")
    parser.add_argument("--naive-lengths", type=int, nargs="*", default=[2400, 20000],
                        help="gpu mode: sequence lengths of the naive output_attentions comparison (none: skip)")
    parser.add_argument("--compile", choices=COMPILE, default="off",
                        help="decoder layers through torch.compile (macer.compress(..., compile=...)): off, on, or "
                             "both side by side")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled configurations (default inductor)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; 1 makes the CPU-time columns a clean "
                             "compute measure on a shared machine)")
    parser.add_argument("--record", action="store_true",
                        help="write the committed results in benchmarks/results/ (default: out/bench/)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default out/bench/)")
    parser.add_argument("--name", default=None, help="file stem of the results (default bench_e2e_<mode>)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see ``add_arguments``); write and print the results."""
    mode = _resolve_mode(args.mode)
    settings = _settings(args, mode)
    out_dir = output.output_dir(args.out, args.record)
    device = torch.device(GPU_DEVICE if mode == "gpu" else "cpu")
    machine = output.machine(device)  # at the start: the commit that runs, even if the tree changes meanwhile
    cpu_label = "{num_layers}L-h{hidden_size}-mlp{intermediate_size}-heads{num_heads}/{num_kv_heads}".format(**settings)
    models = ([(cpu_label, {k: settings[k] for k in CPU_SHAPE})] if mode == "cpu"
              else [(shape, {"text_shape": shape, "vocab_size": REAL_VOCAB[shape]}) for shape in args.text_shapes])
    rows: list[dict] = []
    naive_rows: list[dict] = []
    for label, shape_kwargs in models:
        model = _build(shape_kwargs, device, torch.float32 if mode == "cpu" else torch.bfloat16,
                       settings["attn_implementation"])
        for clip, clip_kwargs in settings["clips"].items():
            rows += benchmark_model(model, label, settings, clip=clip, log=_log, **clip_kwargs)
        if mode == "gpu" and settings["naive_lengths"]:
            from benchmarks.e2e import naive

            # The later readout (L_p): the layer up to which FastV-style code would need the full attention.
            readout = max(_policy("macer", model, 1.0, settings).stage_layers)
            naive_rows += naive.naive_scores_rows(model, label, settings["naive_lengths"], readout, log=_log)
        del model
        if measure.uses_cuda(device):
            torch.cuda.empty_cache()
    meta = {"machine": machine, "settings": settings,
            "clip": "synthetic chat-templated question about an interleaved audio-video clip (macer.testing)",
            "timing": "median of `reps` rounds after `warmup` rounds; all configurations alternate in one process",
            "load_average_at_end": list(os.getloadavg())}
    output.write(args.name or f"bench_e2e_{mode}", rows, naive_rows, meta, out_dir, plot_png=not args.no_plot)
    if settings["compile"] != "off":
        print_speedups(rows)
    return 0


def print_speedups(rows: list[dict]) -> None:
    """The decoder-prefill speedups, each target beside the measured value (``--compile``)."""
    from benchmarks import common

    keys = ("model", "clip", "method", "keep_ratio", "compiled", "llm_prefill_ms", "first_prefill_ms", "speedup",
            "speedup_vs_eager_full", "speedup_cpu", "target_speedup", "meets_target", "decode_ms_per_token")
    print("\nspeedup = full / policy decoder prefill (wall), same setting (eager or compiled layers); speedup_cpu: the "
          "same in process CPU time (CPU mode); target: issue 37, met when both wall speedups reach it")
    common.print_table([{k: r[k] for k in keys} for r in rows])


# ---------------------------------------------------------------------------------------------------------------
# Settings, models and policies
# ---------------------------------------------------------------------------------------------------------------


def _resolve_mode(mode: str) -> str:
    if mode == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs a CUDA GPU (torch.cuda.is_available() is False); use --mode cpu")
    return mode


def _settings(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    defaults = {"cpu": (1, 7, 8), "gpu": (3, 10, 32)}[mode]
    warmup = defaults[0] if args.warmup is None else args.warmup
    reps = defaults[1] if args.reps is None else args.reps
    decode = defaults[2] if args.decode_tokens is None else args.decode_tokens
    if warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {warmup}")
    if reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {reps}")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.profile_reps < 0:
        raise SystemExit(f"--profile-reps must be >= 0, got {args.profile_reps}")
    if decode < 2:
        raise SystemExit(f"--decode-tokens must be >= 2 (decode time is measured between new tokens), got {decode}")
    for rho in args.keep_ratios:
        if not 0.0 < rho <= 1.0:
            raise SystemExit(f"--keep-ratios must be in (0, 1], got {rho}")
    available = available_policies()
    policies = list(args.policies) if args.policies is not None else available
    missing = [p for p in policies if p not in available]
    if missing:
        raise SystemExit(f"--policies {missing} not provided by the installed macer; available: {available}")
    if args.attn == "flash_attention_2" and (mode != "gpu" or importlib.util.find_spec("flash_attn") is None):
        raise SystemExit("--attn flash_attention_2 needs --mode gpu and flash-attn 2 installed "
                         "(pip install flash-attn --no-build-isolation)")
    if (args.frames is None) != (args.audio_tokens is None):
        raise SystemExit("--frames and --audio-tokens go together (they define a custom clip)")
    if args.frames is not None:
        if args.clips is not None:
            raise SystemExit("--clips and --frames/--audio-tokens exclude each other")
        clips = {"custom": {"frames": args.frames, "audio_tokens": args.audio_tokens}}
    else:
        names = args.clips if args.clips is not None else (["paper"] if mode == "cpu" else ["paper", "long"])
        clips = {name: dict(CLIPS[name]) for name in names}
    return {
        "mode": mode, "policies": policies, "keep_ratios": list(args.keep_ratios), "clips": clips,
        "warmup": warmup, "reps": reps, "decode_tokens": decode, "profile_reps": args.profile_reps,
        "grid": list(args.grid), "audio_layer": args.audio_layer, "video_layer": args.video_layer,
        "fastv_layer": args.fastv_layer,
        "naive_lengths": list(args.naive_lengths),
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads, "intermediate_size": args.intermediate_size,
        "threads": torch.get_num_threads(), "attn_implementation": args.attn,
        "compile": args.compile, "compile_options": {"backend": args.compile_backend},
        "dtype": "float32" if mode == "cpu" else "bfloat16",
        "load_average_at_start": list(os.getloadavg()),
    }


def _build(shape_kwargs: dict[str, Any], device: torch.device, dtype: torch.dtype,
           attn: str = "sdpa") -> torch.nn.Module:
    """A random-weight thinker with attention ``attn``. On CUDA it is initialised directly on the device
    (initialising a 7B model on the host takes minutes), in float32 and then cast, so that no initialiser runs in
    bf16."""
    from macer.testing import build_thinker

    if not measure.uses_cuda(device):
        return build_thinker(dtype=dtype, device=device, attn_implementation=attn, **shape_kwargs)
    with torch.device(device):
        return build_thinker(dtype=dtype, device=device, attn_implementation=attn, **shape_kwargs)


def _policy(name: str, model: torch.nn.Module, keep_ratio: float, settings: dict[str, Any]) -> Any:
    """The policy ``name`` at ``keep_ratio``. MACER: the paper's defaults for the 7B/3B text shapes (by model
    identity), the 7B values otherwise, explicit ``--audio-layer`` / ``--video-layer`` win. FastV: the prompt's last
    row after layer ``macer.cost.FASTV_PRUNE_LAYER`` (5, as ``tab:main`` charges it; ``--fastv-layer`` sets it).
    Random: seed 0."""
    import macer
    from macer.core.config import paper_defaults
    from macer.testing import SYNTHETIC_TOKENS

    # The synthetic prompts close the question with the synthetic <|im_end|> (the real id is outside their vocabulary).
    question = {"end_of_turn_token_id": SYNTHETIC_TOKENS.im_end}
    if name == "macer":
        overrides: dict[str, Any] = dict(paper_defaults(model) or {})
        for field_name in ("audio_layer", "video_layer"):
            if settings[field_name] is not None:
                overrides[field_name] = settings[field_name]
        return macer.MacerConfig(keep_ratio=keep_ratio, **{**overrides, **question})
    if name == "fastv":
        depth = thinker_of(model).config.text_config.num_hidden_layers
        layer = settings["fastv_layer"] or min(cost.FASTV_PRUNE_LAYER, depth - 1)
        return macer.FastVConfig(keep_ratio=keep_ratio, layer=layer, **question)
    if name == "random":
        return macer.RandomConfig(keep_ratio=keep_ratio)
    raise SystemExit(f"unknown policy {name!r}; known: {list(POLICIES)}")


# ---------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _median(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def benchmark_model(model: torch.nn.Module, label: str, settings: dict[str, Any], *, clip: str = "paper",
                    frames: int = 12, audio_tokens: int = 1460, log: Callable[[str], None] = _log) -> list[dict]:
    """Alternate the full model and every (policy, keep ratio) on one synthetic clip; one row per configuration
    (medians)."""
    from macer.testing import SYNTHETIC_TOKENS, clip_inputs

    thinker = thinker_of(model)
    device = next(thinker.parameters()).device
    dtype = next(thinker.parameters()).dtype
    inputs = clip_inputs(model, frames=frames, grid_hw=tuple(settings["grid"]), audio_tokens=audio_tokens,
                         device=device, dtype=dtype)
    ids = inputs["input_ids"][0]
    n_audio = int((ids == SYNTHETIC_TOKENS.audio).sum())
    n_video = int((ids == SYNTHETIC_TOKENS.video).sum())
    configs: list[tuple[str, float, Any, dict[str, Any] | None]] = []
    for compiled in {"off": [False], "on": [True], "both": [False, True]}[settings.get("compile", "off")]:
        options = settings["compile_options"] if compiled else None
        configs.append(("full", 1.0, None, options))
        configs += [(name, rho, _policy(name, model, rho, settings), options)
                    for name in settings["policies"] for rho in settings["keep_ratios"]]
    results: dict[int, list[Measurement]] = {i: [] for i in range(len(configs))}
    first: dict[int, Measurement] = {}
    rounds = settings["warmup"] + settings["reps"]
    for r in range(rounds):
        order = list(range(len(configs)))
        shift = r % len(order)
        order = order[shift:] + order[:shift]  # rotate, so no configuration always runs first or after the same one
        latest: dict[int, Measurement] = {}
        for i in order:
            latest[i] = measure.measure_generate(model, inputs, configs[i][2], settings["decode_tokens"],
                                                 compile=configs[i][3])
            first.setdefault(i, latest[i])
            if r >= settings["warmup"]:
                results[i].append(latest[i])
        log(f"[{label} {clip}] round {r + 1}/{rounds}{' (warm-up)' if r < settings['warmup'] else ''}: " + ", ".join(
            f"{configs[i][0]}@{configs[i][1]:g}{' compiled' if configs[i][3] is not None else ''} "
            f"llm {1e3 * latest[i].llm_prefill_s:.0f} ms" for i in sorted(latest)))
    # Each policy's own work and the peak memory, measured apart: a few extra generates of each configuration.
    profiled: dict[int, list[Measurement]] = {i: [] for i in range(len(configs))}
    for _ in range(settings["profile_reps"]):
        for i in profiled:
            profiled[i].append(measure.measure_generate(model, inputs, configs[i][2], settings["decode_tokens"],
                                                        profile=True, compile=configs[i][3]))
    syncs: dict[int, int | None] = dict.fromkeys(range(len(configs)))
    if measure.uses_cuda(device):
        for i in syncs:
            syncs[i] = sum(measure.host_syncs_per_prefill(model, inputs, configs[i][2], configs[i][3]).values())
    shape = cost.DecoderShape.from_config(model)
    fulls = {configs[i][3] is not None: i for i, config in enumerate(configs) if config[0] == "full"}
    rows = []
    for i, (method, keep_ratio, _, options) in enumerate(configs):
        compiled = options is not None
        full = fulls[compiled]
        row = {"model": label, "clip": clip, "compiled": compiled,
               **_row(method, keep_ratio, results[i], profiled[i], results[full], shape, n_audio, n_video)}
        row["first_prefill_ms"] = 1e3 * first[i].prefill_s
        row["host_syncs"] = syncs[i]
        row["extra_host_syncs"] = None if syncs[i] is None else syncs[i] - syncs[full]
        row.update(_speedups(method, keep_ratio, clip, compiled, results[i], results[full],
                             results[fulls[False]] if False in fulls else None))
        rows.append(row)
    return rows


def _speedups(method: str, keep_ratio: float, clip: str, compiled: bool, runs: list[Measurement],
              full_runs: list[Measurement], eager_full_runs: list[Measurement] | None) -> dict[str, Any]:
    """Decoder-prefill speedups (medians of per-round ratios of wall times): to the full model of the same setting
    (``speedup``, like for like) and to the eager full model; on CPU also of process CPU times (``speedup_cpu``, like
    for like: steady on a shared machine, where wall time is not). Beside a compiled MACER row at rho = 0.25 its
    target; ``meets_target`` reads the smaller of the two wall-time speedups (the faster full model is the baseline)."""
    speedup = _median([f.llm_prefill_s / m.llm_prefill_s for m, f in zip(runs, full_runs)])
    versus_eager = (None if eager_full_runs is None else
                    _median([f.llm_prefill_s / m.llm_prefill_s for m, f in zip(runs, eager_full_runs)]))
    cpu = _median([None if m.llm_prefill_cpu_s is None or f.llm_prefill_cpu_s is None
                   else f.llm_prefill_cpu_s / m.llm_prefill_cpu_s for m, f in zip(runs, full_runs)])
    target = (TARGET_SPEEDUP.get(clip) if compiled and method == "macer" and math.isclose(keep_ratio, 0.25)
              else None)
    read = speedup if versus_eager is None else min(speedup, versus_eager)
    return {"speedup": speedup, "speedup_vs_eager_full": versus_eager, "speedup_cpu": cpu, "target_speedup": target,
            "meets_target": None if target is None else read >= target}


def _row(method: str, keep_ratio: float, runs: list[Measurement], profiled: list[Measurement],
         full_runs: list[Measurement], shape: cost.DecoderShape, n_audio: int, n_video: int) -> dict:
    """One configuration's medians. Ratios to the full prefill are medians of per-round ratios (``runs[k]`` and
    ``full_runs[k]`` ran in the same round), which cancels slow drifts of the machine's load."""
    last = runs[-1]
    n_tokens = full_runs[-1].cache_layer_lengths[0]
    if method == "full":
        layer_tokens = [n_tokens] * shape.num_layers
        kept_audio, kept_video = n_audio, n_video
    else:
        layer_tokens = list(last.trace.layer_tokens)
        kept_audio, kept_video = len(last.trace.audio_kept), len(last.trace.video_kept)
    flops = cost.decoder_flops(layer_tokens, shape).total / cost.decoder_flops([n_tokens] * shape.num_layers,
                                                                                shape).total
    # The paper's proxy charges the first L_p layers at full length: defined for policies that prune after layer 1.
    proxy = (cost.run_cost(layer_tokens, shape, n_audio + n_video).paper_proxy
             if layer_tokens[0] == n_tokens else None)

    def ms(values: Sequence[float | None]) -> float | None:
        value = _median(values)
        return None if value is None else 1e3 * value

    def op_ms(names: Sequence[str]) -> float | None:
        return ms([sum(m.op_seconds[op] for op in names) for m in profiled]) if method != "full" else None

    row = {
        "method": method, "keep_ratio": keep_ratio, "tokens": n_tokens, "audio_tokens": n_audio,
        "video_tokens": n_video, "kept_audio": kept_audio, "kept_video": kept_video, "reps": len(runs),
        "prefill_ms": ms([m.prefill_s for m in runs]),
        "llm_prefill_ms": ms([m.llm_prefill_s for m in runs]),
        "prefill_cpu_ms": ms([m.prefill_cpu_s for m in runs]),
        "llm_prefill_cpu_ms": ms([m.llm_prefill_cpu_s for m in runs]),
        "encoders_ms": ms([m.encoders_s for m in runs]),
        "decode_ms_per_token": ms([m.decode_s_per_token for m in runs]),
        "decode_cpu_ms_per_token": ms([m.decode_cpu_s_per_token for m in runs]),
        "peak_extra_mib": _mib(_median([m.peak_extra_bytes for m in profiled])),
        "kv_cache_mib": last.kv_prefill_bytes / _MIB,
        "overhead_ms": ms([m.overhead_s for m in profiled]) if method != "full" else None,
        "decode_host_us_per_step": (None if method == "full" else
                                    _scaled(_median([m.decode_host_s_per_step for m in profiled]), 1e6)),
        "scoring_ms": op_ms(SCORING_OPS), "selection_ms": op_ms(SELECTION_OPS),
        "compaction_ms": op_ms(COMPACTION_OPS), "stage_ms": op_ms(STAGE_OPS),
        "layer_tokens": " ".join(map(str, layer_tokens)),
        "cache_matches_trace": last.cache_layer_lengths == layer_tokens,
        "token_layer_ratio": sum(layer_tokens) / (n_tokens * shape.num_layers), "paper_proxy": proxy,
        "flops_ratio": flops,
    }
    full_prefill_ms = ms([f.prefill_s for f in full_runs])
    row["overhead_share"] = None if row["overhead_ms"] is None else row["overhead_ms"] / full_prefill_ms
    row["llm_prefill_ratio"] = _median([m.llm_prefill_s / f.llm_prefill_s for m, f in zip(runs, full_runs)])
    row["ratio_over_proxy"] = row["llm_prefill_ratio"] / row["token_layer_ratio"]
    row["within_1.15x"] = 1 / 1.15 <= row["ratio_over_proxy"] <= 1.15
    cpu = _median([None if m.llm_prefill_cpu_s is None else m.llm_prefill_cpu_s / f.llm_prefill_cpu_s
                   for m, f in zip(runs, full_runs)])
    row["llm_prefill_cpu_ratio"] = cpu
    row["cpu_ratio_over_proxy"] = None if cpu is None else cpu / row["token_layer_ratio"]
    row["cpu_within_1.15x"] = None if cpu is None else 1 / 1.15 <= row["cpu_ratio_over_proxy"] <= 1.15
    return row


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else factor * value


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / _MIB


def main(argv: Sequence[str] | None = None) -> int:
    # The first paragraph of the docstring, whole (its first line alone stopped mid-sentence).
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
