"""Selection on non-finite scores: one rule on every backend and in the reference (README, "non-finite").

A NaN score ranks below every number (-inf included); NaNs among themselves go to the lower index. So a sample whose
scores are all NaN keeps exactly its first K tokens of each modality, never more, never a -1 row, never a result of
another length; ``select_stage(..., return_flags=True)`` also says which samples had a non-finite score among the
stage's tokens. The oracles here are written by hand (small cases) or are ``reference.stage_ref`` /
``stage_select_ref``, whose NaN handling the first test pins down by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from score_inputs import score_inputs

from macer_kernels import StageModality, select_stage, validation
from macer_kernels.backend import dispatch
from macer_kernels.reference import (
    coverage_greedy_picks,
    coverage_select_ref,
    stage_flags_ref,
    stage_ref,
    topk_indices_ref,
)

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

NAN, INF = float("nan"), float("inf")
# Triton-marked tests run compiled on a GPU where there is one, in the interpreter on CPU tensors otherwise.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# NaN bit patterns a device might see: quiet, negative, every bit set, signalling (float32 bits)
NAN32_BITS = [0x7FC00000, 0xFFC00000, 0xFFFFFFFF, 0x7F800001]


def nan32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def test_reference_ranks_nan_below_every_number():
    """Guards the reference's NaN rule (it sorted NaN anywhere, and the greedy picked index 0 again and again)."""
    s = torch.tensor([NAN, 1.0, -INF, NAN, 0.5, -0.0])
    assert topk_indices_ref(s, 2).tolist() == [1, 4]
    assert topk_indices_ref(s, 4).tolist() == [1, 2, 4, 5]  # -inf is a number: before every NaN
    assert topk_indices_ref(s, 5).tolist() == [0, 1, 2, 4, 5]  # then the NaNs by index
    assert topk_indices_ref(torch.full((7,), NAN), 3).tolist() == [0, 1, 2]
    chunks = torch.tensor([0, 0, 1, 1, 2, 2])
    # weight 1: values 1 + 1 (chunk 0), -inf (chunk 1), 0.5 + 1 then -0.0 + sqrt(1/2) (chunk 2): numbers first
    assert coverage_greedy_picks(s, chunks, 6, 1.0).tolist() == [1, 4, 5, 2, 0, 3]
    assert coverage_select_ref(torch.full((9,), NAN), torch.arange(9) % 3, 4, 0.5).tolist() == [0, 1, 2, 3]
    labels = torch.tensor([[0, 1, 1, 2, 2, 2, 1, 0]])
    mods = [StageModality(1, 3, 2), StageModality(2, 3, 1, coverage_weight=0.2)]
    query = torch.randn(1, 2, 1, 4)
    query[0, 1, 0, 2] = NAN
    keep, scores = stage_ref(query, torch.randn(1, 2, 8, 4), labels, mods, torch.zeros(1, 8, dtype=torch.long))
    assert keep.tolist() == [[0, 1, 2, 3, 7]] and torch.isnan(scores[labels != 0]).all()
    assert stage_flags_ref(scores, labels, mods).tolist() == [True]


