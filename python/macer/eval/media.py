"""Video file -> Qwen2.5-Omni thinker inputs, with the audio of the video's own track.

Decoding (``read_clip``) uses PyAV: ``num_frames`` frames uniformly over the clip (the index rule of
``qwen-vl-utils``: ``linspace(0, n - 1, num_frames)`` rounded) and the audio track as 16 kHz mono float32. The
sampling rate handed to the processor is the *real* one, ``num_frames / duration``, because the processor turns
``fps`` into ``video_second_per_grid`` and so into the audio/video interleaving of the prompt.

``build_processor`` returns the checkpoint's ``Qwen2_5OmniProcessor`` (``video_frontend="hf"``: needs torchvision
for its video processor) or the same processor class with ``TorchVideoProcessor`` in place of the video processor
(``video_frontend="torch"``: resize, rescale, normalise and patchify in plain PyTorch, for machines where torchvision
cannot be installed, e.g. a CPU-only torch build). Everything else (tokenizer, chat layout, Whisper features,
placeholder expansion and the audio/video chunk interleaving) is the library's processor code in both cases.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["VIDEO_FRONTENDS", "Clip", "TorchVideoProcessor", "build_processor", "read_clip"]

VIDEO_FRONTENDS = ("auto", "hf", "torch")
AUDIO_RATE = 16000
"""Sampling rate of Qwen2.5-Omni's Whisper feature extractor."""
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class Clip:
    """A decoded clip: ``frames`` uint8 ``(T, H, W, 3)``, ``fps`` the real sampling rate of those frames,
    ``audio`` float32 mono at 16 kHz (None when the file has no audio track), ``duration`` in seconds."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None
    duration: float


def read_clip(path: str, num_frames: int) -> Clip:
    """Decode ``num_frames`` uniformly spaced frames and the whole audio track of ``path`` (PyAV)."""
    if not isinstance(num_frames, int) or num_frames < 2 or num_frames % 2:
        raise ValueError(f"num_frames must be an even integer >= 2 (Qwen2.5-Omni groups 2 frames per temporal "
                         f"patch), got {num_frames!r}")
    try:
        import av
    except ImportError as exc:  # the eval extra installs it; say so instead of a bare ImportError
        raise ImportError("reading video files needs PyAV: pip install \".[eval]\" (README, Install) or "
                          "pip install av") from exc

    with av.open(path) as container:
        if not container.streams.video:
            raise ValueError(f"{path}: no video stream")
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: the video stream has no decodable frame")
    with av.open(path) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0) or None
        duration = (float(container.duration) / av.time_base) if container.duration else None
        audio = _read_audio(container) if container.streams.audio else None
    if duration is None or duration <= 0:
        if rate is None:
            raise ValueError(f"{path}: neither a duration nor a frame rate is recorded; cannot tell the clip length")
        duration = len(frames) / rate
    index = np.linspace(0, len(frames) - 1, num_frames).round().astype(int)
    return Clip(np.stack([frames[i] for i in index]), num_frames / duration, audio, duration)


def _read_audio(container: Any) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
    chunks = []
    for frame in container.decode(audio=0):
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray().reshape(-1))
    for out in resampler.resample(None):  # flush the resampler's delay line
        chunks.append(out.to_ndarray().reshape(-1))
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    # Qwen2-VL's rule (transformers' smart_resize): sides divisible by factor, area in [min_pixels, max_pixels].
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class TorchVideoProcessor:
    """Qwen2-VL's video preprocessing in plain PyTorch (no torchvision): per frame a bicubic antialiased resize to
    the ``smart_resize`` size, rescale to [0, 1], CLIP mean/std normalisation, then the processor's patch layout
    ``(grid_t, grid_h/2, grid_w/2, 2, 2) x (C, temporal_patch, patch, patch)``. The resize kernel differs from
    torchvision's in the last bits; the layout and the token counts are the library's."""

    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2

    def __init__(self, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280):
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        size = kwargs.get("size") or {}
        min_pixels = size.get("shortest_edge", self.min_pixels)
        max_pixels = size.get("longest_edge", self.max_pixels)
        patches, grids = [], []
        for video in videos:
            v = torch.as_tensor(np.asarray(video)).permute(0, 3, 1, 2).float()
            factor = self.patch_size * self.merge_size
            h, w = _smart_resize(v.shape[2], v.shape[3], factor, min_pixels, max_pixels)
            v = torch.nn.functional.interpolate(v, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
            v = v.clamp(0, 255) / 255.0
            v = (v - torch.tensor(_CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(_CLIP_STD).view(1, 3, 1, 1)
            if pad := -v.shape[0] % self.temporal_patch_size:
                v = torch.cat([v, v[-1:].expand(pad, -1, -1, -1)])
            t, ps, ms, tp = v.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
            gt, gh, gw = t // tp, h // ps, w // ps
            p = v.reshape(gt, tp, 3, gh // ms, ms, ps, gw // ms, ms, ps).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(p.reshape(gt * gh * gw, 3 * tp * ps * ps))
            grids.append([gt, gh, gw])
        return {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)}


def torchvision_usable() -> bool:
    """Whether torchvision imports beside the installed torch (a mismatched build fails at import)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # a torchvision built for another torch raises RuntimeError/ImportError/OSError at import
        return False
    return True


