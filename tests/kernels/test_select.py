"""topk_indices and coverage_select (eq:chunk_coverage_greedy) against the literal float64 references, and above a
few hundred tokens against the step-by-step greedy of tests/helpers/greedy_oracle.py (independent of the fast paths'
sort)."""

import pytest
import torch
from greedy_oracle import coverage_greedy, coverage_greedy_order
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from macer_kernels import coverage_select, temporal_chunks, topk_indices
from macer_kernels.reference import coverage_select_ref, topk_indices_ref


def _fresh(n, seed, *, ties=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (n,), generator=g).float() if ties else torch.rand(n, generator=g)
    return scores.to(device), g


@pytest.mark.parametrize("n", [1, 2, 17, 300, 2000])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_matches_reference(backend, n, ties, seed):
    _, device = backend
    scores, _ = _fresh(n, seed, ties=ties, device=device)
    for k in sorted({0, 1, n // 3, n - 1, n} - {-1}):
        out = topk_indices(scores, k)
        assert out.dtype == torch.long and out.device == scores.device
        assert torch.equal(out.cpu(), topk_indices_ref(scores.cpu(), k)), (seed, k)


def test_topk_ties_go_to_the_lower_index(backend):
    _, device = backend
    scores = torch.tensor([1.0, 3.0, 2.0, 3.0, 3.0, 0.0], device=device)
    assert topk_indices(scores, 2).tolist() == [1, 3]
    assert topk_indices(scores, 4).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("n", [1, 9, 250, 1500])
@pytest.mark.parametrize("weight", [0.0, 0.2, 3.0])
@pytest.mark.parametrize("ties", [False, True])
def test_coverage_matches_literal_greedy(backend, n, weight, ties, seed):
    _, device = backend
    scores, g = _fresh(n, seed, ties=ties, device=device)
    chunks = torch.randint(0, 8, (n,), generator=g).to(device)
    for k in sorted({0, 1, n // 4, n // 2, n}):
        out = coverage_select(scores, chunks, k, weight)
        assert out.dtype == torch.long and out.device == scores.device
        assert torch.equal(out.cpu(), coverage_select_ref(scores.cpu(), chunks.cpu(), k, weight)), (seed, k, weight)


@pytest.mark.parametrize("n", [3001, 5000])
def test_coverage_large_n_matches_the_step_by_step_greedy(backend, n, seed):
    # Sizes where the literal reference is too slow: the oracle runs the greedy step by step over chunk heads, so it
    # does not share the fast paths' argument that all steps are one global sort. Ties and 12 chunks.
    _, device = backend
    scores, g = _fresh(n, seed, ties=True, device=device)
    scores = scores + torch.randint(0, 2, (n,), generator=g).to(device) * torch.rand(n, generator=g).to(device)
    chunks = torch.randint(0, 12, (n,), generator=g).to(device)
    order = coverage_greedy_order(scores.cpu(), chunks.cpu(), 0.2)
    for k in (1, 97, n // 3, n - 1, n):
        out = coverage_select(scores, chunks, k, 0.2)
        assert torch.equal(out.cpu(), torch.tensor(sorted(order[:k]))), (seed, n, k)


def test_the_oracle_agrees_with_the_literal_reference(seed):
    # The large-n oracle is itself held to the literal greedy: ties, absorbed tiny scores, signed zeros, infinities.
    g = torch.Generator().manual_seed(seed)
    inf = float("inf")
    for trial in range(30):
        n = int(torch.randint(1, 80, (1,), generator=g))
        coarse = torch.randint(0, 9, (n,), generator=g)
        palette = torch.tensor([0.0, -0.0, 0.25, 0.5, 1e-30, 3e-25, inf, -inf, 0.0], dtype=torch.float64)
        scores = torch.where(coarse < 9, palette[coarse.clamp_max(8)], 0.0) + (trial % 2) * torch.rand(
            n, generator=g, dtype=torch.float64)
        chunks = torch.randint(0, int(torch.randint(1, 9, (1,), generator=g)), (n,), generator=g)
        weight = (0.0, 0.05, 0.2, 1.0, 9.0)[trial % 5]
        for k in range(n + 1):
            assert torch.equal(coverage_greedy(scores, chunks, k, weight),
                               coverage_select_ref(scores, chunks, k, weight)), (seed, trial, k)


def test_coverage_weight_zero_is_the_reference_topk(backend, seed):
    # With lambda = 0 the greedy is top-k; checked against the literal references, not against topk_indices (the
    # Triton backend implements weight 0 by calling it).
    _, device = backend
    scores, g = _fresh(200, seed, ties=True, device=device)
    chunks = torch.randint(0, 8, (200,), generator=g).to(device)
    for k in (0, 5, 67, 200):
        want = coverage_select_ref(scores.cpu(), chunks.cpu(), k, 0.0)
        assert torch.equal(want, topk_indices_ref(scores.cpu(), k)), (seed, k)
        assert torch.equal(coverage_select(scores, chunks, k, 0.0).cpu(), want), (seed, k)


def test_coverage_spreads_over_chunks():
    # All the best tokens sit in chunk 0; a strong bonus forces one pick per chunk before the second from chunk 0.
    scores = torch.tensor([0.9, 0.8, 0.7, 0.1, 0.1, 0.1])
    chunks = torch.tensor([0, 0, 0, 1, 2, 3])
    assert coverage_select(scores, chunks, 4, 0.0).tolist() == [0, 1, 2, 3]
    # lambda = 9: first pick of a chunk gets +3, the second +2.12: 0.1 + 3 beats 0.8 + 2.12.
    assert coverage_select(scores, chunks, 4, 9.0).tolist() == [0, 3, 4, 5]


def test_coverage_float64_absorbed_scores_keep_the_exact_order(backend):
    # Scores far below the bonus vanish in the float64 sum: s + sqrt(0.2) is the same number for all three tokens
    # of chunk 0. The greedy then prefers the higher score (the exact-arithmetic order), not merely the lower index.
    _, device = backend
    scores = torch.tensor([1e-30, 1e-20, 3e-25, 0.0], dtype=torch.float64, device=device)
    chunks = torch.tensor([0, 0, 0, 1], device=device)
    assert [coverage_select_ref(scores.cpu(), chunks.cpu(), k, 0.2).tolist() for k in (1, 2, 3)] == [
        [1], [1, 3], [1, 2, 3]]
    for k in range(5):
        assert torch.equal(coverage_select(scores, chunks, k, 0.2).cpu(),
                           coverage_select_ref(scores.cpu(), chunks.cpu(), k, 0.2))


def test_coverage_rounding_at_a_binade_edge(backend):
    # Around 2**53 the float64 spacing changes from 1 to 2: with lambda = 0.81 (bonuses 0.9, then 0.636) token 0
    # (2**53 - 1, second pick of chunk 0), token 2 (2**53, first pick of chunk 0) and token 1 all sum to 2**53.
    _, device = backend
    top = 2.0**53
    scores = torch.tensor([top - 1, top, top], dtype=torch.float64, device=device)
    chunks = torch.tensor([0, 1, 0], device=device)
    for k in range(4):
        assert torch.equal(coverage_select(scores, chunks, k, 0.81).cpu(),
                           coverage_select_ref(scores.cpu(), chunks.cpu(), k, 0.81))


def test_coverage_with_equal_size_bins_from_arange(seed):
    n = 864
    scores, _ = _fresh(n, seed)
    chunks = temporal_chunks(torch.arange(n), 8)
    out = coverage_select(scores, chunks, 407, 0.2)
    assert torch.equal(out, coverage_select_ref(scores, chunks, 407, 0.2)), seed
    assert out.unique().numel() == 407


def test_infinite_scores_are_ordered_like_the_greedy(backend):
    _, device = backend
    inf = float("inf")
    scores = torch.tensor([-inf, 0.5, inf, -inf, inf, 0.2], device=device)
    chunks = torch.tensor([0, 1, 1, 2, 0, 2], device=device)
    for k in range(7):
        assert torch.equal(coverage_select(scores, chunks, k, 0.3).cpu(),
                           coverage_select_ref(scores.cpu(), chunks.cpu(), k, 0.3))
        assert torch.equal(topk_indices(scores, k).cpu(), topk_indices_ref(scores.cpu(), k))


_PROPERTY = dict(
    data=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5)), min_size=0, max_size=60),
    weight=st.sampled_from([0.0, 0.05, 0.2, 1.0, 9.0]),
    k_frac=st.floats(0, 1),
)


def test_property_selection_equals_literal_greedy(backend):
    # Coarse values: many exact ties; and distinct tiny ones (a fixed pseudo-random order of the position) that the
    # float64 sum absorbs, so ties in value must fall to the higher score, not merely to the lower index. On every
    # backend (the interpreter runs each Triton program in Python: fewer examples there).
    name, device = backend

    @settings(max_examples=200 if name != "triton" or device != "cpu" else 25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(**_PROPERTY)
    def check(data, weight, k_frac):
        scores = torch.tensor([s / 4 if s < 6 else 1e-30 * (1 + (7 * i) % 11) for i, (s, _) in enumerate(data)],
                              dtype=torch.float64)
        chunks = torch.tensor([c for _, c in data], dtype=torch.long)
        k = int(k_frac * len(data))
        out = coverage_select(scores.to(device), chunks.to(device), k, weight).cpu()
        assert torch.equal(out, coverage_select_ref(scores, chunks, k, weight))
        assert out.numel() == k and (out.numel() < 2 or bool((out[1:] > out[:-1]).all()))
        assert torch.equal(topk_indices(scores.to(device), k).cpu(), topk_indices_ref(scores, k))

    check()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s, c: topk_indices(s, 11), ValueError, r"k must be in \[0, 10\]"),
        (lambda s, c: topk_indices(s, -1), ValueError, "k must be a non-negative integer"),
        (lambda s, c: topk_indices(s, 2.0), ValueError, "k must be a non-negative integer"),
        (lambda s, c: topk_indices(s[None], 2), ValueError, "scores must have 1 dimensions"),
        (lambda s, c: topk_indices(c, 2), TypeError, "scores must be a floating tensor"),
        (lambda s, c: topk_indices(torch.full((3,), float("nan")), 1), ValueError, "scores contains NaN"),
        (lambda s, c: coverage_select(s, c, 11, 0.2), ValueError, r"k must be in \[0, 10\]"),
        (lambda s, c: coverage_select(s, c[:9], 2, 0.2), ValueError, "chunk_ids must have the shape of scores"),
        (lambda s, c: coverage_select(s, c.float(), 2, 0.2), TypeError, "chunk_ids must be an integer tensor"),
        (lambda s, c: coverage_select(s, c - 5, 2, 0.2), ValueError, "chunk_ids must be non-negative"),
        (lambda s, c: coverage_select(s, c, 2, -0.1), ValueError, r"coverage_weight must be in \[0.0, inf\)"),
        (lambda s, c: coverage_select(s, c, 2, float("inf")), ValueError, r"coverage_weight must be in \[0.0, inf\)"),
        (lambda s, c: coverage_select(s * float("nan"), c, 2, 0.2), ValueError, "scores contains NaN"),
        (lambda s, c: coverage_select(c, c, 2, 0.2), TypeError, "scores must be a floating tensor"),
    ],
)
def test_errors(call, error, message):
    scores = torch.rand(10)
    chunks = torch.arange(10) % 3
    with pytest.raises(error, match=message):
        call(scores, chunks)
