"""The host/device copies of a prefill: the prompt's ids, temporal row and mask come to the host in one copy
(``to_host``), the plan's tables go to the device in one copy (``to_device``, through ``upload``). Both engines plan
a prefill between these two copies and read nothing back afterwards.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "to_host", "upload"]


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Bring 1-D tensors to the CPU in one device-to-host copy (none for tensors already there)."""
    remote = [t for t in tensors if t is not None and t.device.type != "cpu"]
    if not remote:
        return list(tensors)
    dtype = torch.float64 if any(t.is_floating_point() for t in remote) else torch.int64
    packed = torch.cat([t.reshape(-1).to(dtype) for t in remote]).cpu()  # the prefill's one device read
    out, offset = [], 0
    for t in tensors:
        if t is None or t.device.type == "cpu":
            out.append(t)
            continue
        piece = packed[offset: offset + t.numel()]
        out.append(piece if t.is_floating_point() else piece.long())
        offset += t.numel()
    return out


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Upload the plan's int64 tables in one host-to-device copy (asynchronous from pinned memory)."""
    if device.type == "cpu" or not tensors:
        return tensors
    packed = upload(torch.cat([t.reshape(-1).long() for t in tensors]), device)
    return list(torch.split(packed, [t.numel() for t in tensors]))


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host table to ``device`` without waiting for it (from pinned memory on a GPU: a copy from pageable
    memory may synchronise)."""
    if device.type == "cpu":
        return t
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)
