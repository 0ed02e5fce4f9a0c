"""The integer oracle of ``split_budget`` (``eq:capacity_nominal``, ``eq:capacity_split``), shared by every test that
checks a budget, so none of them uses the code under test (``split_budget`` is ``macer_kernels.reference``'s
``split_budget_ref`` on validated arguments) as its oracle.

Ratios become integers p / q from their decimal digits (a float as the digits ``repr`` prints, as documented; a
``Fraction`` as its numerator and denominator), and ``floor(p x / q + 1/2)`` is ``(2 p x + q) // (2 q)``: no
``Fraction`` arithmetic, no float.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

from macer_kernels import Budget


def ratio_digits(value: str | float | Fraction) -> tuple[int, int]:
    """``value`` as integers (p, q) with value p / q: a decimal string or a float from its printed digits ("0.35" ->
    (35, 100)), a ``Fraction`` as it is."""
    if isinstance(value, Fraction):
        return value.numerator, value.denominator
    sign, digits, exponent = Decimal(value if isinstance(value, str) else repr(float(value))).as_tuple()
    assert sign == 0, value
    p = int("".join(map(str, digits)))
    return (p * 10**exponent, 1) if exponent >= 0 else (p, 10**-exponent)


def exact_budget(n_audio: int, n_video: int, keep_ratio: str | float | Fraction,
                 audio_share: str | float | Fraction) -> Budget:
    """``split_budget``'s result in integer arithmetic: K_mm, the nominal audio share, the reassignment."""
    rp, rq = ratio_digits(keep_ratio)
    ap, aq = ratio_digits(audio_share)
    n = n_audio + n_video
    total = min(n, (2 * rp * n + rq) // (2 * rq))
    nominal_audio = (2 * ap * total + aq) // (2 * aq)
    audio = min(n_audio, nominal_audio + max(0, total - nominal_audio - n_video))
    return Budget(total, audio, total - audio)
