"""The device work of one stage: scores from the readout layer's queries and keys, and the selection, with every size
from the host plan (``macer.core.policy.plan_prefill``) and no host synchronisation. Torch and ``macer_kernels``
only; both engines call ``run_stage`` (through ``macer.core.prefill.PrefillState``).

A stage reads the rows entering it through ``StageRows``: device tables of their prompt positions, labels and chunk
ids, produced by the previous stage's own launches (the rows a stage keeps are gathered from the tables it read), so
no stage indexes the prompt's tables with the current rows. The question rows are a host-known range of the query's
rows: every drop happens before them.

MACER's stages (``fused``) run a ``macer_kernels.prepared.PreparedStage``, prepared once per stage shape and cached
(``prepared_stage``): on the CUDA backend one host call launches the scoring, the selection and the gather of the
next stage's tables; the outputs are the caller's buffers. Raw scores, joint and random selections compose the ops.

A tensor-parallel engine holds a share of the readout layer's heads in each process: it passes a ``ScoreReduce``
that turns its share's scores into all heads' scores between the scoring and the selection. The prepared stage has no
point between the two (one host call scores and selects), so with a reduce every stage composes the ops; without one
(a single device) MACER's stages stay fused.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from macer.core.policy import PlannedStage, Scoring, member_mask
from macer_kernels import StageModality, compact_many, coverage_select, modality_scores, topk_indices
from macer_kernels.prepared import PreparedStage, prepare_stage

__all__ = ["CACHE_SIZE", "ScoreReduce", "StageRows", "batched", "cached_prepared", "fused", "positions_where",
           "prepared_stage", "run_stage", "score"]

ScoreReduce = Callable[[torch.Tensor], torch.Tensor]
"""``reduce(local) -> scores``: a stage's ``[n]`` fp32 scores from this process's share of the readout layer's heads
to the scores of all of them, before the selection (a tensor-parallel engine's all-gather and fixed-order sum,
``macer.vllm.parallel``). It must return the same bits in every process that takes part, or they select different
rows."""

CACHE_SIZE = 16
"""Prepared stages kept (least recently used dropped first); each holds a scoring workspace and ``[N]`` scores per
stream it ran on (about 1.7 MB at N = 2.4k and 11 MB at N = 16k for the 7B readout), so the cache stays small: a
repeated prompt layout reuses its stages, a new layout prepares its own (the host checks that a plain
``select_stage`` call would make anyway)."""

_PREPARED: OrderedDict[tuple, PreparedStage] = OrderedDict()


@dataclass(frozen=True)
class StageRows:
    """The rows entering a stage as ``[1, n]`` device tables: ``current`` (prompt positions), ``labels`` and ``chunks``
    (temporal chunk ids; None when no stage of the prefill uses coverage)."""

    current: torch.Tensor
    labels: torch.Tensor
    chunks: torch.Tensor | None

    @property
    def tables(self) -> list[torch.Tensor]:
        return [self.current, self.labels] + ([] if self.chunks is None else [self.chunks])


def positions_where(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` True entries of a 1-D ``mask``, ascending, without reading ``mask`` on the host
    (``count`` comes from the host plan; ``nonzero`` would synchronise to learn it)."""
    n = mask.numel()
    slot = torch.cumsum(mask, 0) - 1
    target = torch.where(mask, slot, count)  # entries outside the mask all land in a discarded last slot
    out = torch.empty(count + 1, dtype=torch.long, device=mask.device)
    out.scatter_(0, target, torch.arange(n, device=mask.device))
    return out[:count]


def score(query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, scoring: Scoring, *,
          scale: float | None, eps: float) -> torch.Tensor:
    """``[N]`` fp32 scores of the sequence's tokens from the readout layer's post-RoPE queries ``[1, Hq, N, D]``
    (all rows; ``rows`` picks the query rows) and keys ``[1, Hkv, N, D]``.

    ``"anms"``: ``eq:macer_score`` with the tokens' labels. ``"raw"``: the attention probability averaged over
    heads and rows; computed by the same kernel with every token in one group and ``eps = 0``, where the group's
    mass is the whole softmax row (1), so the renormalisation divides by 1.
    """
    if scoring == "raw":
        labels, eps = torch.ones_like(labels), 0.0
    return modality_scores(query[:, :, rows], key, labels[None], rows[None], scale=scale, eps=eps)[0]


