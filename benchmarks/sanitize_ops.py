"""Every public op on small, awkward shapes, for compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

    python -m benchmarks.sanitize_ops                       # each usable GPU backend (cuda, triton)
    compute-sanitizer --tool memcheck python -m benchmarks.sanitize_ops
    python -m benchmarks.sanitize_ops --backends torch --device cpu   # the driver itself, on CPU (a test runs this)

Shapes are chosen to hit tails and edges, not to be fast: N not a multiple of any tile, D = 80 (not a power of
two), GQA groups of 3, a FlashAttention-layout K read through strides, per-batch causal limits, one modality absent
from a batch element, eps = 0, n = 1, k = 0 and k = n selections, strided scores, uint8/int32/int64 chunk ids,
compaction of bf16/fp32/int64 tensors (one transposed) with 0, 1 and all rows kept, and a left-padded batch
(PAD_LABEL padding, per-sample budgets, right-aligned rows, the [B, W] compaction). Every result is compared with
the PyTorch backend, so a kernel that reads uninitialised memory and happens to pass the sanitizer still fails here.
Prints one ``sanitize pass <backend>`` line per backend; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import macer_kernels as mk


def _cases(device: torch.device) -> list[tuple[str, Callable[[], object]]]:
    g = torch.Generator(device=device.type).manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    cases = []
    # modality_scores: odd N, D = 80, GQA 3, bnhd cache view, per-batch positions, eps = 0, an absent modality.
    for dtype, n, d in ((torch.bfloat16, 37, 80), (torch.float16, 130, 64), (torch.float32, 1, 64),
                        (torch.float64, 65, 16)):
        q = randn(2, 6, 3, d, dtype=dtype)
        k_bnhd = randn(2, n, 2, d, dtype=dtype).transpose(1, 2)
        labels = torch.randint(0, 4, (2, n), generator=g, device=device)
        labels[1][labels[1] == 3] = 1  # label 3 absent from batch 1
        lq = min(3, n)
        q = q[:, :, :lq]
        # Batch 0: the last rows; batch 1: rows spread over the sequence (other causal limits, unsorted).
        positions = torch.stack([torch.arange(n - lq, n), torch.linspace(0, n - 1, lq).long().flip(0)]).to(device)
        cases.append((f"modality_scores {dtype} N={n} D={d}",
                      lambda q=q, k=k_bnhd, m=labels, p=positions: mk.modality_scores(q, k, m, p, eps=0.0)))
        if n >= 3:
            k_bhnd = k_bnhd.contiguous()
            cases.append((f"modality_scores {dtype} N={n} default positions",
                          lambda q=q, k=k_bhnd, m=labels: mk.modality_scores(q, k, m)))
    # selections: n = 1, tails, strided views, all dtypes of scores and chunk ids, k = 0 / 1 / n.
    for n in (1, 37, 864, 3000):
        scores = torch.rand(2 * n, generator=g, device=device)[::2]  # stride 2
        chunks = torch.arange(n, device=device) * 8 // n
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            s = scores.to(dtype)
            for k in sorted({0, 1, n // 4, n}):
                cases.append((f"topk_indices {dtype} n={n} k={k}", lambda s=s, k=k: mk.topk_indices(s, k)))
        for chunk_dtype in (torch.uint8, torch.int32, torch.int64):
            c = chunks.to(chunk_dtype)
            for k, weight in ((n // 4, 0.2), (n, 0.5), (1, 0.0)):
                cases.append((f"coverage_select {chunk_dtype} n={n} k={k} w={weight}",
                              lambda s=scores, c=c, k=k, w=weight: mk.coverage_select(s, c, k, w)))
    # compaction: bf16 hidden, fp32 cos (a transposed view), int64 M-RoPE position ids; 0, 1, some and all rows.
    hidden = randn(2, 37, 24, dtype=torch.bfloat16)
    cos = randn(2, 80, 37).transpose(1, 2)
    pos_ids = torch.arange(37, device=device).expand(3, 2, 37).contiguous()
    for keep in (torch.empty(0, dtype=torch.long, device=device), torch.tensor([36], device=device),
                 torch.tensor([0, 3, 4, 20, 36], device=device), torch.arange(37, device=device)):
        cases.append((f"compact k={keep.numel()}", lambda keep=keep: mk.compact(hidden, keep, 1)))
        cases.append((f"compact_many k={keep.numel()}",
                      lambda keep=keep: mk.compact_many([hidden, cos, pos_ids], keep, [1, 1, 2])))
    cases.append(("temporal_chunks", lambda: mk.temporal_chunks(torch.arange(37, device=device) * 3, 4)))
    if hasattr(mk, "select_stage"):  # the fused stage entry point (issue 9 item 2), where this checkout has it
        cases += _stage_cases(device, g)
    return cases


def _stage_cases(device: torch.device, g: torch.Generator) -> list[tuple[str, Callable[[], object]]]:
    """``select_stage`` over 2 samples of 37 tokens (5 text, 18 audio by top-K, 14 video by coverage) in shuffled
    order, bf16 q/k with GQA 3 and a FlashAttention-layout cache."""
    counts = {0: 5, 1: 18, 2: 14}
    row = torch.cat([torch.full((c,), label) for label, c in counts.items()])
    labels = torch.stack([row[torch.randperm(37, generator=torch.Generator().manual_seed(b))] for b in range(2)])
    labels = labels.to(device)
    chunk_ids = (torch.arange(37, device=device) * 4 // 37).expand(2, 37).contiguous()
    q = torch.randn(2, 6, 3, 80, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(2, 37, 2, 80, generator=g, device=device).to(torch.bfloat16).transpose(1, 2)
    stage = [mk.StageModality(label=1, count=18, keep=5),
             mk.StageModality(label=2, count=14, keep=6, coverage_weight=0.2, num_chunks=4)]
    cases = [("select_stage", lambda: mk.select_stage(q, k, labels, stage, chunk_ids=chunk_ids, return_scores=True))]
    # A left-padded batch (issue 11): padding labelled PAD_LABEL, per-sample counts and budgets, right-aligned rows
    # with -1 fill, and the [B, W] compaction of those rows (-1 slots become zero rows).
    padded = labels.clone()
    padded[1, :6] = mk.PAD_LABEL
    counts = [[int((padded[b] == m).sum()) for b in range(2)] for m in (1, 2)]
    batch_stage = [mk.StageModality(label=1, count=counts[0], keep=[5, min(2, counts[0][1])]),
                   mk.StageModality(label=2, count=counts[1], keep=[6, min(1, counts[1][1])], coverage_weight=0.2,
                                    num_chunks=4)]
    hidden = torch.randn(2, 37, 24, generator=g, device=device).to(torch.bfloat16)
    pos_ids = torch.arange(37, device=device).expand(3, 2, 37).contiguous()

    def batched():
        keep, scores = mk.select_stage(q, k, padded, batch_stage, chunk_ids=chunk_ids, padding=[0, 6],
                                       return_scores=True)
        return [keep, scores, *mk.compact_many([hidden, pos_ids], keep, [1, 2])]

    cases.append(("select_stage padded batch + compact_many [B, W]", batched))
    return cases


def _equal(got, want) -> bool:
    if isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want))
    if got.is_floating_point():
        return bool(torch.allclose(got.double(), want.double(), rtol=2e-2, atol=1e-5, equal_nan=True))
    return bool(torch.equal(got, want))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=None, help="default: every usable backend but torch")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    backends = args.backends or [b for b in mk.available_backends() if b != "torch"]
    cases = _cases(device)
    with mk.use_backend("torch"):
        expected = [fn() for _, fn in cases]
    for name in backends:
        with mk.use_backend(name):
            for (label, fn), want in zip(cases, expected):
                got = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # a kernel fault surfaces here, named by the case
                if not _equal(got, want):
                    print(f"sanitize MISMATCH {name}: {label}")
                    return 1
        print(f"sanitize pass {name} ({len(cases)} cases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
