"""The compiled module ``macer_kernels._C`` and the small helpers every CUDA wrapper uses.

``_C`` links no libtorch: tensors cross the boundary as integer data pointers plus shapes, strides (in elements)
and dtype codes, and the stream as an integer. This file owns that translation.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

try:
    # import_module, not `from macer_kernels import _C`: a missing module must surface as ModuleNotFoundError (the
    # "not built" reason), where the from-import turns it into a plain ImportError ("cannot import name '_C'").
    _ext_module = importlib.import_module("macer_kernels._C")
except ImportError as exc:  # not built (no nvcc, MACER_NO_CUDA=1) or built for another Python
    _ext_module = None
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

_DTYPE_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
}


def ext() -> ModuleType:
    """The compiled module; raises ``RuntimeError`` with the import error when it is missing."""
    if _ext_module is None:
        raise RuntimeError(f"macer_kernels._C is not available: {IMPORT_ERROR}")
    return _ext_module


def dtype_code(op: str, name: str, t: torch.Tensor) -> int:
    """The ``_C`` dtype code of ``t`` (see ``csrc/launchers.h``)."""
    if t.dtype not in _DTYPE_NAMES:
        raise TypeError(f"{op} (cuda): {name} has dtype {t.dtype}; supported: {sorted(_DTYPE_NAMES.values())}")
    return int(ext().DTYPE_CODES[_DTYPE_NAMES[t.dtype]])


def check_cuda_tensor(op: str, name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{op} (cuda): {name} must be a CUDA tensor, got device {t.device}")


def launch_args(t: torch.Tensor) -> tuple[int, int]:
    """``(device index, stream handle)``: the launch goes on torch's current stream of ``t``'s device."""
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return index, torch.cuda.current_stream(index).cuda_stream


def workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """Scratch memory from torch's caching allocator (256-byte aligned, so 16-byte vector access is safe)."""
    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=64)
def select_workspace_bytes(n: int, device: int) -> int:
    """Workspace of the selection ops for n scores (asks CUB once per (n, device))."""
    return int(ext().select_workspace_bytes(n, device))


@functools.lru_cache(maxsize=64)
def select_cta_max_n(device: int, coverage: bool, wide: bool = True) -> int:
    """Largest n the shared-memory selection kernel takes on ``device`` in one launch (one CTA per row, or a thread
    block cluster per row on sm_90; asked once per device). ``wide``: float64 scores (64-bit keys, a lower limit for
    top-K); the default answers for every dtype."""
    return int(ext().select_cta_max_n(device, coverage, wide))
