"""temporal_chunks: floor(C (t - t_min) / (t_max - t_min + 1))."""

import pytest
import torch

from macer_kernels import temporal_chunks
from macer_kernels.reference import temporal_chunks_ref


def test_arange_gives_equal_bins():
    assert torch.bincount(temporal_chunks(torch.arange(864), 8)).tolist() == [108] * 8


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.float64])
def test_matches_reference(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-50, 400, (333,), generator=g).to(dtype).to(device)
    if dtype.is_floating_point:
        t = t + torch.rand(333, generator=g).to(dtype).to(device)
    out = temporal_chunks(t, 8)
    assert out.dtype == torch.long and out.device == t.device
    assert torch.equal(out.cpu(), temporal_chunks_ref(t.cpu(), 8)), seed
    assert 0 <= int(out.min()) and int(out.max()) <= 7


def test_qwen_temporal_rows():
    # Qwen2.5-Omni: 12 frames, temporal grid of 2 frames, 144 tokens per grid, +50 position units per grid (2 s at
    # 25 units per s). Six temporal groups in 8 chunks: every group stays whole, two chunks stay empty.
    t = torch.arange(6).repeat_interleave(144) * 50 + 7
    ids = temporal_chunks(t, 8)
    assert ids.reshape(6, 144).unique(dim=1).shape[1] == 1
    assert ids[::144].tolist() == [0, 1, 3, 4, 6, 7]  # floor(8 * 50 g / 251)


def test_constant_and_empty():
    assert temporal_chunks(torch.full((5,), 3), 8).tolist() == [0] * 5
    assert temporal_chunks(torch.empty(0, dtype=torch.long), 8).numel() == 0
    assert temporal_chunks(torch.arange(3), 1).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("t", "c", "error", "message"),
    [
        (torch.arange(4), 0, ValueError, "num_chunks must be an integer >= 1"),
        (torch.arange(4), 2.0, ValueError, "num_chunks must be a non-negative integer"),
        (torch.arange(4)[None], 2, ValueError, "temporal_positions must have 1 dimensions"),
        (torch.tensor([0.0, float("inf")]), 2, ValueError, "temporal_positions must be finite"),
        (torch.tensor([True, False]), 2, TypeError, "temporal_positions must be integer or floating"),
    ],
)
def test_errors(t, c, error, message):
    with pytest.raises(error, match=message):
        temporal_chunks(t, c)