def build_processor(pretrained: str, video_frontend: str = "auto", *, max_pixels: int | None = None) -> Any:
    """The ``Qwen2_5OmniProcessor`` of a checkpoint folder.

    Args:
        pretrained: checkpoint folder (tokenizer, ``preprocessor_config.json``).
        video_frontend: ``"hf"`` (the checkpoint's video processor; needs torchvision), ``"torch"``
            (``TorchVideoProcessor``), or ``"auto"`` (``"hf"`` when torchvision imports, else ``"torch"``).
        max_pixels: per-frame pixel cap of the video preprocessing (None: the checkpoint's).
    """
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    if video_frontend not in VIDEO_FRONTENDS:
        raise ValueError(f"video_frontend must be one of {VIDEO_FRONTENDS}, got {video_frontend!r}")
    if video_frontend == "auto":
        video_frontend = "hf" if torchvision_usable() else "torch"
    if video_frontend == "hf":
        if not torchvision_usable():
            raise ImportError("video_frontend=hf needs torchvision matching the installed torch (the checkpoint's "
                              "video processor is torchvision-based); install it or pass video_frontend=torch")
        try:
            processor = Qwen2_5OmniProcessor.from_pretrained(pretrained)
        except ValueError as exc:  # e.g. "Unrecognized image processor": no Qwen2-VL keys in the folder
            raise ValueError(f"{pretrained}: transformers cannot build this checkpoint's Qwen2.5-Omni processor for "
                             "video_frontend=hf (its preprocessor_config.json needs the Qwen2-VL image keys, as the "
                             "released checkpoints have; macer.eval.synthetic.write_checkpoint writes them); pass "
                             f"video_frontend=torch to use the PyTorch video frontend. transformers said: {exc}"
                             ) from exc
        processor.frontend = "hf"
        return processor
    # The processor class validates its parts' classes on construction, and its video processor class cannot be
    # built without torchvision: assemble the instance with the torch video processor in place of that one part.
    processor = Qwen2_5OmniProcessor.__new__(Qwen2_5OmniProcessor)
    processor.tokenizer = AutoTokenizer.from_pretrained(pretrained)
    processor.feature_extractor = WhisperFeatureExtractor.from_pretrained(pretrained)
    processor.video_processor = TorchVideoProcessor(**({"max_pixels": max_pixels} if max_pixels else {}))
    processor.chat_template = None
    tokenizer = processor.tokenizer
    for name in ("image", "audio", "video"):
        setattr(processor, f"{name}_token", getattr(tokenizer, f"{name}_token"))
        setattr(processor, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
    for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
        setattr(processor, f"{name}_token", getattr(tokenizer, f"{name}_token"))
    processor.frontend = "torch"
    return processor
