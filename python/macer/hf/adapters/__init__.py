"""Model adapters: one file per model family, and the flat registry ``MODEL_TYPE_TO_ADAPTER``.

An adapter (``macer.hf.adapters.base.Adapter``) tells the model-independent runtime where a model keeps its decoder and
how to read a prompt: modality labels, temporal positions, the end-of-turn token; what the family's config says alone
(labels, end-of-turn id, paper defaults) is its ``family`` in ``macer.core.families``, shared with the vLLM plugin.
Everything else (planning, scoring, selection, compaction, KV caches) knows nothing about the family.

To support a new family: its config facts in ``macer/core/families.py``, then ``macer/hf/adapters/<family>.py`` with an
``Adapter`` subclass, its model types added to ``MODEL_TYPE_TO_ADAPTER`` below (or ``register_adapter`` from your own
code); ``docs/architecture.md`` says where the vLLM side goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from macer.core.families import MODEL_TYPE_TO_FAMILY
from macer.hf.adapters.base import AUDIO, TEXT, VISUAL, Adapter, DecoderParts
from macer.hf.adapters.labelled import LabelledAdapter, label_rows
from macer.hf.adapters.labelled_batch import BatchLabelledAdapter
from macer.hf.adapters.qwen2_5_omni import Qwen25OmniAdapter
from macer.hf.adapters.qwen3_omni import Qwen3OmniAdapter

__all__ = ["AUDIO", "MODEL_TYPE_TO_ADAPTER", "TEXT", "VISUAL", "Adapter", "BatchLabelledAdapter", "DecoderParts",
           "LabelledAdapter",
           "adapter_for", "get_adapter", "label_rows", "register_adapter", "supported_model_types"]

MODEL_TYPE_TO_ADAPTER: dict[str, type[Adapter]] = {
    "qwen2_5_omni": Qwen25OmniAdapter,
    "qwen2_5_omni_thinker": Qwen25OmniAdapter,
    "qwen3_omni_moe": Qwen3OmniAdapter,
    "qwen3_omni_moe_thinker": Qwen3OmniAdapter,
}
"""``config.model_type`` -> adapter class."""


def register_adapter(*model_types: str) -> Callable[[type[Adapter]], type[Adapter]]:
    """Class decorator: use this adapter for models whose ``config.model_type`` is one of ``model_types`` (and its
    ``family``, if it names one, for ``MacerConfig.for_model``'s paper defaults)."""

    def deco(cls: type[Adapter]) -> type[Adapter]:
        for model_type in model_types:
            MODEL_TYPE_TO_ADAPTER[model_type] = cls
            if cls.family is not None:
                MODEL_TYPE_TO_FAMILY[model_type] = cls.family
        return cls

    return deco


def supported_model_types() -> list[str]:
    """Model types with a registered adapter."""
    return sorted(MODEL_TYPE_TO_ADAPTER)


def _model_type(model_or_config: Any) -> Any:
    return getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)


def adapter_for(model_or_config: Any) -> Adapter | None:
    """The adapter for a model or config's ``model_type``, or None."""
    cls = MODEL_TYPE_TO_ADAPTER.get(_model_type(model_or_config))
    return cls() if cls is not None else None


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model.config.model_type``; ``ValueError`` names the supported types otherwise."""
    adapter = adapter_for(model)
    if adapter is None:
        raise ValueError(f"macer.compress: model_type {_model_type(model)!r} ({type(model).__name__}) is not "
                         f"supported; supported model types: {supported_model_types()}. For another decoder-only "
                         "language model, give the prompt's modality labels: "
                         "macer.compress(model, config, adapter=macer.LabelledAdapter(labels, ...))")
    return adapter
