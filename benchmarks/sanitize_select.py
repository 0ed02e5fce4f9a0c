"""The radix selection kernel's launch shapes, for compute-sanitizer racecheck / synccheck / memcheck.

    python -m benchmarks.sanitize_select                      # every case on the GPU, checked against torch
    compute-sanitizer --tool racecheck python -m benchmarks.sanitize_select
    python -m benchmarks.sanitize_select --device cpu         # the driver itself on the torch backend (a test)

``sanitize_ops`` runs every op on small shapes (one CTA each). This driver adds the shapes that reach the kernel's
other code: a row *split* over a cluster of two CTAs (one token above the single-CTA threshold of each path, on
sm_90), full *clusters* (coverage at 20k tokens, top-K at 100k, a batch of coverage rows), and in one CTA the ends of
the radix select (one value: the tie scan; a spread of exponents: the small bin ranked pairwise; a budget equal to a
bin) and chunk ids outside a byte (the direct rank count), plus a launch with programmatic stream serialization behind
the kernel that writes its scores. Every result is compared with the PyTorch backend. Prints ``sanitize pass
select (<n> cases)``; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import macer_kernels as mk


def _plan(n: int, coverage: bool, wide: bool = False) -> tuple:
    from macer_kernels.cuda._ext import ext

    avail, clusters = ext().select_cta_device_limits(torch.cuda.current_device())
    return ext().select_cta_plan(n, coverage, wide, avail, clusters)


# Without a GPU (the driver's own check): sm_90's single-CTA thresholds as recorded in
# benchmarks/results/select_resources.json.
CPU_SPLIT_SIZES = {"coverage": 4097, "top-K": 8193}


def _split_sizes(device: torch.device) -> dict[str, int]:
    """One token above each single-CTA threshold: with clusters (sm_90) kSingleCoverageMax and kSingleTopKMax (a
    cluster of 2 each), without them the largest one-CTA rows (the multi-CTA chain takes the row above)."""
    if device.type != "cuda":
        return CPU_SPLIT_SIZES
    from macer_kernels.cuda._ext import ext

    constants = ext().SELECT_CTA_CONSTANTS
    avail, clusters = ext().select_cta_device_limits(torch.cuda.current_device())
    if clusters >= 2:
        return {"coverage": constants["single_coverage_max"] + 1, "top-K": constants["single_topk_max"] + 1}
    return {"coverage": ext().select_cta_max_n_for(avail, True, False, 1) + 1,
            "top-K": ext().select_cta_max_n_for(avail, False, False, 1) + 1}


def _cases(device: torch.device) -> list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]:
    """(name, the CUDA call, the same call on the torch backend); on a CPU device both are the torch backend."""
    g = torch.Generator(device=device.type).manual_seed(0)
    cases = []

    def add(name, fn, *args):
        def on(backend):
            def run():
                with mk.use_backend(backend):
                    return fn(*args)

            return run

        cases.append((name, on("cuda" if device.type == "cuda" else "torch"), on("torch")))

    split = _split_sizes(device)
    for label, n, coverage in (("small", 37, True), ("small", 864, True), ("split", split["coverage"], True),
                               ("split", split["top-K"], False), ("cluster", 20000, True),
                               ("cluster", 100000, False)):
        scores = torch.rand(n, generator=g, device=device)
        chunks = torch.arange(n, device=device) * 8 // n
        for k in (1, n // 4, n - 1):
            if coverage:
                add(f"{label} coverage n={n} k={k}", mk.coverage_select, scores, chunks, k, 0.2)
            else:
                add(f"{label} topk n={n} k={k}", mk.topk_indices, scores, k)
    # the select's ends in one CTA: one value (tie scan), spread exponents (small bin), a bin taken whole
    n = 5000
    index = torch.arange(n, device=device)
    spread = (2.0 ** (index % 200 - 100) * (1 + index // 200 / 64)).float()
    for name, scores, k in (("tie", torch.full((n,), 0.25, device=device), 1234), ("small bin", spread, 1253),
                            ("whole bin", spread, 1250)):
        add(f"{name} topk n={n} k={k}", mk.topk_indices, scores, k)
        add(f"{name} coverage n={n} k={k}", mk.coverage_select, scores, index % 40, k, 0.7)
    # chunk ids outside a byte: the direct rank count, in one CTA and in a cluster
    for n in (600, 9000):
        scores = torch.rand(n, generator=g, device=device)
        far = torch.arange(n, device=device) % 3 * 2**40
        add(f"direct ranks coverage n={n}", mk.coverage_select, scores, far, n // 3, 0.3)
    # a batch of stage rows on the same scores (top-K and coverage, per-sample budgets): one CTA per row at 2.4k,
    # a cluster per row at 9k (sm_90)
    from macer_kernels.backend import dispatch

    for b, n in ((3, 2400), (2, 9000)):
        scores = torch.rand(b, n, generator=g, device=device)
        labels = torch.randint(0, 3, (b, n), generator=g, device=device)
        chunk_ids = (torch.arange(n, device=device) * 8 // n).expand(b, n).contiguous()
        counts = [[int((labels[s] == m).sum()) for s in range(b)] for m in (1, 2)]
        keeps = torch.tensor([[c // 3 for c in counts[0]], [c // 4 for c in counts[1]]], dtype=torch.int32,
                             device=device).t().contiguous()
        spec = ((1, max(c // 3 for c in counts[0]), None, 0), (2, max(c // 4 for c in counts[1]), 0.2, 8))
        out_len = max(n - (counts[0][s] - counts[0][s] // 3) - (counts[1][s] - counts[1][s] // 4) for s in range(b))
        add(f"stage B={b} n={n}", lambda *a: dispatch("stage_select", device, *a), scores, labels, chunk_ids, spec,
            out_len, keeps)
    return cases


def _pdl_case(device: torch.device) -> None:
    """A launch with programmatic stream serialization right behind the kernel that writes its scores."""
    from macer_kernels.cuda._ext import dtype_code, ext, launch_args

    n, k = 20000, 5000
    base = torch.rand(n, device=device)
    chunks = torch.arange(n, device=device) * 8 // n
    for coverage in (False, True):
        scores = torch.empty_like(base)
        out = torch.empty(k, dtype=torch.long, device=device)
        torch.mul(base, 3.0, out=scores)
        dev, stream = launch_args(scores)
        ext().select_cta("pdl", scores.data_ptr(), dtype_code("pdl", "s", scores), (0, 1), 0, 0, (0, 0),
                         chunks.data_ptr() if coverage else 0, dtype_code("pdl", "c", chunks), (0, 1),
                         out.data_ptr(), 0, k, 1, n, [(0, k, 0.2 if coverage else 0.0, coverage)], 0, 0, dev, stream,
                         pdl=True)
        with mk.use_backend("torch"):
            want = mk.coverage_select(base * 3.0, chunks, k, 0.2) if coverage else mk.topk_indices(base * 3.0, k)
        if not torch.equal(out, want):
            raise SystemExit(f"sanitize MISMATCH select pdl coverage={coverage}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: the driver on the torch backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sanitize_select needs a CUDA GPU (or --device cpu)")
    cases = _cases(device)
    for name, run, torch_path in cases:
        got, want = run(), torch_path()
        if not torch.equal(got, want):
            raise SystemExit(f"sanitize MISMATCH select {name}")
    if device.type == "cuda":
        _pdl_case(device)
        plans = {n: _plan(n, cov) for n, cov in ((20000, True), (100000, False), (4097, True))}
        print(f"launch plans (cluster, tokens per CTA, layout, table, bytes): {plans}")
    print(f"sanitize pass select ({len(cases)} cases{' and a PDL launch' if device.type == 'cuda' else ''})")


if __name__ == "__main__":
    main()
