"""Tiny random Qwen-Omni thinker checkpoints and real multimodal inputs, built in code (no download), for the vLLM
tests of the real thinker architectures (``test_omni_baseline.py``).

* ``write_qwen25_omni(directory, ...)``, ``omni_tokenizer()``, ``omni_processor()``, ``QWEN25_OMNI_TOKENS``,
  ``check_head_size``, ``save_checkpoint``, ``quiet_transformers``: the package's (``macer.testing_omni``, which
  ``python -m macer.testing_omni`` runs for the CPU recipe of docs/serving.md), re-exported here.
* ``waveform(...)``, ``video_frames(...)``: a 16 kHz mono ``float32`` waveform and ``uint8`` RGB frames, what a user
  decodes from a file; ``wav_data_url(...)``, ``video_data_url(...)`` (optionally with the waveform as its sound
  track): the same as ``data:`` URLs for the chat API's ``audio_url`` / ``video_url`` parts, lossless but for the
  WAV's rounding to 16 bits (``pcm16``).
* ``chat_prompt(processor, content)``: the prompt text of one user turn (the checkpoint's chat template), with the
  generation prompt.
* ``load_hf_thinker(path)``: transformers' thinker with the checkpoint's weights.
* ``vllm_interleaved_positions`` / ``vllm_positions``: vLLM 0.32.0's M-RoPE positions of a Qwen2.5-Omni prompt with
  interleaved audio (one token off against transformers'), and transformers' thinker run with them.

vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128 only (the language model's head size is 32 by default).
"""

from __future__ import annotations

import base64
import contextlib
import io
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from macer.testing_omni import (
    CHAT_TEMPLATE,
    QWEN25_OMNI_TOKENS,
    SAMPLE_RATE,
    chat_template,
    check_head_size,
    omni_processor,
    omni_tokenizer,
    quiet_transformers,
    save_checkpoint,
    write_qwen25_omni,
)

__all__ = [
    "CHAT_TEMPLATE",
    "QWEN25_OMNI_TOKENS",
    "SAMPLE_RATE",
    "chat_prompt",
    "chat_template",
    "check_head_size",
    "load_hf_thinker",
    "omni_processor",
    "omni_tokenizer",
    "pcm16",
    "quiet_transformers",
    "save_checkpoint",
    "video_data_url",
    "video_frames",
    "vllm_interleaved_positions",
    "vllm_positions",
    "wav_data_url",
    "waveform",
    "write_qwen25_omni",
]


def load_hf_thinker(path: str | Path, *, attn_implementation: str = "sdpa"):
    """transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` with the checkpoint's ``thinker.`` weights, fp32,
    in eval mode (every key must match both ways). ``Qwen2_5OmniForConditionalGeneration.from_pretrained`` would
    also want the talker's speaker file, ``spk_dict.pt``, which a thinker-only checkpoint has no use for."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    with quiet_transformers():  # the unused talker config's default token ids lie outside its vocabulary
        config = AutoConfig.from_pretrained(path).thinker_config
    config._attn_implementation = attn_implementation
    for sub in (config.text_config, config.audio_config, config.vision_config):
        sub._attn_implementation = attn_implementation
    model = Qwen2_5OmniThinkerForConditionalGeneration(config)  # not on "meta": its rotary buffers are not saved
    prefix = "thinker."
    weights = {key[len(prefix):]: value for key, value in load_file(Path(path) / "model.safetensors").items()
               if key.startswith(prefix)}
    model.load_state_dict(weights, strict=True)
    return model.float().eval()


def waveform(seconds: float, *, seed: int = 0) -> np.ndarray:
    """A 16 kHz mono ``float32`` waveform of ``seconds`` seconds in [-1, 1]: a few tones and noise, distinct per
    ``seed`` (so two clips give two different encodings)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    tones = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
    return np.clip(tones + 0.05 * rng.standard_normal(t.shape), -1, 1).astype(np.float32)


