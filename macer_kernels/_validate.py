"""Argument checks shared by the ops. Every error names the parameter and what is allowed.

Two kinds of checks:

* metadata (shapes, dtypes, devices, strides, Python scalars): always, on every tensor; they read nothing from the
  device and cost no synchronisation;
* values (label and position ranges, NaN scores, sorted keep indices, chunk ids): they need the tensor's contents on
  the host. On CPU tensors they always run. On CUDA (and any other non-CPU) tensors reading values back would be a
  host synchronisation per call, so they run only in **validation mode**: ``macer_kernels.validation()`` (a context
  manager), ``macer_kernels.set_validation(True)``, or the environment variable ``MACER_VALIDATE=1`` (read once, at
  the first op, and again after ``set_validation(None)``). Every op asks
  ``values_checked(t)`` before a value check; the messages are the same in both cases.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from collections.abc import Iterator
from fractions import Fraction

import torch

# The process-wide setting of ``set_validation`` (None: not set, the environment decides), ``MACER_VALIDATE`` as read
# once (None: not read yet; every op asks on every call, and os.environ costs a lookup and a decode each time), and
# the thread-local stack of ``validation()`` blocks, innermost last.
_process_setting: bool | None = None
_env_setting: bool | None = None
_local = threading.local()


def _env_validation() -> bool:
    global _env_setting
    if _env_setting is None:
        value = os.environ.get("MACER_VALIDATE", "").strip().lower()
        if value in ("", "0", "false", "no", "off"):
            _env_setting = False
        elif value in ("1", "true", "yes", "on"):
            _env_setting = True
        else:  # not cached: every call raises until the variable is fixed
            raise ValueError(f"MACER_VALIDATE must be 0 or 1 (also true/false, yes/no, on/off), got {value!r}")
    return _env_setting


def validation_enabled() -> bool:
    """Whether value checks run on CUDA tensors: the innermost ``validation()`` block, else ``set_validation``, else
    ``MACER_VALIDATE`` (read at the first call and again after ``set_validation(None)``), else off."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    if _process_setting is not None:
        return _process_setting
    return _env_validation()


def set_validation(enabled: bool | None) -> None:
    """Turn value checks on CUDA tensors on or off for the whole process (``None``: back to ``MACER_VALIDATE``, read
    again from the environment at the next call).

    ``validation()`` blocks override it in their thread. CPU tensors are always value-checked.
    """
    global _process_setting, _env_setting
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _process_setting = enabled
    if enabled is None:
        _env_setting = None


@contextlib.contextmanager
def validation(enabled: bool = True) -> Iterator[None]:
    """Run value checks on CUDA tensors (or, with ``enabled=False``, skip them) inside a ``with`` block.

    Thread-local and nesting, like ``use_backend``. With validation on, each public op reads its data-dependent
    values back in one host synchronisation and raises the same errors as on CPU; use it while developing and in
    tests, not in a serving loop.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


HOST_DEVICE_TYPES: tuple[str, ...] = ("cpu",)
"""Device types whose values live in host memory: reading them back costs no synchronisation, so their values are
always checked. (The CPU tests of sync-freedom empty it to run CPU tensors through the checks as if on a GPU.)"""


def values_checked(t: torch.Tensor) -> bool:
    """Whether an op may read ``t``'s values on the host to check them: always for CPU tensors (no synchronisation
    there), for CUDA and other device tensors only in validation mode (``validation_enabled()``)."""
    return t.device.type in HOST_DEVICE_TYPES or validation_enabled()


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
    """A real number (not NaN) in the interval given by ``lo``, ``hi`` and the open flags."""
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
    is a full stream synchronisation, so the checks of one call share one. Callers ask ``values_checked`` first.
    """
    if not values:
        return []
    return torch.stack([v.to(torch.int64) for v in values]).tolist()


def check_no_nan(name: str, t: torch.Tensor) -> None:
    """Reject NaN in ``t`` where its values are checked (``values_checked``); a no-op otherwise."""
    if t.is_floating_point() and values_checked(t) and bool(torch.isnan(t).any()):
        raise ValueError(f"{name} contains NaN; scores must be comparable numbers")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must be on one device, got {devices}")
