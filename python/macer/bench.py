"""End-to-end benchmark: full prefill vs MACER at several keep ratios, on a Qwen2.5-Omni thinker with random weights.

``macer bench`` and ``benchmarks/bench_e2e.py`` run this module. For one synthetic audio-video clip at the paper's
token counts (12 frames -> 864 video tokens, 1460 audio tokens, interleaved, a chat-templated question) it runs
``model.generate`` unpatched and inside ``macer.compress`` at each keep ratio, alternating the configurations in one
process (the order rotates each round) so that machine noise hits all of them alike, and reports medians after
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
  ``overhead_ms``, MACER's own work (scoring + selection + compaction, ``compress(..., profile=True)``), split by op
  into ``scoring_ms`` / ``selection_ms`` / ``compaction_ms``, with ``overhead_share`` = overhead / full
  ``prefill_ms``;
* next to the measured ``llm_prefill_ratio`` (MACER / full, the median of per-round ratios;
  ``llm_prefill_cpu_ratio`` on CPU): the run's exact
  ``token_layer_ratio``, the paper's proxy (``eq:appendix_efficiency``) and the exact decoder ``flops_ratio`` from
  ``macer.cost.trace_cost``, and ``ratio_over_proxy`` = measured / token-layer ratio.

Modes:

* ``cpu``: a mid-size thinker (12 layers, hidden 1024, 16 heads, 2 KV heads, MLP 2816; float32, sdpa) so that the
  decoder dominates; runs in about 4 minutes on 2 cores with ``--threads 1``. Target: ``llm_prefill_ratio`` within
  1.15x of ``token_layer_ratio``.
* ``gpu``: the real Qwen2.5-Omni-7B and 3B text-model shapes (``macer.testing.TEXT_SHAPES``, real vocabulary sizes;
  bf16, sdpa, random weights; the encoders stay tiny, their time is reported apart). Also the naive way of getting
  the scores, eager attention with ``output_attentions=True`` as FastV-style code does, against sdpa plus
  ``macer_kernels.modality_scores``, at N = 2.4k and 20k tokens, with out-of-memory recorded as such.

Results go to ``benchmarks/results/`` (CSV + JSON with device, versions, git SHA and settings) with a PNG of time and
memory vs keep ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from macer import cost
from macer.adapters import get_adapter

CPU_SHAPE: dict[str, int] = {"num_layers": 12, "hidden_size": 1024, "num_heads": 16, "num_kv_heads": 2,
                             "intermediate_size": 2816}
"""The CPU mode's decoder: deep and wide enough that the decoder dominates the prefill, small enough for 2 cores."""

REAL_VOCAB: dict[str, int] = {"7B": 152064, "3B": 151936}
"""Vocabulary sizes of the real checkpoints: the thinker runs its LM head on every prompt position, so it counts."""

SCORING_OPS = ("modality_scores",)
SELECTION_OPS = ("split_budget", "temporal_chunks", "topk_indices", "coverage_select")
COMPACTION_OPS = ("compact", "compact_many")

_MIB = 2.0**20

_GPU_DEVICE = "cuda"
"""Device of the gpu mode. Only the tests change it (with ``_uses_cuda`` and stand-ins for ``torch.cuda``), to run
every gpu-mode code path with a tiny model on a machine without a GPU."""


