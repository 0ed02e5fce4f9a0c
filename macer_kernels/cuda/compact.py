"""``compact`` / ``compact_many`` on the gather kernel of ``csrc/kernels/compact.cuh``: one launch moves the kept
positions of a stage's hidden states, RoPE cos/sin and position ids together."""

from __future__ import annotations

import itertools
import math

import torch

from macer_kernels.backend import register
from macer_kernels.cuda._ext import check_cuda_tensor, ext, launch_args

_UNITS = (16, 8, 4, 2, 1)


def _merged_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The single stride of dims ``shape`` if they can be flattened into one (size-1 dims ignored), else None."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    for (_, outer), (size, inner) in itertools.pairwise(dims):
        if outer != size * inner:
            return None
    return dims[-1][1] if dims else 1


def _spec(x: torch.Tensor, dim: int, out: torch.Tensor) -> tuple[int, int, int, int, int, int, int, int]:
    """Describe ``x`` as ``[outer, N, row_units]`` units of U bytes (see ``CompactTensor`` in csrc/launchers.h)."""
    shape, strides, esize = tuple(x.shape), x.stride(), x.element_size()
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    outer_stride = _merged_stride(shape[:dim], strides[:dim])
    inner_stride = _merged_stride(shape[dim + 1:], strides[dim + 1:])
    seq_stride = strides[dim] if shape[dim] > 1 else 0
    outer_stride = 0 if outer == 1 else outer_stride
    if inner_stride != 1 and inner > 1:
        # Rows whose elements are not adjacent move one element at a time (rare: e.g. a transposed view).
        unit, row_units, unit_stride = esize, inner, inner_stride * esize
    else:
        row_bytes = inner * esize
        addresses = (row_bytes, x.data_ptr(), outer_stride * esize, seq_stride * esize)
        unit = next(u for u in _UNITS if all(a % u == 0 for a in addresses))
        row_units, unit_stride = row_bytes // unit, unit
    return (x.data_ptr(), out.data_ptr(), outer, row_units, unit, outer_stride * esize, seq_stride * esize,
            unit_stride)


def compact_many_cuda(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """Keep positions ``keep`` (int64 ``[k]``, strictly increasing) of every tensor along its ``dims`` entry; the
    outputs are new contiguous tensors. All tensors share one launch per group of ``_C.MAX_COMPACT_TENSORS``.

    Any strides are read in place when the dims before and after the sequence dim each flatten to one stride; other
    layouts are copied to contiguous memory first.
    """
    for i, t in enumerate(tensors):
        check_cuda_tensor("compact", f"tensors[{i}]", t)
    check_cuda_tensor("compact", "keep", keep)
    keep = keep.to(torch.long).contiguous()
    k = keep.numel()
    outs, specs = [], []
    # The contiguous copies must outlive the launch: a copy freed while the loop goes on goes back to the caching
    # allocator, which hands the same block to the next output, and the one launch would then read a source from
    # memory it writes. (Freed after the launch is fine: later allocations are ordered after it on this stream.)
    copies = []
    for t, d in zip(tensors, dims):
        shape = list(t.shape)
        shape[d] = k
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        outs.append(out)
        if out.numel() == 0:
            continue
        if (_merged_stride(tuple(t.shape[:d]), t.stride()[:d]) is None
                or _merged_stride(tuple(t.shape[d + 1:]), t.stride()[d + 1:]) is None):
            t = t.contiguous()
            copies.append(t)
        specs.append(_spec(t, d, out))
    if specs:
        device, stream = launch_args(keep)
        ext().compact_many(specs, keep.data_ptr(), k, device, stream)
    return outs


def compact_cuda(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``compact`` of one tensor: ``compact_many_cuda([x], keep, [dim])[0]``."""
    return compact_many_cuda([x], keep, [dim])[0]


register("compact", "cuda")(compact_cuda)
register("compact_many", "cuda")(compact_many_cuda)
