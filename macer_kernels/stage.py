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
    values_checked,
)
from macer_kernels.backend import dispatch, register, resolve
from macer_kernels.modality_scores import MAX_MODALITIES, PAD_LABEL, check_label_values, check_score_inputs
from macer_kernels.select import descending_order

StageSpec = tuple[tuple[int, int, float | None, int | None], ...]
"""What ``stage_select`` backends receive: one ``(label, keep, coverage_weight, num_chunks)`` per stage modality.
``coverage_weight`` is None for top-K; ``num_chunks`` is 0 for top-K, the caller's bound on the chunk ids (ids in
``[0, num_chunks)``) for coverage, or None when the caller gave no bound (ids are any non-negative integers).
``keep`` is the largest budget over the batch when the backend also gets a per-sample ``keeps`` table.

The backend op is ``stage_select(scores, labels, chunk_ids, spec, out_len, keeps, flags=None)``: ``keeps`` is None
(every sample keeps ``spec[m].keep``) or an int32 ``[B, M]`` device tensor of per-sample budgets; ``flags``, when
given, a ``[B]`` bool device tensor the backend fills with ``reference.stage_flags_ref`` (a non-finite score among
the spec's labels). Scores rank by (score desc, index asc) with every NaN after every number. Row b of the
``[B, out_len]`` result holds its ``len_b`` kept positions ascending and right-aligned, ``-1`` before them; a row
whose data contradicts the budgets (fewer tokens of a modality than its keep, or more kept than ``out_len``) is all
``-1``. Padding (``PAD_LABEL``) is never kept."""

Counts = int | Sequence[int]


@dataclass(frozen=True)
class StageModality:
    """One modality that a stage selects in, with its budget and its selector.

    Attributes:
        label: the modality's label in ``labels`` (1..MAX_MODALITIES).
        count: the number of tokens with this label in each sample (a host integer from the caller's plan), or a
            sequence of B such integers, one per sample, when the samples of a batch differ.
        keep: the budget K_m, ``0 <= keep <= count``: one integer for every sample, or a sequence of B (per sample).
        coverage_weight: None for top-K (``eq. Top-k``, ties to the lower index); a float lambda_c >= 0 for the chunk
            coverage greedy (``eq:chunk_coverage_greedy``) over ``chunk_ids``.
        num_chunks: optional bound for coverage: the chunk ids of this modality's tokens lie in ``[0, num_chunks)``
            (checked where values are checked). A kernel may use it to pack chunk ids into a few bits. None: any
            non-negative ids.
    """

    label: int
    count: Counts
    keep: Counts
    coverage_weight: float | None = None
    num_chunks: int | None = None


