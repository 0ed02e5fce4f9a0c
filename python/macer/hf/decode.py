"""Decode steps on a cache that a pruned prefill filled: every layer's cache holds the rows that layer ran on, so a
step's attention mask must follow them. What is fixed is computed once, at the prefill's end (``PromptDecode`` for
a prompt, ``macer.hf.batch.BatchLayout`` for a batch); the layers' decode hooks are registered once per context;
a step's masks are views of the step's own (a prompt) or built once per layout (a batch).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from macer.hf.adapters import DecoderParts
from macer.hf.batch import BatchLayout, decode_step
from macer_kernels import compact

__all__ = ["DecodeSteps", "PromptDecode"]


class DecodeSteps:
    """The decode half of a compress session (``macer.hf.session.Session`` holds one as ``decode``): at a decode step
    on a pruned cache, the decoder's mask and each layer's follow the rows its cache holds.

    ``caches``: cache object -> what its decode steps need (``PromptDecode`` for a prompt, ``BatchLayout`` for a
    batch), filled at each prefill's end. ``decode_hooks``: registered once per layer that needs its own mask (at the
    first decode step that needs them) and kept until ``remove``; they act only while ``step`` (this step's rule) is
    set, which ``end_step`` clears."""

    def __init__(self, parts: DecoderParts, base: str):
        self.parts, self.base = parts, base
        self.caches: weakref.WeakKeyDictionary[Any, PromptDecode | BatchLayout] = weakref.WeakKeyDictionary()
        self.decode_hooks: dict[int, Any] = {}
        self.step: Callable[[int, Any], torch.Tensor | None] | None = None

    def end_step(self) -> None:
        """No step's rule: the layers' decode hooks do nothing until the next decode step sets one."""
        self.step = None

    def remove(self) -> None:
        """The context's end: the layers' decode hooks removed."""
        self.step = None
        for handle in self.decode_hooks.values():
            handle.remove()
        self.decode_hooks.clear()

    def begin(self, cache, length: int, args, kwargs):
        """A decode step: the decoder's mask and each layer's follow the rows its cache holds. Everything fixed was
        computed at the prefill's end (``PromptDecode``, ``BatchLayout``); the layers' hooks are registered once."""
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
        decoder: Any = self.parts.decoder  # a transformers model: get_input_embeddings is a method
        return decoder.get_input_embeddings().weight.dtype

    def _add_decode_hooks(self, entry: PromptDecode | BatchLayout) -> None:
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
            return self._decode_layer(index, args, kwargs)

        return hook

    def _decode_layer(self, index: int, args: tuple, kwargs: dict[str, Any]):
        """Before ``layers[index]`` in a decode step: its own mask, if this step's rule gives one."""
        mask = None if self.step is None else self.step(index, kwargs.get("attention_mask"))
        if mask is None:
            return None
        kwargs["attention_mask"] = mask
        return args, kwargs


class PromptDecode:
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
