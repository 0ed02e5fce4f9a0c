"""Batch size > 1 in ``macer.compress``: a left-padded batch whose samples are planned and selected one by one and
re-packed together after every stage.

Procedure (the runtime calls this module only for ``B > 1``):

1. At the start of a prefill the whole batch's ids, temporal rows and 2-D mask come to the host in the prefill's one
   copy. Each sample's padding is stripped and the sample is planned exactly as if it ran alone
   (``macer.core.policy.plan_prefill`` on its own row): counts, budget split, question rows, chunk ids, stage layers.
2. At a readout layer a MACER stage (ANMS scores, top-K / coverage per modality: ``macer.core.stage.fused``) runs
   once for the whole batch, as a prompt alone runs it: a ``macer_kernels.prepared.PreparedStage`` (prepared once
   per batch layout and cached, ``macer.core.stage.cached_prepared``) on the padded batch with the padding labelled
   ``PAD_LABEL`` (outside every softmax, so each sample scores as if alone, up to fp32 rounding), each sample's own
   counts and budgets (a table uploaded at prepare) and its own question rows. The rows are host-known: every drop
   lies before the question and the batch stays right-aligned, so sample b's question position p sits at row
   ``W - (prompt_length_b - p)`` of the current width W (one shared range when every sample's question ends at the
   same distance from its prompt's end, the usual chat template; else each sample's range, gathered by one more
   launch). The readout waits for the next layer's entry (``compact``), whose one prepared call scores, selects and
   gathers the batch's row tables and every per-token layer input into the re-packed layout: each sample's kept
   rows right-aligned after empty slots (the keep's ``-1``s). On the CUDA backend that is one host call (scoring,
   selection, gather, chained) whatever ``B``. Other stages (raw scores, joint or random selections, a stage before
   layer 1) run ``macer.core.stage.run_stage`` per sample on its own real rows, as a prompt alone.
3. Before the next layer the batch is re-packed with the ``[B, W]`` keep (``-1`` slots give zero rows): by the
   prepared call above, or (per-sample stages) one ``compact_many``: one launch per 8 per-token tensors. The 4-D mask
   is rebuilt for the new layout (causal over each sample's real rows, padded keys masked; a padded query row sees
   only itself, so no row is fully masked and no NaN appears: ``check_no_masked_row`` asserts it on CPU tensors, and
   on a GPU in validation mode).
4. Every layer's cache keeps the layout it was filled in; the session remembers each layer's ``[B, N_l]`` validity
   (``BatchLayout``), and a decode step gives every layer whose layout differs from layer 0's a mask built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from macer.core.stage import cached_prepared, fused
from macer.hf.inputs import layer_inputs, token_tensors
from macer.hf.prefill import PromptPrefill
from macer.hf.trace import PrefillRecord
from macer_kernels import PAD_LABEL, StageModality, compact_many, validation_enabled
from macer_kernels.prepared import prepare_stage
from macer_kernels.stage import Counts


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


def check_no_masked_row(allowed: torch.Tensor) -> None:
    """Raise unless every query row of a ``[B, 1, Q, K]`` boolean mask sees at least one key. A fully masked row is
    NaN in FlashAttention and GPU SDPA while PyTorch's CPU SDPA returns a finite row, so CPU runs would not show it.
    Read on CPU tensors; on a GPU only in validation mode (``macer_kernels.validation``: a host read per re-pack)."""
    if allowed.device.type != "cpu" and not validation_enabled():
        return
    every = allowed.any(dim=-1).all()
    if allowed.device.type == "cpu":
        # torch._assert_async raises at once on a CPU tensor; the hot-path test (tests/hf/test_macer_sync.py), which
        # counts the Python-level reads a GPU would wait for, then sees none in a branch a GPU never takes.
        try:
            torch._assert_async(every)
            failed = False
        except RuntimeError:
            failed = True
    else:
        failed = not bool(every)
    if failed:
        b, _, q = (int(i) for i in (~allowed.any(dim=-1)).nonzero()[0])
        raise RuntimeError(f"macer.compress: internal error: the attention mask built for a re-packed batch leaves "
                           f"query row {q} of sample {b} with no key to attend to (NaN on GPU attention kernels)")


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
    check_no_masked_row(allowed)
    return mask_values(allowed, dtype, boolean)


def mask_values(allowed: torch.Tensor, dtype: torch.dtype, boolean: bool) -> torch.Tensor:
    """A boolean "may attend" tensor as the backend's mask: itself (SDPA) or additive (eager: 0 / dtype min)."""
    if boolean:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


