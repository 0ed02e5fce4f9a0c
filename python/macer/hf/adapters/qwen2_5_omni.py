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

from macer.core.families import QWEN2_5_OMNI, QwenOmni
from macer.hf.adapters.base import Adapter, DecoderParts

__all__ = ["Qwen25OmniAdapter", "QwenOmniAdapter"]


class QwenOmniAdapter(Adapter):
    """What the Qwen-Omni families share: a full model that holds the thinker as ``.thinker``, modality labels from
    the thinker config's audio / video / image token ids (``macer.core.families``), times from the temporal M-RoPE
    row."""

    family: ClassVar[QwenOmni]

    def _thinker(self, model: nn.Module) -> Any:
        hf_model: Any = model  # a transformers model: its config and thinker are attributes, not submodule lookups
        return hf_model.thinker if hf_model.config.model_type == self.family.FULL_MODEL_TYPE else model

    def labels(self, model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("macer.compress needs the prompt's input_ids to label audio/video tokens; a prefill "
                             "from inputs_embeds alone is not supported")
        return self.family.labels(self._thinker(model).config, input_ids)

    def end_of_turn_token_id(self, model: nn.Module) -> int | None:
        hf_model: Any = model
        return self.family.end_of_turn_token_id(hf_model.config)

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


class Qwen25OmniAdapter(QwenOmniAdapter):
    """Adapter for ``Qwen2_5OmniThinkerForConditionalGeneration`` and ``Qwen2_5OmniForConditionalGeneration``."""

    family = QWEN2_5_OMNI
    batch_ready = True  # no per-token state of its own: the runtime's re-packing covers everything

    def parts(self, model: nn.Module) -> DecoderParts:
        thinker = self._thinker(model)
        inner: Any = getattr(thinker, "model", None)
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
        hf_model: Any = model
        if hf_model.config.model_type != "qwen2_5_omni":
            return []

        def generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                "macer.compress: call model.thinker.generate(...) for text answers. The full "
                "Qwen2_5OmniForConditionalGeneration.generate() runs the talker on the thinker's hidden states, which "
                "a pruned prefill shortens, and on transformers 5.23 it fails even without MACER unless the speech "
                "checkpoint is loaded ('Chelsie is not available'). The thinker's generate returns prompt + new "
                "tokens, as usual.")

        return [(model, "generate", generate)]
