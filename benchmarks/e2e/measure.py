"""Measurement plumbing of the end-to-end benchmark: clocks, module and op timers, peak memory, host
synchronisations, and one timed ``generate`` (``measure_generate``)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from macer.hf.adapters import get_adapter

SCORING_OPS = ("modality_scores",)
SELECTION_OPS = ("split_budget", "temporal_chunks", "topk_indices", "coverage_select")
COMPACTION_OPS = ("compact", "compact_many")
STAGE_OPS = ("select_stage", "prepared_stage")
"""The fused stage (scores and every selection of a readout in one call) that MACER's stages run: ``select_stage``
since model v2, a prepared stage's call (``macer_kernels.prepared.PreparedStage.run``, its preparation included the
first time a layout runs) since issue 37."""
_METHOD_OPS = {"prepared_stage": ("macer_kernels.prepared", "PreparedStage", "run")}
"""Ops that are methods, not module-level functions: name -> (module, class, method), patched on the class."""

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cudaMemcpy2D")
"""CUDA runtime calls in which the host waits for the device: the explicit synchronisations and the blocking
(non-``Async``) copies. ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` and ``bool(t)`` on a CUDA tensor each show
up as a ``cudaStreamSynchronize`` (after a ``cudaMemcpyAsync``) in the profiler's CPU-side runtime events."""


def uses_cuda(device: torch.device) -> bool:
    """Whether ``device`` is timed and measured through ``torch.cuda`` (events, allocator peaks, the profiler).
    Only the tests change it (with stand-ins for ``torch.cuda``) to run the gpu mode's code paths on CPU."""
    return device.type == "cuda"


def thinker_of(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "thinker", model)

class _Clock:
    """Intervals on one device: CUDA events (no host sync inside the timed region), or on CPU both wall time
    (``perf_counter``) and the process's CPU time (``process_time``; robust to other processes sharing the cores)."""

    def __init__(self, device: torch.device):
        self.cuda = uses_cuda(device)

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

    names = SCORING_OPS + SELECTION_OPS + COMPACTION_OPS + STAGE_OPS
    originals = {name: getattr(macer_kernels, name) for name in names if name not in _METHOD_OPS}
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
    for name, (module_name, class_name, method) in _METHOD_OPS.items():
        owner = getattr(importlib.import_module(module_name), class_name)
        patched.append((owner, method, getattr(owner, method)))
        setattr(owner, method, wrap(name, getattr(owner, method)))
    try:
        yield calls
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


@contextlib.contextmanager
def _timed_decode() -> Iterator[list[float]]:
    """Host seconds MACER's runtime spends in decode steps while inside the block: the decoder pre-hook's decode branch,
    the per-layer decode hooks, and (in versions that had it) the removal of per-step hooks. Whatever of these the
    installed ``macer.hf.session.Session`` has is wrapped, so one harness measures an older runtime too. Host time
    (perf_counter): what a decode step costs the CPU before its kernels are queued."""
    from macer.hf.session import Session

    session = Session
    spent: list[float] = []
    depth = [0]

    def timed(fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)
                depth[0] -= 1

        return wrapped

    def timed_hooks(make: Callable) -> Callable:
        def wrapped(self, index):
            return timed(make(self, index))

        return wrapped

    patched = [(name, getattr(session, name)) for name in ("_begin_decode", "_close_step", "_decode_hook")
               if hasattr(session, name)]
    for name, fn in patched:
        setattr(session, name, timed_hooks(fn) if name == "_decode_hook" else timed(fn))
    try:
        yield spent
    finally:
        for name, fn in patched:
            setattr(session, name, fn)


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
    if uses_cuda(device):
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
        if uses_cuda(self.device):
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
    decode_host_s_per_step: float | None = None


def measure_generate(model: torch.nn.Module, inputs: dict[str, Any], policy: Any, decode_tokens: int, *,
                     profile: bool = False, compile: dict[str, Any] | None = None) -> Measurement:
    """Run ``model.generate`` once (inside ``macer.compress(model, policy)`` unless the policy is None: the full
    model). With ``compile`` (``torch.compile`` arguments) the decoder layers run compiled
    (``compress(..., compile=compile)``; the full model as ``macer.FullConfig()``, whose context prunes nothing).

    With ``profile`` MACER's own work is measured (``compress(..., profile=True)`` records it, with the device
    synchronised around it; each op's time is recorded) and so is the peak memory. Both disturb the timing (the
    synchronisation; on CPU the RSS-sampling thread competes for the GIL), so timed runs go without ``profile``.
    """
    import macer

    thinker = thinker_of(model)
    device = next(thinker.parameters()).device
    clock = _Clock(device)
    parts = get_adapter(model).parts(model)
    modules = {"llm": parts.decoder, "audio": parts.root.audio_tower, "visual": parts.root.visual}
    streamer = _TokenClock(device)
    if compile is not None and policy is None:
        policy = macer.FullConfig()
    patch = (macer.compress(model, policy, profile=profile, compile=False if compile is None else compile)
             if policy is not None else contextlib.nullcontext())
    op_timer = _timed_ops(clock) if profile else contextlib.nullcontext({})
    memory_meter = _peak_memory(device) if profile else contextlib.nullcontext({"peak_extra": None})
    decode_timer = _timed_decode() if profile and policy is not None else contextlib.nullcontext(None)
    with torch.no_grad(), memory_meter as memory, _module_calls(modules, clock) as calls, \
            op_timer as ops, decode_timer as decode_spent, patch as trace:
        if uses_cuda(device):
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
        prefill_cpu_s=None if uses_cuda(device) else streamer.stamps[0][1] - start[1],
        llm_prefill_s=clock.seconds(*calls["llm"][0]),
        llm_prefill_cpu_s=clock.cpu_seconds(*calls["llm"][0]),
        encoders_s=encoders,
        decode_s_per_token=(streamer.stamps[-1][0] - streamer.stamps[0][0]) / (decode_tokens - 1),
        decode_cpu_s_per_token=((streamer.stamps[-1][1] - streamer.stamps[0][1]) / (decode_tokens - 1)
                                if not uses_cuda(device) else None),
        peak_extra_bytes=memory["peak_extra"],
        kv_prefill_bytes=kv_prefill,
        cache_layer_lengths=prefill_lengths,
        op_seconds=op_seconds,
        trace=trace if policy is not None else None,
        overhead_s=trace.last.overhead_s if profile and policy is not None else None,
        decode_host_s_per_step=None if decode_spent is None else sum(decode_spent) / steps,
    )




def host_syncs_per_prefill(model: torch.nn.Module, inputs: dict[str, Any], policy: Any,
                           compile: dict[str, Any] | None = None) -> dict[str, int]:
    """Count the host synchronisations of one prefill (``model(**inputs)``, encoders included; inside
    ``macer.compress(model, policy)`` unless the policy is None) with ``torch.profiler``: the CUDA runtime calls in
    ``SYNC_EVENTS``, by name. CUDA devices only (on CPU nothing waits for a device)."""
    import macer
    from torch.profiler import ProfilerActivity, profile, supported_activities

    # The activities this torch build can record: asking a CPU-only build for CUDA (as the tests' stand-ins for
    # torch.cuda would) makes every profiled op about 1000x slower.
    activities = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in supported_activities()]
    if compile is not None and policy is None:
        policy = macer.FullConfig()
    patch = (macer.compress(model, policy, compile=False if compile is None else compile) if policy is not None
             else contextlib.nullcontext())
    with torch.no_grad(), patch:
        model(**inputs)  # warm-up: first-call allocations and lazy initialisation are not part of a prefill
        torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            model(**inputs)
            torch.cuda.synchronize()
    # The closing synchronize above is the benchmark's, not the prefill's: not counted.
    counts = count_sync_events(event.name for event in prof.events())
    counts["cudaDeviceSynchronize"] = max(0, counts["cudaDeviceSynchronize"] - 1)
    return counts


def count_sync_events(names: Iterator[str] | list[str]) -> dict[str, int]:
    """Occurrences of each name of ``SYNC_EVENTS`` among profiler event names."""
    counts = dict.fromkeys(SYNC_EVENTS, 0)
    for name in names:
        if name in counts:
            counts[name] += 1
    return counts
