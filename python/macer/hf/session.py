"""The session of one ``macer.compress`` context: runs a policy's stages inside every prefill of a Hugging Face
decoder.

Model-independent; an adapter (``macer.hf.adapters``) says where the decoder is and how to read a prompt, a policy
(``macer.core.policy``) says what to keep. Procedure (layers counted from 1):

1. The decoder's pre-hook starts a prefill (empty cache) or a decode step. At the start of a prefill the prompt's
   ids, temporal positions and mask come to the host in one copy (none when they are on the CPU), and the host plan
   is made: labels, counts, budget, question rows, chunk ids and the length after every stage
   (``macer.hf.plan``, ``macer.core.policy.plan_prefill``). Only then are the layer pre-hooks and the attention
   wrapper switched on; the prefill's end switches them off again, so decode steps run the model's own code.
2. Inside the attention call of ``layers[l - 1]`` for a stage at layer l, a registered attention function
   (transformers' ``AttentionInterface``, ``macer.hf.attention``) runs the user's backend unchanged and hands the
   post-RoPE queries and keys to ``macer.core.stage.run_stage``, which returns the kept rows with sizes from the plan
   (no host synchronisation).
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
   hooks are registered once, and a step's masks are views of the step's own (``macer.hf.decode``).

A batch of ``B > 1`` left-padded prompts is planned per sample, runs each MACER stage once for the whole batch and
re-packs the batch after every stage (``macer.hf.batch``). The state of one prefill (plan, device tables, current
rows) is ``macer.hf.prefill.PromptPrefill`` around ``macer.core.prefill.PrefillState``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from macer.core.policy import Policy
from macer.hf.adapters import Adapter, DecoderParts
from macer.hf.attention import ACTIVE, register_names, unregister_names
from macer.hf.batch import BatchLayout, BatchPrefill
from macer.hf.cache import cache_argument, output_cache
from macer.hf.compiled import CompiledLayers, check_cache
from macer.hf.decode import DecodeSteps, PromptDecode
from macer.hf.plan import plan_batch, plan_prompt
from macer.hf.prefill import PromptPrefill, raise_if_nonfinite
from macer.hf.trace import Trace

__all__ = ["Session"]


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


class Session(DecodeSteps):
    """One ``compress`` context: the hooks that live for the whole context, the prefill bracket, and the rows each
    cached layer holds (for decoding: ``DecodeSteps``)."""

    def __init__(self, model, policy: Policy, adapter: Adapter, parts: DecoderParts, base: str, profile: bool,
                 end_of_turn: int | None, compile_options: dict[str, Any] | None = None):
        self.model, self.policy, self.adapter, self.parts = model, policy, adapter, parts
        self.base, self.profile, self.end_of_turn = base, profile, end_of_turn
        # compress(..., compile=...): the layers run compiled, but for a prefill's readout layers (macer.hf.compiled)
        self.compiled = None if compile_options is None else CompiledLayers(parts.layers, compile_options,
                                                                             self._eager_layer)
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
        self.state: PromptPrefill | BatchPrefill | None = None
        # cache object -> what its decode steps need (``PromptDecode`` for a prompt, ``BatchLayout`` for a batch)
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
            if self.compiled is not None:
                self.compiled.install()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        self._close_prefill()
        self.step = None
        if self.compiled is not None:
            self.compiled.uninstall()
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
        if self.compiled is not None:
            check_cache(cache)
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
            plan, record = plan_prompt(self, input_ids, kwargs, mask, length)
            state = PromptPrefill(plan, device, record)
            stages = plan.stages
        else:
            state = plan_batch(self, input_ids, root_kwargs, kwargs, mask, batch, length, device)
            stages = [stage for sample in state.samples for stage in sample.plan.stages]
        if stages:
            first = min(stage.spec.layer for stage in stages)
            for i in range(first, len(self.parts.layers)):
                hook = self._layer_hook(i)
                state.handles.append(self.parts.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
            if any(s.spec.needs_scores for s in stages) and self.compiled is None:
                # Compiled layers keep the user's implementation; a readout layer switches for its own call.
                self.parts.attn_config._attn_implementation = self.name
        self.state = state
        state.overhead += self.clock.tock(start)
        return None

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
            self.caches[cache] = entry if isinstance(entry, BatchLayout) else PromptDecode(*entry)
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

    def _eager_layer(self, index: int):
        """With compiled layers: how ``layers[index]`` runs eagerly in this prefill, or None (compiled). A layer whose
        attention a stage reads runs its own forward with the tapped attention for that call."""
        state = self.state
        stage = None if state is None else state.stage_at(index + 1)
        if stage is None or not stage.spec.needs_scores:
            return None
        return self._readout_call

    def _readout_call(self, forward, args: tuple, kwargs: dict[str, Any]):
        config = self.parts.attn_config
        config._attn_implementation = self.name
        try:
            return forward(*args, **kwargs)
        finally:
            config._attn_implementation = self.base

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


_MISSING = object()
