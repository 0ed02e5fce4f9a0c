"""Selection on the GPU without a k-step loop: ``topk_indices`` (eq. ``Top-k``) and ``coverage_select``
(``eq:chunk_coverage_greedy``), exactly equal to the float64 references.

The literal greedy (``macer_kernels.reference.coverage_select_ref``) takes, at each step, the unpicked token with the
largest key ``(value, score, -index)``. Inside a chunk every candidate gets the same bonus, so the greedy takes a
chunk's tokens in (score desc, index asc) order, and the t-th of them has the value ``v = s + sqrt(lambda_c / (1 +
t))``. Along a chunk these keys only decrease, so the greedy is a merge of sorted sequences: its pick order is one
global order of all tokens by

``(v desc, s desc, index asc)``,  ``v = float64(s) + sqrt(lambda_c / (1 + rank))``                          (1)

with ``rank`` the token's place in its chunk by (score desc, index asc). The keys are unique (the index is part of
them), so the k picks are the tokens with fewer than k keys ahead of their own.

Top-k:

* ``n <= stage.ONE_PROGRAM_MAX_N`` (16k): one launch of the stage kernel (``triton/stage.py``), one program, by
  radix select on the score bits (8 bits per counting pass: 4 passes for <= 32-bit scores, 8 for float64) and a
  prefix count for the ties at the boundary score; the picks come out in index order.
* larger n: a kernel packs ``(score desc, index asc)`` into one unique int64 key per token (<= 32-bit scores) and
  ``torch.topk`` selects on it; float64 scores use a stable sort.

Coverage greedy (also for ``coverage_weight = 0``, where the bonus is exactly 0 and (1) reduces to top-k's order:
it runs the coverage code, so comparing it with top-k tests something):

* ``n <= PAIRWISE_MAX_N`` (the per-request sizes, e.g. 864 video tokens): tiled pairwise kernels count, for every
  token, the tokens of its chunk ahead of it (rank, then v), then all tokens whose key (1) comes first, then the
  picks of lower index (the output slot). ``O(n^2)`` comparisons spread over the grid, no sort, no host
  synchronisation, three launches; the picks come out in index order. (The stage kernel's one-program coverage
  does the same comparisons in one program: one launch, but one SM; ``docs/triton.md`` weighs the two.)
* larger n: two stable sorts (PyTorch, CUB radix) group the tokens by chunk in (score desc, index asc) order; one
  kernel finds each token's chunk start by binary search and writes its v; one stable sort of v in score order
  gives (1).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from macer_kernels.backend import register
from macer_kernels.select import descending_order
from macer_kernels.triton import stage as _stage
from macer_kernels.triton._device import on_input_device
from macer_kernels.triton.stage import _bonus_value, _desc_key

PAIRWISE_MAX_N = 2048
"""Largest n handled by the pairwise (sort-free) kernels; above it the sort-based path runs. At n = 2048 a kernel
makes 4M comparisons, estimated at a few microseconds on a current GPU, against four or more CUB sorts for the
sort-based path. An estimate, not a measurement (no GPU was available): ``benchmarks/bench_select.py`` decides."""

# Pairwise tiles: 64 x 64 comparisons per step on a GPU (enough programs for n ~ 1k). The interpreter pays per
# step in Python, so it takes bigger tiles; tails and multi-tile loops are still exercised for n > 256.
_BLOCK_I = 256 if triton.knobs.runtime.interpret else 64
_BLOCK_J = _BLOCK_I


@triton.jit
def _coverage_value_kernel(s_ptr, c_ptr, v_ptr, n, weight_ptr,
                          WIDE: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """v_i of (1), with rank_i = #{j in chunk(i) : s_j > s_i or (s_j == s_i and j < i)}, NaN below every number:
    scores are compared as the integer keys of ``stage._desc_key`` (a float ``>`` is false for every NaN)."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < n
    s_raw = tl.load(s_ptr + i, mask=i_ok, other=0.0)
    s_i = _desc_key(s_raw, WIDE)
    c_i = tl.load(c_ptr + i, mask=i_ok, other=0).to(tl.int64)
    count = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < n
        s_j = _desc_key(tl.load(s_ptr + j, mask=j_ok, other=0.0), WIDE)
        c_j = tl.load(c_ptr + j, mask=j_ok, other=0).to(tl.int64)
        better = (s_j[None, :] < s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
        # Lanes past n are masked here, not by a sentinel chunk id: no value is out of range for every id dtype
        # (-2 is chunk 254 as uint8), and their filler score 0 beats negative scores.
        count += tl.sum((better & (c_j[None, :] == c_i[:, None]) & j_ok[None, :]).to(tl.int32), axis=1)
    tl.store(v_ptr + i, _bonus_value(s_raw.to(tl.float64), count, tl.load(weight_ptr)), mask=i_ok)


@triton.jit
def _coverage_position_kernel(s_ptr, v_ptr, pos_ptr, n, WIDE: tl.constexpr, BLOCK_I: tl.constexpr,
                              BLOCK_J: tl.constexpr):
    """pos_i = #{j : key (1) of j comes before key (1) of i}: v desc, then score desc, then index asc (NaN last, as
    integer keys). The keys are unique, so the positions are a permutation of 0..n-1."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < n
    s_i = _desc_key(tl.load(s_ptr + i, mask=i_ok, other=0.0), WIDE)
    v_i = _desc_key(tl.load(v_ptr + i, mask=i_ok, other=0.0), True)
    count = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < n
        s_j = _desc_key(tl.load(s_ptr + j, mask=j_ok, other=0.0), WIDE)
        v_j = _desc_key(tl.load(v_ptr + j, mask=j_ok, other=0.0), True)
        score_first = (s_j[None, :] < s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
        before = (v_j[None, :] < v_i[:, None]) | ((v_j[None, :] == v_i[:, None]) & score_first)
        count += tl.sum((before & j_ok[None, :]).to(tl.int32), axis=1)
    tl.store(pos_ptr + i, count, mask=i_ok)


@triton.jit
def _write_picks_kernel(pos_ptr, out_ptr, n, k, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Token i is picked when pos_i < k; it goes to slot #{j < i picked}, so ``out`` comes out sorted ascending.
    The store is masked by the slot too: whatever ``pos`` holds, nothing is written past ``out[k - 1]``."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < n
    picked = (tl.load(pos_ptr + i, mask=i_ok, other=k) < k) & i_ok
    slot = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, (tl.program_id(0) + 1) * BLOCK_I, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        picked_j = tl.load(pos_ptr + j, mask=j < n, other=k) < k
        slot += tl.sum((picked_j[None, :] & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    tl.store(out_ptr + slot, i.to(tl.int64), mask=picked & (slot < k))


@triton.jit
def _pack_topk_keys_kernel(s_ptr, key_ptr, n, BLOCK: tl.constexpr):
    """One int64 per token whose ascending order is (score desc, index asc, NaN last): the high 32 bits hold the
    float32 score's descending key (``stage._desc_key``: -0.0 as +0.0, every NaN after -inf), the low 32 bits the
    index. Keys are unique."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    descending = _desc_key(tl.load(s_ptr + i, mask=ok, other=0.0), False)  # a signed 32-bit value in an int64
    tl.store(key_ptr + i, (descending << 32) | i.to(tl.int64), mask=ok)


@triton.jit
def _coverage_sorted_kernel(order_ptr, s_ptr, c_ptr, v_ptr, n, weight_ptr, SEARCH_STEPS: tl.constexpr,
                            BLOCK: tl.constexpr):
    """v of (1) for the token at position p of the chunk-grouped order (chunk asc, score desc, index asc).

    The rank is p minus the position where p's chunk starts: chunk ids ascend along the order, so that start is a
    lower bound found by binary search (SEARCH_STEPS >= log2(n) + 1 halvings). v is written at the token's index."""
    weight = tl.load(weight_ptr)
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < n
    token = tl.load(order_ptr + p, mask=ok, other=0)
    c_p = tl.load(c_ptr + token, mask=ok, other=0).to(tl.int64)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = p.to(tl.int64)
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        c_mid = tl.load(c_ptr + tl.load(order_ptr + mid, mask=ok, other=0), mask=ok, other=0).to(tl.int64)
        right = c_mid < c_p
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    s_p = tl.load(s_ptr + token, mask=ok, other=0.0).to(tl.float64)  # NaN: v is NaN, ranked last by the final sort
    tl.store(v_ptr + token, _bonus_value(s_p, p - lo, weight), mask=ok)


@functools.lru_cache(maxsize=64)
def _weight_tensor(coverage_weight: float, device: torch.device) -> torch.Tensor:
    """lambda_c as a one-element float64 tensor (Triton passes Python floats to kernels as float32). lambda_c is a
    configuration constant, so caching saves a fill launch on every call; the tensor is only ever read."""
    return torch.full((1,), coverage_weight, dtype=torch.float64, device=device)


def _pairwise_grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK_I),)


