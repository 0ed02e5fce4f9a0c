"""Shared benchmark plumbing: timing, profiling, environment description, result files.

Three numbers per call, because a target must say which it reads:

* ``median_us`` (``median_time_us``): device time. On CUDA ``triton.testing.do_bench`` (CUDA events around each
  call, L2 flushed before each) when Triton is present, else CUDA events; on CPU ``time.perf_counter``. do_bench
  queues the L2 flush before every call and the host launches the call while the GPU is still flushing, so host
  work done before the call's first launch (argument checks, allocations, Python) is hidden, while host work after
  a synchronisation inside the call is counted.
* ``wall_us`` (``wall_time_us``): what the caller waits for, the host wall time of one call plus a synchronize,
  median over repeated calls on the same inputs (L2 warm, as inside a prefill), the GPU idle before each call.
* ``launches`` / ``syncs`` / ``d2h`` / ``kernel_us`` (``profile_call``): per call, from torch.profiler: kernel launches
  (runtime and driver API, so CUDA-extension, PyTorch and Triton launches alike), host synchronisations
  (stream/device/event synchronize and blocking ``cudaMemcpy``), device-to-host copies, and the summed device time
  of the call's GPU work. None on CPU.

Results are written with the device, library versions, git SHA and thread counts.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def git_sha() -> str:
    """The checkout's commit (``-dirty`` with uncommitted changes); ``MACER_GIT_SHA`` names it where there is no .git
    (a copy of the tree on a lent GPU machine)."""
    if os.environ.get("MACER_GIT_SHA"):
        return os.environ["MACER_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


COLUMNS = {
    "median_us": "device time per call (do_bench on CUDA: CUDA events, L2 flushed, host time before the first launch "
                 "hidden); host wall time on CPU",
    "wall_us": "host wall time of one call + synchronize, median, L2 warm, GPU idle before the call",
    "launches": "kernel launches per call (torch.profiler: cudaLaunchKernel*, cuLaunchKernel*, cudaGraphLaunch)",
    "syncs": "host synchronisations per call (stream/device/event synchronize, blocking cudaMemcpy)",
    "d2h": "device-to-host copies per call",
    "kernel_us": "summed device time of the call's GPU work (torch.profiler, L2 warm)",
}
"""What each timing/counting column means; stored in every result file's meta."""


def environment(device: torch.device | str) -> dict:
    """Device, versions, git SHA and thread counts, stored next to every result."""
    device = torch.device(device)
    env = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
           "git_sha": git_sha(), "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
           "interop_threads": torch.get_num_interop_threads(), "host_cpu": platform.processor() or platform.machine(),
           "columns": COLUMNS}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                      "memory_gib": round(props.total_memory / 2**30, 1),
                      "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def runnable_backends(op: str, device: torch.device | str) -> list[str]:
    """Backends that can run ``op`` on ``device`` here, slowest first (torch, then triton, then cuda)."""
    from macer_kernels import available_backends, use_backend
    from macer_kernels.backend import resolve

    names = []
    for name in reversed(available_backends()):
        try:
            with use_backend(name):
                resolve(op, torch.device(device))
        except RuntimeError:  # e.g. Triton on CPU tensors without the interpreter
            continue
        names.append(name)
    return names


