"""macer.eval.media without lmms-eval: the torch video frontend against independent oracles, clip decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from macer.eval.media import TorchVideoProcessor, _smart_resize, build_processor


@pytest.mark.parametrize("hw", [(48, 64), (336, 336), (720, 1280), (30, 900), (1000, 20)])
def test_smart_resize_matches_transformers(hw):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for max_pixels in (336 * 336, 28 * 28 * 1280):
        assert _smart_resize(*hw, 28, 56 * 56, max_pixels) == smart_resize(*hw, 28, 56 * 56, max_pixels)


def test_torch_video_patch_layout_against_loop_oracle():
    seed = 7
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (5, 56, 84, 3), dtype=np.uint8)  # odd frame count: last frame repeated
    out = TorchVideoProcessor()([frames])
    assert out["video_grid_thw"].tolist() == [[3, 4, 6]]
    mean, std = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
    video = np.concatenate([frames, frames[-1:]]).astype(np.float64) / 255.0  # 56 x 84 is already a size rule
    video = ((video - mean) / std).transpose(0, 3, 1, 2)  # (T, C, H, W)
    rows = []
    for t in range(3):
        for bh in range(2):
            for bw in range(3):
                for mh in range(2):
                    for mw in range(2):
                        h, w = 2 * bh + mh, 2 * bw + mw
                        block = video[2 * t:2 * t + 2, :, 14 * h:14 * h + 14, 14 * w:14 * w + 14]
                        rows.append(block.transpose(1, 0, 2, 3).reshape(-1))  # (C, temporal, y, x)
    expected = torch.tensor(np.stack(rows), dtype=torch.float32)
    assert out["pixel_values_videos"].shape == expected.shape
    assert torch.allclose(out["pixel_values_videos"], expected, atol=1e-5), f"seed {seed}"


def test_torch_video_resizes_to_the_pixel_cap():
    frames = np.zeros((12, 480, 640, 3), dtype=np.uint8)
    grid = TorchVideoProcessor(max_pixels=336 * 336)([frames])["video_grid_thw"][0].tolist()
    assert grid == [6, *(s // 14 for s in _smart_resize(480, 640, 28, 56 * 56, 336 * 336))]
    assert grid[1] * grid[2] * 196 <= 336 * 336


def test_build_processor_rejects_unknown_frontend(tmp_path):
    with pytest.raises(ValueError, match="video_frontend must be one of"):
        build_processor(str(tmp_path), "decord")


def test_read_clip_samples_uniformly_with_real_fps(tmp_path):
    pytest.importorskip("av", reason="needs PyAV (requirements-eval.txt)")
    from macer.eval.media import read_clip
    from macer.eval.synthetic import write_clip

    path = write_clip(tmp_path / "c.mp4", seconds=3.0, fps=8, size=(64, 48), seed=1)
    clip = read_clip(str(path), 12)
    assert clip.frames.shape == (12, 48, 64, 3) and clip.frames.dtype == np.uint8
    assert abs(clip.duration - 3.0) < 0.15 and abs(clip.fps - 12 / clip.duration) < 1e-9
    assert clip.audio is not None and abs(clip.audio.size / 16000 - 3.0) < 0.1
    with pytest.raises(ValueError, match="even integer"):
        read_clip(str(path), 7)