@dataclass
class BatchLayout:
    """What a decode step needs of a batch-pruned cache: each layer's ``[B, N_l]`` real-row mask (layers that share
    a layout share the tensor) and the padded prompt length of the 2-D mask ``generate`` keeps extending."""

    valid: list[torch.Tensor]
    prompt_length: int
    # (id of a layout, dtype, boolean) -> its prompt columns' mask [B, 1, 1, N_l] for a decode step's queries (they
    # come after every prompt key: a prompt key is visible iff real); made at the first step, reused by the others.
    prompt_masks: dict[tuple[int, torch.dtype, bool], torch.Tensor] = field(default_factory=dict)
    hooked: bool = False  # the runtime registered its layers' decode hooks


class BatchPrefill:
    """One prefill of a left-padded batch: a ``PromptPrefill`` per sample (its own plan, device tables and kept rows)
    and the batch layout (each sample's left padding in the current, re-packed sequence)."""

    def __init__(self, samples: list[PromptPrefill], pads: list[int], width: int, valid: torch.Tensor, boolean: bool,
                 tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], padding_mask: bool = False):
        self.samples = samples
        self.pads = list(pads)  # left padding of each sample in the current sequence
        self.valid = valid  # [B, width] real rows of the current sequence
        self.boolean = boolean  # the attention backend's mask kind (SDPA: boolean; eager: additive)
        # FlashAttention takes a 2-D padding mask [B, K] (True = real row; causal is the kernel's, over each sample's
        # unpadded rows) instead of a 4-D mask.
        self.padding_mask = padding_mask
        # The whole batch's labels (PAD_LABEL on the padding) and chunk ids by original padded row, each sample's
        # original padding ([B, 1]), and the original row of each current row (-1 on the padding): what a batched
        # stage reads.
        self.labels, self.chunks, self.offsets = tables
        self.rows = torch.where(valid, torch.arange(width, device=valid.device), -1)
        self.inputs: dict[str, Any] = {}
        self.layer_valid: dict[int, torch.Tensor] = {}  # layer index -> validity of the rows it received
        self.layer_pads: dict[int, list[int]] = {}
        self.handles: list[Any] = []
        self.overhead = 0.0
        self.layer_tokens = self._widths(width)
        self.repacked = False
        self.original_valid, self.original_pads = valid, self.pads
        # A batched stage read at a readout, run by compact at the next layer's entry (_BatchedStage).
        self.deferred: _BatchedStage | None = None
        # The current rows' labels (PAD_LABEL on the padding) and chunk ids (>= 0; None: not made yet): the prompt's
        # tables at first, then as the last batched stage gathered them; None: made from `rows` when a stage needs
        # them (after a re-pack by per-sample stages).
        self._tables: tuple[torch.Tensor, torch.Tensor | None] | None = (self.labels, self.chunks)
        self.nonfinite: list[tuple[int, list[int | None], torch.Tensor]] = []  # the batched stages' flags

    def nonfinite_flags(self) -> list[tuple[int, list[int | None], torch.Tensor]]:
        """Every stage's non-finite flags by batch index (``macer.hf.prefill.raise_if_nonfinite``)."""
        return self.nonfinite + [(layer, [b], flags) for b, sample in enumerate(self.samples)
                                 for layer, _, flags in sample.nonfinite]

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
        return self.deferred is not None or any(s.pending is not None for s in self.samples)

    def stage_at(self, layer: int) -> Any:
        """Some sample's stage at ``layer`` (1-based readout; 0 = before the first layer), or None."""
        return next((stage for s in self.samples if (stage := s.stage_at(layer)) is not None), None)

    def run(self, query: torch.Tensor | None, key: torch.Tensor | None, scale: float | None, eps: float,
            layer: int) -> None:
        """The stages at ``layer`` (1-based readout; 0 = before the first layer): once for the whole batch where
        every one is a fused MACER stage, else each sample's on its own real rows of the readout's queries and
        keys."""
        if query is not None and key is not None and self._run_batched(query, key, scale, eps, layer):
            return
        for b, sample in enumerate(self.samples):
            if sample.stage_at(layer) is None:
                continue
            pad = self.pads[b]
            q = None if query is None else query[b: b + 1, :, pad:]
            k = None if key is None else key[b: b + 1, :, pad:]
            sample.run(q, k, scale, eps)

    def _run_batched(self, query: torch.Tensor, key: torch.Tensor, scale: float | None, eps: float,
                     layer: int) -> bool:
        planned = batch_stage(self.samples, layer, self.pads, self.rows.shape[1])
        if planned is None:
            return False
        mods, rows = planned
        # The samples whose flags count: those whose own stage drops tokens here (a prompt alone runs no device work
        # for a stage that keeps everything, so it has no flag to raise on).
        selected = [b if (st := sample.stage_at(layer)) is not None and st.tokens_after != st.tokens_before else None
                    for b, sample in enumerate(self.samples)]
        for sample in self.samples:
            if sample.stage_at(layer) is not None:
                sample.next += 1
        if all(m.count == m.keep for m in mods):
            return True  # the plans drop nothing here (keep ratio 1): no device work, as for a prompt alone
        lengths = [self.rows.shape[1] - pad - sum(_at(m.count, i) - _at(m.keep, i) for m in mods)
                   for i, pad in enumerate(self.pads)]
        self.deferred = _BatchedStage(layer, mods, rows, query, key, scale, eps, selected, lengths)
        return True

    def _current_tables(self, coverage: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The current rows' labels (``PAD_LABEL`` on the padding) and, for a coverage stage, chunk ids (None
        otherwise): as the last batched stage gathered them, else from the prompt's tables by ``rows``."""
        labels, chunks = self._tables if self._tables is not None else (None, None)
        safe = None
        if labels is None:
            safe = self.rows.clamp(min=0)
            labels = torch.where(self.rows >= 0, self.labels.gather(1, safe), PAD_LABEL)
        if coverage and chunks is None:
            safe = self.rows.clamp(min=0) if safe is None else safe
            chunks = self.chunks.gather(1, safe)  # ids >= 0 (macer.hf.plan.plan_batch)
        self._tables = labels, chunks
        return labels, chunks if coverage else None

    def _run_deferred(self, tensors: list[torch.Tensor], dims: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[torch.Tensor]]:
        """The deferred batched stage: one prepared call scores, selects and gathers the row tables and ``tensors``
        (per-token layer inputs, batch dim before sequence dim ``dims[i]``) into the re-packed layout. Returns the
        ``[B, W]`` keep, its real rows (``keep >= 0``), the new left padding and the compacted tensors."""
        stage, self.deferred = self.deferred, None
        assert stage is not None
        labels, chunks = self._current_tables(any(m.coverage_weight is not None for m in stage.mods))
        tables = [self.rows, labels] + ([] if chunks is None else [chunks])
        gather = [*tables, *tensors]
        gather_dims = [1] * len(tables) + dims
        query, key = stage.query, stage.key
        key_ = ("batch", tuple((m.label, _hashable(m.count), _hashable(m.keep), m.coverage_weight, m.num_chunks)
                               for m in stage.mods),
                tuple((r.start, r.stop) for r in stage.rows), tuple(self.pads), tuple(labels.shape),
                query.shape[1], key.shape[1], query.shape[3], query.dtype, query.device, stage.scale, stage.eps,
                tuple(gather_dims), *((t.shape, t.stride(), t.dtype) for t in gather))
        prepared = cached_prepared(key_, lambda: prepare_stage(
            query, key, labels, stage.mods, chunk_ids=chunks, query_rows=stage.rows, scale=stage.scale,
            eps=stage.eps, padding=self.pads, gather=gather, gather_dims=gather_dims))
        keep, flags, *out = prepared.run(query, key, labels, chunks, gather)
        self.nonfinite.append((stage.layer, stage.selected, flags))
        # The -1 slots of the keep gather zeros: the new padding's rows are -1 and its labels PAD_LABEL again (its
        # chunk ids may stay 0: padding is never a coverage candidate).
        real = keep >= 0
        self.rows = torch.where(real, out[0], -1)
        self._tables = (torch.where(real, out[1], PAD_LABEL), out[2] if len(tables) > 2 else None)
        return keep, real, [keep.shape[1] - n for n in stage.lengths], out[len(tables):]

    def enter(self, index: int) -> None:
        """``layers[index]`` runs on the current layout: remember it (its cache rows)."""
        self.layer_valid[index] = self.valid
        self.layer_pads[index] = self.pads
        for sample in self.samples:
            sample.enter(index)

    def _per_sample_keep(self) -> tuple[torch.Tensor, list[int]]:
        """The ``[B, W]`` keep of stages that ran per sample: each sample's kept rows (in the current sequence),
        right-aligned after -1s, and the new left padding of each sample."""
        device = self.valid.device
        keeps, lengths = [], []
        for b, sample in enumerate(self.samples):
            keep, sample.pending = sample.pending, None
            n = sample.current.numel()
            keep = torch.arange(n, device=device) if keep is None else keep
            keeps.append(keep + self.pads[b])
            lengths.append(keep.numel())
        width = max(lengths)
        pads = [width - n for n in lengths]
        keep = torch.stack([torch.cat([torch.full((p,), -1, dtype=torch.long, device=device), k])
                            for p, k in zip(pads, keeps, strict=True)])
        return keep, pads

    def compact(self, adapter: Any, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]``: re-pack every sample's kept rows, left-padded to the longest (a deferred batched
        stage's one prepared call, or one ``compact_many`` for every per-token tensor), and rebuild the mask for
        the new layout."""
        names, tensors, dims = token_tensors(adapter, args, kwargs, self.inputs or kwargs)
        b = len(self.samples)
        dims = [d % t.dim() for t, d in zip(tensors, dims, strict=True)]
        tensors = [t if t.shape[d - 1] == b else t.expand(*t.shape[:d - 1], b, *t.shape[d:])
                   for t, d in zip(tensors, dims, strict=True)]
        if self.deferred is not None:
            keep, real, pads, compacted = self._run_deferred(tensors, dims)
        else:
            keep, pads = self._per_sample_keep()
            real = keep >= 0
            self.rows = torch.where(real, self.rows.gather(1, keep.clamp(min=0)), -1)
            self._tables = None
            compacted = compact_many(tensors, keep, dims)
        width = keep.shape[1]
        current = self.rows - self.offsets  # each sample's rows as positions of its own prompt (padding < 0)
        for i, sample in enumerate(self.samples):
            sample.current = current[i, pads[i]:]
        hidden, inputs = layer_inputs(adapter, names, compacted)
        inputs["attention_mask"] = real if self.padding_mask else layout_mask(real, width, hidden.dtype, self.boolean)
        adapter.on_stage(kwargs, keep, index)
        self.inputs, self.valid, self.pads, self.repacked = inputs, real, pads, True
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
                # An offloaded cache holds this layer on the CPU: the index goes there (a blocking copy, which also
                # waits for the offload's pending copies of the layer).
                if index.device != layer.keys.device:
                    index = index.to(layer.keys.device)
                # Cache tensors are [B, H, N, D]: gather along N with the batch at dim 0.
                layer.keys = gather_tokens(layer.keys.transpose(1, 2), index, 1).transpose(1, 2)
                layer.values = gather_tokens(layer.values.transpose(1, 2), index, 1).transpose(1, 2)
                valid[i] = self.valid
        return BatchLayout(valid, self.original_valid.shape[1])


def batch_stage(samples: list[PromptPrefill], layer: int, pads: list[int],
                width: int) -> tuple[list[StageModality], list[range]] | None:
    """The batched form of the stages at ``layer``: one ``StageModality`` per selected label with
    per-sample counts and budgets (a sample without a stage there keeps all its tokens of the label), and each
    sample's question rows as a range of the current rows (``question_rows``; ``pads`` and ``width``: the batch's
    current left padding and width). None where the stages cannot run as one prepared stage (not fused, different
    selectors or question lengths, a count the host does not know, or question rows that are not a range of a
    sample's real rows)."""
    stages = [s.stage_at(layer) for s in samples]
    present = [st for st in stages if st is not None]
    if not all(fused(st) for st in present):
        return None
    rules = {(sel.modalities[0], sel.rule, sel.coverage_weight, sel.num_chunks)
             for st in present for sel in st.spec.selections}
    labels = sorted({rule[0] for rule in rules})
    if len(rules) != len(labels) or len({st.query.numel() for st in present}) != 1:
        return None
    counts: dict[int, list[int]] = {m: [] for m in labels}
    keeps: dict[int, list[int]] = {m: [] for m in labels}
    for sample, st in zip(samples, stages, strict=True):
        for m in labels:
            sel = None if st is None else next((x for x in st.spec.selections if x.modalities[0] == m), None)
            count = sample.label_count(m) if sel is None else st.members[st.spec.selections.index(sel)]
            if count is None:
                return None
            counts[m].append(count)
            keeps[m].append(count if sel is None or st.tokens_after == st.tokens_before else sel.k)
    mods = []
    for m in labels:
        _, rule, weight, chunks = next(r for r in rules if r[0] == m)
        coverage = rule == "coverage"
        mods.append(StageModality(m, counts[m], keeps[m], weight if coverage else None,
                                  chunks if coverage else None))
    rows = question_rows(samples, stages, pads, width)
    if rows is None:
        return None
    return mods, rows


def question_rows(samples: list[PromptPrefill], stages: list[Any], pads: list[int],
                  width: int) -> list[range] | None:
    """Each sample's question rows as a range of the current (right-aligned) rows: its stage's rows among the rows
    entering it (``PrefillState.questions``: prompt position p at ``p - (prompt_length - tokens_before)``, since
    every drop lies before the question) after its left padding, i.e. ``W - (prompt_length_b - p)``. A sample
    without a stage here reads the rows of the first that has one (its scores are unused: it keeps all its tokens
    of the stage's labels), or its own last rows where those fall in its padding. None where even those do (a
    sample shorter than the question: the per-sample path then runs)."""
    rows = [None if st is None else range(pad + sample.questions[sample.next].start,
                                          pad + sample.questions[sample.next].stop)
            for sample, st, pad in zip(samples, stages, pads, strict=True)]
    shared = next(r for r in rows if r is not None)
    out = []
    for r, pad in zip(rows, pads, strict=True):
        if r is None:
            r = shared if shared.start >= pad else range(width - len(shared), width)
            if r.start < pad:
                return None
        out.append(r)
    return out


@dataclass
class _BatchedStage:
    """A batched MACER stage between its readout and the next layer's entry: the stage (one ``StageModality`` per
    label, per-sample counts and budgets), each sample's question rows in the current layout, the readout's query
    and key, the samples whose flags count, and each sample's length after the stage."""

    layer: int
    mods: list[StageModality]
    rows: list[range]
    query: torch.Tensor
    key: torch.Tensor
    scale: float | None
    eps: float
    selected: list[int | None]
    lengths: list[int]


def decode_step(layout: BatchLayout, cache: Any, args: tuple, kwargs: dict[str, Any], dtype: torch.dtype,
                boolean: bool, padding_mask: bool = False) -> dict[int, torch.Tensor]:
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
    tail_mask = None
    for i, valid in enumerate(layout.valid):
        if valid is first:
            continue
        if id(valid) not in shared and padding_mask:  # FlashAttention: the layout's 2-D padding mask
            shared[id(valid)] = torch.cat([valid, tail.bool()], dim=1)
        if id(valid) not in shared:
            if tail_mask is None:  # the keys after the prompt, the same for every layout (once per step)
                tail_mask = layout_mask(tail.bool(), queries, dtype, boolean)
            key = (id(valid), dtype, boolean)
            if key not in layout.prompt_masks:
                layout.prompt_masks[key] = mask_values(valid[:, None, None, :], dtype, boolean)
            prompt = layout.prompt_masks[key].expand(-1, -1, queries, -1)
            shared[id(valid)] = torch.cat([prompt, tail_mask], dim=-1)
        out[i] = shared[id(valid)]
    return out


def _at(counts: Counts, i: int) -> int:
    """Sample ``i``'s entry of a ``StageModality`` count or budget (one integer: every sample's)."""
    return counts if isinstance(counts, int) else counts[i]


def _hashable(counts: Counts) -> int | tuple[int, ...]:
    """A ``StageModality`` count or budget as a cache key's part."""
    return counts if isinstance(counts, int) else tuple(counts)
