"""What the synthetic Qwen-Omni thinkers and clips of both families share: the synthetic vocabulary, the config fields
both thinkers have, the seeded build, and the clip skeleton.

A family's module (``qwen2_5_omni``, ``qwen3_omni``) decides its config and its clip's token layout (the media ids
between the user header and the question, the encoders' input sizes) as a ``ClipLayout``; ``chat_clip`` turns that
into model inputs the same way for both: the chat template around the media, then random encoder inputs, drawn from
one generator in a fixed order (system text, question text, image, video, audio), so a seed gives the same clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SYNTHETIC_TOKENS",
    "ClipLayout",
    "SyntheticTokens",
    "around_thinker",
    "chat_clip",
    "check_clip",
    "check_decoder_shape",
    "check_grid",
    "encoder_configs",
    "seeded_thinker",
    "set_undeclared_ids",
    "text_config",
    "thinker_config_of",
]


@dataclass(frozen=True)
class SyntheticTokens:
    """Special-token ids of the synthetic vocabulary (the real Qwen2.5 ids in comments)."""

    im_start: int = 1  # <|im_start|> 151644
    im_end: int = 2  # <|im_end|> 151645
    audio: int = 3  # <|AUDIO|> 151646
    audio_start: int = 4  # <|audio_bos|> 151647
    audio_end: int = 5  # <|audio_eos|> 151648
    vision_start: int = 6  # <|vision_bos|> 151652
    vision_end: int = 7  # <|vision_eos|> 151653
    image: int = 8  # <|IMAGE|> 151655
    video: int = 9  # <|VIDEO|> 151656
    newline: int = 10  # "\n" 198
    system: int = 11  # "system" 8948
    user: int = 12  # "user" 872
    assistant: int = 13  # "assistant" 77091
    first_ordinary: int = 16  # ordinary text tokens are drawn from [first_ordinary, vocab_size)


SYNTHETIC_TOKENS = SyntheticTokens()


# ------------------------------------------------------------------------------------------------ thinker configs
def check_decoder_shape(vocab_size: int, hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    if vocab_size < 64:
        raise ValueError(f"vocab_size must be >= 64, got {vocab_size}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2 or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) / num_heads ({num_heads}) must be an even integer and num_heads a "
            f"multiple of num_kv_heads ({num_kv_heads})"
        )


def text_config(*, vocab_size: int, hidden_size: int, intermediate_size: int | None, num_layers: int,
                num_heads: int, num_kv_heads: int, mrope_section: list[int]) -> dict[str, Any]:
    """The text-model fields both Qwen-Omni thinkers share (Qwen3-Omni adds its MoE fields and interleaving)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section},
        "eos_token_id": SYNTHETIC_TOKENS.im_end,
        "pad_token_id": 0,
    }