@functools.lru_cache(maxsize=64)
def _row_positions(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """``[1, stop - start]`` positions of a host-known row range, made once (only ever read)."""
    return torch.arange(start, stop, device=device)[None]


def fused(stage: PlannedStage) -> bool:
    """Whether ``macer_kernels.select_stage`` computes this stage: ANMS scores, one modality per selection, top-k or
    coverage (it scores and selects with the same labels, so raw scores and joint selections are composed here)."""
    return stage.spec.scoring == "anms" and all(len(s.modalities) == 1 and s.rule != "random"
                                                for s in stage.spec.selections)


def batched(tensors: Sequence[torch.Tensor], dims: Sequence[int]) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    """Views of ``tensors`` with a batch dim of size 1 just before each sequence dim ``dims[i]`` (inserted where the
    dim before it is not of size 1, e.g. a 1-D ``cache_position``): the layout a stage's gather takes. Returns the
    views, their sequence dims and whether a dim was inserted (the compacted view then drops it again)."""
    views, new_dims, inserted = [], [], []
    for t, d in zip(tensors, dims, strict=True):
        d %= t.dim()
        add = d == 0 or t.shape[d - 1] != 1
        if add:
            t, d = t.unsqueeze(d), d + 1
        views.append(t)
        new_dims.append(d)
        inserted.append(add)
    return views, new_dims, inserted


def prepared_stage(stage: PlannedStage, query: torch.Tensor, key: torch.Tensor, rows: StageRows, question: range,
                   *, scale: float | None, eps: float, extra: Sequence[torch.Tensor] = (),
                   extra_dims: Sequence[int] = ()) -> PreparedStage:
    """The prepared form of a fused stage for these inputs' shapes (cached: ``CACHE_SIZE``). The cache key is what
    the preparation depends on: the stage's selections, counts and lengths, the question rows, the tables gathered,
    the heads, head size, dtype and device (the query's and key's strides are read per call), and the layout of each
    ``extra`` tensor gathered with the tables (``batched`` views, sequence dims ``extra_dims``)."""
    key_ = (stage.spec.selections, stage.members, stage.tokens_before, stage.tokens_after, question.start,
            question.stop, rows.chunks is not None, query.shape[1], key.shape[1], query.shape[3], query.dtype,
            query.device, scale, eps, tuple(extra_dims),
            *((t.shape, t.stride(), t.dtype) for t in extra))

    def make() -> PreparedStage:
        modalities = [StageModality(sel.modalities[0], count, sel.k,
                                    sel.coverage_weight if sel.rule == "coverage" else None,
                                    sel.num_chunks if sel.rule == "coverage" else None)
                      for sel, count in zip(stage.spec.selections, stage.members, strict=True)]
        coverage = any(sel.rule == "coverage" for sel in stage.spec.selections)
        tables = rows.tables
        return prepare_stage(query, key, rows.labels, modalities, chunk_ids=rows.chunks if coverage else None,
                             query_rows=question, scale=scale, eps=eps, gather=[*tables, *extra],
                             gather_dims=[1] * len(tables) + list(extra_dims))

    return cached_prepared(key_, make)


def cached_prepared(key: tuple, make: Callable[[], PreparedStage]) -> PreparedStage:
    """The prepared stage cached under ``key`` (made by ``make()`` on a miss; ``CACHE_SIZE`` stages are kept, the
    least recently used dropped first). ``key`` must pin everything the preparation reads: the stage's selections,
    counts and budgets, the question rows, and the shape, strides and dtype of every tensor whose metadata the call
    no longer checks (``PreparedStage.run``); the query's and key's strides are read per call."""
    prepared = _PREPARED.get(key)
    if prepared is not None:
        _PREPARED.move_to_end(key)
        return prepared
    prepared = _PREPARED[key] = make()
    while len(_PREPARED) > CACHE_SIZE:
        _PREPARED.popitem(last=False)
    return prepared


def _needed(value: torch.Tensor | None, what: str, stage: PlannedStage) -> torch.Tensor:
    """``value``, which this stage needs (a stage that ranks scores needs the layer's query and key)."""
    if value is None:
        raise ValueError(f"run_stage: the stage after layer {stage.spec.layer} needs {what}, got None")
    return value


def run_stage(stage: PlannedStage, query: torch.Tensor | None, key: torch.Tensor | None, rows: StageRows,
              question: range, picks: tuple[torch.Tensor | None, ...], *, prompt_length: int, scale: float | None,
              eps: float, out: tuple[torch.Tensor, ...] | None = None, extra: Sequence[torch.Tensor] = (),
              extra_dims: Sequence[int] = (), reduce: ScoreReduce | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, StageRows, list[torch.Tensor]]:
    """``(keep, nonfinite, next_rows, compacted)``: the rows of the current sequence a stage keeps
    (``[1, tokens_after]``, sorted), a ``[1]`` bool device tensor, whether a token the stage ranks has a non-finite
    score (None for a stage without scores; the caller reads the flags once, at the prefill's end), the tables of the
    kept rows, and ``extra`` compacted to the kept rows (each with a batch dim of size 1 just before its sequence dim
    ``extra_dims[i]``, as ``batched`` gives them): on a fused stage in the stage's own gather launch.

    Args:
        rows: the tables of the rows entering the stage (``[1, tokens_before]`` each).
        question: the stage's query rows as a range of the current sequence's rows (host-known).
        picks: the random rule's picks (prompt positions, device); prompt_length: the prompt's token count.
        query, key: the readout layer's post-RoPE queries ``[1, Hq, n, D]`` and keys (None without scores).
        out: for a fused stage, ``(keep, flags, *next tables)`` buffers to write (``PreparedStage.allocate``
            shapes; the compacted ``extra`` tensors are new tensors, model activations); None: new tensors. Not
            written with ``reduce``.
        reduce: None where ``query`` holds every head; else what turns the scores of the heads ``query`` holds into
            the scores of all heads (``ScoreReduce``), applied between the scores and the selection: the stage then
            composes the ops (results as new tensors), fused or not.

    Both paths take their sizes from the host plan and read nothing back; both rank a NaN score below every number
    (ties to the lower index).
    """
    spec = stage.spec
    if fused(stage) and reduce is None:
        query, key = _needed(query, "query", stage), _needed(key, "key", stage)
        prepared = prepared_stage(stage, query, key, rows, question, scale=scale, eps=eps, extra=extra,
                                  extra_dims=extra_dims)
        coverage = any(sel.rule == "coverage" for sel in spec.selections)
        if out is not None and extra:
            out = (*out, *prepared.allocate_gathered(len(out) - 2))  # the caller's buffers, new activations
        keep, flags, *tables = prepared.run(query, key, rows.labels, rows.chunks if coverage else None,
                                            [*rows.tables, *extra], out=out)
        n = len(rows.tables)
        return keep, flags, StageRows(tables[0], tables[1], tables[2] if n > 2 else None), tables[n:]
    labels = rows.labels[0]
    scores, flag = None, None
    if spec.needs_scores:
        query, key = _needed(query, "query", stage), _needed(key, "key", stage)
        positions = _row_positions(question.start, question.stop, labels.device)
        score_labels, score_eps = (torch.ones_like(labels), 0.0) if spec.scoring == "raw" else (labels, eps)
        scores = modality_scores(query[:, :, question.start:question.stop], key, score_labels[None], positions,
                                 scale=scale, eps=score_eps)[0]
        if reduce is not None:
            scores = reduce(scores)
        ranked = member_mask(labels, tuple(m for sel in spec.selections if sel.rule != "random"
                                           for m in sel.modalities))
        flag = (ranked & ~torch.isfinite(scores)).any()[None]
        # Scores are >= 0 or NaN (modality_scores' rule), so -inf for NaN ranks it below every number, ties to the
        # lower index: select_stage's rule, and the public ops (which refuse NaN where they check) accept it.
        scores = torch.where(torch.isnan(scores), float("-inf"), scores)
    keep = torch.ones(labels.numel(), dtype=torch.bool, device=labels.device)
    for sel, count, pick in zip(spec.selections, stage.members, picks, strict=True):
        in_sel = member_mask(labels, sel.modalities)
        keep &= ~in_sel
        if sel.rule == "random":
            # The picks are prompt positions: on the whole prompt (RandomPolicy's stage before layer 1) they are
            # the rows themselves; after other stages dropped rows, the rows holding them are found on the device.
            pick = _needed(pick, "the random rule's picks", stage)
            chosen = pick if stage.tokens_before == prompt_length else torch.searchsorted(rows.current[0], pick)
        else:
            members = positions_where(in_sel, count)
            ranked_scores = _needed(scores, "scores", stage)
            if sel.rule == "coverage":
                chunks = _needed(rows.chunks, "the rows' chunk ids", stage)
                picked = coverage_select(ranked_scores[members], chunks[0][members], sel.k, sel.coverage_weight)
            else:
                picked = topk_indices(ranked_scores[members], sel.k)
            chosen = members[picked]
        keep[chosen] = True
    kept = positions_where(keep, stage.tokens_after)[None]
    n = len(rows.tables)
    # The tables and the extra tensors of the kept rows, in one compact_many.
    tables = compact_many([*rows.tables, *extra], kept, [1] * n + list(extra_dims))
    return kept, flag, StageRows(tables[0], tables[1], tables[2] if n > 2 else None), tables[n:]
