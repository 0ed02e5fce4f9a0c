"""One left-padded batch from several single-prompt Qwen-Omni inputs, as transformers accepts it.

``batch_inputs`` is used by ``macer.eval`` (``--batch_size N`` of ``macer_qwen2_5_omni``), the batch tests and
``benchmarks/bench_batch.py``; ``macer.testing.batch_inputs`` is the same function. See docs/integration.md, "Batches".
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BATCHED_KEYS", "batch_inputs"]

_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
BATCHED_KEYS = ("input_ids", "attention_mask", "use_audio_in_video", *_MEDIA_KEYS, "input_features",
                "feature_attention_mask")
"""The input names ``batch_inputs`` combines; any other name in a sample is refused (never silently dropped)."""


def batch_inputs(samples: list[dict[str, Any]], *, pad_token_id: int = 0, padding_side: str = "left") -> dict[str, Any]:
    """One batch from several single-prompt inputs (a Qwen2.5-Omni / Qwen3-Omni processor's output for one prompt,
    ``macer.testing.clip_inputs(...)``, ``macer.testing_qwen3.qwen3_clip_inputs(...)``), as the processors pad a batch.

    ``input_ids`` / ``attention_mask`` are padded to the longest prompt on ``padding_side`` (``"left"``, as
    ``generate`` needs; ``"right"`` to test that ``macer.compress`` refuses it) with ``pad_token_id``; the media of
    the samples that have them are concatenated in sample order (image and video patches, grid rows and seconds per
    grid), and the audio features are stacked, right-padded to the longest with a per-audio
    ``feature_attention_mask``.

    Each sample holds one prompt (``input_ids`` of shape ``[1, N]``) and only names in ``BATCHED_KEYS``. The samples
    with a video must share ``use_audio_in_video`` (transformers reads one flag per call; a mismatch raises
    ``ValueError``); a sample without a video (audio-only, image, text-only) goes with either, and the batch takes the
    flag of the samples with a video.
    """
    if not samples:
        raise ValueError("batch_inputs: samples must be a non-empty list of single-prompt input dicts")
    if padding_side not in ("left", "right"):
        raise ValueError(f"batch_inputs: padding_side must be 'left' or 'right', got {padding_side!r}")
    for i, sample in enumerate(samples):
        unknown = sorted(set(sample) - set(BATCHED_KEYS))
        if unknown:
            raise ValueError(f"batch_inputs: sample {i} has inputs {unknown} that cannot be batched; known: "
                             f"{list(BATCHED_KEYS)}")
        ids = sample["input_ids"]
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"batch_inputs: sample {i} must hold one prompt (input_ids [1, N]), got input_ids of "
                             f"shape {tuple(ids.shape)}")
    # The flag only changes how a video's positions are laid out: a sample without a video (audio-only, image,
    # text-only) goes with either, so only the samples with a video must agree.
    with_video = {bool(s.get("use_audio_in_video", False)) for s in samples if "video_grid_thw" in s}
    if len(with_video) > 1:
        raise ValueError("batch_inputs: the samples with a video disagree on use_audio_in_video (one flag per call "
                         "in transformers); batch prompts of one layout together (samples without a video go with "
                         "either)")
    flags = with_video or {any(bool(s.get("use_audio_in_video", False)) for s in samples)}
    ids = [s["input_ids"][0] for s in samples]
    masks = [s["attention_mask"][0] for s in samples]
    width = max(t.numel() for t in ids)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        fill = t.new_full((width - t.numel(),), value)
        return torch.cat([fill, t] if padding_side == "left" else [t, fill])

    out: dict[str, Any] = {
        "input_ids": torch.stack([pad(t, pad_token_id) for t in ids]),
        "attention_mask": torch.stack([pad(m, 0) for m in masks]),
        "use_audio_in_video": flags.pop(),
    }
    for name in _MEDIA_KEYS:
        parts = [s[name] for s in samples if name in s]
        if parts:
            out[name] = torch.cat(parts)
    features = [s["input_features"] for s in samples if "input_features" in s]
    if features:
        frames = max(f.shape[-1] for f in features)
        out["input_features"] = torch.cat(
            [torch.nn.functional.pad(f, (0, frames - f.shape[-1])) for f in features])
        out["feature_attention_mask"] = torch.cat(
            [torch.nn.functional.pad(s["feature_attention_mask"], (0, frames - s["feature_attention_mask"].shape[-1]))
             for s in samples if "input_features" in s])
    return out
