"""Compaction: keep a sorted set of sequence positions."""

from __future__ import annotations

import torch

from macer_kernels._validate import check_int, check_same_device, check_tensor
from macer_kernels.backend import dispatch, register


def compact(x: torch.Tensor, keep: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep the positions ``keep`` of ``x`` along ``dim``, in order (text and kept tokens keep their order).

    Args:
        x: any tensor, e.g. hidden states ``[B, N, hidden]``, RoPE ``cos``/``sin`` ``[B, N, D]``, position ids
            ``[3, B, N]`` (``dim=2``).
        keep: 1-D integer tensor of strictly increasing indices in ``[0, x.shape[dim] - 1]``.
        dim: the sequence dimension (negative values count from the end).

    Returns:
        A new tensor with ``x.shape[dim]`` replaced by ``len(keep)``, same dtype and device.
    """
    x = check_tensor("x", x)
    keep = check_tensor("keep", keep, 1)
    check_int("keep", keep)
    check_same_device(x=x, keep=keep)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D tensor, got {dim}")
    dim %= x.dim()
    n = x.shape[dim]
    if keep.numel():
        if int(keep.min()) < 0 or int(keep.max()) >= n:
            raise ValueError(f"keep must hold indices in [0, {n - 1}], got range [{int(keep.min())}, {int(keep.max())}]")
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("keep must be strictly increasing (sorted, no repeats)")
    return dispatch("compact", x.device, x, keep.long(), dim)


@register("compact", "torch")
def _compact_torch(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    return x.index_select(dim, keep)