def _uses_cuda(device: torch.device) -> bool:
    """Whether ``device`` is timed and measured through ``torch.cuda`` (events, allocator peaks)."""
    return device.type == "cuda"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``macer bench`` / ``benchmarks/bench_e2e.py``."""
    parser.add_argument("--mode", choices=("auto", "cpu", "gpu"), default="auto",
                        help="cpu: mid-size model on CPU; gpu: real 7B/3B text shapes in bf16 on CUDA "
                             "(default: gpu when CUDA is available)")
    parser.add_argument("--keep-ratios", type=float, nargs="+", default=[0.25, 0.35, 0.45],
                        help="MACER keep ratios rho to compare with the full prefill")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default cpu 1, gpu 3)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default cpu 7, gpu 10)")
    parser.add_argument("--profile-reps", type=int, default=3,
                        help="extra generates per MACER configuration that measure its own overhead (synchronised)")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help="new tokens per generate, >= 2 (default cpu 8, gpu 32)")
    parser.add_argument("--text-shapes", nargs="+", choices=sorted(REAL_VOCAB), default=["7B", "3B"],
                        help="gpu mode: real text-model shapes to run")
    parser.add_argument("--num-layers", type=int, default=CPU_SHAPE["num_layers"], help="cpu mode: decoder depth")
    parser.add_argument("--hidden-size", type=int, default=CPU_SHAPE["hidden_size"], help="cpu mode: decoder width")
    parser.add_argument("--num-heads", type=int, default=CPU_SHAPE["num_heads"], help="cpu mode: query heads")
    parser.add_argument("--num-kv-heads", type=int, default=CPU_SHAPE["num_kv_heads"], help="cpu mode: KV heads")
    parser.add_argument("--intermediate-size", type=int, default=CPU_SHAPE["intermediate_size"],
                        help="cpu mode: MLP width")
    parser.add_argument("--audio-tokens", type=int, default=1460, help="audio tokens of the synthetic clip")
    parser.add_argument("--frames", type=int, default=12, help="video frames of the clip (864 tokens at 24x24)")
    parser.add_argument("--grid", type=int, nargs=2, default=[24, 24], metavar=("H", "W"),
                        help="14-pixel patches per frame")
    parser.add_argument("--audio-layer", type=int, default=None,
                        help="l_a (default: the paper's value for 28/36-layer models, else 3)")
    parser.add_argument("--video-layer", type=int, default=None,
                        help="l_v (default: the paper's value for 28/36-layer models, else 5)")
    parser.add_argument("--naive-lengths", type=int, nargs="*", default=[2400, 20000],
                        help="gpu mode: sequence lengths of the naive output_attentions comparison (none: skip)")
    parser.add_argument("--threads", type=int, default=None,
                        help="cpu mode: torch intra-op threads (default: torch's choice; 1 makes the CPU-time columns "
                             "a clean compute measure on a shared machine)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--name", default=None, help="file stem of the results (default bench_e2e_<mode>)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see ``add_arguments``); write and print the results."""
    mode = _resolve_mode(args.mode)
    settings = _settings(args, mode)
    device = torch.device(_GPU_DEVICE if mode == "gpu" else "cpu")
    cpu_label = "{num_layers}L-h{hidden_size}-mlp{intermediate_size}-heads{num_heads}/{num_kv_heads}".format(**settings)
    models = ([(cpu_label, {k: settings[k] for k in CPU_SHAPE})] if mode == "cpu"
              else [(shape, {"text_shape": shape, "vocab_size": REAL_VOCAB[shape]}) for shape in args.text_shapes])
    rows: list[dict] = []
    naive_rows: list[dict] = []
    for label, shape_kwargs in models:
        model = _build(shape_kwargs, device, torch.float32 if mode == "cpu" else torch.bfloat16)
        rows += benchmark_model(model, label, settings, log=_log)
        if mode == "gpu" and settings["naive_lengths"]:
            # The later readout (L_p): the layer up to which FastV-style code would need the full attention.
            readout = max(_macer_config(model, 1.0, settings).stage_layers)
            naive_rows += naive_scores_rows(model, label, settings["naive_lengths"], readout)
        del model
        if _uses_cuda(device):
            torch.cuda.empty_cache()
    return _write(rows, naive_rows, settings, device, args)


# ---------------------------------------------------------------------------------------------------------------
# Settings and model construction
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
    settings = {
        "mode": mode, "keep_ratios": list(args.keep_ratios), "warmup": warmup, "reps": reps, "decode_tokens": decode,
        "profile_reps": args.profile_reps,
        "audio_tokens": args.audio_tokens, "frames": args.frames, "grid": list(args.grid),
        "audio_layer": args.audio_layer, "video_layer": args.video_layer, "naive_lengths": list(args.naive_lengths),
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads, "intermediate_size": args.intermediate_size,
        "threads": torch.get_num_threads(), "attn_implementation": "sdpa",
        "dtype": "float32" if mode == "cpu" else "bfloat16",
        "load_average_at_start": list(os.getloadavg()),
    }
    return settings


