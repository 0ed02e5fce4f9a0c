"""Qwen2.5-Omni thinkers with random weights and synthetic prompts, built in code (no processor, no download).

Used by the tests, ``macer demo``, ``macer diagnose`` and the end-to-end benchmarks. Public as ``macer.testing``
(the same objects); the signatures here are a stable API:

* ``thinker_config(...)`` / ``build_thinker(...)``: a ``Qwen2_5OmniThinkerForConditionalGeneration`` of any depth and
  width (tiny for tests, mid-size for benchmarks, the real 7B/3B text shapes via ``text_shape="7B"`` / ``"3B"``).
* ``build_omni_model(...)``: the full ``Qwen2_5OmniForConditionalGeneration`` (talker disabled) around such a thinker.
* ``clip_inputs(model, ...)``: the keyword arguments of one prompt (``input_ids``, ``attention_mask``, encoder inputs,
  ``use_audio_in_video``, ...) for a chat-templated question about an audio-video clip, an audio-only or video-only
  clip, or plain text, at the paper's token counts by default (12 frames -> 864 video tokens, 1460 audio tokens).
* ``batch_inputs(samples, ...)``: several such prompts as one left-padded batch (``macer.batching.batch_inputs``,
  re-exported here).

What both Qwen-Omni families share (the synthetic vocabulary, the config fields, the seeded build, the clip skeleton)
is in ``macer.tools.synthetic.base``; this module decides Qwen2.5-Omni's config and token layout.

The vocabulary is small (``vocab_size``, default 512) with the special tokens remapped into it (``SYNTHETIC_TOKENS``),
so ``lm_head`` over every position stays cheap. The config names its ``<|im_end|>`` (``im_end_token_id``), from which
the adapter defaults ``MacerConfig.end_of_turn_token_id`` (the real id 151645 is outside this vocabulary).
``MacerConfig.for_model`` has no paper settings for these models (they are not Omni-7B/3B, except with
``text_shape="7B"`` / ``"3B"``): give ``audio_layer`` / ``video_layer``, or use ``macer_config_for``.

Token layout, copied from the Qwen2.5-Omni processor (``transformers`` 5.23, ``processing_qwen2_5_omni.py``):

* ``use_audio_in_video=True``: ``<|vision_bos|><|audio_bos|> V.. A.. V.. A.. <|audio_eos|><|vision_eos|>``; the video
  and audio tokens are split into 2-second chunks (``seconds_per_chunk * position_id_per_seconds`` = 50 temporal
  position units) by the processor's ``get_chunked_index`` rule, chunk k of video then chunk k of audio.
* ``use_audio_in_video=False``: ``<|vision_bos|> V*n_v <|vision_eos|><|audio_bos|> A*n_a <|audio_eos|>`` (blocks).

Audio: ``audio_tokens`` LLM tokens come from ``4 * audio_tokens`` mel frames (100 frames/s, two stride-2 reductions).
Video: ``frames`` frames of ``grid_hw`` 14-pixel patches, 2 frames per temporal grid, 2x2 patch merge, so
``frames / 2 * h * w / 4`` LLM tokens (12 frames at 24x24 -> 864). ``seconds`` sets the clip length (default: the
audio duration, ``audio_tokens / 25``), from which ``video_second_per_grid = seconds / (frames / 2)``.
"""

from __future__ import annotations

from typing import Any

import torch

from macer.tools.batching import batch_inputs
from macer.tools.synthetic.base import (
    SYNTHETIC_TOKENS,
    ClipLayout,
    SyntheticTokens,
    around_thinker,
    chat_clip,
    check_clip,
    check_decoder_shape,
    encoder_configs,
    seeded_thinker,
    set_undeclared_ids,
    text_config,
    thinker_config_of,
)

__all__ = [
    "SYNTHETIC_TOKENS",
    "TEXT_SHAPES",
    "SyntheticTokens",
    "batch_inputs",
    "build_omni_model",
    "build_thinker",
    "clip_inputs",
    "decoder_parts",
    "macer_config_for",
    "seeded_thinker",
    "thinker_config",
]


TEXT_SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-Omni text models (the thinker's LLM), from the published configs.
    "7B": {"num_layers": 28, "hidden_size": 3584, "num_heads": 28, "num_kv_heads": 4, "intermediate_size": 18944},
    "3B": {"num_layers": 36, "hidden_size": 2048, "num_heads": 16, "num_kv_heads": 2, "intermediate_size": 11008},
}
"""Real decoder shapes (random weights): ``build_thinker(text_shape="7B")``. Heavy: for GPU benchmarks."""


def _mrope_section(head_dim: int) -> list[int]:
    # Qwen2.5-Omni splits the rotary half-dimension 16/24/24 (t/h/w) for head_dim 128; keep those proportions.
    half = head_dim // 2
    t = max(1, round(half * 16 / 64))
    h = (half - t) // 2
    return [t, h, half - t - h]


