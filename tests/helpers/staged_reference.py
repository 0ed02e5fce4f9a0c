"""An independent staged forward of any transformers decoder, for kept-set tests of ``macer.compress``.

It never touches macer's runtime nor the fast ops: the decoder layers run one by one with eager attention, the
attention probabilities come from the attention module's returned weights, ANMS is computed from them in float64
(``eq:macer_score``), budgets come from the integer oracle ``budget_oracle`` and selections from
``macer_kernels.reference``; after a stage the hidden states and RoPE tables are shortened with plain indexing and a
fresh causal mask is built. ``after_layer`` lets a family add
its own per-layer inputs (Qwen3-Omni's deepstack features) on the rows still present.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from budget_oracle import exact_budget

from macer_kernels.reference import coverage_select_ref, temporal_chunks_ref, topk_indices_ref

AUDIO, VISUAL = 1, 2


def anms(probs: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """eq:macer_score from attention probabilities ``[H, n, n]`` (float64)."""
    a = probs[:, rows].double()  # [H, Lq, n]
    scores = torch.zeros(a.shape[-1], dtype=torch.float64)
    for m in (AUDIO, VISUAL):
        in_m = labels == m
        if in_m.any():
            mass = a[..., in_m].sum(-1, keepdim=True)
            scores[in_m] = (a[..., in_m] / (mass + eps)).mean(dim=(0, 1))
    return scores


def staged_kept(
    layers,
    rotary_emb,
    embeds: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor,
    temporal: torch.Tensor,
    question: torch.Tensor,
    config,
    after_layer: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[int], list[int], torch.Tensor]:
    """Kept audio and visual prompt positions of a staged MACER prefill, and the last layer's hidden states (before
    the final norm) of the rows that reached it.

    Args:
        layers: the decoder layers (eager attention: their ``self_attn`` returns probabilities).
        rotary_emb: the decoder's rotary embedding module, called as ``rotary_emb(hidden, position_ids)``.
        embeds: ``[1, N, D]`` decoder input embeddings. ``position_ids``: what the decoder's RoPE receives.
        labels: ``[N]`` modality labels; ``temporal``: ``[N]`` temporal positions; ``question``: question rows.
        config: a ``MacerConfig``.
        after_layer: ``f(i, hidden, current) -> hidden`` applied after layer ``i`` (``current``: prompt positions of
            the rows present).
    """
    n = labels.numel()
    n_a, n_v = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
    budget = exact_budget(n_a, n_v, config.keep_ratio, config.audio_share)
    stages: dict[int, list[int]] = {}
    for layer, modality, count in ((config.audio_layer, AUDIO, n_a), (config.video_layer, VISUAL, n_v)):
        if count:
            stages.setdefault(layer - 1, []).append(modality)
    weights = {}

    def keep_weights(module, args, output):
        weights["probs"] = output[1]

    current = torch.arange(n)
    hidden = embeds
    cos, sin = rotary_emb(hidden, position_ids)
    kept = {AUDIO: (labels == AUDIO).nonzero().reshape(-1), VISUAL: (labels == VISUAL).nonzero().reshape(-1)}
    with torch.no_grad():
        for i, layer in enumerate(layers):
            length = current.numel()
            mask = torch.full((length, length), torch.finfo(hidden.dtype).min).triu(1)[None, None]
            handle = layer.self_attn.register_forward_hook(keep_weights)
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=None,
                           past_key_values=None, use_cache=False)
            handle.remove()
            if after_layer is not None:
                hidden = after_layer(i, hidden, current)
            if i not in stages:
                continue
            cur_labels = labels[current]
            rows = torch.searchsorted(current, question)
            scores = anms(weights["probs"][0], rows, cur_labels, config.eps)
            index = stage_rows(scores, cur_labels, current, stages[i], budget, temporal, config, kept)
            hidden, cos, sin = hidden[:, index], cos[:, index], sin[:, index]
            current = current[index]
    return sorted(kept[AUDIO].tolist()), sorted(kept[VISUAL].tolist()), hidden


def stage_rows(scores: torch.Tensor, cur_labels: torch.Tensor, current: torch.Tensor, modalities, budget,
               temporal: torch.Tensor, config, kept: dict) -> torch.Tensor:
    """One stage by the float64 references: the indices into ``current`` (the prompt positions still present) that
    survive: every row outside ``modalities``, and each staged modality's top-K (audio) or coverage greedy (video)
    picks, which are also recorded as prompt positions in ``kept[modality]``."""
    keep = torch.ones(len(current), dtype=torch.bool)
    for modality in modalities:
        members = (cur_labels == modality).nonzero().reshape(-1)
        if modality == AUDIO:
            chosen = topk_indices_ref(scores[members], budget.audio)
        else:
            chunks = temporal_chunks_ref(temporal[current[members]], config.num_chunks)
            chosen = coverage_select_ref(scores[members], chunks, budget.video, config.coverage_weight)
        keep[members] = False
        keep[members[chosen]] = True
        kept[modality] = current[members[chosen]]
    return keep.nonzero().reshape(-1)
