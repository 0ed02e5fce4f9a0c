"""``compact`` / ``compact_many`` in one Triton launch for all the tensors of a call.

Each tensor is seen as ``[outer, N, inner]`` through its strides (the dimensions before and after the sequence
dimension merged, which any view whose outer and inner parts are each a single strided block allows) and its kept
rows are copied into a new contiguous ``[outer, k, inner]``. Up to ``SLOTS`` tensors go into one launch: each
tensor is a slot with its own pointers (typed by its own dtype, so mixed dtypes need neither a byte-copy nor one
launch per dtype), sizes and strides passed as kernel arguments, so there is no pointer table to copy to the device
and the launch can be captured in a CUDA graph. Grid: (rows, slots); program (row, t) copies the row-th kept row
``(o, r)`` of tensor t, if that tensor has that many rows.

A 2-D keep ``[B, W]`` (a padded batch, each row a run of -1 then strictly increasing indices) needs every tensor's
batch dimension just before its sequence dimension: that makes the batch the innermost of the merged outer
dimensions, so outer index ``o`` belongs to sample ``o % B`` and reads keep row ``o % B``. A -1 entry gives an
all-zero output row and reads nothing of the source. A 1-D keep is the case ``B = 1``: every outer index reads row 0.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import triton
import triton.language as tl

from macer_kernels.backend import register

SLOTS = 8
"""Tensors per launch; a call with more tensors takes one launch per 8."""

_BLOCK = 1024  # elements per step of a row copy: 2 KB of bf16 hidden state, a 3584-wide row in 4 steps


@triton.jit
def _copy_row(keep_ptr, row, k, kb, src, dst, outer, inner, s_o, s_n, s_i, BLOCK: tl.constexpr):
    """Copy kept row ``row = o * k + r`` of one tensor: ``dst[o, r, :] = src[o, keep[o % kb, r], :]``, zeros where
    that keep entry is negative (-1: the left fill of a shorter sample)."""
    if row < outer * k:
        o = row // k
        r = row - o * k
        idx = tl.load(keep_ptr + (o % kb).to(tl.int64) * k + r)
        src_row = src + o.to(tl.int64) * s_o + idx * s_n
        dst_row = dst + row.to(tl.int64) * inner
        offs = tl.arange(0, BLOCK)
        # A -1 entry reads nothing (its address lies before the source row) and writes zeros: the source mask is the
        # row mask with every lane cut when idx < 0.
        src_end = tl.where(idx >= 0, inner, 0)
        for j0 in range(0, inner, BLOCK):
            j = j0 + offs
            ok = j < inner
            tl.store(dst_row + j, tl.load(src_row + j.to(tl.int64) * s_i, mask=j < src_end, other=0), mask=ok)


@triton.jit
def _compact_kernel(keep_ptr, k, kb,
                    src0, dst0, outer0, inner0, so0, sn0, si0, src1, dst1, outer1, inner1, so1, sn1, si1,
                    src2, dst2, outer2, inner2, so2, sn2, si2, src3, dst3, outer3, inner3, so3, sn3, si3,
                    src4, dst4, outer4, inner4, so4, sn4, si4, src5, dst5, outer5, inner5, so5, sn5, si5,
                    src6, dst6, outer6, inner6, so6, sn6, si6, src7, dst7, outer7, inner7, so7, sn7, si7,
                    NUM_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.program_id(1)
    # Unused slots are compile-time dead (NUM_T), so their None pointers are never compiled.
    if t == 0:
        _copy_row(keep_ptr, row, k, kb, src0, dst0, outer0, inner0, so0, sn0, si0, BLOCK)
    if NUM_T > 1:
        if t == 1:
            _copy_row(keep_ptr, row, k, kb, src1, dst1, outer1, inner1, so1, sn1, si1, BLOCK)
    if NUM_T > 2:
        if t == 2:
            _copy_row(keep_ptr, row, k, kb, src2, dst2, outer2, inner2, so2, sn2, si2, BLOCK)
    if NUM_T > 3:
        if t == 3:
            _copy_row(keep_ptr, row, k, kb, src3, dst3, outer3, inner3, so3, sn3, si3, BLOCK)
    if NUM_T > 4:
        if t == 4:
            _copy_row(keep_ptr, row, k, kb, src4, dst4, outer4, inner4, so4, sn4, si4, BLOCK)
    if NUM_T > 5:
        if t == 5:
            _copy_row(keep_ptr, row, k, kb, src5, dst5, outer5, inner5, so5, sn5, si5, BLOCK)
    if NUM_T > 6:
        if t == 6:
            _copy_row(keep_ptr, row, k, kb, src6, dst6, outer6, inner6, so6, sn6, si6, BLOCK)
    if NUM_T > 7:
        if t == 7:
            _copy_row(keep_ptr, row, k, kb, src7, dst7, outer7, inner7, so7, sn7, si7, BLOCK)


def _merged(sizes: list[int], strides: list[int]) -> tuple[int, int] | None:
    """``(size, stride)`` of dimensions that form one strided block, else None."""
    dims = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    total = 1
    for size, _ in dims:
        total *= size
    for (_, outer_stride), (size, stride) in itertools.pairwise(dims):
        if outer_stride != stride * size:
            return None
    return total, dims[-1][1] if dims else 1


def _slot(x: torch.Tensor, dim: int, k: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The source (a copy only when its outer or inner dimensions do not merge), the output and the slot's
    ``(outer, inner, stride_outer, stride_n, stride_inner)``."""
    sizes, strides = list(x.shape), list(x.stride())
    outer, inner = _merged(sizes[:dim], strides[:dim]), _merged(sizes[dim + 1:], strides[dim + 1:])
    if outer is None or inner is None:
        x = x.contiguous()  # an exotic view (e.g. a permuted batch/head block): one extra copy
        sizes, strides = list(x.shape), list(x.stride())
        outer, inner = _merged(sizes[:dim], strides[:dim]), _merged(sizes[dim + 1:], strides[dim + 1:])
        assert outer is not None and inner is not None  # a contiguous tensor's dims always merge
    out = torch.empty([*sizes[:dim], k, *sizes[dim + 1:]], dtype=x.dtype, device=x.device)
    return x, out, (outer[0], inner[0], outer[1], x.stride(dim), inner[1])


