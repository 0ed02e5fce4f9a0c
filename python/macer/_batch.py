"""Batch size > 1 in ``macer.compress``: a left-padded batch whose samples are planned and selected one by one and
re-packed together after every stage (issue #11).

Procedure (the runtime calls this module only for ``B > 1``):

1. At the start of a prefill the whole batch's ids, temporal rows and 2-D mask come to the host in the prefill's one
   copy. Each sample's padding is stripped and the sample is planned exactly as if it ran alone
   (``macer.policy.plan_prefill`` on its own row): counts, budget split, question rows, chunk ids, stage layers.
2. At a readout layer each sample with a stage there runs ``macer.policy.run_stage`` on its own slice of the queries
   and keys (its real rows only: padded keys would change the softmax of raw scores and the ``eps`` term of ANMS).
   So a stage costs ``B`` selection calls (launches scale with ``B``); sizes still come from the host plan.
3. Before the next layer the batch is re-packed in one gather per per-token tensor: each sample's kept rows,
   left-padded to the longest kept length. The 4-D mask is rebuilt for the new layout (causal over each sample's
   real rows, padded keys masked; a padded query row sees only itself, so no row is fully masked and no NaN
   appears).
4. Every layer's cache keeps the layout it was filled in; the session remembers each layer's ``[B, N_l]`` validity
   (``BatchLayout``), and a decode step gives every layer whose layout differs from layer 0's a mask built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from macer.runtime import _Prefill
    from macer.trace import PrefillRecord


def check_left_padding(mask: torch.Tensor) -> list[int]:
    """Left padding of each row of a host ``[B, N]`` 0/1 mask; any other pattern is refused with a clear error."""
    mask = mask.bool()
    real = mask.sum(dim=1)
    pads = (mask.shape[1] - real).tolist()
    for b, pad in enumerate(pads):
        row = mask[b]
        if pad == mask.shape[1]:
            raise ValueError(f"macer.compress: attention_mask row {b} is all padding; every sample needs tokens")
        if bool(row[:pad].any()) or not bool(row[pad:].all()):
            raise ValueError(
                f"macer.compress: attention_mask row {b} is not left-padded (zeros must all come first); a batch "
                "must be padded on the left, as generate needs (tokenizer.padding_side = 'left' / "
                "processor(..., padding_side='left')); right padding and holes are not supported")
    return pads


def gather_tokens(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``index`` ``[B, M]`` of each sample along token dimension ``dim``; the batch dimension is ``dim - 1``
    (hidden states and RoPE tables ``[B, N, *]`` at dim 1, position ids ``[k, B, N]`` at dim -1)."""
    dim %= t.ndim
    b, m = index.shape
    if t.shape[dim - 1] != b:
        t = t.expand(*t.shape[: dim - 1], b, *t.shape[dim:])
    view = [1] * t.ndim
    view[dim - 1], view[dim] = b, m
    shape = list(t.shape)
    shape[dim] = m
    return torch.gather(t, dim, index.view(view).expand(shape))


