"""Where the compacted layers' per-step arrays live (``macer.vllm.backend.StageMetadata``): query starts, sequence
lengths, slots and tail slots, filled on the host and sent to the device in one copy per step.

* ``Arena``: one pinned host buffer and one device buffer, typed views at byte offsets; per step the views are handed
  out afresh after the fixed ones (``take``) and one non-blocking copy sends the bytes written (``upload``);
* ``CaptureBuffers``: an arena whose views are fixed (``reserve``), one set per (segment of the engine's captured
  layout, KV cache group): the addresses a FULL CUDA graph's compacted layers were captured with, refilled in place by
  every FULL step, and room after them for that step's tail slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Arena", "ArenaFull", "CaptureBuffers", "Pair"]

_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}
View = tuple[np.ndarray, torch.Tensor, torch.Tensor]
"""``(host numpy, host tensor, device tensor)`` views of the same elements (on CPU the two tensors are one)."""


class ArenaFull(Exception):
    """A step needs more of a growable ``Arena`` than it has (``StageMetadata.build`` grows it and builds again)."""

    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


class Arena:
    """Host and device memory of a step's small arrays: typed views at byte offsets of one pinned host buffer and one
    device buffer, filled on the host and sent with one non-blocking copy of the used bytes (``upload``). On CPU the
    two are one tensor. ``reserve`` gives fixed views (the buffers a CUDA graph reads: the same address every step);
    ``take`` gives views in the part after them, handed out afresh each step (``begin``). Only an arena with no fixed
    view grows when a step needs more."""

    def __init__(self, nbytes: int, device: torch.device):
        from vllm.utils.platform_utils import is_pin_memory_available

        self.device, self.nbytes = device, nbytes
        with torch.inference_mode(False):  # runtime state, written in and outside inference mode
            self.host = torch.zeros(nbytes, dtype=torch.uint8,
                                    pin_memory=device.type != "cpu" and is_pin_memory_available())
            self.dev = self.host if device.type == "cpu" else torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.bytes = self.host.numpy()  # the host buffer as numpy, made once: typed views of it are numpy slices
        self.fixed = 0
        self.used = 0
        # Steps of the same shape lay their arrays out alike: their views are made once.
        self._views: dict[tuple[int, torch.dtype, int], View] = {}

    def _view(self, start: int, dtype: torch.dtype, count: int) -> View:
        key = (start, dtype, count)
        view = self._views.get(key)
        if view is None:
            size = count * dtype.itemsize
            host = self.host[start: start + size].view(dtype)
            dev = host if self.dev is self.host else self.dev[start: start + size].view(dtype)
            view = self._views[key] = (self.bytes[start: start + size].view(_NUMPY[dtype]), host, dev)
            if len(self._views) > 4096:  # shapes seen once: forget the oldest
                del self._views[next(iter(self._views))]
        return view

    def _claim(self, dtype: torch.dtype, count: int) -> int:
        start = -(-self.used // 8) * 8
        end = start + count * dtype.itemsize
        if end > self.nbytes:
            if self.fixed:
                raise RuntimeError(f"macer: a step's metadata needs {end} bytes of the {self.nbytes} reserved for "
                                   "the captured CUDA graphs' buffers (please report this)")
            raise ArenaFull(end)
        self.used = end
        return start

    def grow(self, needed: int) -> None:
        """Room for ``needed`` bytes (an arena with no fixed view; the views handed out before are void)."""
        grown = Arena(max(needed, 2 * self.nbytes), self.device)
        self.__dict__.update(host=grown.host, dev=grown.dev, bytes=grown.bytes, nbytes=grown.nbytes, used=0,
                             _views={})

    def reserve(self, dtype: torch.dtype, count: int) -> View:
        """A fixed view of ``count`` elements (before any ``take``)."""
        if self.used != self.fixed:
            raise RuntimeError("macer: Arena.reserve after take")
        view = self._view(self._claim(dtype, count), dtype, count)
        self.fixed = self.used
        return view

    def begin(self) -> None:
        """A new step: the views ``take`` handed out before are free again."""
        self.used = self.fixed

    def take(self, dtype: torch.dtype, count: int) -> View:
        """``(host numpy, host tensor, device tensor)`` views of ``count`` elements, valid for this step."""
        return self._view(self._claim(dtype, count), dtype, count)

    def upload(self) -> None:
        """One non-blocking copy of the bytes written this step (stream-ordered before the step's forward)."""
        if self.dev is not self.host and self.used:
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)


@dataclass
class Pair:
    """The fixed buffers of one (segment, KV cache group) of the captured layout: what its layers' captured kernels
    read (query starts, sequence lengths, slots)."""

    query_start: View
    seq_lens: View
    slots: View


class CaptureBuffers:
    """The fixed buffers of a captured layout (module docstring).

    Args:
        pairs: ``(segment start, KV cache group)`` of every compacted layer group of the layout.
        reqs: the most requests a FULL step holds (vLLM's largest capture size, or ``max_num_seqs``).
        tail_bytes: room for a FULL step's tail slots.
        device: the runner's device.
    """

    def __init__(self, pairs: list[tuple[int, int]], reqs: int, tail_bytes: int, device: torch.device):
        fixed = len(pairs) * (4 * (reqs + 1) + 4 * reqs + 8 * reqs + 24)  # with 8-byte alignment
        self.arena = Arena(fixed + tail_bytes + 64, device)
        self.pairs = {key: Pair(self.arena.reserve(torch.int32, reqs + 1), self.arena.reserve(torch.int32, reqs),
                                self.arena.reserve(torch.int64, reqs)) for key in pairs}
        self.captured: dict = {}  # the last capture's {layer name: (metadata, slots)}: what the graphs read

    def pair(self, key: tuple[int, int]) -> Pair:
        found = self.pairs.get(key)
        if found is None:
            raise RuntimeError(f"macer: segment {key} is not one of the captured layout's (please report this)")
        return found
