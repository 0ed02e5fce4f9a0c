"""Regional ``torch.compile`` of a decoder's layers inside a ``compress`` context (``compile=True``).

Eager transformers spends about 1.3 ms of host time per decoder layer on a 7B model (the H200 run,
``benchmarks/results/h200-2026-11-27``): after MACER's stages shorten the sequence, the GPU waits on the host and a
2.4k-clip prefill cannot pass ~1.4x. Compiling each layer removes most of that host time; MACER's own work stays
outside the compiled regions:

* **What is compiled.** Each decoder layer's own ``forward`` (the model class's, below transformers' gradient-
  checkpointing wrapper), with ``dynamic=True``: every sequence length is a symbol, so prompts of any length and the
  layers after a stage (shorter sequences, caches of other lengths) run the same graphs. One compiled function serves
  every layer of the decoder: the parameters are graph inputs, so the layers share graphs (one for a prefill, one
  for a decode step on a filled cache).
* **What is not.** The layers' forward pre-hooks (the stages' compaction, the decode steps' masks) run around the
  compiled function, eagerly; so do the decoder's hooks (planning, records) and the layers that a running prefill
  reads a stage's scores from (their attention calls MACER's readout, a host-planned device stage): those layers run
  their eager forward with the tapped attention switched on for that call only, so the compiled layers always see
  the user's attention implementation and never recompile for it.
* **The KV cache.** A layer updates ``past_key_values.update(k, v, self.layer_idx)``, whose indexing by layer makes
  Dynamo specialise on the layer index (one graph per layer, past its recompile limit of 8). Each compiled call gets
  ``LayerCache``, a view of its own cache layer that ignores the index, instead. Supported: transformers'
  ``DynamicCache`` (the default) without offloading; another cache is refused when a prefill starts.
* **Compiled code is kept per decoder and options** (a weak map): the next ``compress(..., compile=True)`` on the same
  model reuses the graphs. Leaving the context removes the layers' ``forward`` attributes; weights are never touched.
"""

from __future__ import annotations

import json
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["COMPILE_OPTIONS", "CompiledLayers", "LayerCache", "check_cache", "compile_options"]

COMPILE_OPTIONS = ("backend", "mode", "options", "fullgraph")
"""The ``torch.compile`` arguments ``compress(..., compile={...})`` passes on (``dynamic`` is always True)."""

_GRAPHED_MODES = ("reduce-overhead", "max-autotune")

_COMPILED: weakref.WeakKeyDictionary[nn.Module, dict[str, Callable]] = weakref.WeakKeyDictionary()
_serial = 0


def compile_options(value: object) -> dict[str, Any] | None:
    """``compress``'s ``compile`` argument as ``torch.compile`` keyword arguments (None: not compiled)."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"macer.compress: compile must be True, False or a dict of torch.compile arguments "
                        f"{list(COMPILE_OPTIONS)}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(COMPILE_OPTIONS))
    if unknown:
        hint = " (dynamic is always True: the sequence length is a symbol)" if "dynamic" in unknown else ""
        raise ValueError(f"macer.compress: compile got unknown torch.compile arguments {unknown}; allowed: "
                         f"{list(COMPILE_OPTIONS)}{hint}")
    if value.get("mode") in _GRAPHED_MODES:
        raise ValueError(f"macer.compress: compile mode {value['mode']!r} records CUDA graphs, which a compacted, "
                         "growing DynamicCache cannot use (a graph per length, outputs overwritten by the next "
                         "replay); use mode=None, 'default' or 'max-autotune-no-cudagraphs'")
    return dict(value)


def check_cache(cache: Any) -> None:
    """Refuse a cache the compiled layers cannot index one layer at a time (``LayerCache``)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if cache is None:
        return
    plain = type(cache).update is DynamicCache.update and not getattr(cache, "offloading", False)
    if not plain or not all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", ())):
        raise ValueError(f"macer.compress(compile=True) supports transformers' DynamicCache without offloading (the "
                         f"default), got {type(cache).__name__}"
                         f"{' with offloading' if getattr(cache, 'offloading', False) else ''}; pass no cache or a "
                         "DynamicCache, or use compile=False")


class LayerCache:
    """One layer of a ``DynamicCache`` as the compiled layer sees it: ``update(k, v, layer_idx)`` appends to this
    layer and ignores ``layer_idx`` (so no graph depends on it). Anything else is read from the whole cache."""

    def __init__(self, cache: Any, index: int):
        replicate = getattr(cache, "layer_class_to_replicate", None)  # a DynamicCache made without a config
        while replicate is not None and len(cache.layers) <= index:
            cache.layers.append(replicate())
        self.cache, self.layer = cache, cache.layers[index]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def _layer_call(forward: Callable, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return forward(layer, *args, **kwargs)


def _compiled_for(layers: nn.ModuleList, options: dict[str, Any]) -> Callable:
    """The compiled layer call of this decoder and options, made once. Each gets its own code object: Dynamo keeps
    compiled graphs (and counts recompiles, up to its limit) per code object, so one model's graphs never crowd out
    another's."""
    global _serial
    key = json.dumps(options, sort_keys=True, default=repr)
    per_decoder = _COMPILED.setdefault(layers, {})
    if key not in per_decoder:
        _serial += 1
        code = _layer_call.__code__.replace(co_name=f"macer_layer_{_serial}")
        fn = types.FunctionType(code, _layer_call.__globals__, f"macer_layer_{_serial}")
        per_decoder[key] = torch.compile(fn, dynamic=True, **options)
    return per_decoder[key]


def _own_forward(layer: nn.Module) -> Callable:
    """The layer class's forward, below transformers' gradient-checkpointing wrapper (inference: no checkpointing)."""
    forward = type(layer).forward
    return getattr(forward, "__wrapped__", forward)


class CompiledLayers:
    """The decoder's layers compiled for one ``compress`` context: each layer's ``forward`` is shadowed by an instance
    attribute that calls the compiled function, or, when ``eager(index)`` gives a function, that function on the
    layer's own eager forward (a readout layer of the running prefill)."""

    def __init__(self, layers: nn.ModuleList, options: dict[str, Any],
                 eager: Callable[[int], Callable[[Callable, tuple, dict], Any] | None]):
        self.layers, self.options, self.eager = layers, options, eager
        self.saved: list[tuple[nn.Module, Any]] = []

    def install(self) -> None:
        compiled = _compiled_for(self.layers, self.options)
        for index, layer in enumerate(self.layers):
            self.saved.append((layer, layer.__dict__.get("forward", _MISSING)))
            layer.__dict__["forward"] = self._dispatch(index, layer, compiled)

    def uninstall(self) -> None:
        for layer, saved in reversed(self.saved):
            if saved is _MISSING:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = saved
        self.saved.clear()

    def _dispatch(self, index: int, layer: nn.Module, compiled: Callable) -> Callable:
        own, eager_forward = _own_forward(layer), type(layer).forward.__get__(layer)

        def forward(*args: Any, **kwargs: Any) -> Any:
            run_eager = self.eager(index)
            if run_eager is not None:
                return run_eager(eager_forward, args, kwargs)
            for name in ("cache", "past_key_values"):  # the cache argument's name in transformers >= 5.24 / before
                cache = kwargs.get(name)
                if cache is not None:
                    kwargs[name] = LayerCache(cache, index)
            return compiled(own, layer, *args, **kwargs)

        return forward


_MISSING = object()
