"""One tie rule for the coverage greedy (issue 14, item 10): the float64 reference and the benchmarks' naive provider
both run ``reference.coverage_greedy_picks``; both are checked here against a literal Python loop over the key
``(value, score, -index)`` written in the test."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.bench_select import naive_coverage
from macer_kernels.reference import coverage_select_ref


def _literal_greedy(scores: list[float], chunks: list[int], k: int, weight: float) -> list[int]:
    taken: set[int] = set()
    counts: dict[int, int] = {}
    for _ in range(k):
        keys = {j: (s + math.sqrt(weight / (1 + counts.get(chunks[j], 0))), s, -j)
                for j, s in enumerate(scores) if j not in taken}
        best = max(keys, key=keys.get)
        taken.add(best)
        counts[chunks[best]] = counts.get(chunks[best], 0) + 1
    return sorted(taken)


@pytest.mark.parametrize("chunks", [[0, 1, 2, 3], [5, 5, 5, 5]], ids=["own chunks", "one chunk"])
def test_absorbed_score_differences_go_to_the_higher_score(chunks):
    # s + sqrt(0.2) is the same float64 number for all four scores: the higher score wins (index 1), not the first
    # maximum (index 0), in the reference and in the naive provider alike.
    scores = torch.tensor([1e-30, 1e-20, 3e-25, 0.0], dtype=torch.float64)
    ids = torch.tensor(chunks)
    assert coverage_select_ref(scores, ids, 1, 0.2).tolist() == [1]
    assert naive_coverage(scores, ids, 1, 0.2).tolist() == [1]
    # Then 3e-25 and 1e-30: the three highest scores, whatever the chunks (their bonuses are equal at each step).
    assert coverage_select_ref(scores, ids, 3, 0.2).tolist() == [0, 1, 2]
    assert naive_coverage(scores, ids, 3, 0.2).tolist() == [0, 1, 2]


@pytest.mark.parametrize("weight", [0.0, 0.2, 3.0])
def test_reference_and_naive_provider_equal_the_literal_loop(weight):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    g = torch.Generator().manual_seed(seed)
    n = 60
    # Coarse scores (many exact ties), some infinite, and chunks of uneven sizes.
    scores = torch.randint(-3, 4, (n,), generator=g).to(torch.float64) / 4
    scores[torch.randint(0, n, (3,), generator=g)] = float("-inf")
    scores[torch.randint(0, n, (2,), generator=g)] = float("inf")
    chunks = torch.randint(0, 5, (n,), generator=g) * 7
    for k in (0, 1, 17, n):
        want = _literal_greedy(scores.tolist(), chunks.tolist(), k, weight)
        assert coverage_select_ref(scores, chunks, k, weight).tolist() == want, (seed, k)
        assert naive_coverage(scores, chunks, k, weight).tolist() == want, (seed, k)
