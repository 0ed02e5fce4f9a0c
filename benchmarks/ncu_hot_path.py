"""One call of each hot-path op on the CUDA backend between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python -m benchmarks.ncu_hot_path                 # benchmarks/gpu_check.sh's ncu step
    python -m benchmarks.ncu_hot_path --device cpu        # the driver itself on CPU (torch backend; a test runs this)

Shapes are the microbenchmarks' (Qwen2.5-Omni-7B: 28 query heads, 4 KV heads, D = 128, bf16, Lq = 4): scoring at
N = 20k and 100k, ``coverage_select`` at n = 864 and 20k, ``topk_indices`` at n = 20k, and ``compact_many`` of a 7B
stage's hidden states at N = 2.4k. Every op runs once untimed first (compilation, workspace allocation), so the
profiled range holds only the launches of the measured calls. ncu's Speed Of Light section gives each kernel's
memory and compute throughput as a share of the card's peak: the profile behind the "what limits it" lines of the
GPU results (benchmarks/results/<card>-<date>/README.md).
"""

from __future__ import annotations

import argparse

import torch

import macer_kernels as mk
from macer_kernels.temporal_chunks import temporal_chunks


def _calls(device: torch.device):
    g = torch.Generator(device=device.type).manual_seed(0)
    calls = []
    for n in (20_000, 100_000):
        q = torch.randn(1, 28, 4, 128, generator=g, device=device).to(torch.bfloat16)
        k = torch.randn(1, 4, n, 128, generator=g, device=device).to(torch.bfloat16)
        labels = torch.randint(0, 3, (1, n), generator=g, device=device)
        calls.append((f"modality_scores N={n}", lambda q=q, k=k, labels=labels: mk.modality_scores(q, k, labels)))
    for n in (864, 20_000):
        scores = torch.rand(n, generator=g, device=device)
        chunks = temporal_chunks(torch.arange(n, device=device), 8)
        kk = n // 4
        calls.append((f"coverage_select n={n}",
                      lambda s=scores, c=chunks, kk=kk: mk.coverage_select(s, c, kk, 0.2)))
    scores = torch.rand(20_000, generator=g, device=device)
    calls.append(("topk_indices n=20000", lambda: mk.topk_indices(scores, 5000)))
    hidden = torch.randn(1, 2400, 3584, generator=g, device=device).to(torch.bfloat16)
    keep = torch.sort(torch.randperm(2400, generator=g, device=device)[:900]).values
    calls.append(("compact_many N=2400", lambda: mk.compact_many([hidden], keep, [1])))
    return calls


def profile(tag: str, doc: str, make_calls, argv: list[str] | None = None) -> None:
    """Run ``make_calls(device)``'s calls once to warm up, then once more between cudaProfilerStart/Stop (what
    ``ncu --profile-from-start off`` profiles), printing each name; the Nsight scripts' one driver."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; the CUDA backend) or cpu (torch backend)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backend = "cuda" if device.type == "cuda" else "torch"
    calls = make_calls(device)
    with mk.use_backend(backend):
        for _, call in calls:
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        for name, call in calls:
            print("profiled:", name, flush=True)
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    print(f"{tag} done:", backend, len(calls), "calls")


def main(argv: list[str] | None = None) -> None:
    profile("ncu_hot_path", __doc__, _calls, argv)


if __name__ == "__main__":
    main()
