"""Model adapters, registered by ``config.model_type``.

An adapter tells the generic staged-pruning machinery (``macer.patch``) where a model keeps its decoder and how to
read a prompt: which module receives ``input_ids`` (``root``), which module runs the decoder loop (``decoder``), its
layer list, the modality label of every prompt token (0 text, ``AUDIO`` 1, ``VISUAL`` 2) and the temporal position of
every token. Everything else (scoring, budgets, selection, compaction, KV caches) is model-independent.

To support a new family, subclass ``Adapter`` and decorate it with ``@register_adapter("<model_type>", ...)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["AUDIO", "TEXT", "VISUAL", "Adapter", "DecoderParts", "get_adapter", "register_adapter",
           "supported_model_types"]

TEXT, AUDIO, VISUAL = 0, 1, 2
"""Modality labels handed to ``macer_kernels.modality_scores`` (video and image tokens are both ``VISUAL``)."""

_ADAPTERS: dict[str, type[Adapter]] = {}


@dataclass
class DecoderParts:
    """Where the pieces of one model are.

    Attributes:
        root: the module whose ``forward`` receives ``input_ids`` (a forward pre-hook captures the prompt there).
        decoder: the module whose ``forward`` runs the decoder layers in a loop (pre/post hooks bracket one pass).
        layers: the decoder layers, in order.
        attn_config: the config object whose ``_attn_implementation`` the decoder's attention modules read.
        outer: modules whose forward must not receive ``labels`` during a pruned prefill (logits are shorter).
    """

    root: nn.Module
    decoder: nn.Module
    layers: nn.ModuleList
    attn_config: Any
    outer: tuple[nn.Module, ...] = ()


class Adapter(ABC):
    """Base adapter, with the decoder-layer calling convention shared by transformers' decoder-only models:
    ``layer(hidden_states, attention_mask=..., position_ids=..., position_embeddings=(cos, sin), ...)``."""

    #: keyword arguments of a decoder layer call that carry one entry per token, with their sequence dimension
    layer_token_kwargs: ClassVar[dict[str, int]] = {"position_ids": -1}
    #: keyword argument holding the ``(cos, sin)`` RoPE tables, each ``[B, N, D]``
    position_embeddings_kwarg: ClassVar[str] = "position_embeddings"

    @abstractmethod
    def parts(self, model: nn.Module) -> DecoderParts:
        """Locate root, decoder and layers of ``model``."""

    @abstractmethod
    def labels(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 modality label of each token of a batch-1 prompt (0 text, ``AUDIO``, ``VISUAL``)."""

    @abstractmethod
    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int, device: torch.device) -> torch.Tensor:
        """``[N]`` temporal position of each prompt token, from the decoder call's keyword arguments."""


def register_adapter(*model_types: str) -> Callable[[type[Adapter]], type[Adapter]]:
    """Class decorator: use this adapter for models whose ``config.model_type`` is one of ``model_types``."""

    def deco(cls: type[Adapter]) -> type[Adapter]:
        for model_type in model_types:
            _ADAPTERS[model_type] = cls
        return cls

    return deco


def supported_model_types() -> list[str]:
    """Model types with a registered adapter."""
    _load_builtin()
    return sorted(_ADAPTERS)


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model.config.model_type``; ``ValueError`` names the supported types otherwise."""
    _load_builtin()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(f"macer.compress: model_type {model_type!r} ({type(model).__name__}) is not supported; "
                         f"supported model types: {sorted(_ADAPTERS)}")
    return _ADAPTERS[model_type]()


def _load_builtin() -> None:
    # Importing the module registers its adapters (lazily: it imports nothing heavy, but keeps the registry explicit).
    from macer.adapters import qwen2_5_omni  # noqa: F401