def _per_sample(name: str, value: object, b: int) -> tuple[int, ...]:
    """One non-negative integer per sample from an integer or a sequence of B integers."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != b:
            raise ValueError(f"{name} must be an integer or a sequence of B={b} integers (one per sample), got "
                             f"{len(value)} values")
        return tuple(check_count(f"{name}[{i}]", v) for i, v in enumerate(value))
    return (check_count(name, value),) * b


def _check_modalities(modalities: object, n: int, padding: tuple[int, ...]
                      ) -> tuple[tuple[StageModality, ...], list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The stage's modalities, checked, with each one's per-sample counts and keeps."""
    if isinstance(modalities, StageModality) or not isinstance(modalities, Sequence) or not modalities:
        raise ValueError(f"modalities must be a non-empty sequence of StageModality, got {modalities!r}")
    b = len(padding)
    seen: set[int] = set()
    counts, keeps = [], []
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
        count = _per_sample(f"{name}.count", m.count, b)
        keep = _per_sample(f"{name}.keep", m.keep, b)
        for s, (c, k) in enumerate(zip(count, keep, strict=True)):
            where = "" if b == 1 else f" in sample {s}"
            if c > n:
                raise ValueError(f"{name}.count must be in [0, {n}] (N, the number of keys){where}, got {c}")
            if k > c:
                raise ValueError(f"{name}.keep must be in [0, {c}] (its count){where}, got {k}")
        counts.append(count)
        keeps.append(keep)
        if m.coverage_weight is not None:
            check_real(f"{name}.coverage_weight", m.coverage_weight, 0.0, math.inf, hi_open=True)
            if m.num_chunks is not None and check_count(f"{name}.num_chunks", m.num_chunks) < 1:
                raise ValueError(f"{name}.num_chunks must be an integer >= 1 or None, got {m.num_chunks}")
        elif m.num_chunks is not None:
            raise ValueError(f"{name}.num_chunks is only for coverage (set coverage_weight), got {m.num_chunks}")
    for s in range(b):
        total = padding[s] + sum(c[s] for c in counts)
        if total > n:
            where = "" if b == 1 else f" of sample {s}"
            raise ValueError(f"the counts of modalities{where} plus its padding must add up to at most N={n}, got "
                             f"{total}")
    return tuple(modalities), counts, keeps


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
    padding: Counts = 0,
    return_scores: bool = False,
    return_flags: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    r"""One stage of MACER at a readout layer: ANMS scores (``eq:macer_score``) and the positions the stage keeps.

    Each sample keeps, in ascending order, every token whose label is not a stage modality (text, and modalities
    another stage handles) plus the selected tokens of each stage modality: the ``keep`` highest-scored for top-K
    (ties to the lower index), the coverage greedy's ``keep`` picks over ``chunk_ids`` for coverage. Scores and picks
    are those of ``modality_scores``, ``topk_indices`` and ``coverage_select`` on the modality's tokens
    (``reference.stage_ref`` is the definition).

    Args:
        query, key, query_positions, scale, eps: as in ``modality_scores`` (``[B, Hq, Lq, D]``, ``[B, Hkv, N, D]`` with
            any strides and a contiguous head dimension, ``[B, Lq]`` positions, default the last Lq).
        labels: ``[B, N]`` integer modality labels in ``-1..MAX_MODALITIES`` (0 = text, -1 = ``PAD_LABEL``: the
            padding of a batch, outside every softmax and never kept).
        modalities: the stage's ``StageModality`` entries (distinct labels). Sample b holds exactly ``count`` (or
            ``count[b]``) tokens of each and keeps ``keep`` (or ``keep[b]``) of them.
        chunk_ids: ``[B, N]`` integer temporal chunk of each token (e.g. from ``temporal_chunks``), non-negative where a
            coverage modality's tokens are; only read there. Required iff a modality sets ``coverage_weight``.
        padding: the number of ``PAD_LABEL`` tokens of each sample (an integer for all, or B integers).
        return_scores: also return the ``[B, N]`` fp32 scores.
        return_flags: also return ``[B]`` bool on the device: whether the sample has a non-finite score among the
            tokens of the stage's modalities (``reference.stage_flags_ref``). Written by the selection launch on
            the GPU backends (no extra launch, no host read); a caller reads it once where it already waits.

    Returns:
        ``keep`` ``[B, out_len]`` int64. Sample b keeps ``len_b = N - padding_b - sum_m (count_bm - keep_bm)``
        positions, ascending; ``out_len = max_b len_b`` (host integers known before the call). Each row holds its
        positions right-aligned, after ``out_len - len_b`` entries of -1 (a left-padded batch stays left-padded:
        ``compact_many`` takes such rows as they are). With equal counts, keeps and padding in every sample, every
        row is full. With ``return_scores`` and/or ``return_flags``, the tuple ``(keep, scores, flags)`` without
        the ones not asked for.

    Non-finite scores (a NaN or an infinity in the query rows or a key they see makes every scored token of that
    sample NaN, see ``modality_scores``) rank below every number, ties to the lower index, on every backend and in
    ``reference.stage_ref``: such a sample keeps the first ``keep`` tokens of each modality, the right number of
    positions and never a -1 row. That selection is meaningless, hence ``return_flags``: the model layer raises on it.

    Per-sample budgets (a ``count``/``keep`` sequence) cost one small host-to-device copy of the ``[B, M]`` budget
    table per call (no synchronisation; not capturable in a CUDA graph); uniform budgets pass only host integers.

    No host synchronisation on CUDA tensors: shapes, dtypes, budgets are checked on the host; value checks (label
    range, positions in range, each sample really holding ``count`` tokens of a label, chunk ids) run where
    ``macer_kernels._validate.values_checked`` says: CPU tensors always, CUDA tensors in validation mode. Wrong values
    on CUDA tensors otherwise give wrong positions, never an out-of-bounds access.
    """
    query, key, labels, positions, scale, eps = check_score_inputs(query, key, labels, query_positions, scale, eps,
                                                                   labels_name="labels")
    b, n = labels.shape
    pads = _per_sample("padding", padding, b)
    mods, counts, keeps = _check_modalities(modalities, n, pads)
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
    for name, value in (("return_scores", return_scores), ("return_flags", return_flags)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if values_checked(labels):
        _check_values(labels, positions, chunk_ids, mods, counts, pads, query_positions is not None, n)
    out_len = max(n - pads[s] - sum(c[s] - k[s] for c, k in zip(counts, keeps, strict=True)) for s in range(b))
    spec: StageSpec = tuple(
        (m.label, max(keep), None if m.coverage_weight is None else float(m.coverage_weight),
         0 if m.coverage_weight is None else m.num_chunks)
        for m, keep in zip(mods, keeps, strict=True))
    table = None
    if any(len(set(keep)) > 1 for keep in keeps):
        table = _keeps_table(keeps, query.device)
    # The backend's scoring implementation directly: the arguments are checked above, and the public op's own checks
    # would read values back.
    scores = resolve("modality_scores", query.device)[1](query, key, labels, positions, scale, eps)
    flags = torch.empty(b, dtype=torch.bool, device=query.device) if return_flags else None
    keep = dispatch("stage_select", query.device, scores, labels, chunk_ids, spec, out_len,
                    *(() if table is None else (table,)), **({} if flags is None else {"flags": flags}))
    if not (return_scores or return_flags):
        return keep
    return (keep, *((scores,) if return_scores else ()), *((flags,) if return_flags else ()))


def _keeps_table(keeps: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """The per-sample budgets as a contiguous int32 ``[B, M]`` tensor on ``device``: one host-to-device copy that does
    not wait for the device (from pinned memory where the device is a GPU)."""
    table = torch.tensor(keeps, dtype=torch.int32).t().contiguous()
    if device.type == "cpu":
        return table
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


def _check_values(labels: torch.Tensor, positions: torch.Tensor, chunk_ids: torch.Tensor | None,
                  mods: tuple[StageModality, ...], counts: list[tuple[int, ...]], pads: tuple[int, ...], given: bool,
                  n: int) -> None:
    """The data-dependent checks, in one read-back (where ``values_checked``: CPU tensors, or validation mode)."""
    device = labels.device
    extra = []
    for label, want in [(PAD_LABEL, pads), *((m.label, c) for m, c in zip(mods, counts, strict=True))]:
        per_sample = (labels == label).sum(dim=1)
        wrong = per_sample != torch.tensor(want, device=device)
        first = torch.argmax(wrong.to(torch.uint8))  # the first sample that disagrees (0 when none does)
        extra += [wrong.any(), first, per_sample.gather(0, first.reshape(1))[0]]  # a gather: no index read
    for m in mods:
        if m.coverage_weight is not None:
            is_m = labels == m.label
            extra += [torch.where(is_m, chunk_ids, 0).min(), torch.where(is_m, chunk_ids, 0).max()]
    got = check_label_values(labels, positions, n, given=given, labels_name="labels", extra=tuple(extra))
    names = ["padding"] + [f"modalities[{i}].count" for i in range(len(mods))]
    labels_of = [PAD_LABEL] + [m.label for m in mods]
    wants = [pads, *counts]
    for name, label, want in zip(names, labels_of, wants, strict=True):
        bad, s, have = got[:3]
        got = got[3:]
        if bad:
            raise ValueError(f"{name} says sample {s} holds {want[s]} tokens of label {label}, but labels hold "
                             f"{have}; every sample must hold exactly that many")
    for i, m in enumerate(mods):
        if m.coverage_weight is not None:
            lo, hi, got = got[0], got[1], got[2:]
            if lo < 0:
                raise ValueError(f"chunk_ids must be non-negative at the tokens of label {m.label}, got minimum {lo}")
            if m.num_chunks is not None and hi >= m.num_chunks:
                raise ValueError(f"chunk_ids must be in [0, {m.num_chunks - 1}] (modalities[{i}].num_chunks) at the "
                                 f"tokens of label {m.label}, got maximum {hi}")


def _sort_indices(keys: torch.Tensor, *, descending: bool = False) -> torch.Tensor:
    return torch.sort(keys, dim=1, descending=descending, stable=True).indices


def stage_flags(scores: torch.Tensor, labels: torch.Tensor, spec: StageSpec, flags: torch.Tensor | None) -> None:
    """Write into ``flags`` ``[B]`` whether each sample has a non-finite score at a token of the stage's labels (the
    PyTorch composition's form of what the GPU kernels write in their selection launch); nothing when None."""
    if flags is None:
        return
    stage = torch.zeros_like(labels, dtype=torch.bool)
    for label, _, _, _ in spec:
        stage |= labels == label
    flags.copy_((stage & ~torch.isfinite(scores)).any(dim=1))


@register("stage_select", "torch")
def _stage_select_torch(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
                        spec: StageSpec, out_len: int, keeps: torch.Tensor | None = None,
                        flags: torch.Tensor | None = None) -> torch.Tensor:
    """Batched stable sorts over ``[B, N]``; the tokens of other labels are sorted behind a modality's own, so no
    per-sample count or index list (``nonzero``, a host synchronisation) is needed, and per-sample budgets are a
    rank mask (no loop over the batch). NaN scores sort after every number (``select.order_key``)."""
    stage_flags(scores, labels, spec, flags)
    b, n = labels.shape
    index = torch.arange(n, device=labels.device).expand(b, n)
    s = scores.to(torch.float64)
    by_score = descending_order(s)  # (score desc, index asc, NaN last): shared by every modality
    stage_token = torch.zeros(b, n, dtype=torch.bool, device=labels.device)
    picked = torch.zeros(b, n, dtype=torch.bool, device=labels.device)
    bad = torch.zeros(b, dtype=torch.bool, device=labels.device)
    for m, (label, keep, weight, _) in enumerate(spec):
        is_m = labels == label
        stage_token |= is_m
        want = keep if keeps is None else keeps[:, m].long()  # per-sample budgets [B]
        bad |= is_m.sum(dim=1) < want
        if keep == 0:
            continue
        if weight is None:
            order = by_score
        else:
            order = _coverage_order(s, chunk_ids.long(), is_m, by_score, weight, index)
        # The modality's own tokens first, each group keeping the greedy (or score) order: the first keep are picks.
        order = order.gather(1, _sort_indices((~is_m).gather(1, order).to(torch.uint8)))
        if keeps is None:
            picked.scatter_(1, order[:, :keep], True)
        else:
            picked |= torch.zeros_like(picked).scatter_(1, order, index < want[:, None])
    kept = (~stage_token & (labels != PAD_LABEL)) | picked
    bad |= kept.sum(dim=1) > out_len
    # Not-kept first, then the kept in index order (a stable sort): the last out_len entries are the kept positions,
    # right-aligned, after the largest not-kept positions, which become -1.
    tail = _sort_indices(kept.to(torch.uint8))[:, n - out_len:]
    fill = ~kept.gather(1, tail) | bad[:, None]
    return tail.masked_fill_(fill, -1)


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
    return by_score.gather(1, descending_order(value.gather(1, by_score)))
