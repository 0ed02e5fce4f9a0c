"""The runtime: runs a policy's stages inside every prefill of a Hugging Face decoder (``macer.compress``).

Model-independent; an adapter (``macer.adapters``) says where the decoder is and how to read a prompt, a policy
(``macer.policy``) says what to keep. Procedure (layers counted from 1):

1. The decoder's pre-hook starts a prefill (empty cache) or a decode step. At the start of a prefill the prompt's
   ids, temporal positions and mask come to the host in one copy (none when they are on the CPU), and the host plan
   is made: labels, counts, budget, question rows, chunk ids and the length after every stage
   (``macer.policy.plan_prefill``). Only then are the layer pre-hooks and the attention wrapper switched on; the
   prefill's end switches them off again, so decode steps run the model's own code.
2. Inside the attention call of ``layers[l - 1]`` for a stage at layer l, a registered attention function
   (transformers' ``AttentionInterface``) runs the user's backend unchanged and hands the post-RoPE queries and keys
   to ``macer.policy.run_stage``, which returns the kept rows with sizes from the plan (no host synchronisation).
3. A forward pre-hook on ``layers[l]`` compacts, in one ``compact_many``: the hidden states, RoPE ``cos``/``sin``
   and per-token position ids; the 4-D attention mask is compacted along queries and keys (for a causal mask over a
   sorted subset this *is* the causal mask of the shorter sequence; SDPA's ``None`` mask stays ``None``). Text is
   never dropped, order is preserved, and every later layer receives the compacted tensors. A stage at layer 0
   (``RandomConfig``) compacts before ``layers[0]``.
4. Layers keep the KV cache of the sequence they saw (the paper's single pass). After prefill, with
   ``trim_early_cache``, the dropped tokens are also removed from the earlier layers' caches.
5. Decoding: ``generate`` passes explicit positions, so only the mask needs care: a mask tensor sized against
   layer 0's cache is compacted along keys to each layer's own cache rows (hooks installed for that step only, and
   only when the step's mask is materialised: eager attention, or a 4-D mask given by the caller).

A batch of ``B > 1`` left-padded prompts follows the same steps per sample and re-packs the batch after every stage
(``macer._batch``).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from macer._attention import ACTIVE, register_names, unregister_names
from macer._batch import BatchLayout, BatchPrefill, check_left_padding, decode_step
from macer.adapters import Adapter, DecoderParts, get_adapter, text_config
from macer.policy import AUDIO, MODALITY_NAMES, VISUAL, Plan, Policy, PromptFacts, plan_prefill, run_stage
from macer.trace import PrefillRecord, Stage, Trace
from macer_kernels import PAD_LABEL, compact, compact_many

__all__ = ["SUPPORTED_ATTENTION", "compress"]

SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations the runtime wraps (the user's choice runs unchanged)."""