def median_time_us(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 5, reps: int = 50) -> float:
    """Median wall time of ``fn()`` in microseconds."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return 1e3 * do_bench(fn, warmup=25, rep=200, return_mode="median")
        except ImportError:
            pass
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(1e3 * start.elapsed_time(stop))
        return statistics.median(times)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def wall_time_us(fn: Callable[[], object], device: torch.device | str, *, budget_s: float = 0.2, reps: int = 200,
                 min_reps: int = 5) -> float:
    """Median host wall time of ``fn()`` followed by a device synchronize, in microseconds: launch overhead and any
    host synchronisation inside ``fn`` included, L2 warm (the same inputs every call). The number of runs fits a time
    budget (at least ``min_reps``), as do_bench does, so a slow provider does not take minutes."""
    device = torch.device(device)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU idle before the call: its queue is not part of the call
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    estimate = timed()  # also the warm-up of a first call
    reps = max(min_reps, min(reps, int(budget_s / max(estimate, 1e-9))))
    for _ in range(min(10, reps)):
        timed()
    return 1e6 * statistics.median(timed() for _ in range(reps))


LAUNCH_EVENTS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
                           "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cudaGraphLaunch"})
"""Host-side CUDA API events that launch device work (runtime API: PyTorch and the extension; driver API: Triton)."""
SYNC_EVENTS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                         "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"})
"""Host-side CUDA API events that block the host until the GPU is done."""
_CALL_MARK = "macer_bench_call"
PROFILE_COLUMNS = ("launches", "syncs", "d2h", "kernel_us")


def summarize_profile(events: Iterable, calls: int) -> dict[str, float]:
    """Per-call counts from torch.profiler events (``prof.events()``) of ``calls`` calls, each inside a
    ``record_function(_CALL_MARK)`` range: only host API events inside those ranges count (not the synchronize that
    ends the profile); device events count whole (the synchronize adds none)."""
    from torch.autograd import DeviceType

    events = list(events)
    ranges = [(e.time_range.start, e.time_range.end) for e in events
              if e.name == _CALL_MARK and e.device_type == DeviceType.CPU]
    if len(ranges) != calls:
        raise RuntimeError(f"profile holds {len(ranges)} marked calls, expected {calls}")

    def in_call(e) -> bool:
        return any(start <= e.time_range.start <= end for start, end in ranges)

    api = [e.name for e in events if e.device_type == DeviceType.CPU and e.name != _CALL_MARK and in_call(e)]
    device = [e for e in events if e.device_type == DeviceType.CUDA and e.name != _CALL_MARK]
    return {"launches": sum(name in LAUNCH_EVENTS for name in api) / calls,
            "syncs": sum(name in SYNC_EVENTS for name in api) / calls,
            "d2h": sum("DtoH" in e.name for e in device) / calls,
            "kernel_us": sum(e.time_range.elapsed_us() for e in device) / calls}


def kernel_breakdown(events: Iterable, calls: int) -> str:
    """Device time per call of each kernel (short names, longest first) as ``name=us;name=us``: where a call's
    ``kernel_us`` goes."""
    from torch.autograd import DeviceType

    times: dict[str, float] = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or e.name == _CALL_MARK:
            continue
        name = re.split(r"[(<]", e.name, maxsplit=1)[0].split("::")[-1].strip() or e.name
        times[name] = times.get(name, 0.0) + e.time_range.elapsed_us() / calls
    return ";".join(f"{name}={us:.1f}" for name, us in sorted(times.items(), key=lambda kv: -kv[1]))


def profile_call(fn: Callable[[], object], device: torch.device | str, *, calls: int = 5,
                 per_kernel: bool = False) -> dict[str, float | str | None]:
    """Launches, host synchronisations, device-to-host copies and device time per call of ``fn`` (after one warm-up
    call), from torch.profiler; all None on CPU. ``per_kernel`` adds ``kernels``: ``kernel_breakdown``."""
    device = torch.device(device)
    if device.type != "cuda":
        return dict.fromkeys(PROFILE_COLUMNS + (("kernels",) if per_kernel else ()))
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function(_CALL_MARK):
                fn()
        torch.cuda.synchronize(device)
    counts: dict[str, float | str | None] = dict(summarize_profile(prof.events(), calls))
    if per_kernel:
        counts["kernels"] = kernel_breakdown(prof.events(), calls)
    return counts


QUICK_WALL = {"budget_s": 0.02, "min_reps": 1}
"""``wall_time_us`` settings of a benchmark's ``--quick`` smoke run: a few calls per provider, not a time budget."""


def time_provider(fn: Callable[[], object], device: torch.device | str, *, quick: bool = False, warmup: int = 5,
                  reps: int = 50, profile: bool = True, per_kernel: bool = False) -> dict[str, float | str | None]:
    """One provider's columns of a benchmark row: ``median_us`` (``median_time_us`` with ``warmup`` / ``reps``),
    ``wall_us`` (``wall_time_us``, ``QUICK_WALL`` under ``quick``) and the ``profile_call`` counts (``per_kernel``
    adds ``kernels``); ``profile=False`` leaves the counts None, for a provider whose launches would flood the
    profiler."""
    row: dict[str, float | str | None] = {
        "median_us": median_time_us(fn, device, warmup=warmup, reps=reps),
        "wall_us": wall_time_us(fn, device, **(QUICK_WALL if quick else {})),
    }
    if profile:
        row.update(profile_call(fn, device, per_kernel=per_kernel))
    else:
        row.update(dict.fromkeys(PROFILE_COLUMNS + (("kernels",) if per_kernel else ())))
    return row


def copy_bandwidth_gbs(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + bytes written per second), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = median_time_us(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def write_results(name: str, rows: list[dict], meta: dict, out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``rows`` to ``<name>.csv`` and ``rows`` + ``meta`` to ``<name>.json``; return both paths."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{name}.csv", out_dir / f"{name}.json"
    if rows:
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return csv_path, json_path


def report(name: str, rows: list[dict], meta: dict, out_dir: Path | None, header: str) -> None:
    """A host benchmark's ending: ``meta`` gets the load average at the end, the results are written
    (``write_results``), and ``header`` (the machine; the load average at start and end are appended), the table and
    the written paths are printed."""
    meta["load_average_at_end"] = list(os.getloadavg())
    paths = write_results(name, rows, meta, out_dir)
    print(f"{header}  load {meta['load_average_at_start'][0]:.2f} -> {meta['load_average_at_end'][0]:.2f}")
    print_table(rows)
    for path in paths:
        print(f"wrote {path}")


def slug(text: str) -> str:
    """``text`` (a device name) as a file-name part: lower case, runs of other characters as one ``_``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def print_table(rows: list[dict], skip: tuple[str, ...] = ()) -> None:
    if not rows:
        return
    cols = [c for c in rows[0] if c not in skip]
    widths = [max(len(str(c)), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
