"""The device work of one stage: scores from the readout layer's queries and keys, and the selection, with every size
from the host plan (``macer.core.policy.plan_prefill``) and no host synchronisation. Torch and ``macer_kernels``
only; both engines call ``run_stage`` (through ``macer.core.prefill.PrefillState``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from macer.core.policy import PlannedStage, Scoring, member_mask
from macer_kernels import StageModality, coverage_select, modality_scores, select_stage, topk_indices

__all__ = ["ScoreReduce", "fused", "positions_where", "run_stage", "score"]

ScoreReduce = Callable[[torch.Tensor], torch.Tensor]
"""``reduce(local) -> scores``: a stage's ``[n]`` fp32 scores from this process's share of the readout layer's heads
to the scores of all of them, before the selection (a tensor-parallel engine's all-gather and fixed-order sum,
``macer.vllm.parallel``). It must return the same bits in every process that takes part, or they select different
rows."""


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


def fused(stage: PlannedStage) -> bool:
    """Whether ``macer_kernels.select_stage`` computes this stage: ANMS scores, one modality per selection, top-k or
    coverage (it scores and selects with the same labels, so raw scores and joint selections are composed here)."""
    return stage.spec.scoring == "anms" and all(len(s.modalities) == 1 and s.rule != "random"
                                                for s in stage.spec.selections)


def run_stage(stage: PlannedStage, query: torch.Tensor | None, key: torch.Tensor | None, current: torch.Tensor,
              labels: torch.Tensor, chunks: torch.Tensor | None, question: torch.Tensor,
              picks: tuple[torch.Tensor | None, ...], *, scale: float | None, eps: float,
              reduce: ScoreReduce | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(keep, nonfinite)``: the rows of the current sequence a stage keeps (sorted; ``stage.tokens_after`` of them)
    and a ``[1]`` bool device tensor, whether a token the stage ranks has a non-finite score (None for a stage
    without scores). The caller reads the flags once, at the prefill's end.

    Args:
        current: ``[n]`` prompt positions of the rows entering the stage (device).
        labels, chunks: per-prompt-position tables on the device (``chunks`` only for the coverage rule).
        question: the stage's query rows as prompt positions (device); ``picks``: the random rule's picks (device).
        query, key: the readout layer's post-RoPE queries and keys (None for a stage without scores).
        reduce: None where ``query`` holds every head; else what turns the scores of the heads ``query`` holds into
            the scores of all heads (``ScoreReduce``), applied between the scores and the selection.

    MACER's stages run the fused ``macer_kernels.select_stage`` (scores and every selection in one call, at most 4
    launches on the GPU backends); raw scores, joint and random selections compose the ops. Both take their sizes
    from the host plan and read nothing back. Both rank a NaN score below every number (ties to the lower index).
    With ``reduce`` the ops are composed (the fused call scores and selects in one go, with no point between them).
    """
    spec = stage.spec
    cur_labels = labels[current]
    rows = torch.searchsorted(current, question) if spec.needs_scores else None
    if fused(stage) and reduce is None:
        modalities = [StageModality(sel.modalities[0], count, sel.k,
                                    sel.coverage_weight if sel.rule == "coverage" else None,
                                    sel.num_chunks if sel.rule == "coverage" else None)
                      for sel, count in zip(spec.selections, stage.members, strict=True)]
        coverage = any(sel.rule == "coverage" for sel in spec.selections)
        keep, flags = select_stage(query[:, :, rows], key, cur_labels[None], modalities,
                                   chunk_ids=chunks[current][None] if coverage else None, query_positions=rows[None],
                                   scale=scale, eps=eps, return_flags=True)
        return keep[0], flags
    scores, flag = None, None
    if spec.needs_scores:
        scores = score(query, key, cur_labels, rows, spec.scoring, scale=scale, eps=eps)
        if reduce is not None:
            scores = reduce(scores)
        ranked = member_mask(cur_labels, tuple(m for sel in spec.selections if sel.rule != "random"
                                                for m in sel.modalities))
        flag = (ranked & ~torch.isfinite(scores)).any()[None]
        # Scores are >= 0 or NaN (modality_scores' rule), so -inf for NaN ranks it below every number, ties to the
        # lower index: select_stage's rule, and the public ops (which refuse NaN where they check) accept it.
        scores = torch.where(torch.isnan(scores), float("-inf"), scores)
    keep = torch.ones(current.numel(), dtype=torch.bool, device=current.device)
    for sel, count, pick in zip(spec.selections, stage.members, picks, strict=True):
        in_sel = member_mask(cur_labels, sel.modalities)
        keep &= ~in_sel
        if sel.rule == "random":
            chosen = torch.searchsorted(current, pick)
        else:
            members = positions_where(in_sel, count)
            if sel.rule == "coverage":
                picked = coverage_select(scores[members], chunks[current[members]], sel.k, sel.coverage_weight)
            else:
                picked = topk_indices(scores[members], sel.k)
            chosen = members[picked]
        keep[chosen] = True
    return positions_where(keep, stage.tokens_after), flag
