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

from typing import Any, ClassVar

import torch
from torch import nn

from macer.adapters.base import AUDIO, VISUAL, Adapter, DecoderParts, text_config

__all__ = ["IM_END", "PAPER_DEFAULTS", "SIZES", "Qwen25OmniAdapter", "QwenOmniAdapter"]

IM_END = 151645
"""``<|im_end|>`` of the Qwen2 vocabulary (checked against transformers' constants, see docs/integration.md)."""

SIZES: dict[str, dict[str, int]] = {
    # The text model's published sizes: a model is identified by all four (plus its model type), never by depth alone.
    "qwen2.5-omni-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                        "num_key_value_heads": 4},
    "qwen2.5-omni-3b": {"num_hidden_layers": 36, "hidden_size": 2048, "num_attention_heads": 16,
                        "num_key_value_heads": 2},
}

PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    # tab:macer_defaults: (l_a, l_v, alpha, lambda_c), selected once on a held-out split and frozen.
    "qwen2.5-omni-7b": {"audio_layer": 3, "video_layer": 5, "audio_share": 0.30, "coverage_weight": 0.20},
    "qwen2.5-omni-3b": {"audio_layer": 4, "video_layer": 7, "audio_share": 0.32, "coverage_weight": 0.30},
}


class QwenOmniAdapter(Adapter):
    """What the Qwen-Omni families share: a full model that holds the thinker as ``.thinker``, modality labels from
    the thinker config's audio / video / image token ids, times from the temporal M-RoPE row, and a model recognised
    by its text sizes."""

    FULL_MODEL_TYPE: str = ""
    """``model_type`` of the full model (talker included), which holds the thinker as ``.thinker``."""
    SIZES: ClassVar[dict[str, dict[str, int]]] = {}
    """Model name -> the text config's sizes that identify it."""

    def _thinker(self, model: nn.Module) -> nn.Module:
        return model.thinker if model.config.model_type == self.FULL_MODEL_TYPE else model

    def labels(self, model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("macer.compress needs the prompt's input_ids to label audio/video tokens; a prefill "
                             "from inputs_embeds alone is not supported")
        config = self._thinker(model).config
        labels = torch.zeros_like(input_ids)
        labels[input_ids == config.audio_token_id] = AUDIO
        labels[(input_ids == config.video_token_id) | (input_ids == config.image_token_id)] = VISUAL
        return labels

    def temporal_positions(self, decoder_kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
        position_ids = decoder_kwargs.get("position_ids")
        if position_ids is None:
            return None  # the text model then uses arange positions itself (no multimodal grid was given)
        return position_ids[-3] if position_ids.ndim == 3 else position_ids

    def check_batch(self, model: nn.Module, input_ids: torch.Tensor | None, root_kwargs: dict[str, Any]) -> None:
        # transformers reads one use_audio_in_video per call: with it on, get_rope_index expects every video to be
        # interleaved with its audio (a block-layout or video-only prompt gets wrong positions, silently); with it
        # off, an interleaved prompt gets wrong positions. Audio-only and text-only prompts work either way.
        # Qwen3-Omni's get_rope_index (5.23) counts its videos by the same flag (a vision start followed by an audio
        # start, or by a video token), so the rule is the same for both families.
        if input_ids is None:
            return
        config = self._thinker(model).config
        video, audio_start, vision_start = (config.video_token_id, config.audio_start_token_id,
                                            config.vision_start_token_id)
        flag = bool(root_kwargs.get("use_audio_in_video"))
        for b, ids in enumerate(input_ids):
            if not bool((ids == video).any()):
                continue
            interleaved = bool(((ids[:-1] == vision_start) & (ids[1:] == audio_start)).any())
            if interleaved != flag:
                layout = "interleaved (vision start, audio start, ...)" if interleaved else \
                    "a video block (block layout or video only)"
                raise ValueError(
                    f"macer.compress: sample {b} of the batch holds {layout}, but the call has "
                    f"use_audio_in_video={flag}; transformers reads one use_audio_in_video per call, so a batch cannot "
                    "mix interleaved prompts (use_audio_in_video=True) with block-layout or video-only ones (False): "
                    "run them as separate batches (audio-only and text-only prompts go with either)")

    def identify(self, model_or_config: Any) -> str | None:
        text = text_config(model_or_config)
        for name, sizes in self.SIZES.items():
            if all(getattr(text, key, None) == value for key, value in sizes.items()):
                return name
        return None


class Qwen25OmniAdapter(QwenOmniAdapter):
    """Adapter for ``Qwen2_5OmniThinkerForConditionalGeneration`` and ``Qwen2_5OmniForConditionalGeneration``."""

    FULL_MODEL_TYPE = "qwen2_5_omni"
    SIZES = SIZES
    batch_ready = True  # no per-token state of its own: the runtime's re-packing covers everything

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

    def guards(self, model: nn.Module) -> list[tuple[Any, str, Any]]:
        if model.config.model_type != "qwen2_5_omni":
            return []

        def generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                "macer.compress: call model.thinker.generate(...) for text answers. The full "
                "Qwen2_5OmniForConditionalGeneration.generate() runs the talker on the thinker's hidden states, which "
                "a pruned prefill shortens, and on transformers 5.23 it fails even without MACER unless the speech "
                "checkpoint is loaded ('Chelsie is not available'). The thinker's generate returns prompt + new "
                "tokens, as usual.")

        return [(model, "generate", generate)]

    def end_of_turn_token_id(self, model: nn.Module) -> int | None:
        # A config that names its <|im_end|> (macer.testing's synthetic vocabulary; Qwen3-Omni's configs) wins;
        # else the Qwen2 id, if the vocabulary is that large.
        config = getattr(model.config, "thinker_config", None) or model.config
        named = getattr(config, "im_end_token_id", None)
        if isinstance(named, int):
            return named
        return IM_END if text_config(config).vocab_size > IM_END else None

    def paper_defaults(self, model_or_config: Any) -> dict[str, Any] | None:
        name = self.identify(model_or_config)
        return dict(PAPER_DEFAULTS[name]) if name is not None else None
