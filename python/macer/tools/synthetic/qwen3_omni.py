"""Qwen3-Omni thinkers with random weights and synthetic prompts, built in code (no processor, no download).

The Qwen3-Omni counterpart of ``qwen2_5_omni`` (same special-token ids, ``SYNTHETIC_TOKENS``; the shared skeleton in
``macer.tools.synthetic.base``), for the tests and examples of the ``qwen3_omni_moe`` adapter. Public as
``macer.testing_qwen3`` (the same objects):

* ``qwen3_thinker_config(...)`` / ``build_qwen3_thinker(...)``: a ``Qwen3OmniMoeThinkerForConditionalGeneration``
  with a sparse-MoE decoder (``num_experts``, ``num_experts_per_tok``; ``mlp_only_layers`` keep a dense MLP) and
  ``deepstack_layers`` deepstack feature levels from the vision encoder, added to the decoder's hidden states after
  its first ``deepstack_layers`` layers.
* ``build_qwen3_omni_model(...)``: the full ``Qwen3OmniMoeForConditionalGeneration`` (no talker) around such a thinker.
* ``qwen3_clip_inputs(model, ...)``: one chat-templated question about a synthetic audio-video clip.

Token layout, copied from the Qwen3-Omni processor (``transformers`` 5.23, ``processing_qwen3_omni_moe.py``,
``replace_video_with_audio_token``) and matching its ``get_rope_index``:

* ``use_audio_in_video=True``: ``<|vision_start|><|audio_start|> ... <|audio_end|><|vision_end|>`` with the video and
  audio tokens interleaved token by token on one time axis: a video token at time ``grid * seconds_per_grid *
  position_id_per_seconds`` comes before an audio token at time ``k`` (one position per audio token) when its time is
  ``<= k``. With 13 audio tokens per second and 2 s per grid: ``V.. A26 V.. A26 ...``.
* ``use_audio_in_video=False``: ``<|vision_start|> V.. <|vision_end|><|audio_start|> A.. <|audio_end|>``.

``position_id_per_seconds`` must be 13, the processor's value (the config class default is 25; a hand-built config
that keeps 25 silently misaligns audio and video positions). Audio: ``seconds`` of mel frames at 100 frames/s give
13 tokens per second (``audio_token_count``). Video: ``frames`` frames of ``grid_hw`` patches, 2 frames per temporal
grid, 2x2 patch merge: ``frames / 2 * h * w / 4`` tokens, ``video_second_per_grid = 2 / fps``.
"""

from __future__ import annotations

from typing import Any

import torch

from macer.tools.synthetic.base import (
    SYNTHETIC_TOKENS,
    ClipLayout,
    around_thinker,
    chat_clip,
    check_clip,
    check_decoder_shape,
    check_grid,
    encoder_configs,
    seeded_thinker,
    set_undeclared_ids,
    text_config,
    thinker_config_of,
)

__all__ = ["audio_token_count", "build_qwen3_omni_model", "build_qwen3_thinker", "qwen3_clip_inputs",
           "qwen3_thinker_config"]

POSITION_ID_PER_SECONDS = 13
"""Temporal M-RoPE positions per second in Qwen3-Omni's processor (and audio tokens per second)."""


def _mrope_section(head_dim: int) -> list[int]:
    # Qwen3-Omni interleaves t/h/w frequencies with sections 24/20/20 for head_dim 128; keep those proportions.
    half = head_dim // 2
    hw = max(1, round(half * 20 / 64))
    return [half - 2 * hw, hw, hw]


