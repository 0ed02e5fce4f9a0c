"""Argument checks of the model layer. Every error names the parameter and what is allowed.

``check_count`` and ``check_real`` are the ops' own (``macer_kernels``), so a count or a real number is refused with
the same message in both layers.
"""

from __future__ import annotations

import math
import numbers
from typing import cast

from macer_kernels import check_count, check_real

__all__ = ["check_count", "check_real", "field_bool", "field_choice", "field_int", "field_real"]


def field_int(owner: str, name: str, value: object, lo: int) -> int:
    """A config field holding an integer >= ``lo``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{owner}.{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def field_real(owner: str, name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A config field holding a finite real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if math.isinf(hi) else ']'}"
    number = cast(float, value)  # read as a number only where it is one: numbers.Real (NumPy's too) has no static type
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(number)
    if ok:
        ok = (number > lo if lo_open else number >= lo) and number <= hi
    if not ok:
        raise ValueError(f"{owner}.{name} must be a finite real number in {interval}, got {value!r}")
    return float(number)


def field_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """A config field holding one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {list(choices)}, got {value!r}")
    return value  # narrowed to str by the membership test


def field_bool(owner: str, name: str, value: object) -> bool:
    """A config field holding True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")
    return value
