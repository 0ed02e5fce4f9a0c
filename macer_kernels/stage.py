"""The fused stage readout: score the tokens of a readout layer and select what a stage keeps, in one call.

A model integration calls ``select_stage`` once per readout layer. Everything that sizes the work (the token counts
and budgets of the stage's modalities, the selector of each, the output length) is a host value known before the
call, so the call reads no device value back on CUDA tensors and can be captured in a CUDA graph. On the Triton and
CUDA backends it is at most 4 kernel launches: the scoring launches of ``modality_scores`` and one ``stage_select``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from macer_kernels._validate import (
    check_count,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
    read_back,
    values_checked,
)
from macer_kernels.backend import dispatch, register, resolve
from macer_kernels.modality_scores import MAX_MODALITIES, check_score_inputs

StageSpec = tuple[tuple[int, int, float | None, int | None], ...]
"""What ``stage_select`` backends receive: one ``(label, keep, coverage_weight, num_chunks)`` per stage modality.
``coverage_weight`` is None for top-K; ``num_chunks`` is 0 for top-K, the caller's bound on the chunk ids (ids in
``[0, num_chunks)``) for coverage, or None when the caller gave no bound (ids are any non-negative integers)."""


@dataclass(frozen=True)
class StageModality:
    """One modality that a stage selects in, with its budget and its selector.

    Attributes:
        label: the modality's label in ``labels`` (1..MAX_MODALITIES).
        count: the number of tokens with this label in each sample (a host integer from the caller's plan).
        keep: the budget K_m, ``0 <= keep <= count``.
        coverage_weight: None for top-K (``eq. Top-k``, ties to the lower index); a float lambda_c >= 0 for the chunk
            coverage greedy (``eq:chunk_coverage_greedy``) over ``chunk_ids``.
        num_chunks: optional bound for coverage: the chunk ids of this modality's tokens lie in ``[0, num_chunks)``
            (checked where values are checked). A kernel may use it to pack chunk ids into a few bits. None: any
            non-negative ids.
    """

    label: int
    count: int
    keep: int
    coverage_weight: float | None = None
    num_chunks: int | None = None


def _check_modalities(modalities: object, n: int) -> tuple[StageModality, ...]:
    if isinstance(modalities, StageModality) or not isinstance(modalities, Sequence) or not modalities:
        raise ValueError(f"modalities must be a non-empty sequence of StageModality, got {modalities!r}")
    seen: set[int] = set()
    for i, m in enumerate(modalities):
        name = f"modalities[{i}]"
        if not isinstance(m, StageModality):
            raise TypeError(f"{name} must be a StageModality, got {type(m).__name__}")
        label = check_count(f"{name}.label", m.label)
        if not 1 <= label <= MAX_MODALITIES:
            raise ValueError(f"{name}.label must be in [1, {MAX_MODALITIES}], got {label}")
        if label in seen:
            raise ValueError(f"{name}.label {label} appears twice; each modality is selected once per stage")
        seen.add(label)
        count = check_count(f"{name}.count", m.count)
        if count > n:
            raise ValueError(f"{name}.count must be in [0, {n}] (N, the number of keys), got {count}")
        keep = check_count(f"{name}.keep", m.keep)
        if keep > count:
            raise ValueError(f"{name}.keep must be in [0, {count}] (its count), got {keep}")
        if m.coverage_weight is not None:
            check_real(f"{name}.coverage_weight", m.coverage_weight, 0.0, math.inf, hi_open=True)
            if m.num_chunks is not None and check_count(f"{name}.num_chunks", m.num_chunks) < 1:
                raise ValueError(f"{name}.num_chunks must be an integer >= 1 or None, got {m.num_chunks}")
        elif m.num_chunks is not None:
            raise ValueError(f"{name}.num_chunks is only for coverage (set coverage_weight), got {m.num_chunks}")
    total = sum(m.count for m in modalities)
    if total > n:
        raise ValueError(f"the counts of modalities must add up to at most N={n}, got {total}")
    return tuple(modalities)


def select_stage(
    query: torch.Tensor,
    key: torch.Tensor,
    labels: torch.Tensor,
    modalities: Sequence[StageModality],
    *,
    chunk_ids: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = 1e-6,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""One stage of MACER at a readout layer: ANMS scores (``eq:macer_score``) and the positions the stage keeps.

    Each sample keeps, in ascending order, every token whose label is not a stage modality (text, and modalities
    another stage handles) plus the selected tokens of each stage modality: the ``keep`` highest-scored for top-K
    (ties to the lower index), the coverage greedy's ``keep`` picks over ``chunk_ids`` for coverage. Scores and picks
    are those of ``modality_scores``, ``topk_indices`` and ``coverage_select`` on the modality's tokens
    (``reference.stage_ref`` is the definition).

    Args:
        query, key, query_positions, scale, eps: as in ``modality_scores`` (``[B, Hq, Lq, D]``, ``[B, Hkv, N, D]`` with
            any strides and a contiguous head dimension, ``[B, Lq]`` positions, default the last Lq).
        labels: ``[B, N]`` integer modality labels in ``0..MAX_MODALITIES`` (0 = text).
        modalities: the stage's ``StageModality`` entries (distinct labels). Every sample holds exactly ``count``
            tokens of each (same counts in every sample).
        chunk_ids: ``[B, N]`` integer temporal chunk of each token (e.g. from ``temporal_chunks``), non-negative where a
            coverage modality's tokens are; only read there. Required iff a modality sets ``coverage_weight``.
        return_scores: also return the ``[B, N]`` fp32 scores.

    Returns:
        ``keep`` ``[B, out_len]`` int64, each row strictly increasing, with ``out_len = N - sum(count - keep)`` (a host
        integer known before the call); with ``return_scores``, ``(keep, scores)``.

    No host synchronisation on CUDA tensors: shapes, dtypes, budgets are checked on the host; value checks (label
    range, positions in range, each sample really holding ``count`` tokens of a label, chunk ids) run where
    ``macer_kernels._validate.values_checked`` says: CPU tensors always, CUDA tensors in validation mode. Wrong values
    on CUDA tensors otherwise give wrong positions, never an out-of-bounds access.
    """
    query, key, labels, positions, scale, eps = check_score_inputs(query, key, labels, query_positions, scale, eps,
                                                                   labels_name="labels")
    b, n = labels.shape
    mods = _check_modalities(modalities, n)
    coverage = [m for m in mods if m.coverage_weight is not None]
    if coverage and chunk_ids is None:
        raise ValueError(f"chunk_ids is required: modality label {coverage[0].label} uses coverage_weight")
    if not coverage and chunk_ids is not None:
        raise ValueError("chunk_ids must be None: no modality of the stage sets coverage_weight, so none reads it")
    if chunk_ids is not None:
        chunk_ids = check_tensor("chunk_ids", chunk_ids, 2)
        check_int("chunk_ids", chunk_ids)
        if tuple(chunk_ids.shape) != (b, n):
            raise ValueError(f"chunk_ids must be [B={b}, N={n}], got {tuple(chunk_ids.shape)}")
    if chunk_ids is not None:
        check_same_device(query=query, chunk_ids=chunk_ids)
    if not isinstance(return_scores, bool):
        raise ValueError(f"return_scores must be a bool, got {return_scores!r}")
    if values_checked(labels):
        _check_values(labels, positions, chunk_ids, mods, n)
    out_len = n - sum(m.count - m.keep for m in mods)
    spec: StageSpec = tuple(
        (m.label, m.keep, None if m.coverage_weight is None else float(m.coverage_weight),
         0 if m.coverage_weight is None else m.num_chunks)
        for m in mods)
    # The backend's scoring implementation directly: the arguments are checked above, and the public op's own checks
    # would read values back.
    scores = resolve("modality_scores", query.device)[1](query, key, labels, positions, scale, eps)
    keep = dispatch("stage_select", query.device, scores, labels, chunk_ids, spec, out_len)
    return (keep, scores) if return_scores else keep


def _check_values(labels: torch.Tensor, positions: torch.Tensor, chunk_ids: torch.Tensor | None,
                  mods: tuple[StageModality, ...], n: int) -> None:
    """The data-dependent checks, in one read-back (where ``values_checked``: CPU tensors, or validation mode)."""
    values = [labels.min(), labels.max()] if n else []
    values += [positions.min(), positions.max()]
    for m in mods:
        is_m = labels == m.label
        per_sample = is_m.sum(dim=1)
        values += [per_sample.min(), per_sample.max()]
        if m.coverage_weight is not None:
            values += [torch.where(is_m, chunk_ids, 0).min(), torch.where(is_m, chunk_ids, 0).max()]
    got = read_back(*values)
    if n:
        lo, hi, got = got[0], got[1], got[2:]
        if lo < 0 or hi > MAX_MODALITIES:
            raise ValueError(f"labels must be in [0, {MAX_MODALITIES}], got range [{lo}, {hi}]")
    if got[0] < 0 or got[1] >= n:
        raise ValueError(f"query_positions must be in [0, N-1={n - 1}], got range [{got[0]}, {got[1]}]")
    got = got[2:]
    for i, m in enumerate(mods):
        lo, hi, got = got[0], got[1], got[2:]
        if lo != m.count or hi != m.count:
            raise ValueError(f"modalities[{i}].count is {m.count} but labels hold between {lo} and {hi} tokens of "
                             f"label {m.label} per sample; every sample must hold exactly count")
        if m.coverage_weight is not None:
            lo, hi, got = got[0], got[1], got[2:]
            if lo < 0:
                raise ValueError(f"chunk_ids must be non-negative at the tokens of label {m.label}, got minimum {lo}")
            if m.num_chunks is not None and hi >= m.num_chunks:
                raise ValueError(f"chunk_ids must be in [0, {m.num_chunks - 1}] (modalities[{i}].num_chunks) at the "
                                 f"tokens of label {m.label}, got maximum {hi}")


def _sort_indices(keys: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    return torch.sort(keys, dim=1, descending=descending, stable=True).indices


@register("stage_select", "torch")
def _stage_select_torch(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
                        spec: StageSpec, out_len: int) -> torch.Tensor:
    """Batched stable sorts over ``[B, N]``; the tokens of other labels are sorted behind a modality's own, so no
    per-sample count or index list (``nonzero``, a host synchronisation) is needed."""
    b, n = labels.shape
    index = torch.arange(n, device=labels.device).expand(b, n)
    s = scores.to(torch.float64)
    by_score = _sort_indices(s, descending=True)  # (score desc, index asc): shared by every modality
    stage_token = torch.zeros(b, n, dtype=torch.bool, device=labels.device)
    picked = torch.zeros(b, n, dtype=torch.bool, device=labels.device)
    for label, keep, weight, _ in spec:
        is_m = labels == label
        stage_token |= is_m
        if keep == 0:
            continue
        if weight is None:
            order = by_score
        else:
            order = _coverage_order(s, chunk_ids.long(), is_m, by_score, weight, index)
        # The modality's own tokens first, each group keeping the greedy (or score) order: the first keep are picks.
        order = order.gather(1, _sort_indices((~is_m).gather(1, order).to(torch.uint8)))
        picked.scatter_(1, order[:, :keep], True)
    kept = ~stage_token | picked
    return _sort_indices((~kept).to(torch.uint8))[:, :out_len]


def _coverage_order(s: torch.Tensor, chunks: torch.Tensor, is_m: torch.Tensor, by_score: torch.Tensor, weight: float,
                    index: torch.Tensor) -> torch.Tensor:
    """Per row, every index in the coverage greedy's pick order among the tokens of ``is_m`` (other tokens anywhere):
    the batched form of ``select._coverage_order`` (v desc, score desc, index asc with v = s + sqrt(w / (1 + rank)),
    rank = place in the chunk by score desc, index asc)."""
    # Group by (not in the modality, chunk), each group in score order: stable sorts compose into a lexsort.
    grouped = by_score.gather(1, _sort_indices(chunks.gather(1, by_score)))
    grouped = grouped.gather(1, _sort_indices((~is_m).gather(1, grouped).to(torch.uint8)))
    c = chunks.gather(1, grouped)
    new_group = torch.ones_like(is_m)
    new_group[:, 1:] = c[:, 1:] != c[:, :-1]
    start = torch.cummax(torch.where(new_group, index, 0), dim=1).values
    rank = (index - start).to(torch.float64)
    value = torch.empty_like(s)
    # The same float64 expression as the literal greedy, so both compare the same numbers.
    value.scatter_(1, grouped, s.gather(1, grouped) + torch.sqrt(weight / (1.0 + rank)))
    return by_score.gather(1, _sort_indices(value.gather(1, by_score), descending=True))