def thinker_config(
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    encoder_hidden_size: int = 32,
    encoder_layers: int = 1,
    text_shape: str | None = None,
    attn_implementation: str = "sdpa",
):
    """A ``Qwen2_5OmniThinkerConfig`` with the given decoder shape and tiny audio/vision encoders.

    Args:
        num_layers, hidden_size, num_heads, num_kv_heads, intermediate_size: the decoder (text model) shape;
            ``intermediate_size`` defaults to ``2 * hidden_size``. ``hidden_size / num_heads`` must be even.
        vocab_size: size of the synthetic vocabulary (>= 64; special ids from ``SYNTHETIC_TOKENS``).
        encoder_hidden_size, encoder_layers: width and depth of both random encoders (they only have to produce
            features of the right count; their cost is kept small).
        text_shape: ``"7B"`` or ``"3B"`` overrides the decoder shape with ``TEXT_SHAPES[text_shape]``.
        attn_implementation: ``"sdpa"`` or ``"eager"`` (``"flash_attention_2"`` where installed).
    """
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    if text_shape is not None:
        if text_shape not in TEXT_SHAPES:
            raise ValueError(f"text_shape must be one of {sorted(TEXT_SHAPES)}, got {text_shape!r}")
        shape = TEXT_SHAPES[text_shape]
        num_layers, hidden_size = shape["num_layers"], shape["hidden_size"]
        num_heads, num_kv_heads = shape["num_heads"], shape["num_kv_heads"]
        intermediate_size = shape["intermediate_size"]
    check_decoder_shape(vocab_size, hidden_size, num_heads, num_kv_heads)
    tok = SYNTHETIC_TOKENS
    text = text_config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        mrope_section=_mrope_section(hidden_size // num_heads))
    audio, vision = encoder_configs(encoder_hidden_size, encoder_layers, hidden_size)
    config = Qwen2_5OmniThinkerConfig(
        text_config=text,
        audio_config={**audio, "n_window": 100},
        vision_config={**vision, "fullatt_block_indexes": [encoder_layers - 1]},
        audio_token_index=tok.audio,
        image_token_index=tok.image,
        video_token_index=tok.video,
        audio_start_token_id=tok.audio_start,
        audio_end_token_id=tok.audio_end,
        user_token_id=tok.user,
    )
    return set_undeclared_ids(config, attn_implementation)


def build_thinker(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_kwargs: Any,
):
    """A ``Qwen2_5OmniThinkerForConditionalGeneration`` with random weights, in eval mode.

    ``config_kwargs`` go to ``thinker_config`` (``num_layers``, ``hidden_size``, ``attn_implementation``, ...).
    The weights depend only on ``seed`` and the shape.
    """
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return seeded_thinker(Qwen2_5OmniThinkerForConditionalGeneration, thinker_config(**config_kwargs), seed=seed,
                          dtype=dtype, device=device)


def build_omni_model(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **config_kwargs: Any,
):
    """A ``Qwen2_5OmniForConditionalGeneration`` (talker disabled) whose ``.thinker`` is ``build_thinker(...)``.

    The thinker has the same weights as ``build_thinker(seed=seed, **config_kwargs)``.
    """
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.utils import logging as hf_logging

    thinker = build_thinker(seed=seed, dtype=dtype, device=device, **config_kwargs)
    # The default talker config names real-vocabulary token ids and warns about them; it is never instantiated.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = Qwen2_5OmniConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    inner: Any = config.thinker_config
    inner.vision_start_token_id = SYNTHETIC_TOKENS.vision_start
    inner.vision_end_token_id = SYNTHETIC_TOKENS.vision_end
    inner.im_end_token_id = SYNTHETIC_TOKENS.im_end
    attn = thinker.config.text_config._attn_implementation
    inner._attn_implementation = attn
    inner.text_config._attn_implementation = attn
    return around_thinker(Qwen2_5OmniForConditionalGeneration, config, thinker)


def _chunked_index(values: list[int], per_chunk: int) -> list[tuple[int, int]]:
    """The processor's ``get_chunked_index``, copied literally (including that a value more than one chunk ahead
    closes one chunk per following token): the token layout must match ``get_rope_index`` exactly."""
    chunks = []
    start, current = 0, 1
    for i, value in enumerate(values):
        if value >= current * per_chunk:
            chunks.append((start, i))
            start = i
            current += 1
    chunks.append((start, len(values)))
    return chunks


def clip_inputs(
    model_or_config: Any,
    *,
    frames: int = 12,
    grid_hw: tuple[int, int] = (24, 24),
    audio_tokens: int = 1460,
    use_audio_in_video: bool = True,
    seconds: float | None = None,
    question_tokens: int = 20,
    system_tokens: int = 24,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Model inputs for one chat-templated question about a synthetic clip (batch size 1).

    Layout: ``<|im_start|>system\\n S <|im_end|>\\n<|im_start|>user\\n MEDIA Q <|im_end|>\\n<|im_start|>assistant\\n``
    with ``S`` ``system_tokens`` and ``Q`` ``question_tokens`` random ordinary tokens; the prompt ends with the
    assistant header, so the question span of MACER is the last tokens of ``Q``.

    Args:
        model_or_config: a model built here (or its thinker config); gives the vocabulary size and token ids.
        frames: video frames (even; 0 = no video). ``grid_hw``: patches per frame (even, even).
        audio_tokens: LLM audio tokens (0 = no audio).
        use_audio_in_video: interleave audio and video in 2-second chunks (needs both), else two blocks.
        seconds: clip duration for the video's temporal positions; default ``audio_tokens / 25`` (or
            ``frames / 2`` seconds without audio, the processor's default 2 fps).
        question_tokens, system_tokens: lengths of the random text spans.
        seed: seed of the random text and encoder inputs.

    Returns:
        ``dict`` for ``model(**inputs)`` / ``model.generate(**inputs)``: ``input_ids``, ``attention_mask`` and, as
        present, ``pixel_values_videos``, ``video_grid_thw``, ``video_second_per_grid``, ``input_features``,
        ``feature_attention_mask``, and ``use_audio_in_video``.
    """
    config = thinker_config_of(model_or_config)
    tok = SYNTHETIC_TOKENS
    check_clip(frames, grid_hw)
    if audio_tokens < 0:
        raise ValueError(f"audio_tokens must be >= 0, got {audio_tokens}")
    if use_audio_in_video and not (frames and audio_tokens):
        raise ValueError("use_audio_in_video=True needs both frames > 0 and audio_tokens > 0")
    grids = frames // 2
    per_grid = grid_hw[0] * grid_hw[1] // 4
    if seconds is None:
        seconds = audio_tokens / config.position_id_per_seconds if audio_tokens else float(grids)
    second_per_grid = seconds / grids if grids else 0.0

    media: list[int] = []
    video_ids = [tok.video] * (grids * per_grid)
    audio_ids = [tok.audio] * audio_tokens
    if use_audio_in_video:
        per_chunk = int(config.position_id_per_seconds * config.seconds_per_chunk)
        # Temporal values as get_rope_index computes them (long() of grid * seconds_per_grid * 25).
        t_index = (torch.arange(grids) * torch.tensor(second_per_grid).float() * config.position_id_per_seconds).long()
        video_values = t_index.repeat_interleave(per_grid).tolist()
        v_chunks = _chunked_index(video_values, per_chunk)
        a_chunks = _chunked_index(list(range(audio_tokens)), per_chunk)
        media.append(tok.vision_start)
        media.append(tok.audio_start)
        for j in range(max(len(v_chunks), len(a_chunks))):
            if j < len(v_chunks):
                media += [tok.video] * (v_chunks[j][1] - v_chunks[j][0])
            if j < len(a_chunks):
                media += [tok.audio] * (a_chunks[j][1] - a_chunks[j][0])
        media += [tok.audio_end, tok.vision_end]
    else:
        if frames:
            media += [tok.vision_start, *video_ids, tok.vision_end]
        if audio_tokens:
            media += [tok.audio_start, *audio_ids, tok.audio_end]

    # 4 mel frames per audio token: two stride-2 reductions in the audio encoder's length rule.
    layout = ClipLayout(media, grids=grids, grid_hw=grid_hw, second_per_grid=second_per_grid,
                        mel_frames=4 * audio_tokens if audio_tokens else None)
    return chat_clip(config, layout, seed=seed, system_tokens=system_tokens, question_tokens=question_tokens,
                     use_audio_in_video=use_audio_in_video, device=device, dtype=dtype)


def macer_config_for(model: Any, **overrides: Any):
    """``MacerConfig`` for a model built here: the paper's settings where ``model`` has a real text shape
    (``text_shape="7B"`` / ``"3B"``), else the ``MacerConfig`` defaults (the 7B values), then ``overrides``;
    ``end_of_turn_token_id`` is the synthetic ``<|im_end|>``."""
    from macer.core.config import MacerConfig, paper_defaults

    overrides = {**(paper_defaults(model) or {}), **overrides}
    overrides.setdefault("end_of_turn_token_id", SYNTHETIC_TOKENS.im_end)
    return MacerConfig(**overrides)


def decoder_parts(model: Any):
    """``macer.hf.adapters.DecoderParts`` of a model built here: ``.decoder`` (the text model), ``.layers``, ``.root``
    (the module that receives ``input_ids`` and holds ``audio_tower``, ``visual`` and ``rope_deltas``), whichever
    module tree the installed transformers uses."""
    from macer.hf.adapters import get_adapter

    return get_adapter(model).parts(model)