def _build(shape_kwargs: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight thinker. On CUDA it is initialised directly on the device (initialising a 7B model on the host
    takes minutes), in float32 and then cast, so that no initialiser runs in bf16."""
    from macer.testing import build_thinker

    if not _uses_cuda(device):
        return build_thinker(dtype=dtype, device=device, attn_implementation="sdpa", **shape_kwargs)
    with torch.device(device):
        return build_thinker(dtype=dtype, device=device, attn_implementation="sdpa", **shape_kwargs)


def _macer_config(model: torch.nn.Module, keep_ratio: float, settings: dict[str, Any]):
    """The paper's defaults for the 7B/3B text shapes (by model identity), the 7B values otherwise; explicit layers
    win."""
    from macer.config import paper_defaults
    from macer.testing import macer_config_for

    overrides: dict[str, Any] = dict(paper_defaults(model) or {})
    for name in ("audio_layer", "video_layer"):
        if settings[name] is not None:
            overrides[name] = settings[name]
    return macer_config_for(model, keep_ratio=keep_ratio, **overrides)


def _thinker(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "thinker", model)


# ---------------------------------------------------------------------------------------------------------------
# Measurement plumbing
# ---------------------------------------------------------------------------------------------------------------


class _Clock:
    """Intervals on one device: CUDA events (no host sync inside the timed region), or on CPU both wall time
    (``perf_counter``) and the process's CPU time (``process_time``; robust to other processes sharing the cores)."""

    def __init__(self, device: torch.device):
        self.cuda = _uses_cuda(device)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), time.process_time()

    def seconds(self, start: Any, stop: Any) -> float:
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        return stop[0] - start[0]

    def cpu_seconds(self, start: Any, stop: Any) -> float | None:
        return None if self.cuda else stop[1] - start[1]


@contextlib.contextmanager
def _module_calls(modules: dict[str, torch.nn.Module], clock: _Clock) -> Iterator[dict[str, list]]:
    """Record ``(start, stop)`` marks of every call of each named module while inside the block."""
    calls: dict[str, list] = {name: [] for name in modules}
    handles = []
    for name, module in modules.items():
        pending: list = []
        handles.append(module.register_forward_pre_hook(lambda *_, p=pending: p.append(clock.mark())))
        handles.append(module.register_forward_hook(
            lambda *_, p=pending, c=calls[name]: c.append((p.pop(), clock.mark()))))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _timed_ops(clock: _Clock) -> Iterator[dict[str, list]]:
    """Time every call of MACER's ops (scoring, selection, compaction) while inside the block.

    The model layer imports the ops by name, so each op is replaced in every loaded ``macer``/``macer_kernels``
    module that holds it and restored afterwards. Only outermost calls are timed (an op calling another is counted
    once).
    """
    import macer_kernels

    names = SCORING_OPS + SELECTION_OPS + COMPACTION_OPS
    originals = {name: getattr(macer_kernels, name) for name in names}
    calls: dict[str, list] = {name: [] for name in names}
    depth = [0]

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                calls[name].append((start, clock.mark()))
                depth[0] -= 1

        return timed

    wrappers = {name: wrap(name, fn) for name, fn in originals.items()}
    patched = []
    for module in list(sys.modules.values()):
        module_name = getattr(module, "__name__", "")
        if module_name not in ("macer", "macer_kernels") and not module_name.startswith(("macer.", "macer_kernels.")):
            continue
        for name, fn in originals.items():
            if getattr(module, name, None) is fn:
                setattr(module, name, wrappers[name])
                patched.append((module, name, fn))
    try:
        yield calls
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so the RSS before a run is not inflated by the last one."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def _peak_memory(device: torch.device) -> Iterator[dict[str, float | None]]:
    """Peak bytes above the memory resident at entry: the CUDA allocator's peak, or the sampled process RSS."""
    result: dict[str, float | None] = {"peak_extra": None}
    if _uses_cuda(device):
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_extra"] = torch.cuda.max_memory_allocated(device) - base
        return
    _malloc_trim()
    base = _rss_bytes()
    if base is None:
        yield result
        return
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _rss_bytes() or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        result["peak_extra"] = max(peak[0], _rss_bytes() or 0) - base


