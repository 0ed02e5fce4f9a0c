"""Benchmark ``topk_indices`` and ``coverage_select`` (eq:chunk_coverage_greedy): naive PyTorch vs every backend.

    python -m benchmarks.bench_select            # GPU: n = 864 / 20k / 100k video tokens, writes benchmarks/results/
    python -m benchmarks.bench_select --quick    # CPU smoke run on tiny sizes, writes nothing

k = n / 4 (keep ratio 0.25), lambda_c = 0.2 and C = 8 temporal chunks (the 7B defaults in ``macer.core.config``).
Providers: ``naive`` is the obvious PyTorch code (``torch.topk`` + a sort for top-k; the literal k-step greedy as a
loop of PyTorch ops on the device for the coverage greedy, run only where k <= 5000 because it costs k steps of
several launches); ``torch`` is the PyTorch backend; then every other backend that can run on the device.

Targets (issue 37), on ``median_us``: top-K at n = 20k under 10 us; coverage at n = 20k under 60 us (aim 20 us).
Each row shows its target (``target_us``, ``aim_us``) and ``met``; a summary after the table puts the CUDA rows
beside their limits. ``ctas`` is the CUDA kernel's launch plan: the CTAs per row (1, or a thread block cluster on
sm_90), or ``chain`` above the kernel's limit (the multi-CTA CUB chain).

Columns (``benchmarks.common`` defines them): ``median_us``, the device time between CUDA events
(``triton.testing.do_bench``), which leaves out the host's launch overhead (Python, the argument checks,
allocations) before the first launch, for a few microseconds of kernels most of the latency; ``wall_us``, what the
caller waits for (one call and a synchronize, L2 warm): **the selection targets read this column**; ``launches``,
``syncs``, ``d2h`` and ``kernel_us`` per call from torch.profiler (None on CPU). ``exact`` says whether the provider
returned the same indices as the PyTorch backend, which the tests hold to the float64 references.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, runnable_backends, slug, time_provider, write_results
from macer_kernels import coverage_select, temporal_chunks, topk_indices, use_backend
from macer_kernels.reference import coverage_greedy_picks

SIZES = (864, 20_000, 100_000)
QUICK_SIZES = (50, 300)
KEEP_RATIO = 0.25
COVERAGE_WEIGHT = 0.2
NUM_CHUNKS = 8
NAIVE_GREEDY_MAX_K = 5000
# (op, n) -> (limit, aim) in us of median_us (device time).
TARGETS = {("topk_indices", 20_000): (10.0, None), ("coverage_select", 20_000): (60.0, 20.0)}


def cuda_plan(op: str, n: int, device: torch.device) -> str | None:
    """The CUDA kernel's CTAs per row for this call (a cluster above 1), or 'chain' above its limit."""
    if device.type != "cuda":
        return None
    from macer_kernels.cuda._ext import ext

    coverage = op == "coverage_select"
    index = device.index if device.index is not None else torch.cuda.current_device()
    avail, clusters = ext().select_cta_device_limits(index)
    return str(ext().select_cta_plan(n, coverage, False, avail, clusters)[0] or "chain")


def print_targets(rows: list[dict]) -> None:
    """Each target beside the CUDA provider's measured value and its limit."""
    for (op, n), (limit, aim) in TARGETS.items():
        for row in rows:
            if row["op"] == op and row["n"] == n and row["provider"] == "cuda":
                goal = f"< {limit:g} us" + (f" (aim {aim:g})" if aim else "")
                verdict = "met" if row["median_us"] < limit else "MISSED"
                print(f"target {op} n={n}: cuda median_us {row['median_us']:.4g} (wall_us {row['wall_us']:.4g}, "
                      f"ctas {row['ctas']}) vs {goal}: {verdict}")


def naive_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    # torch.topk does not promise the lower index on ties; this is what code without the tie rule would write.
    return torch.sort(torch.topk(scores, k).indices).values


def naive_coverage(scores: torch.Tensor, chunks: torch.Tensor, k: int, weight: float) -> torch.Tensor:
    """The literal greedy on the device: ``reference.coverage_greedy_picks``, the k-step definition the float64
    reference uses too (one tie rule: value, then score, then the lower index), k steps of a few launches each."""
    return torch.sort(coverage_greedy_picks(scores, chunks, k, weight)).values


def _backend_fn(name: str, fn: Callable, *args) -> Callable[[], torch.Tensor]:
    def run():
        with use_backend(name):
            return fn(*args)

    return run


def run(sizes, device: torch.device, *, quick: bool = False) -> list[dict]:
    rows = []
    backends = runnable_backends("coverage_select", device)
    for n in sizes:
        g = torch.Generator(device=device.type).manual_seed(n)
        scores = torch.rand(n, generator=g, device=device)
        chunks = temporal_chunks(torch.arange(n, device=device), NUM_CHUNKS)
        k = int(KEEP_RATIO * n)
        ops = {
            "topk_indices": ({"naive": functools.partial(naive_topk, scores, k)}, topk_indices, (scores, k)),
            "coverage_select": ({"naive": functools.partial(naive_coverage, scores, chunks, k, COVERAGE_WEIGHT)}
                                if k <= NAIVE_GREEDY_MAX_K else {},
                                coverage_select, (scores, chunks, k, COVERAGE_WEIGHT)),
        }
        for op, (providers, fn, args) in ops.items():
            providers = {**providers, **{name: _backend_fn(name, fn, *args) for name in backends}}
            expected = _backend_fn("torch", fn, *args)()
            naive_us = None
            for name, provider in providers.items():
                # The literal greedy's k steps of launches would flood the profiler; its counts say nothing new.
                literal = name == "naive" and op == "coverage_select"
                times = time_provider(provider, device, quick=quick, profile=not literal)
                us = times["median_us"]
                naive_us = us if name == "naive" else naive_us
                limit, aim = TARGETS.get((op, n), (None, None))
                rows.append({"op": op, "provider": name, "n": n, "k": k, **times,
                             "speedup": naive_us / us if naive_us else float("nan"),
                             "ctas": cuda_plan(op, n, device) if name == "cuda" else None,
                             "target_us": limit, "aim_us": aim, "met": None if limit is None else us < limit,
                             "exact": bool(torch.equal(provider(), expected))})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run on tiny sizes; writes no results")
    parser.add_argument("--sizes", type=int, nargs="+", help="override the token counts n")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.quick:
        print_table(run(args.sizes or QUICK_SIZES, torch.device("cpu"), quick=True))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_select needs a CUDA GPU (use --quick for a CPU smoke run)")
    device = torch.device("cuda")
    rows = run(args.sizes or SIZES, device)
    print_table(rows)
    print_targets(rows)
    meta = {**environment(device), "keep_ratio": KEEP_RATIO, "coverage_weight": COVERAGE_WEIGHT,
            "num_chunks": NUM_CHUNKS, "scores_dtype": "float32"}
    paths = write_results(f"select_{slug(meta['device'])}", rows, meta, args.out)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