def video_frames(num_frames: int, *, height: int = 112, width: int = 112, seed: int = 0) -> np.ndarray:
    """``[num_frames, height, width, 3]`` ``uint8`` RGB frames: a smooth random image drifting over time plus
    noise, distinct per ``seed``."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 255, size=(height // 8 + 2, width // 8 + 2, 3))
    frames = []
    for index in range(num_frames):
        shifted = np.roll(base, index, axis=1)
        big = np.kron(shifted, np.ones((8, 8, 1)))[:height, :width]
        frames.append(np.clip(big + rng.normal(0, 8, big.shape), 0, 255))
    return np.stack(frames).astype(np.uint8)


def wav_data_url(samples: np.ndarray) -> str:
    """``samples`` (16 kHz mono float) as a ``data:audio/wav;base64,...`` URL of 16-bit PCM WAV."""
    import wave

    pcm = _pcm16_ints(samples)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_data_url(frames: np.ndarray, *, fps: float = 2.0, audio: np.ndarray | None = None) -> str:
    """``frames`` (``[T, H, W, 3]`` uint8 RGB) at ``fps`` frames per second, with ``audio`` (a 16 kHz mono waveform)
    as its sound track if given, as a ``data:video/x-matroska;base64,...`` URL. Lossless: FFV1 video (RGB) and 32-bit
    float PCM audio, so vLLM decodes back exactly ``frames`` (OpenCV) and ``audio`` as ``float32`` (PyAV). Written
    with PyAV (``av``, the audio decoder of vLLM's ``audio`` extra).

    Not 16-bit PCM: vLLM 0.32.0's ``load_audio_pyav`` (``vllm/multimodal/media/audio.py``) returns a sound track it
    does not resample as ``frame.to_ndarray().astype(float32)``, which for integer sample formats is the raw integers
    (16-bit PCM decodes to values up to 32767, not [-1, 1]); float formats (``flt``, ``fltp``: AAC, MP3, Opus, float
    PCM) come back as they are."""
    import av

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"video_data_url: frames must be [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        video = container.add_stream("ffv1", rate=Fraction(fps).limit_denominator(1000))
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        sound = None
        if audio is not None:
            sound = container.add_stream("pcm_f32le", rate=SAMPLE_RATE)
            sound.layout = "mono"
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            samples = av.AudioFrame.from_ndarray(np.asarray(audio, dtype=np.float32)[None, :], format="flt",
                                                 layout="mono")
            samples.sample_rate = SAMPLE_RATE
            container.mux(sound.encode(samples))
            container.mux(sound.encode())
    return "data:video/x-matroska;base64," + base64.b64encode(buffer.getvalue()).decode()


def _pcm16_ints(samples: np.ndarray) -> np.ndarray:
    # x * 32768, the inverse of the decoders' int / 32768, so that pcm16 of pcm16 samples changes nothing.
    return np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32768), -32768, 32767).astype("<i2")


def pcm16(samples: np.ndarray) -> np.ndarray:
    """``samples`` as a decoder gives them back from 16-bit PCM (``wav_data_url``): ``float32`` multiples of
    1/32768."""
    return _pcm16_ints(samples).astype(np.float32) / 32768


def vllm_interleaved_positions(positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The M-RoPE positions vLLM 0.32.0 gives a Qwen2.5-Omni prompt, from transformers' ``get_rope_index`` positions
    ``[3, N]`` of the same ``input_ids`` ``[N]``: they differ in every video whose audio is interleaved
    (``use_audio_in_video=True``), the span ``<|vision_bos|><|audio_bos|> X_1 .. X_K <|audio_eos|><|vision_eos|>``.

    transformers (the Qwen reference) gives ``<|vision_bos|>`` and ``<|audio_bos|>`` one position ``p``, the K
    interleaved media tokens their time-aligned positions ``m_1 .. m_K`` (built from ``p + 1``), and
    ``<|audio_eos|>``, ``<|vision_eos|>`` one position ``q = max + 1``. vLLM's ``get_mrope_input_positions``
    (``vllm/model_executor/models/qwen2_5_omni_thinker.py``) starts the video item's positions at its placeholder
    offset, which is ``<|audio_bos|>`` (the prompt update is ``[<|audio_bos|>, X.., <|audio_eos|>]``), but
    ``_compute_interleaved_positions`` returns positions for the K media tokens only: ``<|audio_bos|>`` gets ``m_1``,
    ``X_i`` gets ``m_(i+1)``, and from ``X_K`` on the tokens count as text: ``X_K`` gets ``q``, ``<|audio_eos|>``
    ``q + 1``, ``<|vision_eos|>`` ``q + 2``, and every later token two more than in transformers (per such video).
    Without an interleaved video the two agree (tested).
    """
    tok = QWEN25_OMNI_TOKENS
    ids = input_ids.tolist()
    result = positions.clone()
    shift = 0  # what vLLM adds, after the spans seen so far, to transformers' positions
    for start in (k for k in range(1, len(ids)) if ids[k] == tok.audio_start and ids[k - 1] == tok.vision_start):
        end = ids.index(tok.audio_end, start)  # <|audio_eos|>
        media = end - start - 1
        result[:, start:start + media] = positions[:, start + 1:end] + shift
        text_from = int(result[:, :start + media].max()) + 1
        result[:, start + media:end + 2] = text_from + torch.arange(3)  # X_K, <|audio_eos|>, <|vision_eos|>
        shift = text_from + 3 - (int(positions[0, end]) + 1)
        result[:, end + 2:] = positions[:, end + 2:] + shift
    return result


@contextlib.contextmanager
def vllm_positions(thinker: Any):
    """Within the block, transformers' ``thinker`` computes its M-RoPE positions as vLLM 0.32.0 does
    (``vllm_interleaved_positions``) for prefills and, through its ``rope_deltas``, decode steps; the rest of its
    forward is untouched. Batch size 1."""
    original = thinker.get_rope_index

    def get_rope_index(input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        positions, deltas = original(input_ids, *args, **kwargs)
        if input_ids.shape[0] != 1:
            raise ValueError("vllm_positions: batch size 1 only")
        shifted = vllm_interleaved_positions(positions[:, 0], input_ids[0])[:, None]
        return shifted, torch.full_like(deltas, int(shifted.max()) + 1 - input_ids.shape[1])

    thinker.get_rope_index = get_rope_index
    try:
        yield thinker
    finally:
        del thinker.get_rope_index


def chat_prompt(processor: Any, content: list[dict[str, Any]] | str) -> str:
    """The prompt text of one user turn with ``content`` (chat parts or a string), from the checkpoint's chat
    template, ending with the assistant header."""
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