def audio_token_count(mel_frames: int, n_window: int = 50) -> int:
    """LLM audio tokens from ``mel_frames`` mel frames (the audio encoder's length rule, ``n_window`` = 50: 13 tokens
    per full 100-frame window, the remainder through three stride-2 convolutions)."""
    chunk = 2 * n_window
    rest = mel_frames % chunk
    tail = (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 if rest else 0
    return tail + (mel_frames // chunk) * 13


def qwen3_thinker_config(
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    mlp_only_layers: tuple[int, ...] = (0,),
    deepstack_layers: int = 3,
    vocab_size: int = 512,
    encoder_hidden_size: int = 32,
    attn_implementation: str = "sdpa",
):
    """A ``Qwen3OmniMoeThinkerConfig`` with the given decoder shape and tiny audio/vision encoders.

    Args:
        num_layers, hidden_size, num_heads, num_kv_heads: the decoder shape (``hidden_size / num_heads`` even).
        intermediate_size: the dense MLP width of ``mlp_only_layers`` (default ``2 * hidden_size``).
        num_experts, num_experts_per_tok, moe_intermediate_size: the sparse-MoE blocks of the other layers
            (``moe_intermediate_size`` defaults to ``hidden_size // 2``); ``num_experts=0`` makes every layer dense.
        mlp_only_layers: 0-based layers with a dense MLP instead of the MoE block.
        deepstack_layers: deepstack feature levels (>= 1): the vision encoder has this many blocks and each one's
            merged output is added to the visual positions after decoder layer 0, 1, ... (the real model: 3).
        vocab_size: synthetic vocabulary size (>= 64; special ids from ``SYNTHETIC_TOKENS``).
        encoder_hidden_size: width of both random encoders.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
    """
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    check_decoder_shape(vocab_size, hidden_size, num_heads, num_kv_heads)
    if deepstack_layers < 1 or deepstack_layers > num_layers:
        raise ValueError(f"deepstack_layers must be in [1, num_layers={num_layers}], got {deepstack_layers}")
    tok = SYNTHETIC_TOKENS
    text = text_config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        mrope_section=_mrope_section(hidden_size // num_heads))
    text.update(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                moe_intermediate_size=moe_intermediate_size or hidden_size // 2, decoder_sparse_step=1,
                mlp_only_layers=list(mlp_only_layers))
    text["rope_parameters"]["interleaved"] = True
    audio, vision = encoder_configs(encoder_hidden_size, 1, hidden_size)
    audio.update(downsample_hidden_size=8, n_window=50, n_window_infer=800)
    # The vision encoder has one block per deepstack level, each one's merged output a level.
    vision.update(depth=deepstack_layers, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                  num_position_embeddings=64, deepstack_visual_indexes=list(range(deepstack_layers)))
    config = Qwen3OmniMoeThinkerConfig(
        text_config=text,
        audio_config=audio,
        vision_config=vision,
        audio_token_id=tok.audio,
        image_token_id=tok.image,
        video_token_id=tok.video,
        audio_start_token_id=tok.audio_start,
        user_token_id=tok.user,
        position_id_per_seconds=POSITION_ID_PER_SECONDS,
    )
    config.audio_end_token_id = tok.audio_end  # read by get_rope_index, not declared here (Qwen2.5-Omni's is)
    return set_undeclared_ids(config, attn_implementation)


def build_qwen3_thinker(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_kwargs: Any,
):
    """A ``Qwen3OmniMoeThinkerForConditionalGeneration`` with random weights, in eval mode; ``config_kwargs`` go to
    ``qwen3_thinker_config``. The weights depend only on ``seed`` and the shape."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return seeded_thinker(Qwen3OmniMoeThinkerForConditionalGeneration, qwen3_thinker_config(**config_kwargs),
                          seed=seed, dtype=dtype, device=device)


def build_qwen3_omni_model(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_kwargs: Any,
):
    """A ``Qwen3OmniMoeForConditionalGeneration`` without talker (``enable_audio_output=False``) whose ``.thinker``
    is ``build_qwen3_thinker(seed=seed, **config_kwargs)``. Generate text with
    ``model.generate(**inputs, return_audio=False, thinker_eos_token_id=SYNTHETIC_TOKENS.im_end, ...)``."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    thinker = build_qwen3_thinker(seed=seed, dtype=dtype, device=device, **config_kwargs)
    tok = SYNTHETIC_TOKENS
    config = Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False,
                                im_start_token_id=tok.im_start, im_end_token_id=tok.im_end,
                                system_token_id=tok.system, user_token_id=tok.user,
                                assistant_token_id=tok.assistant)
    return around_thinker(Qwen3OmniMoeForConditionalGeneration, config, thinker)


def _interleave(video_times: list[float], audio_tokens: int) -> list[int]:
    """The processor's merge of video and audio tokens on one time axis (``replace_video_with_audio_token``)."""
    tok = SYNTHETIC_TOKENS
    out: list[int] = []
    v = a = 0
    while v < len(video_times) and a < audio_tokens:
        if video_times[v] <= a:
            out.append(tok.video)
            v += 1
        else:
            out.append(tok.audio)
            a += 1
    return out + [tok.video] * (len(video_times) - v) + [tok.audio] * (audio_tokens - a)


def qwen3_clip_inputs(
    model_or_config: Any,
    *,
    frames: int = 8,
    grid_hw: tuple[int, int] = (8, 8),
    seconds: float = 8.0,
    audio: bool = True,
    use_audio_in_video: bool = True,
    image_grid_hw: tuple[int, int] | None = None,
    question_tokens: int = 12,
    system_tokens: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Model inputs for one chat-templated question about a synthetic clip (batch size 1).

    Layout: ``<|im_start|>system\\n S <|im_end|>\\n<|im_start|>user\\n [IMAGE] MEDIA Q <|im_end|>\\n<|im_start|>
    assistant\\n`` (``S``, ``Q``: random ordinary tokens).

    Args:
        model_or_config: a model built here (thinker or full model) or its thinker config.
        frames: video frames (even; 0 = no video), sampled at ``frames / seconds`` fps. ``grid_hw``: patches per
            frame (even, even).
        seconds: clip duration: the audio track's length (``100 * seconds`` mel frames) and the video's time span.
        audio: include the clip's audio track.
        use_audio_in_video: interleave audio and video on one time axis (needs both), else two blocks.
        image_grid_hw: add one image of this many patches (even, even) before the clip.
        question_tokens, system_tokens: lengths of the random text spans.
        seed: seed of the random text and encoder inputs.

    Returns:
        ``dict`` for ``model(**inputs)`` / ``model.generate(**inputs)``.
    """
    config = thinker_config_of(model_or_config)
    tok = SYNTHETIC_TOKENS
    check_clip(frames, grid_hw)
    if image_grid_hw is not None:
        check_grid("image_grid_hw", image_grid_hw)
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if use_audio_in_video and not (frames and audio):
        raise ValueError("use_audio_in_video=True needs frames > 0 and audio=True")
    if config.position_id_per_seconds != POSITION_ID_PER_SECONDS:
        raise ValueError(f"config.position_id_per_seconds must be {POSITION_ID_PER_SECONDS} (the processor's value), "
                         f"got {config.position_id_per_seconds}")
    merge = config.vision_config.spatial_merge_size
    temporal_patch = config.vision_config.temporal_patch_size
    grids = frames // temporal_patch
    per_grid = grid_hw[0] * grid_hw[1] // merge**2
    second_per_grid = seconds / grids if grids else 0.0
    mel_frames = round(100 * seconds) if audio else 0
    n_audio = audio_token_count(mel_frames, config.audio_config.n_window) if audio else 0

    media: list[int] = []
    if image_grid_hw is not None:
        media += [tok.vision_start, *[tok.image] * (image_grid_hw[0] * image_grid_hw[1] // merge**2),
                  tok.vision_end]
    if use_audio_in_video:
        # The processor and get_rope_index compare float32 times: grid * seconds_per_grid * 13.
        times = (torch.arange(grids).float() * torch.tensor(second_per_grid).float()
                 * config.position_id_per_seconds).repeat_interleave(per_grid).tolist()
        media += [tok.vision_start, tok.audio_start, *_interleave(times, n_audio), tok.audio_end, tok.vision_end]
    else:
        if frames:
            media += [tok.vision_start, *[tok.video] * (grids * per_grid), tok.vision_end]
        if audio:
            media += [tok.audio_start, *[tok.audio] * n_audio, tok.audio_end]

    layout = ClipLayout(media, grids=grids, grid_hw=grid_hw, second_per_grid=second_per_grid,
                        mel_frames=mel_frames if audio else None, image_grid_hw=image_grid_hw)
    return chat_clip(config, layout, seed=seed, system_tokens=system_tokens, question_tokens=question_tokens,
                     use_audio_in_video=use_audio_in_video, device=device, dtype=dtype)
