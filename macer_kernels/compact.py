"""Compaction: keep a sorted set of sequence positions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from macer_kernels._validate import check_int, check_same_device, check_tensor, read_back, values_checked
from macer_kernels.backend import dispatch, register


def _check_keep(keep: torch.Tensor, n: int) -> torch.Tensor:
    keep = check_tensor("keep", keep, 1)
    check_int("keep", keep)
    if keep.numel() and values_checked(keep):
        # One host synchronisation for the range and the order.
        lo, hi, increasing = read_back(keep.min(), keep.max(), (keep[1:] > keep[:-1]).all())
        if lo < 0 or hi >= n:
            raise ValueError(f"keep must hold indices in [0, {n - 1}], got range [{lo}, {hi}]")
        if not increasing:
            raise ValueError("keep must be strictly increasing (sorted, no repeats)")
    return keep.long()


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
            and on CUDA tensors only in validation mode: out-of-range indices may fault there).
        dim: the sequence dimension (negative values count from the end).

    Returns:
        A new tensor with ``x.shape[dim]`` replaced by ``len(keep)``, same dtype and device.
    """
    x = check_tensor("x", x)
    check_same_device(x=x, keep=check_tensor("keep", keep))
    dim = _check_dim("dim", x, dim)
    keep = _check_keep(keep, x.shape[dim])
    return dispatch("compact", x.device, x, keep, dim)


def compact_many(tensors: Sequence[torch.Tensor], keep: torch.Tensor, dims: Sequence[int]) -> list[torch.Tensor]:
    """``compact`` applied to several tensors that share one sequence axis (one stage's hidden states, RoPE cos/sin,
    position ids, ...). A backend may fuse this into one launch.

    Args:
        tensors: tensors on one device; ``tensors[i].shape[dims[i]]`` must be the same length N for all.
        keep: 1-D strictly increasing indices in ``[0, N - 1]``.
        dims: the sequence dimension of each tensor.

    Returns:
        The compacted tensors, in order.
    """
    tensors = [check_tensor(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    dims = list(dims)
    if len(dims) != len(tensors):
        raise ValueError(f"dims must give one dimension per tensor ({len(tensors)}), got {len(dims)}")
    if not tensors:
        return []
    dims = [_check_dim(f"dims[{i}]", t, d) for i, (t, d) in enumerate(zip(tensors, dims))]
    lengths = {t.shape[d] for t, d in zip(tensors, dims)}
    if len(lengths) != 1:
        raise ValueError(f"tensors must share one sequence length along dims, got lengths {sorted(lengths)}")
    check_same_device(keep=check_tensor("keep", keep), **{f"tensors[{i}]": t for i, t in enumerate(tensors)})
    keep = _check_keep(keep, lengths.pop())
    return dispatch("compact_many", keep.device, tensors, keep, dims)


@register("compact", "torch")
def _compact_torch(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    return x.index_select(dim, keep)


@register("compact_many", "torch")
def _compact_many_torch(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    return [t.index_select(d, keep) for t, d in zip(tensors, dims)]
