"""Capacity-coordinated split of the retained multimodal budget."""

from __future__ import annotations

from macer_kernels._validate import check_count, check_real
from macer_kernels.reference import split_budget_ref
from macer_kernels.types import Budget


def split_budget(n_audio: int, n_video: int, keep_ratio: float, audio_share: float) -> Budget:
    """Split the retained multimodal budget between audio and video (Sec. 4; ``eq:capacity_nominal``,
    ``eq:capacity_split``).

    ``K_mm = min(n_a + n_v, floor(rho (n_a + n_v) + 0.5))``,
    ``Kbar_a = floor(alpha K_mm + 0.5)``, ``Kbar_v = K_mm - Kbar_a``,
    ``K_a = min(n_a, Kbar_a + max(0, Kbar_v - n_v))``, ``K_v = K_mm - K_a``.

    Capacity a modality cannot use is reassigned to the other, so ``K_a <= n_a`` and ``K_v <= n_v`` always hold.

    Args:
        n_audio, n_video: token counts, non-negative integers.
        keep_ratio: rho in (0, 1].
        audio_share: alpha, the retained-audio share, in [0, 1].

    Returns:
        ``Budget(total, audio, video)``.
    """
    n_audio = check_count("n_audio", n_audio)
    n_video = check_count("n_video", n_video)
    keep_ratio = check_real("keep_ratio", keep_ratio, 0.0, 1.0, lo_open=True)
    audio_share = check_real("audio_share", audio_share, 0.0, 1.0)
    # Scalar arithmetic: the reference is the implementation, on validated arguments.
    return split_budget_ref(n_audio, n_video, keep_ratio, audio_share)