def _check_batched(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> None:
    """A 2-D keep ``[B, W]``: every tensor has its batch dimension (size B) just before its sequence dimension."""
    b = keep.shape[0]
    for i, (t, d) in enumerate(zip(tensors, dims)):
        if d < 1 or t.shape[d - 1] != b:
            raise ValueError(f"tensors[{i}] must have the batch dimension (size B={b} of the 2-D keep) just before its "
                             f"sequence dimension dims[{i}]={d}, got shape {tuple(t.shape)}")


@register("compact_many", "triton")
def compact_many_triton(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """Triton ``compact_many``: one launch per ``SLOTS`` tensors (one launch for a stage's hidden states, cos, sin
    and position ids). ``keep`` is 1-D ``[k]`` (one index set for every row) or 2-D ``[B, W]`` (one row per sample,
    -1 for an all-zero output row; see the module docstring)."""
    if keep.dim() not in (1, 2):
        raise ValueError(f"keep must be 1-D [k] or 2-D [B, W], got {keep.dim()} dimensions")
    dims = [d % t.dim() for t, d in zip(tensors, dims)]
    if keep.dim() == 2:
        _check_batched(tensors, keep, dims)
    kb, k = (keep.shape[0], keep.shape[1]) if keep.dim() == 2 else (1, keep.shape[0])
    keep = keep.contiguous()  # the kernel reads keep[b, r] at b * k + r (a no-op for the usual contiguous keep)
    slots = [_slot(t, d, k) for t, d in zip(tensors, dims)]
    device = keep.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for first in range(0, len(slots), SLOTS):
            group = slots[first:first + SLOTS]
            rows = max(meta[0] * k for _, _, meta in group)
            if rows == 0:
                continue
            args = []
            for src, out, (outer, inner, s_o, s_n, s_i) in group:
                args += [src, out, outer, inner, s_o, s_n, s_i]
            args += [None, None, 0, 0, 0, 0, 0] * (SLOTS - len(group))
            _compact_kernel[(rows, len(group))](keep, k, kb, *args, NUM_T=len(group), BLOCK=_BLOCK, num_warps=4)
    return [out for _, out, _ in slots]


@register("compact", "triton")
def compact_triton(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """Triton ``compact``: the one-tensor case of ``compact_many`` (one launch)."""
    return compact_many_triton([x], keep, [dim])[0]

