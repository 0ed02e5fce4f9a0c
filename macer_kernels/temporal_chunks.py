"""Temporal partition of video tokens for the coverage greedy."""

from __future__ import annotations

import torch

from macer_kernels._validate import check_count, check_tensor, values_checked


def temporal_chunks(temporal_positions: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Chunk id ``floor(C (t - t_min) / (t_max - t_min + 1))`` of each video token (Appendix B, coverage greedy).

    Args:
        temporal_positions: 1-D tensor of the video tokens' temporal positions (integer or floating, e.g. the
            temporal row of M-RoPE position ids). ``torch.arange(n)`` gives C equal-size bins. Floating positions must
            be finite (checked on CPU tensors, and on CUDA tensors only in validation mode).
        num_chunks: C >= 1.

    Returns:
        int64 tensor of ids in ``[0, C - 1]``, same length and device.
    """
    t = check_tensor("temporal_positions", temporal_positions, 1)
    num_chunks = check_count("num_chunks", num_chunks)
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks}")
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"temporal_positions must be integer or floating, got {t.dtype}")
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=t.device)
    if t.is_floating_point():
        if values_checked(t) and not bool(torch.isfinite(t).all()):
            raise ValueError("temporal_positions must be finite")
        t = t.to(torch.float64)
        lo, hi = t.min(), t.max()
        return torch.floor(num_chunks * (t - lo) / (hi - lo + 1)).long()
    t = t.long()
    lo, hi = t.min(), t.max()
    # Integer arithmetic: exact for any position range.
    return torch.div(num_chunks * (t - lo), hi - lo + 1, rounding_mode="floor")
