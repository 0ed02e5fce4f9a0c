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
   ``trim_early_cache``, the dropped tokens are also removed from the earlier layers' caches. Every scored stage
   leaves a device flag "a ranked token's score was not finite" (NaN/inf attention); the prefill's end reads them
   all in one copy and raises an error naming the layer and the sample if one is set (``raise_if_nonfinite``).
5. Decoding: ``generate`` passes explicit positions, so only the mask needs care: a mask tensor sized against
   layer 0's cache gives each layer the columns of its own cache rows (only when the step's mask is materialised:
   eager attention, or a 4-D mask given by the caller). What is fixed is computed at the prefill's end, the layer
   hooks are registered once, and a step's masks are views of the step's own (``_Decode``).

A batch of ``B > 1`` left-padded prompts is planned per sample, runs each MACER stage once for the whole batch and
re-packs the batch after every stage (``macer._batch``). The state of one prefill (plan, device tables, current
rows) is ``macer._prefill``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from macer._attention import ACTIVE, register_names, unregister_names
from macer._batch import BatchLayout, BatchPrefill, decode_step
from macer._prefill import _Clock, _plan, _plan_batch, _Prefill, raise_if_nonfinite
from macer.adapters import Adapter, DecoderParts, get_adapter
from macer.core.families import text_config
from macer.core.policy import Policy
from macer.trace import Trace
from macer_kernels import compact

__all__ = ["SUPPORTED_ATTENTION", "compress"]

SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations the runtime wraps (the user's choice runs unchanged)."""


def compress(model: nn.Module, config: Policy, *, profile: bool = False,
             adapter: Adapter | None = None) -> contextlib.AbstractContextManager[Trace]:
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

    Returns:
        A single-use context manager (one ``with`` block; entering it again is a ``RuntimeError``) whose ``as``
        target is a ``macer.Trace``: budgets, kept tokens, tokens per layer and cache lengths of every prefill
        (``trace.samples``: the last prefill's record per prompt).
    """
    return _Compress(_session(model, config, profile=profile, adapter=adapter))


class _Compress(contextlib.AbstractContextManager):
    """``compress``'s context manager: single use like a generator's, but entering it twice says so (a generator's
    context manager raises an AttributeError from contextlib's internals)."""

    def __init__(self, context: contextlib.AbstractContextManager[Trace]):
        self._context, self._entered = context, False

    def __enter__(self) -> Trace:
        if self._entered:
            raise RuntimeError("macer.compress: this compress(...) object was already used in a with block (it is "
                               "single use); call macer.compress(model, config) again for each block")
        self._entered = True
        return self._context.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._context.__exit__(*exc)


@contextlib.contextmanager
def _session(model: nn.Module, config: Policy, *, profile: bool, adapter: Adapter | None) -> Iterator[Trace]:
    """The body of ``compress``: checks, install, yield the trace, uninstall."""
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
    _check_one_device(parts)
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


def _check_one_device(parts: DecoderParts) -> None:
    """A decoder split over several devices (``device_map`` over GPUs, CPU or disk offload: parameters on ``meta``)
    is refused: the prefill's tables live on the embeddings' device and a stage's rows would index another device's
    tensors."""
    embeddings = getattr(parts.decoder, "get_input_embeddings", lambda: None)()
    modules = [m for m in (embeddings, *parts.layers) if isinstance(m, nn.Module)]
    devices = {p.device for m in modules for p in itertools.islice(m.parameters(), 1)}
    if len(devices) > 1:
        raise ValueError(f"macer.compress: the decoder's embeddings and layers are on several devices "
                         f"({', '.join(sorted(map(str, devices)))}): a model split by device_map (several GPUs, or CPU "
                         "/ disk offload) is not supported; load the model on one device (device_map={'': 'cuda:0'} "
                         "or model.to(device))")


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


def cache_argument(kwargs: dict[str, Any]) -> Any:
    """The KV cache a decoder call received: ``cache=`` (transformers >= 5.24, whose ``generate`` passes it by that
    name) or ``past_key_values=`` (earlier releases). Reading only the old name made every decode step on 5.24 look
    like a new prompt, so nothing was pruned."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries: ``output.cache`` (transformers >= 5.24) or ``output.past_key_values``."""
    cache = getattr(output, "cache", None)
    return getattr(output, "past_key_values", None) if cache is None else cache


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
        # Decode-step hooks, registered once per layer that needs its own mask (at the first decode step that needs
        # them) and kept until the context ends; they act only while ``self.step`` (this step's rule) is set.
        self.decode_hooks: dict[int, Any] = {}
        self.step: Callable[[int, Any], torch.Tensor | None] | None = None
        self.name: str | None = None
        self.guarded: list[tuple[Any, str, Any]] = []
        self.prompt_ids: torch.Tensor | None = None
        self.root_kwargs: dict[str, Any] = {}
        self.state: _Prefill | BatchPrefill | None = None
        # cache object -> what its decode steps need (``_Decode`` for a prompt, ``BatchLayout`` for a batch)
        self.caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
        self.step = None
        for handle in [*self.handles, *self.decode_hooks.values()]:
            handle.remove()
        self.handles.clear()
        self.decode_hooks.clear()
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
        self.step = None
        embeds = kwargs.get("inputs_embeds")
        tokens = embeds if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        batch, length, device = tokens.shape[0], tokens.shape[1], tokens.device
        cache = cache_argument(kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            return self._begin_decode(cache, length, args, kwargs)
        if batch != 1:
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
        self.adapter.on_prefill(kwargs)
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

    def _begin_decode(self, cache, length: int, args, kwargs):
        """A decode step: the decoder's mask and each layer's follow the rows its cache holds. Everything fixed was
        computed at the prefill's end (``_Decode``, ``BatchLayout``); the layers' hooks are registered once."""
        entry = self.caches.get(cache)
        if entry is None:
            return None  # a cache this session did not prune: every layer holds the same rows, nothing to do
        if isinstance(entry, BatchLayout):
            return self._begin_decode_batch(entry, cache, args, kwargs)
        mask = kwargs.get("attention_mask")
        changed = False
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and entry.kept != entry.prompt_length:
            # Layer 0 holds only the kept prompt rows (trim_early_cache, RandomConfig): a 2-D mask over the original
            # prompt must lose the dropped columns to line up with it. A prompt alone has no padding (refused at the
            # prefill), so its prompt columns are all ones and dropping the first ones is that compaction (a view).
            kwargs["attention_mask"] = mask[:, entry.prompt_length - entry.kept:]
            changed = True
        # Only a materialised mask (eager attention, or a 4-D mask / mask dict given by the caller or generate)
        # needs per-layer columns. SDPA builds None for a one-token step of a prompt alone, but a 4-D mask over
        # layer 0's rows for a step of several tokens (a second chat turn on the cache, assisted generation);
        # FlashAttention builds none (its causal alignment is bottom-right, right for every layer's rows).
        given = isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.ndim == 4)
        built = self.base == "eager" or (length > 1 and self.base != "flash_attention_2")
        if entry.cut and (built or given):
            entry.compacted.clear()  # the last step's masks (their ids may be reused)
            self.step = entry.caller_mask if given else entry.built_mask
            self._add_decode_hooks(entry)
        return (args, kwargs) if changed else None

    def _begin_decode_batch(self, layout: BatchLayout, cache: Any, args, kwargs):
        """A decode step on a batch-pruned cache: the decoder's 2-D mask follows layer 0's layout, and every layer
        with another layout gets its own 4-D mask (one per layout, shared by its layers)."""
        masks = decode_step(layout, cache, args, kwargs, self._hidden_dtype(kwargs), self.base != "eager",
                            padding_mask=self.base == "flash_attention_2")
        if masks:
            self.step = lambda index, mask: masks.get(index)
            self._add_decode_hooks(layout)
        return args, kwargs

    def _hidden_dtype(self, kwargs: dict[str, Any]) -> torch.dtype:
        """The dtype of the hidden states entering the layers (an additive mask's dtype): the embeddings', not a
        parameter's (a quantised layer's first parameter is an integer tensor)."""
        embeds = kwargs.get("inputs_embeds")
        if embeds is not None:
            return embeds.dtype
        return self.parts.decoder.get_input_embeddings().weight.dtype

    def _end(self, module, args, kwargs, output):
        """Decoder post-hook: finish a prefill (cache bookkeeping, optional trimming, trace record)."""
        state = self.state
        self._close_prefill()
        self.step = None
        if state is None:
            return None
        cache = output_cache(output)
        cache = cache_argument(kwargs) if cache is None else cache
        start = self.clock.tick()
        raise_if_nonfinite(state.nonfinite_flags())
        entry = state.finish(cache, self.policy.trim_early_cache, len(self.parts.layers))
        if cache is not None and entry is not None:
            self.caches[cache] = entry if isinstance(entry, BatchLayout) else _Decode(*entry)
        records = state.records(cache is not None, entry)
        state.overhead += self.clock.tock(start)
        for record in records:
            record.overhead_s = state.overhead if self.profile else None
        self.trace.add(records)
        return None

    # ---------------------------------------------------------------- prefill
    def readout(self, index: int, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                kwargs: dict[str, Any]) -> None:
        """Inside the attention call of ``layers[index]``: run the stage that reads this layer, if any."""
        state = self.state
        if state is None or state.stage_at(index + 1) is None:
            return
        start = self.clock.tick()
        scale = kwargs.get("scaling") or getattr(module, "scaling", None)
        state.run(query, key, scale, getattr(self.policy, "eps", 0.0), index + 1)
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
            state.run(None, None, None, 0.0, 0)  # a stage before the first layer (no readout)
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
    def _add_decode_hooks(self, entry: _Decode | BatchLayout) -> None:
        """At the first decode step of a cache that needs per-layer masks: register the decode hook of every layer
        whose cache rows differ from layer 0's (once per layer for the whole context; a decode step that needs no
        per-layer mask, e.g. SDPA's, never registers any)."""
        if entry.hooked:
            return
        if isinstance(entry, BatchLayout):
            layers = [i for i, valid in enumerate(entry.valid) if valid is not entry.valid[0]]
        else:
            layers = list(entry.cut)
        for i in layers:
            if i not in self.decode_hooks:
                self.decode_hooks[i] = self.parts.layers[i].register_forward_pre_hook(self._decode_hook(i),
                                                                                     with_kwargs=True)
        entry.hooked = True

    def _decode_hook(self, index: int):
        def hook(module, args, kwargs):
            return None if self.step is None else self._decode_layer(index, args, kwargs)

        return hook

    def _decode_layer(self, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]`` in a decode step: its own mask, if this step's rule gives one."""
        mask = self.step(index, kwargs.get("attention_mask"))
        if mask is None:
            return None
        kwargs["attention_mask"] = mask
        return args, kwargs


class _Decode:
    """What a decode step on a pruned prompt's cache needs, computed once at the prefill's end: the prompt length,
    the prompt rows layer 0 holds, and for every layer holding fewer (``cut``: how many) where its rows lie among
    layer 0's (``own``; layers sharing rows share the tensor)."""

    def __init__(self, rows: list[torch.Tensor], prompt_length: int):
        self.prompt_length, self.kept = prompt_length, rows[0].numel()
        self.cut: dict[int, int] = {}
        self.own: dict[int, torch.Tensor] = {}
        positions: dict[int, torch.Tensor] = {}
        for i, layer_rows in enumerate(rows):
            if layer_rows is rows[0]:
                continue
            if id(layer_rows) not in positions:
                positions[id(layer_rows)] = torch.searchsorted(rows[0], layer_rows)
            self.cut[i] = self.kept - layer_rows.numel()
            self.own[i] = positions[id(layer_rows)]
        self.compacted: dict[tuple[int, int], torch.Tensor] = {}
        self.hooked = False  # its layers' decode hooks are registered

    def built_mask(self, index: int, mask: Any) -> torch.Tensor | None:
        """Layer ``index``'s mask from one transformers built over layer 0's rows from the step's 2-D mask: the
        prompt has no padding, so every prompt column is visible to the step's queries and the layer's columns are
        the last ones (a view; no work per step)."""
        cut = self.cut.get(index)
        if cut is None or not isinstance(mask, torch.Tensor):
            return None
        return mask[..., cut:]

    def caller_mask(self, index: int, mask: Any) -> torch.Tensor | None:
        """Layer ``index``'s columns of a 4-D mask the caller gave (its prompt columns may differ): compacted, once
        per mask and row set in a step."""
        own = self.own.get(index)
        if own is None or not isinstance(mask, torch.Tensor):
            return None
        key = (id(own), id(mask))
        if key not in self.compacted:
            tail = torch.arange(self.kept, mask.shape[-1], device=mask.device)
            self.compacted[key] = compact(mask, torch.cat([own.to(mask.device), tail]), dim=-1)
        return self.compacted[key]


_MISSING = object()
