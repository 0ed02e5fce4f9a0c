"""Where the host time of one MACER readout goes: the fused stage (``select_stage`` + ``compact_many``, what
``macer.compress`` runs at each readout layer) and the per-op readout of ``bench_readout``, each profiled with
torch.profiler (CPU and CUDA activity) on the Qwen2.5-Omni-7B readout of the 2.4k-token prompt.

    python -m benchmarks.host_profile                 # GPU (benchmarks/gpu_check.sh's host_profile step)
    python -m benchmarks.host_profile --device cpu    # the driver itself on CPU (a test runs this; tiny prompt)

Prints per readout: device time (do_bench-style median), wall time (one call + synchronize), launches / syncs /
device time from the profiler (``benchmarks.common``), then the profiler's table of host operators by self CPU time.
The gap between wall time and device time is host time; the table says which Python-level ops it is spent in.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_readout import (
    COVERAGE_WEIGHT,
    NUM_CHUNKS,
    PROMPT,
    QUICK_PROMPT,
    QUICK_SHAPE,
    backend_readout,
    make_inputs,
)
from benchmarks.common import median_time_us, profile_call, wall_time_us
from macer_kernels import StageModality, compact_many, select_stage, use_backend


def stage_readout(x: dict, backend: str):
    """One readout as the runtime does it: ``select_stage`` (scores + both selections, kept rows in order) and one
    ``compact_many`` of the stage's tensors."""
    labels = x["modality"]
    n = labels.shape[1]
    chunk_ids = torch.zeros(1, n, dtype=torch.long, device=labels.device)
    chunk_ids[0, x["video_pos"]] = x["chunks"]
    budget = x["budget"]
    mods = [StageModality(1, int(x["audio_pos"].numel()), budget.audio),
            StageModality(2, int(x["video_pos"].numel()), budget.video, coverage_weight=COVERAGE_WEIGHT,
                          num_chunks=NUM_CHUNKS)]

    def call():
        with use_backend(backend):
            keep = select_stage(x["query"], x["key"], labels, mods, chunk_ids=chunk_ids)
            return keep, compact_many([x["hidden"], x["cos"], x["sin"], x["position_ids"]], keep[0], [1, 1, 1, 2])

    return call


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
        cases[f"stage[{backend}]"] = stage_readout(x, backend)
        cases[f"per-op readout[{backend}]"] = lambda backend=backend: backend_readout(backend, x)
    expected = None
    for name, call in cases.items():
        keep = call()[0]
        keep = keep[0] if keep.dim() == 2 else keep
        expected = keep if expected is None else expected
        same = bool(torch.equal(keep, expected))
        us = median_time_us(call, device, warmup=3, reps=20)
        wall = wall_time_us(call, device, budget_s=0.05 if device.type == "cuda" else 0.01, min_reps=3)
        counts = profile_call(call, device)
        print(f"{name}: device {us:.1f} us, wall {wall:.1f} us, {counts}, same kept rows as the first: {same}")
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
