"""Temporal partition of video tokens for the coverage greedy."""

from __future__ import annotations

import numbers

import torch

from macer_kernels._validate import check_tensor, values_checked

_INT64_MAX = 2**63 - 1
# Floating positions are scaled by 2**-33 before the formula: a power of two, so every operation rounds exactly as it
# would unscaled (for normal floats), while t - t_min (up to 2 * 1.8e308 unscaled) times C (< 2**31) stays finite.
# Rounding can still make the quotient of the last chunk's tokens equal C (t_max - t_min + 1 rounds to t_max - t_min
# once the span passes 2**53); the exact value is always below C, so those ids are C - 1.
_FLOAT_SCALE = 2.0**-33


def temporal_chunks(temporal_positions: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Chunk id ``floor(C (t - t_min) / (t_max - t_min + 1))`` of each video token (Appendix B, coverage greedy).

    Args:
        temporal_positions: 1-D tensor of the video tokens' temporal positions (integer or floating, e.g. the
            temporal row of M-RoPE position ids). ``torch.arange(n)`` gives C equal-size bins. Integer positions must
            span less than ``2**63 - 1`` (``t_max - t_min + 1`` fits int64); within that the ids are exact. Floating
            positions must be finite (any finite float64; the span may exceed ``2**53``: the ids are then those of
            the float64 formula, computed without overflow and kept in ``[0, C - 1]``). Both are checked on CPU
            tensors, and on CUDA tensors only in validation mode (``macer_kernels.validation``), so the op never
            reads device values back on the host.
        num_chunks: C, an integer in ``[1, 2**31)``.

    Returns:
        int64 tensor of ids in ``[0, C - 1]``, same length and device.
    """
    t = check_tensor("temporal_positions", temporal_positions, 1)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, numbers.Integral) or not 1 <= num_chunks < 2**31:
        raise ValueError(f"num_chunks must be an integer >= 1 (and < 2**31), got {num_chunks!r}")
    num_chunks = int(num_chunks)
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"temporal_positions must be integer or floating, got {t.dtype}")
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=t.device)
    if t.is_floating_point():
        if values_checked(t) and not bool(torch.isfinite(t).all()):
            raise ValueError("temporal_positions must be finite")
        t = t.to(torch.float64) * _FLOAT_SCALE
        lo, hi = t.min(), t.max()
        ids = torch.floor(num_chunks * (t - lo) / (hi - lo + _FLOAT_SCALE)).long()
        return ids.clamp_(max=num_chunks - 1)
    t = t.long()
    lo, hi = t.min(), t.max()
    if values_checked(t) and int(hi) - int(lo) + 1 > _INT64_MAX:
        raise ValueError(f"temporal_positions must span less than 2**63 - 1 (t_max - t_min + 1 must fit int64), "
                         f"got t_min={int(lo)}, t_max={int(hi)}")
    d, span = t - lo, hi - lo + 1
    # C d can overflow int64 (spans beyond 2**63 / C). With R = C q + r (0 <= r < C) and d = q k + e (0 <= e < q):
    # C d = R k + (C e - r k), so floor(C d / R) = k + floor((C e - r k) / R), where C e < C q <= R and
    # r k < 2 C**2 < 2**63 (k <= d / q < 2 C): every intermediate fits int64. When R < C (q = 0), C d < C**2 fits.
    q, r = torch.div(span, num_chunks, rounding_mode="floor"), torch.remainder(span, num_chunks)
    q_safe = q.clamp(min=1)
    k, e = torch.div(d, q_safe, rounding_mode="floor"), torch.remainder(d, q_safe)
    large = k + torch.div(num_chunks * e - r * k, span, rounding_mode="floor")
    small = torch.div(num_chunks * torch.where(q == 0, d, 0), span, rounding_mode="floor")
    return torch.where(q == 0, small, large)
