"""Qwen3-Omni (transformers ``qwen3_omni_moe``): the thinker, and the full model through ``.thinker``.

Module tree (transformers 5.23)::

    Qwen3OmniMoeForConditionalGeneration      (model_type "qwen3_omni_moe"; talker and code2wav optional)
      .thinker: Qwen3OmniMoeThinkerForConditionalGeneration   (model_type "qwen3_omni_moe_thinker")
        .model: Qwen3OmniMoeThinkerModel       <- root: receives input_ids, computes the M-RoPE position ids
          .audio_tower, .visual
          .language_model: Qwen3OmniMoeThinkerTextModel   <- decoder: runs layers[i] in a loop
            .layers[i]: Qwen3OmniMoeThinkerTextDecoderLayer (attention + dense MLP or sparse MoE block)

transformers 5.19 (the release vLLM 0.32 pins, checked by ``tests/serving/test_omni_macer.py``) has no
``Qwen3OmniMoeThinkerModel``: the thinker itself is the root and ``thinker.model`` is the text model (the decoder).
``parts`` accepts both.

What differs from Qwen2.5-Omni:

* Position ids are float (``[3, B, N]``, under ``generate`` ``[4, B, N]`` with a text row first); the temporal row
  ``position_ids[-3]`` puts audio (13 positions per second, one per audio token) and video (its grid times) on one
  time axis.
* Deepstack: the decoder receives ``visual_pos_masks`` (``[B, N]`` bool) and ``deepstack_visual_embeds`` (one
  ``[n_visual, D]`` tensor per level, 3 in the real model) and adds level ``i`` to the visual rows after ``layers[i]``
  through ``_deepstack_process``. Both are locals of the decoder's forward, so a stage before or among those layers
  must shorten them where they are used: the adapter wraps ``_deepstack_process`` on the decoder instance for the
  ``compress`` context (``guards``), notes the prefill's mask (``on_prefill``), tracks the original row of every row
  still present through ``on_stage`` (``[B, W]``, ``-1`` on a re-packed batch's padding) and, after a stage, hands the
  original the mask at those rows and the embedding rows of the visual tokens among them (their rank among the
  mask's True entries, batch-major, as ``h[mask]`` orders them). Before any stage it calls the original unchanged
  (keep ratio 1 stays bit-identical). So stages before, among and after the deepstack layers work for one prompt
  and for a left-padded batch alike.
* MoE routing is per token with no capacity limit, so dropping tokens does not change the routing of the kept ones:
  nothing else to adapt.
* Audio output: the talker reads the thinker's hidden states of every prompt token, which a pruned prefill does not
  have; ``compress`` refuses a full model whose talker is loaded (``model.disable_talker()`` first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from macer.core.families import QWEN3_OMNI
from macer.hf.adapters.base import DecoderParts
from macer.hf.adapters.qwen2_5_omni import QwenOmniAdapter

__all__ = ["Qwen3OmniAdapter"]


class Qwen3OmniAdapter(QwenOmniAdapter):
    """Adapter for ``Qwen3OmniMoeThinkerForConditionalGeneration`` and ``Qwen3OmniMoeForConditionalGeneration``."""

    family = QWEN3_OMNI
    batch_ready = True  # the deepstack remapping follows a re-packed batch (on_stage gets its [B, W] keep)

    def __init__(self) -> None:
        # The current prefill's visual_pos_masks (the decoder's own tensor, handed to every deepstack level), the
        # original padded row of each row of the sequence after its stages ([B, W], -1 on re-packed padding; None
        # before the first stage), and the shortened deepstack inputs of the last stage, computed once and reused by
        # the later deepstack levels.
        self._mask: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._remap: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def parts(self, model: nn.Module) -> DecoderParts:
        hf_model: Any = model  # a transformers model: its config is an attribute, not a submodule lookup
        if hf_model.config.model_type == "qwen3_omni_moe" and getattr(model, "has_talker", False):
            raise ValueError("macer.compress: this Qwen3-Omni model has its talker loaded; audio output reads the "
                             "thinker's hidden states of every prompt token, which a pruned prefill does not keep. "
                             "Call model.disable_talker() (text answers: generate(..., return_audio=False)) or "
                             "compress model.thinker")
        thinker = self._thinker(model)
        inner: Any = getattr(thinker, "model", None)
        if hasattr(inner, "language_model"):  # transformers 5.23: thinker.model is the multimodal model
            root, decoder = inner, inner.language_model
        else:  # transformers 5.19 (vLLM 0.32's): the thinker is the root, thinker.model the text model
            root, decoder = thinker, inner
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "_deepstack_process"):
            raise ValueError(f"macer.compress: cannot find the decoder of {type(thinker).__name__} (expected "
                             "thinker.model.language_model or thinker.model with layers and _deepstack_process); "
                             "transformers version not supported")
        return DecoderParts(root=root, decoder=decoder, layers=decoder.layers, attn_config=decoder.config,
                            outer=(thinker,))

    def on_prefill(self, decoder_kwargs: dict[str, Any]) -> None:
        self._mask = decoder_kwargs.get("visual_pos_masks")
        self._rows = self._remap = None

    def on_stage(self, decoder_kwargs: dict[str, Any], keep: torch.Tensor, layer: int) -> None:
        # One prompt: keep [k]; a re-packed batch: keep [B, W] with -1 on the new padding. Rows compose: the original
        # row of kept slot r of sample b is the original row of the slot keep[b, r] pointed at.
        keep = keep[None] if keep.ndim == 1 else keep
        if self._rows is None:
            self._rows = keep
        else:
            self._rows = torch.where(keep >= 0, self._rows.gather(1, keep.clamp(min=0)), -1)

    def guards(self, model: nn.Module) -> list[tuple[Any, str, Any]]:
        decoder = self.parts(model).decoder
        original = decoder._deepstack_process

        def deepstack(hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor):
            return self.deepstack(original, hidden_states, visual_pos_masks, visual_embeds)

        return [(decoder, "_deepstack_process", deepstack)]

    def deepstack(self, original: Any, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor,
                  visual_embeds: torch.Tensor) -> torch.Tensor:
        """The decoder's ``_deepstack_process`` (``original``) on the rows still present after the stages."""
        rows = self._rows
        if rows is None or visual_pos_masks is not self._mask:
            return original(hidden_states, visual_pos_masks, visual_embeds)  # no stage before this level
        if tuple(rows.shape) != tuple(hidden_states.shape[:2]):
            raise RuntimeError(f"macer: Qwen3-Omni's deepstack got {tuple(hidden_states.shape[:2])} rows after "
                               f"stages that kept {tuple(rows.shape)} (please report this)")
        if self._remap is None or self._remap[0] is not rows:
            # Once per stage (the deepstack levels after it reuse it): the mask at the rows present ([B, W],
            # False on padding) and, for the visual rows among them, their index into the embeddings, whose rows
            # follow the mask's True entries in batch-major order (rank = flat cumsum - 1). The boolean selection
            # reads its count back from the device (one host synchronisation per stage placed before a deepstack
            # level, counted by tests/hf/test_macer_sync.py), as transformers' own h[mask] does in every level.
            mask = visual_pos_masks if visual_pos_masks.device == rows.device else visual_pos_masks.to(rows.device)
            present = rows.clamp(min=0)
            kept = mask.gather(1, present) & (rows >= 0)
            rank = (mask.reshape(-1).cumsum(0) - 1).view(mask.shape)
            self._remap = (rows, kept, rank.gather(1, present)[kept])
        _, kept, index = self._remap
        if index.device != visual_embeds.device:
            index = index.to(visual_embeds.device)
        return original(hidden_states, kept, visual_embeds.index_select(0, index))