def encoder_configs(width: int, depth: int, hidden_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The audio and vision encoder fields both Qwen-Omni thinkers share: ``depth`` layers of ``width``, output
    projected to the decoder's ``hidden_size`` (each family adds its own windowing and vision fields)."""
    heads = max(1, width // 16)
    audio = {"num_mel_bins": 128, "encoder_layers": depth, "encoder_attention_heads": heads,
             "encoder_ffn_dim": 2 * width, "d_model": width, "output_dim": hidden_size, "max_source_positions": 1500}
    vision = {"depth": depth, "hidden_size": width, "intermediate_size": 2 * width, "num_heads": heads,
              "out_hidden_size": hidden_size}
    return audio, vision


def set_undeclared_ids(config: Any, attn_implementation: str) -> Any:
    """``config`` with the fields both thinkers read but their config classes do not declare, and the attention."""
    tok = SYNTHETIC_TOKENS
    # Read by get_rope_index but not declared fields of the thinker config: set them explicitly.
    config.vision_start_token_id = tok.vision_start
    config.vision_end_token_id = tok.vision_end
    # Names the synthetic <|im_end|>, from which the adapter defaults MacerConfig.end_of_turn_token_id (the real
    # Qwen2.5-Omni config has no such field; Qwen3-Omni's has): 151645 lies outside this vocabulary.
    config.im_end_token_id = tok.im_end
    config._attn_implementation = attn_implementation
    config.text_config._attn_implementation = attn_implementation
    return config


# ------------------------------------------------------------------------------------------------ models
def seeded_thinker(cls: type, config: Any, *, seed: int, dtype: torch.dtype, device: str | torch.device):
    """``cls(config)`` with weights drawn from ``seed`` alone (the caller's RNG state untouched), generation set up
    for the synthetic vocabulary (eos = its ``<|im_end|>``, pad = 0), on ``device`` in ``dtype``, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = SYNTHETIC_TOKENS.im_end
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def around_thinker(cls: type, config: Any, thinker: Any):
    """``cls(config)``, a full Omni model, with ``thinker`` as its ``.thinker`` (config included), in eval mode. Built
    on the meta device: the thinker it would build is replaced, and the talker is off."""
    with torch.device("meta"):
        model = cls(config)
    model.thinker = thinker
    model.config.thinker_config = thinker.config
    return model.eval()


# ------------------------------------------------------------------------------------------------ clips
def thinker_config_of(model_or_config: Any) -> Any:
    """The thinker config of a model built here (thinker or full model) or of a config (full or thinker)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "thinker_config", None) or config


def check_clip(frames: int, grid_hw: tuple[int, int]) -> None:
    """The clip arguments of ``clip_inputs`` / ``qwen3_clip_inputs``: an even frame count, a grid of even sides."""
    if frames < 0 or frames % 2:
        raise ValueError(f"frames must be an even integer >= 0, got {frames}")
    check_grid("grid_hw", grid_hw)


def check_grid(name: str, hw: tuple[int, int]) -> None:
    if hw[0] % 2 or hw[1] % 2 or min(hw) < 2:
        raise ValueError(f"{name} must be two even integers >= 2, got {hw}")


@dataclass(frozen=True)
class ClipLayout:
    """What a family's clip builder decides: the token ids between the user header and the question, and the sizes
    of the encoders' random inputs (0 grids, no mel frames: that input is absent)."""

    media: list[int]
    grids: int = 0  # temporal grids of the video (its frames / the temporal patch size)
    grid_hw: tuple[int, int] = (2, 2)  # the video's patches per frame
    second_per_grid: float = 0.0
    mel_frames: int | None = None  # the audio track's mel frames
    image_grid_hw: tuple[int, int] | None = None  # one image of this many patches


def chat_clip(config: Any, layout: ClipLayout, *, seed: int, system_tokens: int, question_tokens: int,
              use_audio_in_video: bool, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The inputs of one chat-templated question about ``layout``'s media (batch size 1):
    ``<|im_start|>system\\n S <|im_end|>\\n<|im_start|>user\\n MEDIA Q <|im_end|>\\n<|im_start|>assistant\\n`` with
    ``S`` and ``Q`` random ordinary tokens (the prompt ends with the assistant header, so MACER's question span is the
    last tokens of ``Q``), then the random image, video and audio inputs, all drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tok = SYNTHETIC_TOKENS
    vocab_size = config.text_config.vocab_size
    ids = [tok.im_start, tok.system, tok.newline, *_text(generator, system_tokens, vocab_size), tok.im_end, tok.newline,
           tok.im_start, tok.user, tok.newline, *layout.media, *_text(generator, question_tokens, vocab_size),
           tok.im_end, tok.newline, tok.im_start, tok.assistant, tok.newline]
    input_ids = torch.tensor([ids], dtype=torch.long)
    inputs: dict[str, Any] = {
        "input_ids": input_ids.to(device),
        "attention_mask": torch.ones_like(input_ids).to(device),
        "use_audio_in_video": use_audio_in_video,
    }
    vision = config.vision_config
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if layout.image_grid_hw is not None:
        h, w = layout.image_grid_hw
        inputs["pixel_values"] = torch.randn(h * w, row, generator=generator).to(device=device, dtype=dtype)
        inputs["image_grid_thw"] = torch.tensor([[1, h, w]], device=device)
    if layout.grids:
        h, w = layout.grid_hw
        inputs["pixel_values_videos"] = torch.randn(layout.grids * h * w, row, generator=generator).to(
            device=device, dtype=dtype)
        inputs["video_grid_thw"] = torch.tensor([[layout.grids, h, w]], device=device)
        inputs["video_second_per_grid"] = torch.tensor([layout.second_per_grid], device=device)
    if layout.mel_frames is not None:
        inputs["input_features"] = torch.randn(1, config.audio_config.num_mel_bins, layout.mel_frames,
                                               generator=generator).to(device=device, dtype=dtype)
        inputs["feature_attention_mask"] = torch.ones(1, layout.mel_frames, dtype=torch.long, device=device)
    return inputs


def _text(generator: torch.Generator, n: int, vocab_size: int) -> list[int]:
    lo = SYNTHETIC_TOKENS.first_ordinary
    return torch.randint(lo, vocab_size, (n,), generator=generator).tolist()
