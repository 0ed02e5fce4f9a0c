"""Qwen2.5-Omni (transformers ``qwen2_5_omni``): the thinker, and the full model through ``.thinker``.

Module tree (transformers 5.23)::

    Qwen2_5OmniForConditionalGeneration      (model_type "qwen2_5_omni")
      .thinker: Qwen2_5OmniThinkerForConditionalGeneration   (model_type "qwen2_5_omni_thinker")
        .model: Qwen2_5OmniThinkerModel       <- root: receives input_ids, computes the 3-row M-RoPE position ids
          .audio_tower, .visual
          .language_model: Qwen2_5OmniThinkerTextModel   <- decoder: runs layers[i] in a loop
            .layers[i]: Qwen2_5OmniDecoderLayer

Older releases (transformers 5.17, checked by running the tests against it) have no ``Qwen2_5OmniThinkerModel``: the
thinker itself is the root (it holds ``audio_tower``, ``visual``, ``rope_deltas`` and receives ``input_ids``) and
``thinker.model`` is the text model. ``parts`` accepts both; in both, ``root.audio_tower`` / ``root.visual`` are the
encoders.

The text model only receives ``inputs_embeds``, so modality labels come from the ``input_ids`` seen by the root.
Its ``position_ids`` are ``[3, B, N]`` (temporal, height, width) or, under ``generate``, ``[4, B, N]`` (a text row
first); the temporal row is ``position_ids[-3]`` in both cases.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from macer.adapters import AUDIO, VISUAL, Adapter, DecoderParts, register_adapter


@register_adapter("qwen2_5_omni", "qwen2_5_omni_thinker")
class Qwen25OmniAdapter(Adapter):
    """Adapter for ``Qwen2_5OmniThinkerForConditionalGeneration`` and ``Qwen2_5OmniForConditionalGeneration``."""

    def _thinker(self, model: nn.Module) -> nn.Module:
        return model.thinker if model.config.model_type == "qwen2_5_omni" else model

    def parts(self, model: nn.Module) -> DecoderParts:
        thinker = self._thinker(model)
        inner = getattr(thinker, "model", None)
        if hasattr(inner, "language_model"):  # transformers 5.2x: thinker.model is the multimodal model
            root, decoder = inner, inner.language_model
        elif hasattr(inner, "layers"):  # transformers 5.17: thinker.model is the text model
            root, decoder = thinker, inner
        else:
            raise ValueError(f"macer.compress: cannot find the decoder of {type(thinker).__name__} (expected "
                             "thinker.model.language_model.layers or thinker.model.layers); transformers "
                             "version not supported")
        return DecoderParts(root=root, decoder=decoder, layers=decoder.layers, attn_config=decoder.config,
                            outer=(thinker,))

    def labels(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        config = self._thinker(model).config
        ids = input_ids.reshape(-1)
        labels = torch.zeros_like(ids)
        labels[ids == config.audio_token_id] = AUDIO
        labels[(ids == config.video_token_id) | (ids == config.image_token_id)] = VISUAL
        return labels

    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int, device: torch.device) -> torch.Tensor:
        position_ids = decoder_kwargs.get("position_ids")
        if position_ids is None:
            # The text model then uses arange positions itself (no multimodal grid was given).
            return torch.arange(length, device=device)
        if position_ids.ndim == 3:
            return position_ids[-3, 0]
        return position_ids[0]
