"""The CUDA device a Triton launch runs on."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def on_input_device(fn: F) -> F:
    """Run ``fn`` with the device of its first (tensor) argument made current.

    A Triton launch goes to the *current* CUDA device and that device's current stream, whatever device the pointers
    live on. Without this, tensors on ``cuda:1`` (a model split over GPUs) would be read by a kernel running on
    ``cuda:0``: an illegal-address fault without peer access, a slow peer read with it, and in either case no ordering
    with the work queued on ``cuda:1``'s stream.
    """

    @functools.wraps(fn)
    def wrapper(first: torch.Tensor, *args, **kwargs):
        guard = torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            return fn(first, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
