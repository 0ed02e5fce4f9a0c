"""Argument checks shared by the ops. Every error names the parameter and what is allowed."""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import torch


def check_count(name: str, value: object) -> int:
    """A non-negative Python integer (bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value}")
    return int(value)


def check_real(
    name: str, value: object, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    """A finite real number in the interval given by ``lo``, ``hi`` and the open flags."""
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number in {interval}, got {value!r}")
    value = float(value)
    below = value <= lo if lo_open else value < lo
    above = value >= hi if hi_open else value > hi
    if below or above:
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def decimal_fraction(value: numbers.Real) -> Fraction:
    """The exact rational a user means by a real number: a ``Fraction`` as given, an integer as itself, and a float
    as the decimal Python prints for it (``repr``, the shortest decimal that reads back as the same float).

    ``0.35`` is stored as the binary ``0.34999999999999997779...``; read as 35/100 it gives the paper's numbers, e.g.
    ``floor(0.35 * 90 + 0.5) = 32`` where float arithmetic gives 31. A float that is not a short decimal reads as
    the (up to 17) significant digits ``repr`` prints (``1 / 3`` as ``0.3333333333333333``); pass a ``Fraction`` for
    an exact rational such as 1/3.
    """
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    try:
        # str() of Python and NumPy floats is the shortest round-trip decimal (NumPy's float32 prints '0.35' too).
        return Fraction(str(value))
    except ValueError:
        return Fraction(float(value))


def check_tensor(name: str, value: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def read_back(*values: torch.Tensor) -> list[int]:
    """Integer values of several 0-d device tensors, read back to the host in one synchronisation.

    The data-dependent checks (label ranges, NaN, sortedness) need host values; on a GPU each separate ``int(t)``
    is a full stream synchronisation, so the checks of one call share one.
    """
    return torch.stack([v.to(torch.int64) for v in values]).tolist()


def check_no_nan(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and bool(torch.isnan(t).any()):
        raise ValueError(f"{name} contains NaN; scores must be comparable numbers")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")