class _TokenClock:
    """A ``generate`` streamer that stamps the arrival of every new token (the first ``put`` is the prompt)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[tuple[float, float]] = []  # (wall, process CPU) seconds
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if _uses_cuda(self.device):
            torch.cuda.synchronize(self.device)
        self.stamps.append((time.perf_counter(), time.process_time()))

    def end(self) -> None:
        pass


def _cache_layer_lengths_and_bytes(cache: Any) -> tuple[list[int], int]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    lengths = [int(layer.keys.shape[-2]) for layer in layers]
    nbytes = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                 for layer in layers)
    return lengths, nbytes


@dataclass
class Measurement:
    """One ``generate`` call, full or MACER."""

    prefill_s: float
    prefill_cpu_s: float | None
    llm_prefill_s: float
    llm_prefill_cpu_s: float | None
    encoders_s: float
    decode_s_per_token: float
    decode_cpu_s_per_token: float | None
    peak_extra_bytes: float | None
    kv_prefill_bytes: int
    cache_layer_lengths: list[int]
    op_seconds: dict[str, float] = field(default_factory=dict)
    trace: Any = None
    overhead_s: float | None = None


def measure_generate(model: torch.nn.Module, inputs: dict[str, Any], macer_config: Any, decode_tokens: int, *,
                     profile: bool = False) -> Measurement:
    """Run ``model.generate`` once (inside ``macer.compress(model, macer_config)`` unless the config is None).

    With ``profile`` MACER's own work is measured (``compress(..., profile=True)`` records it, with the device
    synchronised around it; each op's time is recorded) and so is the peak memory. Both disturb the timing (the
    synchronisation; on CPU the RSS-sampling thread competes for the GIL), so timed runs go without ``profile``.
    """
    import macer

    thinker = _thinker(model)
    device = next(thinker.parameters()).device
    clock = _Clock(device)
    parts = get_adapter(model).parts(model)
    modules = {"llm": parts.decoder, "audio": parts.root.audio_tower, "visual": parts.root.visual}
    streamer = _TokenClock(device)
    patch = (macer.compress(model, macer_config, profile=profile) if macer_config is not None
             else contextlib.nullcontext())
    op_timer = _timed_ops(clock) if profile else contextlib.nullcontext({})
    memory_meter = _peak_memory(device) if profile else contextlib.nullcontext({"peak_extra": None})
    with torch.no_grad(), memory_meter as memory, _module_calls(modules, clock) as calls, \
            op_timer as ops, patch as trace:
        if _uses_cuda(device):
            torch.cuda.synchronize(device)
        start = (time.perf_counter(), time.process_time())
        out = model.generate(**inputs, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False,
                             streamer=streamer, return_dict_in_generate=True)
    if len(streamer.stamps) != decode_tokens:
        raise RuntimeError(f"expected {decode_tokens} new tokens, the streamer saw {len(streamer.stamps)}")
    lengths, nbytes = _cache_layer_lengths_and_bytes(out.past_key_values)
    # The returned cache also holds the decode steps but the last: one token per layer per step.
    per_token = nbytes / sum(lengths)
    steps = decode_tokens - 1
    kv_prefill = round(nbytes - steps * len(lengths) * per_token)
    prefill_lengths = [n - steps for n in lengths]
    encoders = sum(clock.seconds(*calls[name][0]) for name in ("audio", "visual") if calls[name])
    op_seconds = {name: sum(clock.seconds(a, b) for a, b in marks) for name, marks in ops.items()}
    return Measurement(
        prefill_s=streamer.stamps[0][0] - start[0],
        prefill_cpu_s=None if _uses_cuda(device) else streamer.stamps[0][1] - start[1],
        llm_prefill_s=clock.seconds(*calls["llm"][0]),
        llm_prefill_cpu_s=clock.cpu_seconds(*calls["llm"][0]),
        encoders_s=encoders,
        decode_s_per_token=(streamer.stamps[-1][0] - streamer.stamps[0][0]) / (decode_tokens - 1),
        decode_cpu_s_per_token=((streamer.stamps[-1][1] - streamer.stamps[0][1]) / (decode_tokens - 1)
                                if not _uses_cuda(device) else None),
        peak_extra_bytes=memory["peak_extra"],
        kv_prefill_bytes=kv_prefill,
        cache_layer_lengths=prefill_lengths,
        op_seconds=op_seconds,
        trace=trace if macer_config is not None else None,
        overhead_s=trace.last.overhead_s if profile and macer_config is not None else None,
    )


# ---------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _median(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def benchmark_model(model: torch.nn.Module, label: str, settings: dict[str, Any],
                    log: Callable[[str], None] = _log) -> list[dict]:
    """Alternate full and MACER generates on one synthetic clip; one row per configuration (medians)."""
    from macer.testing import SYNTHETIC_TOKENS, clip_inputs

    thinker = _thinker(model)
    device = next(thinker.parameters()).device
    dtype = next(thinker.parameters()).dtype
    inputs = clip_inputs(model, frames=settings["frames"], grid_hw=tuple(settings["grid"]),
                         audio_tokens=settings["audio_tokens"], device=device, dtype=dtype)
    ids = inputs["input_ids"][0]
    n_audio = int((ids == SYNTHETIC_TOKENS.audio).sum())
    n_video = int((ids == SYNTHETIC_TOKENS.video).sum())
    configs: list[tuple[str, float, Any]] = [("full", 1.0, None)]
    configs += [("macer", rho, _macer_config(model, rho, settings)) for rho in settings["keep_ratios"]]
    results: dict[int, list[Measurement]] = {i: [] for i in range(len(configs))}
    rounds = settings["warmup"] + settings["reps"]
    for r in range(rounds):
        order = list(range(len(configs)))
        shift = r % len(order)
        order = order[shift:] + order[:shift]  # rotate, so no configuration always runs first or after the same one
        latest: dict[int, Measurement] = {}
        for i in order:
            latest[i] = measure_generate(model, inputs, configs[i][2], settings["decode_tokens"])
            if r >= settings["warmup"]:
                results[i].append(latest[i])
        log(f"[{label}] round {r + 1}/{rounds}{' (warm-up)' if r < settings['warmup'] else ''}: " + ", ".join(
            f"{configs[i][0]}@{configs[i][1]:g} llm {1e3 * latest[i].llm_prefill_s:.0f} ms" for i in sorted(latest)))
    # MACER's own work and the peak memory, measured apart: a few extra generates of each configuration.
    profiled: dict[int, list[Measurement]] = {i: [] for i in range(len(configs))}
    for _ in range(settings["profile_reps"]):
        for i in profiled:
            profiled[i].append(measure_generate(model, inputs, configs[i][2], settings["decode_tokens"], profile=True))
    shape = cost.DecoderShape.from_config(model)
    return [_row(label, configs[i][0], configs[i][1], results[i], profiled[i], results[0], shape, n_audio, n_video)
            for i in range(len(configs))]


def _row(label: str, method: str, keep_ratio: float, runs: list[Measurement], profiled: list[Measurement],
         full_runs: list[Measurement], shape: cost.DecoderShape, n_audio: int, n_video: int) -> dict:
    """One configuration's medians. Ratios to the full prefill are medians of per-round ratios (``runs[k]`` and
    ``full_runs[k]`` ran in the same round), which cancels slow drifts of the machine's load."""
    last = runs[-1]
    n_tokens = last.cache_layer_lengths[0]
    if method == "full":
        layer_tokens = [n_tokens] * shape.num_layers
        run_cost = cost.run_cost(layer_tokens, shape, n_audio + n_video)
        kept_audio, kept_video = n_audio, n_video
    else:
        run_cost = cost.trace_cost(last.trace, shape)
        layer_tokens = list(last.trace.layer_tokens)
        kept_audio, kept_video = last.trace.budget.audio, last.trace.budget.video

    def ms(values: Sequence[float | None]) -> float | None:
        value = _median(values)
        return None if value is None else 1e3 * value

    def op_ms(names: Sequence[str]) -> float | None:
        return ms([sum(m.op_seconds[op] for op in names) for m in profiled]) if method == "macer" else None

    row = {
        "model": label, "method": method, "keep_ratio": keep_ratio, "tokens": n_tokens, "audio_tokens": n_audio,
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
        "overhead_ms": ms([m.overhead_s for m in profiled]) if method == "macer" else None,
        "scoring_ms": op_ms(SCORING_OPS), "selection_ms": op_ms(SELECTION_OPS),
        "compaction_ms": op_ms(COMPACTION_OPS),
        "layer_tokens": " ".join(map(str, layer_tokens)),
        "cache_matches_trace": last.cache_layer_lengths == layer_tokens,
        "token_layer_ratio": run_cost.token_layer_ratio, "paper_proxy": run_cost.paper_proxy,
        "flops_ratio": run_cost.flops_ratio,
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


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / _MIB


# ---------------------------------------------------------------------------------------------------------------
# GPU: the naive way of reading the scores
# ---------------------------------------------------------------------------------------------------------------


def _scores_from_output_attentions(text_model: torch.nn.Module, embeds: torch.Tensor, modality: torch.Tensor,
                                   readout_layer: int, query_tokens: int) -> torch.Tensor:
    """ANMS (``eq:macer_score``) from the probabilities an eager forward returns with ``output_attentions=True``."""
    out = text_model(inputs_embeds=embeds, use_cache=False, output_attentions=True)
    probs = out.attentions[readout_layer - 1][:, :, -query_tokens:].float()  # [1, Hq, Lq, N]
    labels = modality[:, None, None, :]
    scores = torch.zeros(modality.shape, device=embeds.device)
    for m in (1, 2):
        in_m = labels == m
        mass = (probs * in_m).sum(-1, keepdim=True)
        scores += (probs / (mass + 1e-6) * in_m).sum(dim=(1, 2)) / (query_tokens * probs.shape[1])
    return scores


def _scores_from_cache(text_model: torch.nn.Module, embeds: torch.Tensor, query: torch.Tensor,
                       modality: torch.Tensor, readout_layer: int) -> torch.Tensor:
    """ANMS from an sdpa prefill's cached keys at the readout layer and the question rows' queries."""
    import macer_kernels

    out = text_model(inputs_embeds=embeds, use_cache=True)
    key = out.past_key_values.layers[readout_layer - 1].keys
    return macer_kernels.modality_scores(query, key, modality)


def naive_scores_rows(model: torch.nn.Module, label: str, lengths: Sequence[int], readout_layer: int,
                      query_tokens: int = 4) -> list[dict]:
    """Time and memory of getting ANMS scores at the readout layer of an N-token prefill, two ways:

    * ``eager+output_attentions``: the decoder with eager attention and ``output_attentions=True`` (every layer's
      ``[Hq, N, N]`` probabilities are materialised and returned), scores then computed from the readout layer's
      question rows, as FastV-style code does;
    * ``sdpa+modality_scores``: the decoder with sdpa (no probabilities) plus ``macer_kernels.modality_scores`` on
      the question rows' queries and the layer's keys.

    Out of memory is recorded (``oom=True``) instead of raised. Random hidden states stand in for a prompt and
    random question-row queries for the model's own (the cost is the same).
    """
    thinker = _thinker(model)
    text_model = get_adapter(model).parts(model).decoder
    device = next(thinker.parameters()).device
    dtype = next(thinker.parameters()).dtype
    shape = cost.DecoderShape.from_config(model)
    rows = []
    previous = thinker.config.text_config._attn_implementation
    try:
        for n in lengths:
            generator = torch.Generator(device=device).manual_seed(n)
            embeds = torch.randn(1, n, shape.hidden_size, generator=generator, device=device, dtype=dtype)
            modality = torch.randint(0, 3, (1, n), generator=generator, device=device)
            query = torch.randn(1, shape.num_heads, query_tokens, shape.head_dim, generator=generator, device=device,
                                dtype=dtype)
            for method in ("eager+output_attentions", "sdpa+modality_scores"):
                thinker.set_attn_implementation({"text_config": "eager" if method.startswith("eager") else "sdpa"})

                if method.startswith("eager"):
                    fn = functools.partial(_scores_from_output_attentions, text_model, embeds, modality, readout_layer,
                                           query_tokens)
                else:
                    fn = functools.partial(_scores_from_cache, text_model, embeds, query, modality, readout_layer)
                row = {"model": label, "method": method, "tokens": n, "readout_layer": readout_layer, "oom": False,
                       "time_ms": None, "peak_mib": None}
                try:
                    with torch.no_grad():
                        fn()  # warm-up
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                        times = []
                        for _ in range(3):
                            start = time.perf_counter()
                            fn()
                            torch.cuda.synchronize(device)
                            times.append(time.perf_counter() - start)
                    row["time_ms"] = 1e3 * statistics.median(times)
                    row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / _MIB
                except torch.cuda.OutOfMemoryError:
                    row["oom"] = True
                torch.cuda.empty_cache()
                rows.append(row)
                _log(f"[{label}] naive scores N={n} {method}: "
                     + ("OOM" if row["oom"] else f"{row['time_ms']:.1f} ms, {row['peak_mib']:.0f} MiB above weights"))
    finally:
        thinker.set_attn_implementation({"text_config": previous})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------


def _benchmarks_common():
    """``benchmarks/common.py`` of the source tree (the benchmark plumbing shared by all benchmarks)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "common.py").is_file():
        raise SystemExit(f"macer bench writes its results through benchmarks/common.py, not found under {root}; "
                         "run it from a source checkout")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import common

    return common


def _cpu_model() -> str | None:
    """The host CPU's model name (``common.environment`` names only the architecture on some machines)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _write(rows: list[dict], naive_rows: list[dict], settings: dict[str, Any], device: torch.device,
           args: argparse.Namespace) -> int:
    common = _benchmarks_common()
    name = args.name or f"bench_e2e_{settings['mode']}"
    meta = {"env": common.environment(device), "cpu_model": _cpu_model(),
            "settings": settings,
            "clip": "synthetic chat-templated question about an interleaved audio-video clip (macer.testing)",
            "timing": "median of `reps` rounds after `warmup` rounds; full and MACER alternate in one process",
            "load_average_at_end": list(os.getloadavg())}
    out_dir = args.out if args.out is not None else common.RESULTS_DIR
    csv_path, json_path = common.write_results(name, rows, meta, out_dir)
    paths = [csv_path, json_path]
    if naive_rows:
        paths += common.write_results(f"{name}_naive", naive_rows, meta, out_dir)
    print(f"device: {meta['env']['device']}  torch {meta['env']['torch']}  git {meta['env']['git_sha']}")
    common.print_table([{k: v for k, v in r.items() if k != "layer_tokens"} for r in rows])
    if naive_rows:
        common.print_table(naive_rows)
    if not args.no_plot:
        paths.append(plot(rows, Path(out_dir) / f"{name}.png", title=meta["env"]["device"]))
    for path in paths:
        print(f"wrote {path}")
    return 0


def plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """Per model (one column each): prefill times, measured ratios next to the cost model, and memory, all vs the
    keep ratio; the full prefill as dotted horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(3, len(models), figsize=(6 * len(models), 10), squeeze=False)
    for col, label in enumerate(models):
        full = next(r for r in rows if r["model"] == label and r["method"] == "full")
        macer_rows = sorted((r for r in rows if r["model"] == label and r["method"] == "macer"),
                            key=lambda r: r["keep_ratio"])
        rhos = [r["keep_ratio"] for r in macer_rows]
        series = [("prefill_ms", "prefill (all, wall)"), ("llm_prefill_ms", "LLM prefill (wall)"),
                  ("llm_prefill_cpu_ms", "LLM prefill (CPU time)")]
        ax = axes[0][col]
        for color, (key, name) in enumerate(series):
            if full[key] is None:
                continue
            ax.plot(rhos, [r[key] for r in macer_rows], "o-", color=f"C{color}", label=f"MACER {name}")
            ax.axhline(full[key], color=f"C{color}", ls=":", label=f"full {name}")
        key = "decode_cpu_ms_per_token" if full["decode_cpu_ms_per_token"] is not None else "decode_ms_per_token"
        decode = ", ".join(f"{r[key]:.1f}" for r in macer_rows)
        ax.set_title(f"{label}\n{key}: full {full[key]:.1f}, MACER {decode}", fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ratios = [("llm_prefill_ratio", "measured LLM prefill (wall)", "o-"),
                  ("llm_prefill_cpu_ratio", "measured LLM prefill (CPU time)", "o-"),
                  ("token_layer_ratio", "token-layer ratio (exact)", "x--"),
                  ("flops_ratio", "FLOPs ratio (exact)", "x--"),
                  ("paper_proxy", "paper proxy eq:appendix_efficiency", "x:")]
        for color, (key, name, style) in enumerate(ratios):
            if macer_rows and macer_rows[0][key] is not None:
                ax.plot(rhos, [r[key] for r in macer_rows], style, color=f"C{color}", label=name)
        ax.set_ylabel("MACER / full")
        ax.legend(fontsize=7)
        ax = axes[2][col]
        for color, (key, name) in enumerate((("kv_cache_mib", "KV cache after prefill"),
                                             ("peak_extra_mib", "peak memory above weights"))):
            if full[key] is None:
                continue
            ax.plot(rhos, [r[key] for r in macer_rows], "o-", color=f"C{color + 2}", label=f"MACER {name}")
            ax.axhline(full[key], color=f"C{color + 2}", ls=":", label=f"full {name}")
        ax.set_xlabel("keep ratio rho")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
