"""One call of each scoring path and of the K-streaming baseline between cudaProfilerStart/Stop, for Nsight Compute's
metrics of kernel-plan 8.7 (benchmarks/gpu_check.sh's ``ncu_scores`` step).

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
        dram__bytes_write.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum python -m benchmarks.ncu_scores
    python -m benchmarks.ncu_scores --device cpu      # the driver itself on CPU (torch backend; a test runs this)

Shapes: Qwen2.5-Omni-7B (28 query heads, 4 KV heads, D = 128, bf16, Lq = 4), N = 20k and 100k, labels in runs of
~100 keys as an omni prompt's. Calls: the CUDA backend's default path (S-B on an sm_90a build on an H100/H200, else
S-A), S-A forced, and ``stream_k_cuda`` (K read once). What to read off: per key, ``smsp__inst_executed.sum`` / (N x
4 KV heads) warp-instructions (plan: <= ~40 for the new kernels); DRAM bytes against K's 1024 B per key; the L2 hit
rate of the reduce's logit reads (S-A) and of S-B's spill read-back (plan: > 90 % under a persisting window).
"""

from __future__ import annotations

import torch

import macer_kernels as mk
from benchmarks.ncu_hot_path import profile


def _inputs(n: int, device: torch.device, g: torch.Generator):
    q = torch.randn(1, 28, 4, 128, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(1, 4, n, 128, generator=g, device=device).to(torch.bfloat16)
    runs = torch.randint(0, 3, (-(-n // 100),), generator=g, device=device)
    labels = runs.repeat_interleave(100)[:n][None]
    return q, k, labels


def calls(device: torch.device) -> list[tuple[str, object]]:
    g = torch.Generator(device=device.type).manual_seed(0)
    out = []
    for n in (20_000, 100_000):
        q, k, labels = _inputs(n, device, g)
        out.append((f"modality_scores default N={n}", lambda q=q, k=k, m=labels: mk.modality_scores(q, k, m)))
        if device.type == "cuda":
            from macer_kernels.cuda.modality_scores import modality_scores_cuda, stream_k_cuda

            pos = torch.arange(n - 4, n, device=device)[None]
            out.append((f"modality_scores S-A N={n}",
                        lambda q=q, k=k, m=labels, p=pos: modality_scores_cuda(q, k, m, p, 128 ** -0.5, 1e-6,
                                                                               path="sa")))
            out.append((f"stream_k N={n}", lambda k=k: stream_k_cuda(k)))
    return out


def main(argv: list[str] | None = None) -> None:
    profile("ncu_scores", __doc__, calls, argv)


if __name__ == "__main__":
    main()