@contextlib.contextmanager
def compress(model: nn.Module, config: Policy, *, profile: bool = False,
             adapter: Adapter | None = None) -> Iterator[Trace]:
    """Run a selection policy's staged pruning in every prefill of ``model`` inside the ``with`` block.

    ``model(**inputs)`` and ``model.generate(**inputs)`` work as usual, for one prompt or a left-padded batch (each
    prompt planned, scored and selected as if alone, the batch re-packed after every stage: ``macer._batch``); each
    prefill is pruned on its own, decoding runs on the compacted caches, and leaving the block (also by an exception)
    restores the model exactly: hooks removed, attention implementation restored, nothing else touched.

    Args:
        model: a model whose ``config.model_type`` has an adapter (``macer.supported_model_types()``).
        config: a policy: ``MacerConfig`` (MACER), ``FastVConfig``, ``RandomConfig``, ``FullConfig``, or any
            ``macer.make_policy(name)``. Its layers must lie in the decoder (checked here).
        profile: synchronise the device around MACER's own work and record it in ``PrefillRecord.overhead_s``.
        adapter: use this adapter instead of the one registered for the model type, e.g.
            ``macer.LabelledAdapter(labels, ...)`` for any decoder called with ``inputs_embeds``.

    Yields:
        ``macer.Trace``: budgets, kept tokens, tokens per layer and cache lengths of every prefill
        (``trace.samples``: the last prefill's record per prompt).
    """
    if not isinstance(config, Policy):
        raise TypeError(f"macer.compress: config must be a policy (macer.MacerConfig, FastVConfig, RandomConfig, "
                        f"FullConfig or macer.make_policy(name)), got {type(config).__name__}")
    if adapter is None:
        adapter = get_adapter(model)
    elif not isinstance(adapter, Adapter):
        raise TypeError(f"macer.compress: adapter must be a macer.adapters.Adapter (e.g. macer.LabelledAdapter), got "
                        f"{type(adapter).__name__}")
    parts = adapter.parts(model)
    config.check_depth(len(parts.layers))
    if any(id(module) in ACTIVE for layer in parts.layers for module in layer.modules()):
        raise ValueError("macer.compress: this model is already inside a macer.compress context")
    base = parts.attn_config._attn_implementation
    if base not in SUPPORTED_ATTENTION:
        raise ValueError(f"macer.compress: attention implementation {base!r} is not supported; "
                         f"supported: {list(SUPPORTED_ATTENTION)}")
    layer_types = getattr(parts.attn_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"macer.compress: only full-attention decoders are supported, got layer_types "
                         f"{sorted(set(layer_types))} (sliding-window caches cannot be compacted)")
    end_of_turn = _end_of_turn(model, adapter, config)
    session = _Session(model, config, adapter, parts, base, profile, end_of_turn)
    session.install()
    try:
        yield session.trace
    finally:
        session.uninstall()


def _end_of_turn(model: nn.Module, adapter: Adapter, policy: Policy) -> int | None:
    """The policy's end-of-turn id, else the adapter's; an id outside the vocabulary is refused here."""
    eot = policy.end_of_turn_token_id
    if eot is None:
        return adapter.end_of_turn_token_id(model)
    vocab = getattr(text_config(model), "vocab_size", None)
    if isinstance(vocab, int) and eot >= vocab:
        raise ValueError(f"macer.compress: end_of_turn_token_id={eot} is outside this model's vocabulary "
                         f"(vocab_size={vocab}); pass the id of the token that closes the user's question, or "
                         f"leave it None for the model's own ({adapter.end_of_turn_token_id(model)})")
    return eot


def _to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Bring 1-D tensors to the CPU in one device-to-host copy (none for tensors already there)."""
    remote = [t for t in tensors if t is not None and t.device.type != "cpu"]
    if not remote:
        return list(tensors)
    dtype = torch.float64 if any(t.is_floating_point() for t in remote) else torch.int64
    packed = torch.cat([t.reshape(-1).to(dtype) for t in remote]).cpu()  # the prefill's one device read
    out, offset = [], 0
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        piece = packed[offset: offset + t.numel()]
        out.append(piece if t.is_floating_point() else piece.long())
        offset += t.numel()
    return out


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Upload the plan's int64 tables in one host-to-device copy (asynchronous from pinned memory)."""
    if device.type == "cpu" or not tensors:
        return tensors
    packed = torch.cat([t.reshape(-1).long() for t in tensors])
    packed = packed.pin_memory() if torch.cuda.is_available() else packed
    packed = packed.to(device, non_blocking=True)
    return list(torch.split(packed, [t.numel() for t in tensors]))