def _write_picks(pos: torch.Tensor, n: int, k: int) -> torch.Tensor:
    out = torch.empty(k, dtype=torch.long, device=pos.device)
    _write_picks_kernel[_pairwise_grid(n)](pos, out, n, k, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J)
    return out


@register("topk_indices", "triton")
@on_input_device
def topk_indices_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Triton eq. ``Top-k``: ``k`` indices of the largest scores, ties to the lower index, sorted ascending."""
    n = scores.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    if n <= _stage.ONE_PROGRAM_MAX_N:
        # One launch, one program: radix select on the score bits (triton/stage.py), every token one modality.
        return _stage.launch_stage_select(scores.view(1, n), None, None, ((1, k, None, 0),), k)[0]
    scores = scores.contiguous()
    if scores.dtype == torch.float64:
        # A float64 score and an index do not fit one 64-bit key: a stable sort keeps equal scores in index order.
        return torch.sort(descending_order(scores)[:k]).values
    keys = torch.empty(n, dtype=torch.int64, device=scores.device)
    _pack_topk_keys_kernel[(triton.cdiv(n, 1024),)](scores, keys, n, BLOCK=1024)
    picked = torch.topk(keys, k, largest=False, sorted=False).values
    return torch.sort(picked & 0xFFFFFFFF).values


@register("coverage_select", "triton")
@on_input_device
def coverage_select_triton(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int,
                           coverage_weight: float) -> torch.Tensor:
    """Triton ``eq:chunk_coverage_greedy``: the literal greedy's k picks, sorted ascending."""
    n = scores.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    scores, chunk_ids = scores.contiguous(), chunk_ids.contiguous()
    dev = scores.device
    weight = _weight_tensor(coverage_weight, dev)
    value = torch.empty(n, dtype=torch.float64, device=dev)
    if n <= PAIRWISE_MAX_N:
        pos = torch.empty(n, dtype=torch.int32, device=dev)
        grid = _pairwise_grid(n)
        # Widening to float64 is exact and monotone, so 32-bit keys of <= 32-bit scores order them as the reference
        # does; they are much cheaper than float64 keys on GPUs with slow float64.
        wide = scores.dtype == torch.float64
        _coverage_value_kernel[grid](scores, chunk_ids, value, n, weight, WIDE=wide, BLOCK_I=_BLOCK_I,
                                     BLOCK_J=_BLOCK_J)
        _coverage_position_kernel[grid](scores, value, pos, n, WIDE=wide, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J)
        return _write_picks(pos, n, k)
    # Score order (score desc, index asc, NaN last), then grouped by chunk: two stable sorts form the lexsort.
    by_score = descending_order(scores)
    grouped = by_score[torch.sort(chunk_ids[by_score], stable=True).indices]
    _coverage_sorted_kernel[(triton.cdiv(n, 256),)](grouped, scores, chunk_ids, value, n, weight,
                                                   SEARCH_STEPS=n.bit_length() + 1, BLOCK=256)
    # Key (1): a stable sort by v (descending) of the score order keeps (score desc, index asc) among equal v.
    greedy = by_score[descending_order(value[by_score])]
    return torch.sort(greedy[:k]).values
