"""The per-token inputs of a transformers decoder-layer call that a stage shortens: the hidden states, the RoPE
``(cos, sin)`` tables and the adapter's per-token layer kwargs (``Adapter.layer_token_kwargs``). One prompt
(``macer.hf.prefill``) and a re-packed batch (``macer.hf.batch``) compact the same list: in a MACER stage's own
prepared call, or after other stages in one ``compact_many``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["layer_inputs", "token_tensors"]


def token_tensors(adapter: Any, args: tuple, kwargs: dict[str, Any], source: dict[str, Any]
                  ) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """What a stage compacts before the next layer: the hidden states, RoPE ``cos``/``sin`` and the adapter's
    per-token layer kwargs (from ``source``: the last compacted inputs, else the layer's own), with the sequence dim
    of each (non-negative)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    cos, sin = source[adapter.position_embeddings_kwarg]
    names, tensors, dims = ["hidden_states", "cos", "sin"], [hidden, cos, sin], [1, 1, 1]
    for name, dim in adapter.layer_token_kwargs.items():
        if isinstance(source.get(name), torch.Tensor):
            names.append(name)
            tensors.append(source[name])
            dims.append(dim % source[name].ndim)
    return names, tensors, dims


def layer_inputs(adapter: Any, names: list[str], compacted: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The compacted hidden states and the layer kwargs that replace the originals (RoPE as its ``(cos, sin)``)."""
    out = dict(zip(names, compacted, strict=True))
    inputs: dict[str, Any] = {adapter.position_embeddings_kwarg: (out.pop("cos"), out.pop("sin"))}
    hidden = out.pop("hidden_states")
    inputs.update(out)
    return hidden, inputs