def _plan(session: _Session, input_ids: torch.Tensor | None, kwargs: dict[str, Any], mask: torch.Tensor | None,
          length: int) -> tuple[Plan, PrefillRecord]:
    """The host plan of a prefill and its trace record: the prompt's ids, temporal row and mask come to the host in
    one copy, everything else is computed there."""
    temporal = session.adapter.temporal_positions(kwargs, length)
    ids, temporal, mask = _to_host(None if input_ids is None else input_ids[0],
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
    ids, temporal, host_mask = _to_host(input_ids, temporal, mask if isinstance(mask, torch.Tensor) else None)
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
    on_device = _to_device([batch_labels, batch_chunks, torch.tensor(pads)[:, None]], device)
    tables = tuple(t.reshape(batch, -1) for t in on_device)
    return BatchPrefill(samples, pads, length, valid, boolean=session.base != "eager", tables=tables)


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


class _Prefill:
    """One prefill pass through the decoder: its host plan, device tables and the rows currently in the sequence."""

    def __init__(self, plan: Plan, device: torch.device, record: PrefillRecord):
        self.plan, self.record = plan, record
        n = plan.facts.length
        host = [plan.facts.labels, *(stage.query for stage in plan.stages)]
        host += [pick for stage in plan.stages for pick in stage.picks if pick is not None]
        host += [plan.chunks] if plan.chunks is not None else []
        tables = iter(_to_device(host, device))
        self.labels = next(tables)
        self.queries = [next(tables) for _ in plan.stages]
        self.picks = [tuple(next(tables) if p is not None else None for p in stage.picks) for stage in plan.stages]
        self.chunks = next(tables) if plan.chunks is not None else None
        self.full = torch.arange(n, device=device)
        self.current = self.full
        # Host numbers a batched stage needs, read from the host plan now (nothing is read in the layers).
        self.question_rows = [stage.query.tolist() for stage in plan.stages]
        labels = {AUDIO, VISUAL} | {m for stage in plan.stages for sel in stage.spec.selections for m in sel.modalities}
        self.counts = {m: plan.facts.count(m) for m in labels}
        self.next = 0  # index of the next stage to run
        self.pending: torch.Tensor | None = None  # rows of the current sequence to keep, applied at the next layer
        self.inputs: dict[str, Any] = {}  # compacted per-token layer kwargs after the last applied stage
        self.layer_rows: dict[int, torch.Tensor] = {}  # rows present at each hooked layer (= its cache rows)
        self.handles: list[Any] = []
        self.overhead = 0.0

    @property
    def layer_tokens(self) -> list[int]:
        return self.plan.layer_tokens

    def has_pending(self) -> bool:
        return self.pending is not None

    def enter(self, index: int) -> None:
        """``layers[index]`` runs on the current rows (they become its cache rows)."""
        self.layer_rows[index] = self.current

    def stage_at(self, layer: int):
        """The next stage if it reads (or, at 0, applies before) decoder layer index ``layer``."""
        if self.next < len(self.plan.stages) and self.plan.stages[self.next].spec.layer == layer:
            return self.plan.stages[self.next]
        return None

    def label_count(self, label: int) -> int | None:
        """Tokens of ``label`` in the current rows, from the plan (None after a joint selection over it: its share
        of the joint budget is data-dependent)."""
        count = self.counts[label]
        for stage in self.plan.stages[: self.next]:
            for sel in stage.spec.selections:
                if label in sel.modalities:
                    if len(sel.modalities) > 1:
                        return None
                    count = sel.k if stage.tokens_after != stage.tokens_before else count
        return count

    def run(self, query: torch.Tensor | None, key: torch.Tensor | None, scale: float | None, eps: float) -> None:
        stage, i = self.plan.stages[self.next], self.next
        self.next += 1
        if stage.tokens_after == stage.tokens_before:
            return  # the plan says nothing is dropped (keep ratio 1): no device work
        self.pending = run_stage(stage, query, key, self.current, self.labels, self.chunks, self.queries[i],
                                 self.picks[i], scale=scale, eps=eps)


    def compact(self, adapter: Adapter, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]``: keep the pending rows of every per-token input (one ``compact_many``)."""
        keep, self.pending = self.pending, None
        hidden = args[0] if args else kwargs["hidden_states"]
        source = self.inputs or kwargs
        cos, sin = source[adapter.position_embeddings_kwarg]
        names, tensors, dims = ["hidden_states", "cos", "sin"], [hidden, cos, sin], [1, 1, 1]
        for name, dim in adapter.layer_token_kwargs.items():
            if isinstance(source.get(name), torch.Tensor):
                names.append(name)
                tensors.append(source[name])
                dims.append(dim)
        out = dict(zip(names, compact_many(tensors, keep, dims), strict=True))
        inputs = {adapter.position_embeddings_kwarg: (out.pop("cos"), out.pop("sin"))}
        hidden = out.pop("hidden_states")
        inputs.update(out)
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


class _Session:
    """One ``compress`` context: the hooks that live for the whole context, the prefill bracket, and the rows each
    cached layer holds (for decoding)."""

    def __init__(self, model, policy: Policy, adapter: Adapter, parts: DecoderParts, base: str, profile: bool,
                 end_of_turn: int | None):
        self.model, self.policy, self.adapter, self.parts = model, policy, adapter, parts
        self.base, self.profile, self.end_of_turn = base, profile, end_of_turn
        self.clock = _Clock(profile)
        self.trace = Trace()
        self.handles: list[Any] = []
        self.step_handles: list[Any] = []
        self.name: str | None = None
        self.guarded: list[tuple[Any, str, Any]] = []
        self.prompt_ids: torch.Tensor | None = None
        self.root_kwargs: dict[str, Any] = {}
        self.state: _Prefill | BatchPrefill | None = None
        # cache object -> (prompt rows held by each layer, prompt length): decode sizes masks per layer from them
        self.caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.decode_rows: list[torch.Tensor] | None = None
        self.decode_masks: dict[tuple[int, int], torch.Tensor] = {}

    # ---------------------------------------------------------------- install / uninstall
    def install(self) -> None:
        try:
            self.name = register_names(self.base)
            for i, layer in enumerate(self.parts.layers):
                for module in layer.modules():
                    if hasattr(module, "layer_idx"):
                        ACTIVE[id(module)] = (self, i)
            for outer in self.parts.outer:
                self.handles.append(outer.register_forward_pre_hook(self._outer_hook, with_kwargs=True))
            self.handles.append(self.parts.root.register_forward_pre_hook(self._root_hook, with_kwargs=True))
            self.handles.append(self.parts.decoder.register_forward_pre_hook(self._begin, with_kwargs=True))
            self.handles.append(self.parts.decoder.register_forward_hook(self._end, with_kwargs=True))
            for obj, attr, value in self.adapter.guards(self.model):
                self.guarded.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
                obj.__dict__[attr] = value
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        self._close_prefill()
        self._close_step()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for obj, attr, value in reversed(self.guarded):
            if value is _MISSING:
                obj.__dict__.pop(attr, None)
            else:
                obj.__dict__[attr] = value
        self.guarded.clear()
        for layer in self.parts.layers:
            for module in layer.modules():
                if ACTIVE.get(id(module), (None,))[0] is self:
                    del ACTIVE[id(module)]
        if self.name is not None:
            unregister_names(self.name)
            self.name = None

    def _close_prefill(self) -> None:
        """Switch the prefill machinery off (also after a prefill that ended in an exception)."""
        if self.state is not None:
            for handle in self.state.handles:
                handle.remove()
            self.state = None
        self.parts.attn_config._attn_implementation = self.base

    def _close_step(self) -> None:
        for handle in self.step_handles:
            handle.remove()
        self.step_handles.clear()

    # ---------------------------------------------------------------- context-long hooks
    def _outer_hook(self, module, args, kwargs):
        if kwargs.get("labels") is not None:
            raise ValueError("macer.compress: labels (a training loss) are not supported; a pruned prefill returns "
                             "logits for the kept tokens only. Call the model outside compress for a loss.")

    def _root_hook(self, module, args, kwargs):
        self.prompt_ids = kwargs.get("input_ids", args[0] if args else None)
        self.root_kwargs = kwargs

    def _begin(self, module, args, kwargs):
        """Decoder pre-hook: start a prefill (empty cache) or a decode step (non-empty cache)."""
        input_ids, self.prompt_ids = self.prompt_ids, None
        root_kwargs, self.root_kwargs = self.root_kwargs, {}
        self._close_prefill()
        self._close_step()
        self.decode_rows = None
        self.decode_masks.clear()
        embeds = kwargs.get("inputs_embeds")
        tokens = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        batch, length, device = tokens.shape[0], tokens.shape[1], tokens.device
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:
            return self._begin_decode(cache, args, kwargs)
        if batch != 1:
            if self.base == "flash_attention_2":
                raise ValueError(f"macer.compress: a batch of {batch} prompts runs with attn_implementation 'sdpa' or "
                                 "'eager'; flash_attention_2 takes batch size 1 under compress")
            if not self.adapter.batch_ready:
                raise ValueError(f"macer.compress: the {type(self.adapter).__name__} adapter does not support a batch "
                                 f"of {batch} prompts yet; run them one at a time")
        if cache is not None and getattr(cache, "is_compileable", False):
            raise ValueError(f"macer.compress: {type(cache).__name__} is not supported (static caches cannot hold "
                             "layers of different lengths); use the default DynamicCache")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            raise ValueError("macer.compress: precomputed attention-mask dicts are not supported; pass a 2-D mask")
        if isinstance(mask, torch.Tensor) and mask.ndim != 2:
            raise ValueError(f"macer.compress: attention_mask must be 2-D [1, N], got shape {tuple(mask.shape)}")
        start = self.clock.tick()
        if input_ids is not None and input_ids.shape[-1] != length:
            input_ids = None
        if batch == 1:
            plan, record = _plan(self, input_ids, kwargs, mask, length)
            state = _Prefill(plan, device, record)
            stages = plan.stages
        else:
            state = _plan_batch(self, input_ids, root_kwargs, kwargs, mask, batch, length, device)
            stages = [stage for sample in state.samples for stage in sample.plan.stages]
        if stages:
            first = min(stage.spec.layer for stage in stages)
            for i in range(first, len(self.parts.layers)):
                hook = self._layer_hook(i)
                state.handles.append(self.parts.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
            if any(s.spec.needs_scores for s in stages):
                self.parts.attn_config._attn_implementation = self.name
        self.state = state
        state.overhead += self.clock.tock(start)
        return None

    def _begin_decode(self, cache, args, kwargs):
        entry = self.caches.get(cache)
        if entry is None:
            return None  # a cache this session did not prune: every layer holds the same rows, nothing to do
        if isinstance(entry, BatchLayout):
            return self._begin_decode_batch(entry, cache, args, kwargs)
        rows, prompt_len = entry
        mask = kwargs.get("attention_mask")
        changed = False
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and rows[0].numel() != prompt_len:
            # Layer 0 holds only the kept prompt rows (trim_early_cache, RandomConfig): a 2-D mask over the original
            # prompt must lose the dropped columns to line up with it.
            tail = torch.arange(prompt_len, mask.shape[-1], device=mask.device)
            kwargs["attention_mask"] = compact(mask, torch.cat([rows[0].to(mask.device), tail]), dim=-1)
            changed = True
        # Only a materialised mask (eager attention, or a 4-D mask / mask dict given by the caller or generate)
        # needs per-layer columns; SDPA and FlashAttention build None for a batch-1 decode step without padding.
        if self.base == "eager" or isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.ndim == 4):
            self.decode_rows = rows
            for i, layer in enumerate(self.parts.layers):
                if rows[i] is not rows[0]:
                    self.step_handles.append(layer.register_forward_pre_hook(self._decode_hook(i), with_kwargs=True))
        return (args, kwargs) if changed else None

    def _begin_decode_batch(self, layout: BatchLayout, cache: Any, args, kwargs):
        """A decode step on a batch-pruned cache: the decoder's 2-D mask follows layer 0's layout, and every layer
        with another layout gets its own 4-D mask (hooks for this step only)."""
        dtype = next(self.parts.layers[0].parameters()).dtype
        masks = decode_step(layout, cache, args, kwargs, dtype, self.base != "eager")
        for i, layer in enumerate(self.parts.layers):
            if i in masks:
                self.step_handles.append(layer.register_forward_pre_hook(_set_mask(masks[i]), with_kwargs=True))
        return args, kwargs

    def _end(self, module, args, kwargs, output):
        """Decoder post-hook: finish a prefill (cache bookkeeping, optional trimming, trace record)."""
        state = self.state
        self._close_prefill()
        self._close_step()
        if state is None:
            return None
        cache = getattr(output, "past_key_values", None)
        cache = kwargs.get("past_key_values") if cache is None else cache
        if isinstance(state, BatchPrefill):
            self._end_batch(state, cache)
            return None
        start = self.clock.tick()
        record, plan = state.record, state.plan
        n = plan.facts.length
        rows = [state.layer_rows.get(i, state.full) for i in range(len(self.parts.layers))]
        if cache is not None and state.current is not state.full:
            final = state.current
            if self.policy.trim_early_cache:
                for i, layer_rows in enumerate(rows):
                    if layer_rows is not final:
                        keep = torch.searchsorted(layer_rows, final)
                        layer = cache.layers[i]
                        layer.keys, layer.values = compact_many([layer.keys, layer.values], keep, [-2, -2])
                rows = [final] * len(rows)
            self.caches[cache] = (rows, n)
        if cache is not None:
            record.cache_lengths = [int(layer.get_seq_length()) for layer in cache.layers[: len(self.parts.layers)]]
        record.kept_positions = None if state.current is state.full else state.current
        state.overhead += self.clock.tock(start)
        record.overhead_s = state.overhead if self.profile else None
        self.trace.add([record])
        return None

    def _end_batch(self, state: BatchPrefill, cache: Any) -> None:
        start = self.clock.tick()
        layout = state.finish(cache, self.policy.trim_early_cache, len(self.parts.layers))
        if cache is not None and layout is not None:
            self.caches[cache] = layout
        records = state.records(cache is not None, layout)
        state.overhead += self.clock.tock(start)
        for record in records:
            record.overhead_s = state.overhead if self.profile else None
        self.trace.add(records)

    # ---------------------------------------------------------------- prefill
    def readout(self, index: int, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                kwargs: dict[str, Any]) -> None:
        """Inside the attention call of ``layers[index]``: run the stage that reads this layer, if any."""
        state = self.state
        if state is None or state.stage_at(index + 1) is None:
            return
        start = self.clock.tick()
        scale = kwargs.get("scaling") or getattr(module, "scaling", None)
        if isinstance(state, BatchPrefill):
            state.run(query, key, scale, getattr(self.policy, "eps", 0.0), index + 1)
        else:
            state.run(query, key, scale, getattr(self.policy, "eps", 0.0))
        state.overhead += self.clock.tock(start)

    def _layer_hook(self, index: int):
        def hook(module, args, kwargs):
            return self._prefill_layer(index, args, kwargs)

        return hook

    def _prefill_layer(self, index: int, args: tuple, kwargs: dict[str, Any]):
        state = self.state
        if state is None:
            return None
        if state.stage_at(0) is not None and index == 0:
            start = self.clock.tick()
            if isinstance(state, BatchPrefill):  # a stage before the first layer (no readout)
                state.run(None, None, None, 0.0, 0)
            else:
                state.run(None, None, None, 0.0)
            state.overhead += self.clock.tock(start)
        if state.has_pending():
            start = self.clock.tick()
            args, kwargs = state.compact(self.adapter, index, args, kwargs)
            state.overhead += self.clock.tock(start)
        if state.inputs:
            kwargs.update(state.inputs)
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] != state.layer_tokens[index]:
            raise RuntimeError(f"macer: layer {index + 1} received {hidden.shape[1]} tokens, the plan says "
                               f"{state.layer_tokens[index]} (please report this)")
        state.enter(index)
        return args, kwargs

    # ---------------------------------------------------------------- decode
    def _decode_hook(self, index: int):
        def hook(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            rows = self.decode_rows
            if not isinstance(mask, torch.Tensor) or rows is None:
                return None
            key = (id(rows[index]), id(mask))
            if key not in self.decode_masks:
                base = rows[0].to(mask.device)
                own = torch.searchsorted(base, rows[index].to(mask.device))
                tail = torch.arange(base.numel(), mask.shape[-1], device=mask.device)
                self.decode_masks[key] = compact(mask, torch.cat([own, tail]), dim=-1)
            kwargs["attention_mask"] = self.decode_masks[key]
            return args, kwargs

        return hook


def _set_mask(mask: torch.Tensor):
    def hook(module, args, kwargs):
        kwargs["attention_mask"] = mask
        return args, kwargs

    return hook


_MISSING = object()
