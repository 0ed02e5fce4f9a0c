"""Capacity-coordinated split of the retained multimodal budget."""

from __future__ import annotations

import functools
import numbers
from fractions import Fraction

from macer_kernels._validate import check_count, check_real, decimal_fraction
from macer_kernels.types import Budget

__all__ = ["exact_ratio", "split_budget", "split_budget_exact"]


def split_budget(n_audio: int, n_video: int, keep_ratio: float | Fraction, audio_share: float | Fraction) -> Budget:
    """Split the retained multimodal budget between audio and video (Sec. 4; ``eq:capacity_nominal``,
    ``eq:capacity_split``).

    ``K_mm = min(n_a + n_v, floor(rho (n_a + n_v) + 0.5))``,
    ``Kbar_a = floor(alpha K_mm + 0.5)``, ``Kbar_v = K_mm - Kbar_a``,
    ``K_a = min(n_a, Kbar_a + max(0, Kbar_v - n_v))``, ``K_v = K_mm - K_a``.

    Capacity a modality cannot use is reassigned to the other, so ``K_a <= n_a`` and ``K_v <= n_v`` always hold.

    The products are computed exactly on the decimal numbers written: ``keep_ratio=0.35`` means 35/100, so
    ``split_budget(45, 45, 0.35, 0.3).total`` is ``floor(31.5 + 0.5) = 32`` (float arithmetic gives
    ``0.35 * 90 = 31.499999999999996`` and 31). A float is read as the shortest decimal that Python prints for it
    (``repr``); one that is not a short decimal, such as ``1 / 3``, reads as the digits printed
    (0.3333333333333333, 16 of them). Pass a ``fractions.Fraction`` for an exact rational (``Fraction(1, 3)``).

    Args:
        n_audio, n_video: token counts, non-negative integers.
        keep_ratio: rho in (0, 1], a float or a ``Fraction``.
        audio_share: alpha, the retained-audio share, in [0, 1], a float or a ``Fraction``.

    Returns:
        ``Budget(total, audio, video)``.
    """
    n_audio = check_count("n_audio", n_audio)
    n_video = check_count("n_video", n_video)
    check_real("keep_ratio", keep_ratio, 0.0, 1.0, lo_open=True)
    check_real("audio_share", audio_share, 0.0, 1.0)
    # A Fraction just outside the range can round into it as a float (1 + 10**-20 -> 1.0): check the exact value.
    if not 0 < decimal_fraction(keep_ratio) <= 1:
        raise ValueError(f"keep_ratio must be in (0.0, 1.0], got {keep_ratio}")
    if not 0 <= decimal_fraction(audio_share) <= 1:
        raise ValueError(f"audio_share must be in [0.0, 1.0], got {audio_share}")
    return split_budget_exact(n_audio, n_video, decimal_fraction(keep_ratio), decimal_fraction(audio_share))


@functools.lru_cache(maxsize=1024, typed=True)
def _cached_ratio(value: numbers.Real) -> Fraction:
    return decimal_fraction(value)


def exact_ratio(value: float | numbers.Real) -> Fraction:
    """``decimal_fraction(value)`` (the rational a user means by a real number: 0.35 is 35/100), cached by type and
    value: a policy's ratios are constants, and reading a float's decimal digits costs microseconds per call."""
    try:
        return _cached_ratio(value)  # type: ignore[arg-type]  # numbers.Real is not Hashable: see the except
    except TypeError:  # an unhashable number type
        return decimal_fraction(value)


def split_budget_exact(n_audio: int, n_video: int, keep_ratio: Fraction, audio_share: Fraction) -> Budget:
    """``split_budget`` on exact rationals, in integer arithmetic and without argument checks (a policy calls it with
    its validated fields read by ``exact_ratio``). With rho = p / q, ``floor(rho n + 1/2) = (2 p n + q) // (2 q)``
    exactly (Python integers), and the same for alpha K_mm: the result equals
    ``macer_kernels.reference.split_budget_ref``'s ``Fraction`` arithmetic for every input."""
    p, q = keep_ratio.numerator, keep_ratio.denominator
    a, b = audio_share.numerator, audio_share.denominator
    n = n_audio + n_video
    total = min(n, (2 * p * n + q) // (2 * q))
    nominal_audio = (2 * a * total + b) // (2 * b)
    audio = min(n_audio, nominal_audio + max(0, total - nominal_audio - n_video))
    return Budget(total, audio, total - audio)
