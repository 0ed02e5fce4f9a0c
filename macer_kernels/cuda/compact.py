"""``compact`` / ``compact_many`` on the gather kernel of ``csrc/kernels/compact.cuh``: one launch moves the kept
positions of a stage's hidden states, RoPE cos/sin and position ids together, for one sequence (a 1-D keep) or a
whole padded batch (a 2-D keep ``[B, W]`` whose -1 entries give all-zero rows)."""

from __future__ import annotations

import itertools

import torch

from macer_kernels.backend import register
from macer_kernels.cuda._ext import check_cuda_tensor, ext, launch_args


def _merged_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The single stride of dims ``shape`` if they can be flattened into one (size-1 dims ignored), else None."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    for (_, outer), (size, inner) in itertools.pairwise(dims):
        if outer != size * inner:
            return None
    return dims[-1][1] if dims else 1


def _flattens(t: torch.Tensor, dim: int, batched: bool) -> bool:
    """Whether the dims before ``dim`` (before the batch dim ``dim - 1`` when ``batched``, which keeps its own stride)
    and after it each flatten to one stride (always true when contiguous)."""
    if t.is_contiguous():
        return True
    shape, strides = tuple(t.shape), t.stride()
    end = dim - 1 if batched else dim
    return (_merged_stride(shape[:end], strides[:end]) is not None
            and _merged_stride(shape[dim + 1:], strides[dim + 1:]) is not None)


def compact_many_cuda(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """Keep positions ``keep`` of every tensor along its ``dims`` entry; the outputs are new contiguous tensors. All
    tensors share one launch per group of ``_C.MAX_COMPACT_TENSORS``; nothing reads ``keep`` on the host.

    ``keep``: int64 ``[k]``, strictly increasing; or ``[B, W]`` for a batch: each tensor has its batch dimension, of
    size B, at ``dims[i] - 1``, and ``out[..., b, r, ...] = x[..., b, keep[b, r], ...]``, all zeros where
    ``keep[b, r]`` is -1 (the left fill of ``stage_select``'s right-aligned rows; nothing is read for it).

    Per tensor this allocates the output and passes (pointers, shape, strides, element size, dim); the module builds
    the ``[outer, batch, N, row_units]`` descriptors (``compact_descriptor`` in csrc/compact.cu). Any strides are read
    in place when the dims before and after the sequence dim (and the batch dim) each flatten to one stride; other
    layouts are copied to contiguous memory first.
    """
    for i, t in enumerate(tensors):
        check_cuda_tensor("compact", f"tensors[{i}]", t)
    check_cuda_tensor("compact", "keep", keep)
    if keep.dim() not in (1, 2):
        raise ValueError(f"compact (cuda): keep must be 1-D [k] or 2-D [B, W], got {keep.dim()} dimensions")
    batched = keep.dim() == 2
    if keep.dtype != torch.long or not keep.is_contiguous():
        keep = keep.to(torch.long).contiguous()
    rows, k = (keep.shape[0], keep.shape[1]) if batched else (0, keep.shape[0])
    for i, (t, d) in enumerate(zip(tensors, dims)):
        if batched and (d < 1 or t.shape[d - 1] != rows):
            raise ValueError(f"compact (cuda): with a 2-D keep [B={rows}, W], tensors[{i}] needs a batch dimension "
                             f"of size B just before its sequence dimension {d}, got shape {tuple(t.shape)}")
    outs, layouts = [], []
    # The contiguous copies must outlive the launch: a copy freed while the loop goes on goes back to the caching
    # allocator, which hands the same block to the next output, and the one launch would then read a source from
    # memory it writes. (Freed after the launch is fine: later allocations are ordered after it on this stream.)
    copies = []
    for t, d in zip(tensors, dims):
        shape = list(t.shape)
        shape[d] = k
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
        outs.append(out)
        if k == 0 or out.numel() == 0:
            continue
        if not _flattens(t, d, batched):
            t = t.contiguous()
            copies.append(t)
        layouts.append((t.data_ptr(), out.data_ptr(), t.shape, t.stride(), t.element_size(), d))
    if layouts:
        device, stream = launch_args(keep)
        ext().compact_layouts(layouts=layouts, keep=keep.data_ptr(), keep_rows=rows, k=k, device=device,
                              stream=stream)
    return outs


def compact_cuda(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``compact`` of one tensor: ``compact_many_cuda([x], keep, [dim])[0]``."""
    return compact_many_cuda([x], keep, [dim])[0]


register("compact", "cuda")(compact_cuda)
register("compact_many", "cuda")(compact_many_cuda)
