"""The Qwen-Omni thinkers' test prompts and the two ways of running them, shared by ``test_omni_baseline.py`` (vLLM's
own thinkers against transformers') and ``test_omni_macer.py`` (the MACER thinkers against ``macer.compress``).

* ``Clip`` / ``CLIPS``: one user turn about a clip (audio only, video only, audio and video as two blocks, video
  with its audio interleaved, text only) with its media as a user decodes them: 16-bit samples, ``uint8`` frames.
* ``engine_request(processor, clip)``: the clip as a ``generate`` request (prompt from the chat template, the media
  as ``multi_modal_data``); ``hf_inputs(processor, clip)``: the same processor's tensors for transformers.
* ``in_process_engine(checkpoint, **kwargs)``: an ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), fp32,
  eager, no chunked prefill, no prefix caching, no multimodal processor cache (docs/serving.md says why).
* ``write_test_checkpoint(family, directory)`` / ``greedy_hf_thinker(family, checkpoint)``: the two modules'
  checkpoint of a family and transformers' thinker on it, set up as the engine decodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omni_checkpoints import SAMPLE_RATE, chat_prompt, pcm16, video_frames, waveform

__all__ = ["CLIPS", "QUESTION", "STEPS", "Clip", "engine_request", "greedy", "greedy_hf_thinker", "hf_inputs",
           "in_process_engine", "write_test_checkpoint"]

STEPS = 16
"""Greedy tokens per request."""
QUESTION = "What happens in this clip?"


@dataclass(frozen=True)
class Clip:
    """One user turn: ``seconds`` of audio (0: none), ``frames`` of video (0: none), interleaved or not."""

    name: str
    seconds: float = 0.0
    frames: int = 0
    audio_in_video: bool = False
    seed: int = 0
    audio: np.ndarray | None = field(default=None, compare=False)
    video: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self):
        # 16-bit samples, as a decoder gives them back from a WAV or a video's sound track (the chat tests).
        object.__setattr__(self, "audio", pcm16(waveform(self.seconds, seed=self.seed)) if self.seconds else None)
        object.__setattr__(self, "video", video_frames(self.frames, seed=self.seed) if self.frames else None)

    def parts(self) -> list[dict[str, Any]]:
        """The turn's content parts for the chat template (the interleaved audio has no part of its own)."""
        media = []
        if self.audio is not None and not self.audio_in_video:
            media.append({"type": "audio"})
        if self.video is not None:
            media.append({"type": "video"})
        return [*media, {"type": "text", "text": QUESTION}]


CLIPS = {
    clip.name: clip for clip in (
        Clip("audio", seconds=3.0, seed=1),
        Clip("video", frames=8, seed=2),
        Clip("audio_video", seconds=4.0, frames=8, seed=3),
        # 4 s of video (2 fps, 2 frames per grid: t = 0, 25, 50, 75) and 3 s of audio (75 tokens): two 2-second
        # chunks, V144 V144 A50 | V144 V144 A25.
        Clip("audio_in_video", seconds=3.0, frames=8, audio_in_video=True, seed=4),
        Clip("text"),
    )
}


def write_test_checkpoint(family: Any, directory: Path) -> Path:
    """``family.write`` (``write_qwen25_omni`` / ``write_qwen3_omni``) to ``directory`` at the tests' size: 4 layers of
    width 128, 4 heads, 2 KV heads. init_std 0.08: peaked attention, so that a wrong position or row changes the
    scores and tokens (at transformers' 0.02 the random model repeats one or two tokens whatever its input)."""
    return family.write(directory, num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.08)


def greedy_hf_thinker(family: Any, checkpoint: Path):
    """transformers' thinker on ``checkpoint`` (``family.load``), generating ``STEPS`` tokens whatever they are, as
    ``ignore_eos`` in the engine (``greedy``)."""
    model = family.load(checkpoint)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.text_config.pad_token_id
    return model


def in_process_engine(checkpoint, **kwargs: Any):
    """An ``LLM`` on ``checkpoint`` whose engine core runs in this process (its model is reachable through
    ``apply_model``); ``kwargs`` add to or override the shared settings."""
    import vllm

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        settings = dict(enforce_eager=True, dtype="float32", max_model_len=4096, max_num_batched_tokens=4096,
                        enable_prefix_caching=False, enable_chunked_prefill=False, kv_cache_memory_bytes=64 << 20,
                        seed=0, limit_mm_per_prompt={"audio": 2, "video": 2}, mm_processor_cache_gb=0)
        return vllm.LLM(model=str(checkpoint), **{**settings, **kwargs})
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def greedy():
    """``STEPS`` greedy tokens whatever they are (``ignore_eos``)."""
    import vllm

    return vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def engine_request(processor, clip: Clip) -> dict[str, Any]:
    """``clip`` as a ``generate`` request: the chat template's prompt text, the waveform and frames as
    ``multi_modal_data``."""
    data: dict[str, Any] = {}
    if clip.audio is not None:
        data["audio"] = [(clip.audio, SAMPLE_RATE)]
    if clip.video is not None:
        data["video"] = [clip.video]
    request: dict[str, Any] = {"prompt": chat_prompt(processor, clip.parts())}
    if data:
        request["multi_modal_data"] = data
        request["mm_processor_kwargs"] = {"use_audio_in_video": clip.audio_in_video}
    return request


def hf_inputs(processor, clip: Clip) -> dict[str, Any]:
    """The processor's tensors for ``clip`` and its ``use_audio_in_video``, for transformers' thinker."""
    media: dict[str, Any] = {}
    if clip.audio is not None:
        media["audio"] = [clip.audio]
    if clip.video is not None:
        media["videos"] = [clip.video]
    inputs = processor(text=chat_prompt(processor, clip.parts()), use_audio_in_video=clip.audio_in_video,
                       return_tensors="pt", **media)
    return {**inputs, "use_audio_in_video": clip.audio_in_video}
