"""The host plan of a prefill in the transformers engine: the prompt's ids, temporal positions and mask come to the
host in the prefill's one copy (``macer.core.transfer.to_host``), the adapter labels the rows, and each prompt (each
sample of a left-padded batch, its padding stripped) is planned by ``macer.core.policy.plan_prefill`` with its trace
record; the plan's tables go to the device in one copy (``PromptPrefill``, ``BatchPrefill``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from macer.core.policy import AUDIO, MODALITY_NAMES, VISUAL, Plan, Policy, PromptFacts, plan_prefill
from macer.core.transfer import to_device, to_host
from macer.hf.adapters import Adapter, DecoderParts
from macer.hf.batch import BatchPrefill, check_left_padding
from macer.hf.prefill import PromptPrefill
from macer.hf.trace import PrefillRecord, Stage
from macer_kernels import PAD_LABEL

__all__ = ["PlanContext", "plan_batch", "plan_prompt", "plan_sample"]


class PlanContext(Protocol):
    """What a plan reads of a compress session (``macer.hf.session.Session``)."""

    model: nn.Module
    policy: Policy
    adapter: Adapter
    parts: DecoderParts
    base: str
    end_of_turn: int | None


def plan_prompt(session: PlanContext, input_ids: torch.Tensor | None, kwargs: dict[str, Any],
                mask: torch.Tensor | None, length: int) -> tuple[Plan, PrefillRecord]:
    """The host plan of a prefill and its trace record: the prompt's ids, temporal row and mask come to the host in
    one copy, everything else is computed there."""
    temporal = session.adapter.temporal_positions(kwargs, length)
    ids, temporal, mask = to_host(None if input_ids is None else input_ids[0],
                                   None if temporal is None else temporal[0],
                                   mask[0] if isinstance(mask, torch.Tensor) else None)
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError("macer.compress: attention_mask has padding (zeros) in a single prompt; pad only a batch of "
                         "several prompts, on the left")
    labels = session.adapter.labels(session.model, None if ids is None else ids[None])[0].long()
    return plan_sample(session, ids, labels, temporal, length, session.adapter.question_end(length))


def plan_sample(session: PlanContext, ids: torch.Tensor | None, labels: torch.Tensor, temporal: torch.Tensor | None,
                length: int, question_end: int | None, padding: int = 0) -> tuple[Plan, PrefillRecord]:
    """Plan and record of one prompt from its host ids, labels and temporal row (padding removed); ``padding`` is its
    left padding in the batch, added to every index the record reports."""
    facts = PromptFacts(labels=labels, temporal=torch.arange(length) if temporal is None else temporal,
                        input_ids=ids, end_of_turn_token_id=session.end_of_turn,
                        num_layers=len(session.parts.layers), question_end=question_end)
    plan = plan_prefill(session.policy, facts)
    scored = [s.query.tolist() for s in plan.stages if s.spec.needs_scores]
    record = PrefillRecord(
        prompt_length=length, n_audio=facts.count(AUDIO), n_video=facts.count(VISUAL), planned_budget=plan.budget,
        query_positions=[q + padding for q in scored[0]] if scored else [], layer_tokens=list(plan.layer_tokens),
        stages=[Stage(s.spec.layer, tuple(MODALITY_NAMES[m] for sel in s.spec.selections for m in sel.modalities),
                      s.tokens_before, s.tokens_after) for s in plan.stages],
        policy=session.policy.name, labels=labels, padding=padding)
    return plan, record


def plan_batch(session: PlanContext, input_ids: torch.Tensor | None, root_kwargs: dict[str, Any],
               kwargs: dict[str, Any], mask: torch.Tensor | None, batch: int, length: int,
               device: torch.device) -> BatchPrefill:
    """A left-padded batch: one host copy of every row's ids, temporal positions and mask, then each sample planned
    on its own unpadded row, exactly as if it ran alone (``macer.hf.batch``)."""
    temporal = session.adapter.temporal_positions(kwargs, length)
    if temporal is not None and temporal.shape[0] != batch:
        temporal = temporal.expand(batch, length)
    ids, temporal, host_mask = to_host(input_ids, temporal, mask if isinstance(mask, torch.Tensor) else None)
    ids = None if ids is None else ids.reshape(batch, length)
    temporal = None if temporal is None else temporal.reshape(batch, length)
    pads = [0] * batch if host_mask is None else check_left_padding(host_mask.reshape(batch, length))
    session.adapter.check_batch(session.model, ids, root_kwargs)
    labels = session.adapter.labels(session.model, ids).long()
    if tuple(labels.shape) != (batch, length):
        raise ValueError(f"macer.compress: the adapter gave labels of shape {tuple(labels.shape)} for a batch of "
                         f"{batch} rows of {length}; a batch needs one label per row ([B, N], padding included)")
    ends = session.adapter.question_ends(batch, length)
    samples = []
    # The batch's tables by padded row for the stages that run once for the whole batch (macer.hf.batch).
    batch_labels = labels.clone()
    batch_chunks = torch.zeros(batch, length, dtype=torch.long)
    for b, pad in enumerate(pads):
        row_end = ends[b]
        end = None if row_end is None else row_end - pad
        plan, record = plan_sample(session, None if ids is None else ids[b, pad:], labels[b, pad:],
                                    None if temporal is None else temporal[b, pad:], length - pad, end, pad)
        samples.append(PromptPrefill(plan, device, record, defer=False))  # per-sample stages read `pending`
        batch_labels[b, :pad] = PAD_LABEL
        if plan.chunks is not None:
            # -1 where the sample's own stages read no chunk id: any valid id there (such a token is never a
            # coverage candidate of a batched stage: the sample keeps all its tokens of that label)
            batch_chunks[b, pad:] = plan.chunks.clamp(min=0)
    if isinstance(mask, torch.Tensor):
        valid = mask.bool()
    else:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    on_device = to_device([batch_labels, batch_chunks, torch.tensor(pads)[:, None]], device)
    labels_table, chunks_table, pads_table = (t.reshape(batch, -1) for t in on_device)
    return BatchPrefill(samples, pads, length, valid, boolean=session.base != "eager",
                        tables=(labels_table, chunks_table, pads_table),
                        padding_mask=session.base == "flash_attention_2")