def _stage_case(b: int, n: int, seed: int, dtype: torch.dtype):
    """B samples with PAD, text, audio (1) and video (2) tokens; sample 0 finite, sample 1 some NaN (several bit
    patterns, and -inf), sample 2 all NaN on the stage's tokens (only where b > 2)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, n, generator=g).to(dtype)
    scores[:, 3] = -0.0  # a signed zero tied with the +0.0 below
    scores[:, 8] = 0.0
    labels = torch.tensor(([-1] * 2 + [0] * 3 + [1, 2] * n)[:n]).repeat(b, 1)
    labels[:, -2:] = 0
    labels[:, 2:].copy_(labels[:, 2:][:, torch.randperm(n - 2, generator=g)].clone())
    chunks = torch.randint(0, 4, (b, n), generator=g)
    where = torch.nonzero(labels[1] > 0).flatten()
    for j, bits in enumerate(NAN32_BITS):
        scores[1, where[3 * j + 1]] = nan32(bits)
    scores[1, where[2]] = -INF
    if b > 2:
        scores[2] = torch.where(labels[2] > 0, NAN, scores[2])
    return scores, labels, chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stage_select_on_nan_scores_matches_the_reference(backend, dtype, seed):
    """Guards issue 21/20: torch kept NaN first, Triton returned a row of -1, CUDA ranked a canonical NaN best; now
    every backend keeps what ``stage_select_ref`` keeps and flags the samples with a non-finite score."""
    from test_cuda_select_emulation import padded_oracle

    _, device = backend
    scores, labels, chunks = _stage_case(3, 45, seed, dtype)
    counts = [int((labels[0] == m).sum()) for m in (1, 2)]
    spec = ((1, counts[0] // 2, None, 0), (2, counts[1] // 3, 0.3, 4))
    out_len = 43 - sum(c - k for c, (_, k, _, _) in zip(counts, spec))
    want = padded_oracle(scores, labels, chunks, spec, out_len, None)
    assert (want >= 0).all(), "no row may be dropped"
    for keeps in (None, torch.tensor([[2, 1], [counts[0] // 2, 0], [1, counts[1] // 3]], dtype=torch.int32)):
        flags = torch.empty(3, dtype=torch.bool, device=device)
        got = dispatch("stage_select", torch.device(device), scores.to(device), labels.to(device),
                       chunks.to(device), spec, out_len, None if keeps is None else keeps.to(device), flags=flags)
        oracle = want if keeps is None else padded_oracle(scores, labels, chunks, spec, out_len, keeps)
        assert torch.equal(got.cpu(), oracle), f"seed={seed} keeps={keeps}"
        assert flags.cpu().tolist() == [False, True, True], f"seed={seed}"
    # an all-NaN sample keeps its first K tokens of each modality
    first = [torch.nonzero(labels[2] == m).flatten()[:k] for m, k, _, _ in spec]
    kept = set(want[2].tolist())
    assert all(set(f.tolist()) <= kept for f in first) and len(kept) == out_len


def _infinite_case(seed: int, dtype: torch.dtype = torch.float32):
    """Four samples and no NaN anywhere: finite; +inf at one audio token; -inf at one video token; +inf at a text
    token and -inf at a PAD token (not the stage's tokens). The rule says "non-finite", so the flags are
    [False, True, True, False]."""
    scores, labels, chunks = (t[:1].repeat(4, 1) for t in _stage_case(2, 45, seed, dtype))
    audio, video = (torch.nonzero(labels[0] == m).flatten() for m in (1, 2))
    scores[1, audio[2]] = INF
    scores[2, video[3]] = -INF
    scores[3, torch.nonzero(labels[0] == 0).flatten()[0]] = INF
    scores[3, torch.nonzero(labels[0] == -1).flatten()[0]] = -INF
    assert not torch.isnan(scores).any()
    spec = ((1, len(audio) // 2, None, 0), (2, len(video) // 3, 0.3, 4))
    out_len = int((labels[0] >= 0).sum()) - sum(len(t) - k for t, (_, k, _, _) in zip((audio, video), spec))
    return scores, labels, chunks, spec, out_len


def test_an_infinity_without_nan_sets_the_flag(backend, seed):
    """+inf or -inf at a stage token, with no NaN in the sample, is non-finite: flagged on every backend as by
    ``stage_flags_ref``; an infinity outside the stage's tokens is not. The kept sets follow the reference."""
    from test_cuda_select_emulation import padded_oracle

    _, device = backend
    for dtype in (torch.float32, torch.float64):
        scores, labels, chunks, spec, out_len = _infinite_case(seed, dtype)
        stage = [StageModality(label, 1, 0) for label, _, _, _ in spec]
        assert stage_flags_ref(scores, labels, stage).tolist() == [False, True, True, False]
        flags = torch.empty(4, dtype=torch.bool, device=device)
        got = dispatch("stage_select", torch.device(device), scores.to(device), labels.to(device), chunks.to(device),
                       spec, out_len, None, flags=flags)
        assert torch.equal(got.cpu(), padded_oracle(scores, labels, chunks, spec, out_len, None)), f"seed={seed}"
        assert flags.cpu().tolist() == [False, True, True, False], f"{dtype} seed={seed}"


def test_cuda_selection_paths_flag_an_infinity_without_nan(seed):
    """The CUDA backend's two selection paths on CPU: the one-CTA kernel's flag rule in its numpy replay
    (``test_cuda_select_emulation.select_cta``) and the multi-CTA sort chain's code (``stage_select_sorts``) flag
    +-inf as the PyTorch path and the reference do (the kernels themselves: ``test_an_infinity...`` on a GPU)."""
    from test_cuda_select_emulation import select_cta

    from macer_kernels.cuda.stage import stage_select_sorts

    scores, labels, chunks, spec, out_len = _infinite_case(seed)
    mods = [(label, keep, weight) for label, keep, weight, _ in spec]
    _, flags = select_cta(scores.numpy(), labels.numpy(), chunks.numpy(), mods, out_len, out_len, flags=True)
    assert flags.tolist() == [False, True, True, False]
    sort_flags = torch.empty(4, dtype=torch.bool)
    stage_select_sorts(scores, labels, chunks, spec, out_len, None, sort_flags)
    assert sort_flags.tolist() == [False, True, True, False]


def test_select_stage_flags_a_nan_query_row_and_keeps_the_first_tokens(backend, seed):
    """The issue's repro: one NaN in a query row of sample 1. Its scored tokens are all NaN, so it keeps its first K
    tokens of each modality (as reference.stage_ref, which used to return another length) and is flagged."""
    _, device = backend
    q, k, m = score_inputs(2, 4, 2, 3, 40, 8, seed=seed)
    m[:] = 0
    m[:, 4:20] = 1
    m[:, 20:34] = 2
    q[1, 2, 1, 5] = NAN
    chunk_ids = torch.arange(40)[None].expand(2, 40) // 5
    mods = [StageModality(1, 16, 5), StageModality(2, 14, 4, coverage_weight=0.25, num_chunks=8)]
    keep, scores, flags = select_stage(q.to(device), k.to(device), m.to(device), mods, chunk_ids=chunk_ids.to(device),
                                       return_scores=True, return_flags=True)
    want, _ = stage_ref(q, k, m, mods, chunk_ids)
    assert keep.shape == (2, 40 - 11 - 10) and torch.equal(keep.cpu(), want), f"seed={seed}"
    assert keep[1].tolist() == [*range(9), *range(20, 24), *range(34, 40)]
    assert flags.cpu().tolist() == [False, True] and torch.isnan(scores[1, 4:34]).all()
    only_keep = select_stage(q.to(device), k.to(device), m.to(device), mods, chunk_ids=chunk_ids.to(device),
                             return_flags=False)
    assert torch.equal(only_keep, keep)
    keep2, flags2 = select_stage(q.to(device), k.to(device), m.to(device), mods, chunk_ids=chunk_ids.to(device),
                                 return_flags=True)
    assert torch.equal(keep2, keep) and torch.equal(flags2, flags)


def test_select_stage_refuses_a_non_bool_return_flags():
    q, k, m = score_inputs(1, 2, 1, 1, 8, 4, seed=0)
    with pytest.raises(ValueError, match="return_flags must be a bool, got 1"):
        select_stage(q, k, m.clamp(max=1), [StageModality(1, int((m > 0).sum()), 1)], return_flags=1)


# --- the standalone ops' unchecked device paths: the same ranking, no over-pick -------------------------------------

def _nan_scores(n: int, nans: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = (torch.randint(0, 6, (n,), generator=g).to(dtype) / 4)  # ties
    where = torch.randperm(n, generator=g)[:nans]
    for j, i in enumerate(where.tolist()):
        s[i] = nan32(NAN32_BITS[j % len(NAN32_BITS)])
    return s


@pytest.mark.triton
def test_triton_coverage_pairwise_with_nan_picks_exactly_k():
    """Issue 20 item 1's interpreter repro: n = 100, k = 10, 5 NaN gave 15 picks written past ``out[k - 1]``."""
    pytest.importorskip("triton")
    from macer_kernels.triton.select import coverage_select_triton

    s = _nan_scores(100, 5, 1)
    chunks = torch.arange(100) % 7
    for k in (10, 97, 100):
        got = coverage_select_triton(s.to(TRITON_DEVICE), chunks.to(TRITON_DEVICE), k, 0.4).cpu()
        assert torch.equal(got, coverage_select_ref(s, chunks, k, 0.4)), k


@pytest.mark.triton
def test_triton_write_picks_never_stores_past_k():
    """The store of ``_write_picks_kernel`` is masked by the slot: positions that claim more than k picks (what the
    NaN ranking used to produce) write nothing past ``out[k - 1]``."""
    pytest.importorskip("triton")
    from macer_kernels.triton import select as tsel

    n, k = 60, 10
    pos = torch.zeros(n, dtype=torch.int32, device=TRITON_DEVICE)  # every token claims place 0
    out = torch.full((k + 64,), -7, dtype=torch.long, device=TRITON_DEVICE)  # a guard the over-pick stays inside
    tsel._write_picks_kernel[tsel._pairwise_grid(n)](pos, out, n, k, BLOCK_I=tsel._BLOCK_I, BLOCK_J=tsel._BLOCK_J)
    out = out.cpu()
    assert out[:k].tolist() == list(range(k)) and (out[k:] == -7).all()


@pytest.mark.triton
@pytest.mark.parametrize("n", [50, 2100, 16400])
def test_triton_unchecked_selection_paths_follow_the_rule(n):
    """Every Triton selection path (one program, pairwise coverage, the sort-based paths above their limits) on NaN
    scores, against the references; the public ops refuse NaN on CPU, so the backend functions are called."""
    pytest.importorskip("triton")
    from macer_kernels.triton.select import coverage_select_triton, topk_indices_triton

    s = _nan_scores(n, max(3, n // 20), n)
    s[::13] = -0.0
    dev = TRITON_DEVICE
    for dtype in (torch.float32, torch.float64):
        x = s.to(dtype)
        for k in (1, n // 2, n):
            assert torch.equal(topk_indices_triton(x.to(dev), k).cpu(), topk_indices_ref(x, k)), (dtype, k)
        if n <= 2100:
            chunks = torch.arange(n) % 5
            for k in (3, n - 1) if n < 100 else (3, 60):  # the literal greedy costs k passes
                got = coverage_select_triton(x.to(dev), chunks.to(dev), k, 0.3).cpu()
                assert torch.equal(got, coverage_select_ref(x, chunks, k, 0.3)), (dtype, k)


def test_torch_unchecked_selection_paths_follow_the_rule():
    from macer_kernels.select import _coverage_select_torch, _topk_indices_torch

    s = _nan_scores(80, 9, 3)
    chunks = torch.arange(80) % 6
    for k in (1, 40, 80):
        assert torch.equal(_topk_indices_torch(s, k), topk_indices_ref(s, k)), k
        assert torch.equal(_coverage_select_torch(s, chunks, k, 0.7), coverage_select_ref(s, chunks, k, 0.7)), k


def test_order_key_ranks_signed_zeros_equal_and_nan_last():
    """``select.order_key`` (torch backend, CUDA multi-CTA chain, Triton sort paths): -0.0 ties with +0.0, every NaN
    bit pattern has one key below -inf's. Guards the -0.0 -> +0.0 normalisation of the multi-CTA sort path."""
    from macer_kernels.select import NAN_KEY, order_key

    x = torch.tensor([-0.0, 0.0, -INF, INF, 1.0, -1.0, *[nan32(b) for b in NAN32_BITS]], dtype=torch.float64)
    key = order_key(x).tolist()
    assert key[0] == key[1] and key[2] > NAN_KEY and key[3] > key[4] > key[0] > key[5] > key[2]
    assert key[6:] == [NAN_KEY] * len(NAN32_BITS)


def test_multi_cta_sort_chain_ties_signed_zeros_to_the_lower_index(seed):
    """Issue 22 item 6 on CPU: ``stage_select_sorts`` is the CUDA multi-CTA path's code; scores of only -0.0 and
    +0.0 (interleaved, -0.0 first) must be kept by index, as the reference keeps them."""
    from macer_kernels.cuda.stage import stage_select_sorts
    from macer_kernels.reference import stage_select_ref

    g = torch.Generator().manual_seed(seed)
    n = 64
    scores = torch.where(torch.arange(n) % 2 == 0, -0.0, 0.0)[None].repeat(2, 1)
    scores[1] = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0)
    labels = (torch.arange(n) % 3)[None].repeat(2, 1)
    chunks = torch.randint(0, 4, (2, n), generator=g)
    for weight in (None, 0.0, 0.5):
        mods = [StageModality(1, 21, 7), StageModality(2, 21, 5, coverage_weight=weight)]
        spec = tuple((m.label, m.keep, m.coverage_weight, None if weight is not None else 0) for m in mods)
        out_len = n - 14 - 16
        got = stage_select_sorts(scores, labels, chunks if weight is not None else None, spec, out_len)
        want = stage_select_ref(scores, labels, mods, chunks)
        assert torch.equal(got, want), f"seed={seed} weight={weight}"


# --- GPU only: the CUDA kernels' own paths ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cuda_nan_bit_patterns_rank_last_on_every_path(dtype, seed):
    """The CUDA keys test NaN by value, not by bits (issue 20 item 2): every NaN pattern, in every input dtype, ranks
    after -inf in the one-CTA kernel and in the multi-CTA chain, as in the reference."""
    from macer_kernels.cuda import _ext
    from macer_kernels.cuda.select import coverage_select_cuda, topk_indices_cuda

    limit = _ext.select_cta_max_n(torch.cuda.current_device(), True)
    for n in (300, limit + 100):  # one CTA, then the multi-CTA chain
        s = _nan_scores(n, 40, seed + n).to(dtype)
        s[7] = -INF
        s[::11] = -0.0  # ties with the +0.0 scores, to the lower index
        chunks = torch.arange(n) % 9
        with validation(False):
            for k in (5, n - 20, n):
                got = topk_indices_cuda(s.cuda(), k).cpu()
                assert torch.equal(got, topk_indices_ref(s, k)), f"seed={seed} n={n} k={k} {dtype}"
            for k in (5, 60):
                got = coverage_select_cuda(s.cuda(), chunks.cuda(), k, 0.3).cpu()
                assert torch.equal(got, coverage_select_ref(s, chunks, k, 0.3)), f"seed={seed} n={n} k={k} {dtype}"


@pytest.mark.cuda
def test_cuda_stage_select_multi_cta_with_nan_and_signed_zeros(seed):
    """The stage's multi-CTA path (n above the one-CTA limit) on NaN scores and signed zeros (issue 22 item 6), with
    the flags, against the reference."""
    from macer_kernels.cuda import _ext
    from macer_kernels.cuda.stage import stage_select_cuda
    from macer_kernels.reference import stage_select_ref

    n = _ext.select_cta_max_n(torch.cuda.current_device(), False) + 50
    g = torch.Generator().manual_seed(seed)
    scores = torch.where(torch.rand(2, n, generator=g) < 0.5, -0.0, 0.0)
    scores[1, :: 97] = NAN
    labels = (torch.arange(n) % 3)[None].repeat(2, 1)
    chunks = torch.randint(0, 8, (2, n), generator=g)
    c1, c2 = (int((labels[0] == m).sum()) for m in (1, 2))
    mods = [StageModality(1, c1, 40), StageModality(2, c2, 30, coverage_weight=0.5)]
    spec = ((1, 40, None, 0), (2, 30, 0.5, None))
    out_len = n - (c1 - 40) - (c2 - 30)
    flags = torch.empty(2, dtype=torch.bool, device="cuda")
    got = stage_select_cuda(scores.cuda(), labels.cuda(), chunks.cuda(), spec, out_len, None, flags).cpu()
    assert torch.equal(got, stage_select_ref(scores, labels, mods, chunks)), f"seed={seed}"
    assert flags.cpu().tolist() == [False, True]
