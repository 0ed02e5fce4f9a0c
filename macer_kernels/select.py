"""Selection ops: modality-local top-K and the video chunk-coverage greedy."""

from __future__ import annotations

import math

import torch

from macer_kernels._validate import (
    check_count,
    check_int,
    check_no_nan,
    check_real,
    check_same_device,
    check_tensor,
    read_back,
    tracing,
    values_checked,
)
from macer_kernels.backend import dispatch, register


def _check_k(k: int, n: int) -> int:
    k = check_count("k", k)
    if k > n:
        raise ValueError(f"k must be in [0, {n}] (the number of scores), got {k}")
    return k


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores (``TopKIdx``, eq. ``Top-k``), ties to the lower index, sorted ascending.

    Args:
        scores: 1-D floating tensor of n scores (no NaN: checked on CPU tensors, and on CUDA tensors in validation
            mode, ``macer_kernels.validation()``; otherwise never read back, and a NaN ranks below every number,
            NaNs by index: the selection rule for non-finite scores, the same on every backend).
        k: integer in ``[0, n]``.

    Returns:
        int64 tensor ``[k]`` on the device of ``scores``, strictly increasing.
    """
    scores = check_tensor("scores", scores, 1)
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating tensor, got {scores.dtype}")
    k = _check_k(k, scores.numel())
    check_no_nan("scores", scores)
    if tracing():  # one opaque node in the caller's graph (macer_kernels.library)
        return torch.ops.macer.topk_indices(scores, k)
    return dispatch("topk_indices", scores.device, scores, k)


def coverage_select(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    r"""Video chunk-coverage greedy, ``eq:chunk_coverage_greedy``, without a k-step loop.

    The literal rule picks, k times, ``argmax_j s_j + sqrt(lambda_c / (1 + r_{c(j)}))`` among unpicked tokens, where
    ``r_g`` counts tokens already picked from chunk ``g`` (ties to the lower index). Within a chunk every candidate
    gets the same bonus, so the greedy takes each chunk's tokens in descending score order; giving the t-th token of
    its chunk the value ``v = s + sqrt(lambda_c / (1 + t))`` turns the greedy into a merge of per-chunk non-increasing
    sequences, and its k picks are the k largest values. Equal values go to the higher score, then to the lower
    index, as in the reference greedy (``reference.coverage_select_ref`` explains why). ``coverage_weight = 0`` is
    plain top-k.

    Args:
        scores: 1-D floating tensor of n scores (no NaN; unchecked, a NaN ranks as in ``topk_indices``).
        chunk_ids: 1-D integer tensor of n non-negative chunk ids (e.g. from ``temporal_chunks``). Both value
            conditions are checked on CPU tensors, and on CUDA tensors only in validation mode.
        k: integer in ``[0, n]``.
        coverage_weight: lambda_c, a finite number >= 0.

    Returns:
        int64 tensor ``[k]``, strictly increasing. Values are compared in float64.
    """
    scores = check_tensor("scores", scores, 1)
    chunk_ids = check_tensor("chunk_ids", chunk_ids, 1)
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating tensor, got {scores.dtype}")
    check_int("chunk_ids", chunk_ids)
    if chunk_ids.shape != scores.shape:
        raise ValueError(f"chunk_ids must have the shape of scores {tuple(scores.shape)}, got {tuple(chunk_ids.shape)}")
    check_same_device(scores=scores, chunk_ids=chunk_ids)
    k = _check_k(k, scores.numel())
    coverage_weight = check_real("coverage_weight", coverage_weight, 0.0, math.inf, hi_open=True)
    if scores.numel() and values_checked(scores):
        has_nan, lowest_chunk = read_back(torch.isnan(scores).any(), chunk_ids.min())  # one host synchronisation
        if has_nan:
            raise ValueError("scores contains NaN; scores must be comparable numbers")
        if lowest_chunk < 0:
            raise ValueError(f"chunk_ids must be non-negative, got minimum {lowest_chunk}")
    if tracing():
        return torch.ops.macer.coverage_select(scores, chunk_ids, k, coverage_weight)
    return dispatch("coverage_select", scores.device, scores, chunk_ids, k, coverage_weight)


def _stable_argsort(keys: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    return torch.sort(keys, descending=descending, stable=True).indices


NAN_KEY = -(2**63) + 1
"""``order_key`` of every NaN: below the key of -inf (``-2**63 + 2**52 - 1``); ``-2**63`` stays free for "never"."""


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as selection ranks floats: ascending key = ascending number, -0.0 equal to +0.0, and every
    NaN (any sign or payload) equal to ``NAN_KEY``, below every number. A stable descending sort of the keys is
    (score desc, index asc) with the NaNs last: the selection rule for non-finite scores. (``torch.sort`` itself
    ranks NaN above +inf.)"""
    x = x.to(torch.float64)
    bits = torch.where(x == 0, 0.0, x).view(torch.int64)
    key = bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)  # two's-complement order == float order for numbers
    return key.masked_fill_(torch.isnan(x), NAN_KEY)


def descending_order(x: torch.Tensor) -> torch.Tensor:
    """Indices that sort ``x`` along its last dim by (value desc, index asc), NaN after every number."""
    return torch.sort(order_key(x), dim=-1, descending=True, stable=True).indices


@register("topk_indices", "torch")
def _topk_indices_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort keeps equal scores in index order, which is the lower-index tie-break.
    order = descending_order(scores)
    return torch.sort(order[:k]).values


def _coverage_order(scores: torch.Tensor, chunk_ids: torch.Tensor, coverage_weight: float) -> torch.Tensor:
    """All n indices in the order the literal greedy picks them (its first k picks are the first k here).

    Inside a chunk every candidate gets the same bonus, so the greedy takes a chunk's tokens in the order
    (score descending, index ascending); the t-th of them gets the value ``v = s + sqrt(lambda / (1 + t))``. Along a
    chunk that sequence is sorted by the greedy's key (v descending, score descending, index ascending) -- v because
    scores fall and bonuses shrink, the rest by construction -- so the greedy is a merge of sorted sequences, i.e.
    one global sort by that key.
    """
    n = scores.numel()
    index = torch.arange(n, device=scores.device)
    s = scores.to(torch.float64)
    # Chunk order: by chunk, then score descending, then index (stable sorts compose into a lexsort). NaN scores come
    # last in their chunk, so they take no rank from a number; their values are NaN and rank last below.
    by_score = descending_order(s)
    by_chunk = by_score[_stable_argsort(chunk_ids[by_score])]
    chunk_sorted = chunk_ids[by_chunk]
    new_chunk = torch.ones(n, dtype=torch.bool, device=scores.device)
    new_chunk[1:] = chunk_sorted[1:] != chunk_sorted[:-1]
    chunk_start = torch.cummax(torch.where(new_chunk, index, 0), dim=0).values
    rank = (index - chunk_start).to(torch.float64)  # t: tokens of the same chunk ahead of this one
    value = torch.empty(n, dtype=torch.float64, device=scores.device)
    # The same float64 expression as the literal greedy, so both compare the same numbers.
    value[by_chunk] = s[by_chunk] + torch.sqrt(coverage_weight / (1.0 + rank))
    # Global key: value descending, score descending, index ascending.
    order = by_score  # score descending, index ascending
    return order[descending_order(value[order])]


@register("coverage_select", "torch")
def _coverage_select_torch(scores, chunk_ids, k, coverage_weight):
    return torch.sort(_coverage_order(scores, chunk_ids.long(), coverage_weight)[:k]).values
