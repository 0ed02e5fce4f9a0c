"""The state of one prefill: the host plan of a prompt (or of each prompt of a left-padded batch) and the rows the
sequence holds as the stages run (``_Prefill``; a batch's ``macer._batch.BatchPrefill`` holds one per sample).

The prompt's ids, temporal positions and mask come to the host in the prefill's one copy (``_to_host``); the plan's
tables go to the device in one copy (``_to_device``); nothing is read back afterwards (Qwen3-Omni's deepstack remap
reads one count per stage placed before a deepstack level: ``macer.adapters.qwen3_omni``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from macer._batch import BatchPrefill, check_left_padding, layer_inputs, token_tensors
from macer.adapters import Adapter
from macer.core.policy import AUDIO, MODALITY_NAMES, VISUAL, Plan, PromptFacts, plan_prefill
from macer.core.prefill import PrefillState, nonfinite_hits
from macer.core.transfer import to_device, to_host
from macer.trace import PrefillRecord, Stage
from macer_kernels import PAD_LABEL, compact, compact_many

if TYPE_CHECKING:
    from macer.runtime import _Session


def _plan(session: _Session, input_ids: torch.Tensor | None, kwargs: dict[str, Any], mask: torch.Tensor | None,
          length: int) -> tuple[Plan, PrefillRecord]:
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
    return _plan_sample(session, ids, labels, temporal, length, session.adapter.question_end(length))


def _plan_sample(session: _Session, ids: torch.Tensor | None, labels: torch.Tensor, temporal: torch.Tensor | None,
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


def _plan_batch(session: _Session, input_ids: torch.Tensor | None, root_kwargs: dict[str, Any],
                kwargs: dict[str, Any], mask: torch.Tensor | None, batch: int, length: int,
                device: torch.device) -> BatchPrefill:
    """A left-padded batch: one host copy of every row's ids, temporal positions and mask, then each sample planned
    on its own unpadded row, exactly as if it ran alone (``macer._batch``)."""
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
    # The batch's tables by padded row for the stages that run once for the whole batch (macer._batch).
    batch_labels = labels.clone()
    batch_chunks = torch.full((batch, length), -1, dtype=torch.long)
    for b, pad in enumerate(pads):
        end = None if ends[b] is None else ends[b] - pad
        plan, record = _plan_sample(session, None if ids is None else ids[b, pad:], labels[b, pad:],
                                    None if temporal is None else temporal[b, pad:], length - pad, end, pad)
        samples.append(_Prefill(plan, device, record))
        batch_labels[b, :pad] = PAD_LABEL
        if plan.chunks is not None:
            batch_chunks[b, pad:] = plan.chunks
    if isinstance(mask, torch.Tensor):
        valid = mask.bool()
    else:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    on_device = to_device([batch_labels, batch_chunks, torch.tensor(pads)[:, None]], device)
    tables = tuple(t.reshape(batch, -1) for t in on_device)
    return BatchPrefill(samples, pads, length, valid, boolean=session.base != "eager", tables=tables,
                        padding_mask=session.base == "flash_attention_2")


def raise_if_nonfinite(entries: list[tuple[int, list[int | None], torch.Tensor]]) -> None:
    """Raise if a stage ranked non-finite scores (``entries`` as in ``nonfinite_hits``), naming the earliest."""
    hits = nonfinite_hits(entries)
    if hits:
        layer, b = hits[0]
        raise RuntimeError(
            f"macer.compress: the attention scores of the stage reading layer {layer} are not finite for sample {b} "
            f"(batch index): NaN or inf in that layer's queries or keys, i.e. in the weights of layer {layer} "
            "(q_proj/k_proj, its norms) or in the hidden states entering it (an earlier layer, the inputs). A "
            "selection from such scores would keep arbitrary tokens, so this prefill is stopped; the model is left "
            "as it was. Check the weights and inputs (the model without compress shows NaN logits too).")


class _Clock:
    """MACER's own time; with ``profile`` the device is synchronised around each interval."""

    def __init__(self, profile: bool):
        self.profile = profile

    def _sync(self) -> None:
        if self.profile and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def tick(self) -> float:
        self._sync()
        return time.perf_counter()

    def tock(self, start: float) -> float:
        self._sync()
        return time.perf_counter() - start


class _Prefill(PrefillState):
    """One prompt's prefill inside a transformers decoder: the engine-independent state (``PrefillState``), its trace
    record, the compacted layer kwargs and the hooks of this prefill."""

    def __init__(self, plan: Plan, device: torch.device, record: PrefillRecord):
        super().__init__(plan, device)
        self.record = record
        self.inputs: dict[str, Any] = {}  # compacted per-token layer kwargs after the last applied stage
        self.handles: list[Any] = []
        self.overhead = 0.0

    def finish(self, cache: Any, trim: bool, num_layers: int) -> tuple[list[torch.Tensor], int] | None:
        """After the prefill: trim earlier layers' caches to the final rows if asked; returns what a decode step
        needs (each layer's prompt rows and the prompt length; None when nothing was pruned)."""
        rows = [self.layer_rows.get(i, self.full) for i in range(num_layers)]
        entry = None
        if cache is not None and self.current is not self.full:
            final = self.current
            if trim:
                for i, layer_rows in enumerate(rows):
                    if layer_rows is not final:
                        keep = torch.searchsorted(layer_rows, final)
                        layer = cache.layers[i]
                        # An offloaded cache holds this layer on the CPU: its index goes there (a blocking copy,
                        # which also waits for the offload's pending copies of the layer).
                        if keep.device != layer.keys.device:
                            keep = keep.to(layer.keys.device)
                        layer.keys, layer.values = compact_many([layer.keys, layer.values], keep, [-2, -2])
                rows = [final] * len(rows)
            entry = (rows, self.plan.facts.length)
        if cache is not None:
            self.record.cache_lengths = [int(layer.get_seq_length()) for layer in cache.layers[:num_layers]]
        self.record.kept_positions = None if self.current is self.full else self.current
        return entry

    def records(self, cached: bool, entry: Any) -> list[PrefillRecord]:
        """The prefill's record (completed by ``finish``)."""
        return [self.record]

    def compact(self, adapter: Adapter, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]``: keep the pending rows of every per-token input (one ``compact_many``)."""
        keep, self.pending = self.pending, None
        source = self.inputs or kwargs
        names, tensors, dims = token_tensors(adapter, args, kwargs, source)
        hidden, inputs = layer_inputs(adapter, names, compact_many(tensors, keep, dims))
        mask = source.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            # Rows and columns of a causal mask restricted to a sorted subset = the causal mask of the subset.
            mask = compact(mask, keep, dim=-1)
            if mask.ndim == 4:
                mask = compact(mask, keep, dim=-2)
        inputs["attention_mask"] = mask
        adapter.on_stage(kwargs, keep, index)
        self.inputs = inputs
        self.current = self.current[keep]
        if args:
            return (hidden, *args[1:]), kwargs
        kwargs["hidden_states"] = hidden
        return args, kwargs
