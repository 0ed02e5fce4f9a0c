"""Compaction: keep a sorted set of sequence positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from macer_kernels._validate import check_int, check_same_device, check_tensor, read_back, tracing, values_checked
from macer_kernels.backend import dispatch, register


def _check_keep(keep: torch.Tensor, n: int, *, batched: bool = False) -> torch.Tensor:
    keep = check_tensor("keep", keep, 2 if batched else 1)
    check_int("keep", keep)
    if keep.numel() and values_checked(keep):
        if batched:  # one host synchronisation: -1 only as a left run, then strictly increasing indices in range
            real = keep >= 0
            lo, hi, filled, increasing = read_back(
                keep.min(), keep.max(), (real[:, 1:] | ~real[:, :-1]).all(),
                ((keep[:, 1:] > keep[:, :-1]) | ~real[:, :-1]).all())
            if lo < -1 or hi >= n:
                raise ValueError(f"keep must hold indices in [0, {n - 1}] or -1 (fill), got range [{lo}, {hi}]")
            if not filled:
                raise ValueError("keep rows must hold their -1 fill first (a left run), then the indices")
        else:
            # One host synchronisation for the range and the order.
            lo, hi, increasing = read_back(keep.min(), keep.max(), (keep[1:] > keep[:-1]).all())
            if lo < 0 or hi >= n:
                raise ValueError(f"keep must hold indices in [0, {n - 1}], got range [{lo}, {hi}]")
        if not increasing:
            raise ValueError("keep must be strictly increasing (sorted, no repeats)")
    return keep.long()


def _is_batched(keep: torch.Tensor) -> bool:
    if keep.dim() not in (1, 2):
        raise ValueError(f"keep must be 1-D [k] or, for a batch, 2-D [B, W]; got {keep.dim()} dimensions")
    return keep.dim() == 2


def _check_batch_dims(tensors: Sequence[torch.Tensor], dims: Sequence[int], b: int) -> None:
    """A 2-D keep ``[B, W]`` needs the batch dimension, of size B, just before each tensor's sequence dimension."""
    for i, (t, d) in enumerate(zip(tensors, dims, strict=True)):
        if d == 0 or t.shape[d - 1] != b:
            raise ValueError(f"with a 2-D keep [B={b}, W], tensors[{i}] needs a batch dimension of size B just before "
                             f"its sequence dimension {d}, got shape {tuple(t.shape)}")


def _check_dim(name: str, x: torch.Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name} must be an int in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D tensor, got {dim!r}")
    return dim % x.dim()


def compact(x: torch.Tensor, keep: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep the positions ``keep`` of ``x`` along ``dim``, in order (text and kept tokens keep their order).

    Args:
        x: any tensor, e.g. hidden states ``[B, N, hidden]``, RoPE ``cos``/``sin`` ``[B, N, D]``, position ids
            ``[3, B, N]`` (``dim=2``).
        keep: 1-D integer tensor of strictly increasing indices in ``[0, x.shape[dim] - 1]`` (checked on CPU tensors,
            and on CUDA tensors only in validation mode: out-of-range indices may fault there). Or, for a batch,
            ``[B, W]``: row b holds the positions of batch element b (the dimension just before ``dim``, of size B):
            a run of -1 first (each gives an all-zero row: the left padding of a re-packed batch, as
            ``select_stage`` returns it), then strictly increasing indices.
        dim: the sequence dimension (negative values count from the end).

    Returns:
        A new tensor with ``x.shape[dim]`` replaced by ``len(keep)`` (``W`` for a 2-D keep), same dtype and device.
    """
    x = check_tensor("x", x)
    check_same_device(x=x, keep=check_tensor("keep", keep))
    dim = _check_dim("dim", x, dim)
    batched = _is_batched(keep)
    if batched:
        _check_batch_dims([x], [dim], keep.shape[0])
    keep = _check_keep(keep, x.shape[dim], batched=batched)
    if tracing():  # one opaque node in the caller's graph (macer_kernels.library)
        return torch.ops.macer.compact(x, keep, dim)
    return dispatch("compact", x.device, x, keep, dim)


def compact_many(tensors: Sequence[torch.Tensor], keep: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    """``compact`` applied to several tensors that share one sequence axis (one stage's hidden states, RoPE cos/sin,
    position ids, ...). A backend may fuse this into one launch.

    Args:
        tensors: tensors on one device; ``tensors[i].shape[dims[i]]`` must be the same length N for all.
        keep: 1-D strictly increasing indices in ``[0, N - 1]``, or ``[B, W]`` per batch element as in ``compact``
            (every tensor then has its batch dimension, of size B, just before its sequence dimension).
        dims: the sequence dimension of each tensor.

    Returns:
        The compacted tensors, in order.
    """
    # A tensor or a str is iterable too: a lone tensor would be split along dim 0 into wrong "tensors", and an int
    # would fail inside list() with a message that names nothing.
    if isinstance(tensors, (torch.Tensor, str)) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__} "
                        f"(for one tensor use compact(x, keep, dim))")
    if isinstance(dims, (torch.Tensor, str)) or not isinstance(dims, Sequence):
        raise TypeError(f"dims must be a list or tuple of ints, one per tensor, got {type(dims).__name__} {dims!r}")
    tensors = [check_tensor(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    dims = list(dims)
    if len(dims) != len(tensors):
        raise ValueError(f"dims must give one dimension per tensor ({len(tensors)}), got {len(dims)}")
    if not tensors:
        return []
    dims = [_check_dim(f"dims[{i}]", t, d) for i, (t, d) in enumerate(zip(tensors, dims))]
    lengths = [t.shape[d] for t, d in zip(tensors, dims)]  # a list: symbolic sizes (traced) do not hash
    if any(length != lengths[0] for length in lengths):
        raise ValueError(f"tensors must share one sequence length along dims, got lengths {sorted(set(lengths))}")
    check_same_device(keep=check_tensor("keep", keep), **{f"tensors[{i}]": t for i, t in enumerate(tensors)})
    batched = _is_batched(keep)
    if batched:
        _check_batch_dims(tensors, dims, keep.shape[0])
    keep = _check_keep(keep, lengths[0], batched=batched)
    if tracing():
        return torch.ops.macer.compact_many(tensors, keep, dims)
    return dispatch("compact_many", keep.device, tensors, keep, dims)


def _gather_batched(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``x[..., b, keep[b, r], ...]`` along ``dim`` (batch at ``dim - 1``), zero rows where ``keep`` is -1."""
    b, w = keep.shape
    shape = list(x.shape)
    shape[dim] = w
    if x.shape[dim] == 0:  # nothing to gather from: every slot is -1 (the public op checks that), all zero rows
        return x.new_zeros(shape)
    view = [1] * x.dim()
    view[dim - 1], view[dim] = b, w
    out = torch.gather(x, dim, keep.clamp(min=0).view(view).expand(shape))
    return out.masked_fill_((keep < 0).view(view), 0)


@register("compact", "torch")
def _compact_torch(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    return _gather_batched(x, keep, dim) if keep.dim() == 2 else x.index_select(dim, keep)


@register("compact_many", "torch")
def _compact_many_torch(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    return [_compact_torch(t, keep, d) for t, d in zip(tensors, dims)]