def layout_mask(valid: torch.Tensor, queries: int, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    """``[B, 1, queries, K]`` mask for the last ``queries`` rows of a sequence whose ``K`` keys are real where
    ``valid`` ``[B, K]``: causal over keys, padded keys masked, and each query row may see its own key (a padded
    row then is never fully masked). Boolean (SDPA: True = attend) or additive (eager: 0 / dtype min)."""
    k = valid.shape[1]
    cols = torch.arange(k, device=valid.device)
    rows = cols[k - queries:]
    causal = cols[None, :] <= rows[:, None]
    allowed = (causal[None] & valid[:, None, :]) | (cols[None, :] == rows[:, None])[None]
    allowed = allowed[:, None]
    if boolean:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


@dataclass
class BatchLayout:
    """What a decode step needs of a batch-pruned cache: each layer's ``[B, N_l]`` real-row mask (layers that share
    a layout share the tensor) and the padded prompt length of the 2-D mask ``generate`` keeps extending."""

    valid: list[torch.Tensor]
    prompt_length: int


class BatchPrefill:
    """One prefill of a left-padded batch: a ``_Prefill`` per sample (its own plan, device tables and kept rows) and
    the batch layout (each sample's left padding in the current, re-packed sequence)."""

    def __init__(self, samples: list[_Prefill], pads: list[int], width: int, valid: torch.Tensor, boolean: bool):
        self.samples = samples
        self.pads = list(pads)  # left padding of each sample in the current sequence
        self.valid = valid  # [B, width] real rows of the current sequence
        self.boolean = boolean  # the attention backend's mask kind (SDPA: boolean; eager: additive)
        self.inputs: dict[str, Any] = {}
        self.layer_valid: dict[int, torch.Tensor] = {}  # layer index -> validity of the rows it received
        self.layer_pads: dict[int, list[int]] = {}
        self.handles: list[Any] = []
        self.overhead = 0.0
        self.layer_tokens = self._widths(width)
        self.repacked = False
        self.original_valid, self.original_pads = valid, self.pads

    def _widths(self, width: int) -> list[int]:
        """The batch's sequence length entering each layer: the padded width until the first layer at which some
        sample is shorter than before, then the longest sample."""
        plans = [s.plan for s in self.samples]
        out, changed = [], False
        previous = [p.facts.length for p in plans]
        for i in range(len(plans[0].layer_tokens)):
            now = [p.layer_tokens[i] for p in plans]
            changed = changed or now != previous
            out.append(max(now) if changed else width)
            previous = now
        return out

    def has_pending(self) -> bool:
        return any(s.pending is not None for s in self.samples)

    def stage_at(self, layer: int) -> bool:
        return any(s.stage_at(layer) is not None for s in self.samples)

    def run(self, query: torch.Tensor | None, key: torch.Tensor | None, scale: float | None, eps: float,
            layer: int) -> None:
        """The stages of the samples that have one at ``layer`` (1-based readout; 0 = before the first layer), each
        on its own real rows of the readout's queries and keys."""
        for b, sample in enumerate(self.samples):
            if sample.stage_at(layer) is None:
                continue
            pad = self.pads[b]
            q = None if query is None else query[b: b + 1, :, pad:]
            k = None if key is None else key[b: b + 1, :, pad:]
            sample.run(q, k, scale, eps)

    def enter(self, index: int) -> None:
        """``layers[index]`` runs on the current layout: remember it (its cache rows)."""
        self.layer_valid[index] = self.valid
        self.layer_pads[index] = self.pads
        for sample in self.samples:
            sample.enter(index)

    def compact(self, adapter: Any, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]``: re-pack every sample's kept rows, left-padded to the longest (one gather per
        per-token tensor), and rebuild the mask for the new layout."""
        device = self.valid.device
        keeps, lengths = [], []
        for b, sample in enumerate(self.samples):
            keep, sample.pending = sample.pending, None
            n = sample.current.numel()
            keep = torch.arange(n, device=device) if keep is None else keep
            keeps.append(keep + self.pads[b])
            lengths.append(keep.numel())
            sample.current = sample.current[keep]
        width = max(lengths)
        pads = [width - n for n in lengths]
        # Padded slots gather row 0 of their sample's current sequence: any finite row will do, the mask hides them.
        index = torch.stack([torch.cat([torch.zeros(p, dtype=torch.long, device=device), k])
                             for p, k in zip(pads, keeps, strict=True)])
        valid = torch.stack([torch.cat([torch.zeros(p, dtype=torch.bool, device=device),
                                        torch.ones(n, dtype=torch.bool, device=device)])
                             for p, n in zip(pads, lengths, strict=True)])
        hidden = args[0] if args else kwargs["hidden_states"]
        source = self.inputs or kwargs
        cos, sin = source[adapter.position_embeddings_kwarg]
        inputs: dict[str, Any] = {adapter.position_embeddings_kwarg: (gather_tokens(cos, index, 1),
                                                                       gather_tokens(sin, index, 1))}
        for name, dim in adapter.layer_token_kwargs.items():
            if isinstance(source.get(name), torch.Tensor):
                inputs[name] = gather_tokens(source[name], index, dim)
        inputs["attention_mask"] = layout_mask(valid, width, hidden.dtype, self.boolean)
        hidden = gather_tokens(hidden, index, 1)
        self.inputs, self.valid, self.pads, self.repacked = inputs, valid, pads, True
        if args:
            return (hidden, *args[1:]), kwargs
        kwargs["hidden_states"] = hidden
        return args, kwargs

    def records(self, cached: bool, layout: BatchLayout | None) -> list[PrefillRecord]:
        """Each sample's ``PrefillRecord``, completed as if it ran alone: its own cache rows per layer (the batch's
        cache also holds its padding) and its kept prompt positions."""
        out = []
        for sample in self.samples:
            record = sample.record
            if cached:
                rows = [sample.current if layout is not None and layout.valid[i] is self.valid
                        else sample.layer_rows.get(i, sample.full) for i in range(len(self.layer_tokens))]
                record.cache_lengths = [r.numel() for r in rows]
            record.kept_positions = None if sample.current is sample.full else sample.current
            out.append(record)
        return out

    def finish(self, cache: Any, trim: bool, num_layers: int) -> BatchLayout | None:
        """After the prefill: trim earlier layers' caches to the final layout if asked, and return the per-layer
        layout a decode step needs (None when nothing was re-packed: every layer holds the original rows)."""
        if not self.repacked:
            return None
        valid = [self.layer_valid.get(i, self.original_valid) for i in range(num_layers)]
        if trim and cache is not None:
            device = self.valid.device
            for i in range(num_layers):
                if valid[i] is self.valid:
                    continue
                before = self.layer_pads.get(i, self.original_pads)
                index = torch.stack([
                    torch.cat([torch.zeros(pad, dtype=torch.long, device=device),
                               torch.searchsorted(s.layer_rows.get(i, s.full), s.current) + before[b]])
                    for b, (pad, s) in enumerate(zip(self.pads, self.samples, strict=True))])
                layer = cache.layers[i]
                # Cache tensors are [B, H, N, D]: gather along N with the batch at dim 0.
                layer.keys = gather_tokens(layer.keys.transpose(1, 2), index, 1).transpose(1, 2)
                layer.values = gather_tokens(layer.values.transpose(1, 2), index, 1).transpose(1, 2)
                valid[i] = self.valid
        return BatchLayout(valid, self.original_valid.shape[1])


def decode_step(layout: BatchLayout, cache: Any, args: tuple, kwargs: dict[str, Any], dtype: torch.dtype,
                boolean: bool) -> dict[int, torch.Tensor]:
    """Prepare a decode step on a batch-pruned cache: the decoder's 2-D mask (``[B, prompt_length + T]`` from
    ``generate``, or none) is rebuilt for layer 0's layout in ``kwargs``; returns the 4-D mask of every other layer
    whose layout differs from layer 0's (layers sharing a layout share the tensor)."""
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 2):
        raise ValueError("macer.compress: decoding a pruned batch needs a 2-D attention_mask (as generate passes) or "
                         "none")
    embeds = kwargs.get("inputs_embeds")
    queries = (embeds if embeds is not None else args[0] if args else kwargs["input_ids"]).shape[1]
    first = layout.valid[0]
    if mask is not None:
        tail = mask[:, layout.prompt_length:]
    else:  # no padding anywhere: the tokens after the prompt are layer 0's extra cache rows plus this step's
        after = cache.layers[0].get_seq_length() - first.shape[1] + queries
        tail = torch.ones(first.shape[0], after, dtype=torch.long, device=first.device)
    kwargs["attention_mask"] = torch.cat([first.to(tail.dtype), tail], dim=1)
    shared: dict[int, torch.Tensor] = {}
    out = {}
    for i, valid in enumerate(layout.valid):
        if valid is first:
            continue
        if id(valid) not in shared:
            shared[id(valid)] = layout_mask(torch.cat([valid, tail.bool()], dim=1), queries, dtype, boolean)
        out[i] = shared[id(valid)]
    return out
