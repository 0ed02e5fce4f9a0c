"""A tiny random Qwen3-Omni (MoE) thinker checkpoint with its processor files, built in code (no download): the
Qwen3-Omni counterpart of ``omni_checkpoints.write_qwen25_omni``, for the vLLM tests of its real thinker.

* ``write_qwen3_omni(directory, ...)``: a full ``Qwen3OmniMoeConfig`` checkpoint (talker off) with the thinker's
  weights under ``thinker.``: audio encoder, vision encoder with deepstack levels, sparse-MoE Qwen3 language model
  with interleaved M-RoPE, at tiny sizes (``macer.testing_qwen3.qwen3_thinker_config``), the real vocabulary size
  and special token ids (``QWEN3_OMNI_TOKENS``), and a ``Qwen3OmniMoeProcessor`` (Whisper features, Qwen2-VL image
  and video processors with Qwen3-Omni's 16-pixel patches, the tokenizer of ``omni_checkpoints.omni_tokenizer`` with
  Qwen3-Omni's special tokens).
* ``load_hf_qwen3_thinker(path)``: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` with those weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from omni_checkpoints import check_head_size, omni_tokenizer, quiet_transformers, save_checkpoint

__all__ = ["QWEN3_OMNI_TOKENS", "load_hf_qwen3_thinker", "qwen3_omni_processor", "write_qwen3_omni"]


@dataclass(frozen=True)
class Qwen3OmniTokens:
    """Special token ids of Qwen3-Omni's tokenizer (Qwen3-Omni-30B-A3B's ``tokenizer_config.json`` / config)."""

    endoftext: int = 151643
    im_start: int = 151644
    im_end: int = 151645
    vision_start: int = 151652  # <|vision_start|>
    vision_end: int = 151653  # <|vision_end|>
    image: int = 151655  # <|image_pad|>
    video: int = 151656  # <|video_pad|>
    audio_start: int = 151669  # <|audio_start|>
    audio_end: int = 151670  # <|audio_end|>
    audio: int = 151675  # <|audio_pad|> (transformers' config default is 151646)
    vocab_size: int = 152064


QWEN3_OMNI_TOKENS = Qwen3OmniTokens()

_NAMES = [  # ids 151643.. in order; the thinker reads only the ones named in Qwen3OmniTokens
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
]
_SPECIAL_TOKENS = {name: QWEN3_OMNI_TOKENS.endoftext + index for index, name in enumerate(_NAMES)}
_PROCESSOR_TOKENS = {  # the tokenizer attributes Qwen3OmniMoeProcessor reads
    "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
PATCH_SIZE = 16
"""Qwen3-Omni's vision patch (the processor's and the encoder's): 32x32 pixels per merged token."""


def qwen3_omni_processor():
    """A ``Qwen3OmniMoeProcessor``: Whisper features (128 mel bins, 16 kHz), Qwen2-VL image and video processors with
    16-pixel patches, the tokenizer with Qwen3-Omni's special tokens. Frames are resized by the processor's defaults
    (``Qwen3OmniMoeProcessorKwargs``: 128 to 768 patches of 32x32 pixels), the video sampled at its default 1 fps."""
    from transformers import Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = omni_tokenizer(_SPECIAL_TOKENS, _PROCESSOR_TOKENS)
    return Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=PATCH_SIZE),
        video_processor=Qwen2VLVideoProcessor(patch_size=PATCH_SIZE),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16_000),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _qwen3_config(*, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, num_experts: int,
                  deepstack_layers: int, init_std: float):
    from macer.testing_qwen3 import qwen3_thinker_config
    from transformers import Qwen3OmniMoeConfig

    tok = QWEN3_OMNI_TOKENS
    thinker = qwen3_thinker_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, num_experts=num_experts,
                                   deepstack_layers=deepstack_layers, vocab_size=tok.vocab_size).to_dict()
    thinker.update(audio_token_id=tok.audio, image_token_id=tok.image, video_token_id=tok.video,
                   audio_start_token_id=tok.audio_start, audio_end_token_id=tok.audio_end,
                   vision_start_token_id=tok.vision_start, vision_end_token_id=tok.vision_end,
                   user_token_id=872, initializer_range=init_std)
    thinker.pop("im_end_token_id", None)
    thinker["text_config"].update(eos_token_id=tok.im_end, pad_token_id=tok.endoftext, initializer_range=init_std,
                                  tie_word_embeddings=False)
    # transformers' Qwen3-Omni always interleaves the M-RoPE sections; vLLM does only when the config says
    # "mrope_interleaved" (as the published config does, beside "interleaved"). Without it vLLM rotates video rows
    # (t, h, w unequal) with the sections in blocks: other logits from the first layer on, same for audio and text.
    thinker["text_config"]["rope_parameters"]["mrope_interleaved"] = True
    # image_size and apply_vit_abs_pos_embed: read by vLLM's vision encoder, not declared by transformers' config.
    # vLLM sizes its position table (image_size / patch_size)^2, transformers num_position_embeddings: the published
    # 768 / 16 = 48 per side, 2304 entries; here sqrt(num_position_embeddings) per side.
    side = math.isqrt(thinker["vision_config"]["num_position_embeddings"])
    thinker["vision_config"].update(patch_size=PATCH_SIZE, initializer_range=init_std, image_size=side * PATCH_SIZE,
                                    apply_vit_abs_pos_embed=True)
    thinker["audio_config"]["initializer_range"] = init_std
    with quiet_transformers():  # the default talker config warns about its token ids; it is never built
        return Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False, im_start_token_id=tok.im_start,
                                  im_end_token_id=tok.im_end, system_token_id=8948, user_token_id=872,
                                  assistant_token_id=77091)


def write_qwen3_omni(directory: str | Path, *, num_layers: int = 4, hidden_size: int = 128, num_heads: int = 4,
                     num_kv_heads: int = 2, num_experts: int = 4, deepstack_layers: int = 3, init_std: float = 0.05,
                     seed: int = 0) -> Path:
    """Write a random Qwen3-Omni checkpoint (fp32, talker off) with its processor files to ``directory``.

    Loads in vLLM as ``Qwen3OmniMoeThinkerForConditionalGeneration`` and in transformers through
    ``load_hf_qwen3_thinker``. Layer 0 has a dense MLP, the others ``num_experts`` experts (2 per token); the vision
    encoder has ``deepstack_layers`` blocks, each feeding a deepstack level added after decoder layer 0, 1, ....
    """
    from transformers import Qwen3OmniMoeForConditionalGeneration

    check_head_size("write_qwen3_omni", hidden_size, num_heads)
    config = _qwen3_config(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, num_experts=num_experts, deepstack_layers=deepstack_layers,
                           init_std=init_std)
    return save_checkpoint(directory, Qwen3OmniMoeForConditionalGeneration, config, qwen3_omni_processor(), seed=seed)


def load_hf_qwen3_thinker(path: str | Path, *, attn_implementation: str = "sdpa"):
    """transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` with the checkpoint's ``thinker.`` weights, fp32,
    in eval mode (loaded through the full model's ``from_pretrained``, which maps the saved layout back)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with quiet_transformers():
        model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, output_loading_info=True)
    left = {name: keys for name, keys in info.items() if keys}
    if left:
        raise RuntimeError(f"load_hf_qwen3_thinker: the checkpoint did not load exactly: {left}")
    return model.thinker.eval()
