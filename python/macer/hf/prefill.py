"""One prompt's prefill inside a transformers decoder (``PromptPrefill``): the engine-independent state
(``macer.core.prefill.PrefillState``: plan, device tables, current and pending rows, stage flags) with what the
transformers engine adds around it: the trace record, the compacted layer kwargs, cache trimming after the prefill.
A batch's ``macer.hf.batch.BatchPrefill`` holds one per sample.

Nothing is read back from the device after the plan (Qwen3-Omni's deepstack remap reads one count per stage placed
before a deepstack level: ``macer.hf.adapters.qwen3_omni``) except the stages' non-finite flags, once, at the
prefill's end (``raise_if_nonfinite``).
"""

from __future__ import annotations

from typing import Any

import torch

from macer.core.policy import Plan
from macer.core.prefill import PrefillState, nonfinite_hits
from macer.hf.adapters import Adapter
from macer.hf.inputs import layer_inputs, token_tensors
from macer.hf.trace import PrefillRecord
from macer_kernels import compact, compact_many

__all__ = ["PromptPrefill", "raise_if_nonfinite"]


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


class PromptPrefill(PrefillState):
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
        assert keep is not None  # called where has_pending(): this engine runs its stages undeferred
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
