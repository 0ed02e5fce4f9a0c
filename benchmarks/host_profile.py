"""Where the host time of one MACER readout goes: the prepared stage (``macer_kernels.prepared``: one call per
stage, what ``macer.compress`` runs at each readout layer), the fused stage it replaced (``select_stage`` +
``compact_many``) and the per-op readout of ``bench_readout``, each profiled with torch.profiler (CPU and CUDA
activity) on the Qwen2.5-Omni-7B readout of the 2.4k-token prompt.

    python -m benchmarks.host_profile                 # GPU (benchmarks/gpu_check.sh's host_profile step)
    python -m benchmarks.host_profile --device cpu    # the driver itself on CPU (a test runs this; tiny prompt)

Prints per readout: device time (do_bench-style median), wall time (one call + synchronize), **host time** (the
call alone on the host: it returns once its kernels are queued, so this is the stage's host cost, paid on every
stage whatever the GPU does), launches / syncs / device time from the profiler (``benchmarks.common``), then the
profiler's table of host operators by self CPU time. The gap between wall time and device time is host time the GPU
waited for; the table says which Python-level ops it is spent in.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_readout import (
    PROMPT,
    QUICK_PROMPT,
    QUICK_SHAPE,
    backend_readout,
    fused_readout,
    make_inputs,
    prepared_readout,
)
from benchmarks.common import median_time_us, profile_call, wall_time_us


def host_time_us(call, device: torch.device, reps: int = 50) -> float:
    """Median host time of ``call()`` alone (the GPU idle before it; its kernels run after the clock stops)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        times.append(1e6 * (time.perf_counter() - t0))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (torch backend, tiny prompt)")
    parser.add_argument("--rows", type=int, default=18, help="rows of each host-operator table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        x, backends = make_inputs(PROMPT, device), ["cuda", "triton"]
    else:
        x, backends = make_inputs(QUICK_PROMPT, device, **QUICK_SHAPE), ["torch"]
    cases = {}
    for backend in backends:
        cases[f"prepared[{backend}]"] = prepared_readout(backend, x)
        cases[f"stage[{backend}]"] = fused_readout(backend, x)
        cases[f"per-op readout[{backend}]"] = lambda backend=backend: backend_readout(backend, x)
    expected = None
    for name, call in cases.items():
        keep = call()[0]
        expected = keep if expected is None else expected
        same = bool(torch.equal(keep, expected))
        us = median_time_us(call, device, warmup=3, reps=20)
        wall = wall_time_us(call, device, budget_s=0.05 if device.type == "cuda" else 0.01, min_reps=3)
        host = host_time_us(call, device, reps=50 if device.type == "cuda" else 3)
        counts = profile_call(call, device)
        print(f"{name}: device {us:.1f} us, wall {wall:.1f} us, host {host:.1f} us per stage, {counts}, same kept "
              f"rows as the first: {same}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print("host_profile done:", len(cases), "readouts")


if __name__ == "__main__":
    main()
