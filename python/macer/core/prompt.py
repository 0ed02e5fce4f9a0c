"""The host arithmetic of a prompt's plan, on numpy arrays: label runs, searches from the prompt's end, temporal chunk
ids, the random rule's draw, and a small thread-safe cache of plans by prompt layout. Numpy and torch (host) only;
``macer.core.policy.plan_prefill`` is the one caller that puts them together.

Why numpy: a plan is a few passes over ``N`` integers. Torch's CPU ops cost a few microseconds of dispatch each and
``Fraction`` arithmetic tens, which made a plan take 0.7 ms at N = 2.4k and 1.9 ms at 16.3k; the same passes in numpy
take tens of microseconds (``benchmarks/bench_plan.py``).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["PlanCache", "Runs", "chunk_ids", "computed_once", "host_array", "last_index", "member_mask",
           "random_picks", "runs_of"]

_INT64_MAX = 2**63 - 1

_FEW_RUNS = 64
"""Runs up to which ``chunk_ids`` reads their bounds in Python integers (cheaper than two numpy reductions)."""


class computed_once:
    """``functools.cached_property`` without its per-instance lock (Python 3.11 takes one on every first access, a
    microsecond each): the value is stored in the instance's ``__dict__``, which later lookups read directly. Works on
    frozen dataclasses. For values that are pure functions of the instance (a race computes one twice, harmlessly)."""

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.fn(instance)
        return value


def host_array(t: torch.Tensor) -> np.ndarray:
    """A 1-D host tensor as a numpy array (a view when it is on the CPU). ``Tensor.numpy`` refuses a device tensor
    and one that requires grad itself, so the common case costs one call (the checks in Python cost three)."""
    try:
        array = t.numpy()
    except (RuntimeError, TypeError):  # on a device, or requires grad
        return t.detach().cpu().reshape(-1).numpy()
    return array if array.ndim == 1 else array.reshape(-1)


class Runs(NamedTuple):
    """Maximal runs of equal values of a 1-D array: run ``i`` holds ``values[i]`` and ends at index ``last[i]``."""

    last: np.ndarray
    values: np.ndarray

    def key(self) -> tuple[str, bytes, bytes]:
        """Bytes that determine the array exactly (dtype, runs, values)."""
        return self.values.dtype.str, self.last.tobytes(), self.values.tobytes()

    def expand(self, per_run: np.ndarray) -> np.ndarray:
        """One entry per element of the array: ``per_run[i]`` over run ``i``."""
        lengths = np.empty_like(self.last)
        lengths[:1] = self.last[:1] + 1
        np.subtract(self.last[1:], self.last[:-1], out=lengths[1:])
        return np.repeat(per_run, lengths)


def runs_of(values: np.ndarray) -> Runs:
    """The runs of a 1-D array (one pass). A prompt's labels come in a few dozen runs (media blocks, interleaved
    2-second chunks), a video's temporal positions in one run per frame grid."""
    inner = (values[1:] != values[:-1]).nonzero()[0]  # the method: np.nonzero adds a Python wrapper
    last = np.empty(inner.size + (values.size > 0), dtype=np.int64)
    last[: inner.size] = inner
    last[inner.size:] = values.size - 1
    return Runs(last, values[last])


def last_index(values: np.ndarray, target: int, *, other: bool = False) -> int:
    """The last position holding ``target`` (with ``other``: holding anything else; -1: none), searched from the end
    in growing blocks: a chat prompt's end-of-turn token and its last media token sit a few dozen tokens before its
    end, so this reads a few dozen entries, not ``N``."""
    stop, size = values.size, 64
    while stop > 0:
        start = max(0, stop - size)
        block = values[start:stop]
        hits = (block != target if other else block == target).nonzero()[0]
        if hits.size:
            return start + int(hits[-1])
        stop, size = start, size * 4
    return -1


def member_mask(labels: np.ndarray, modalities: Sequence[int]) -> np.ndarray:
    """Whether each position's label is one of ``modalities``."""
    mask = labels == modalities[0]
    for modality in modalities[1:]:
        mask |= labels == modality
    return mask


def chunk_ids(temporal: Runs, num_chunks: int, values: np.ndarray | None = None) -> np.ndarray | None:
    """``floor(C (t - t_min) / (t_max - t_min + 1))`` per element of the array ``temporal`` holds the runs of, in
    int64, computed once per run, when it holds integers whose ``C (t - t_min)`` fits int64 (then the integer formula
    is exact, as ``macer_kernels.temporal_chunks``'s); None otherwise (floating positions, huge spans, no element):
    the caller then runs ``temporal_chunks`` itself, which also refuses what it refuses (non-finite floats, spans
    beyond int64). ``values``: the array itself, when the caller holds it: the formula then runs over it directly
    (three array passes instead of expanding the runs: cheaper for a video's few hundred to thousands of tokens)."""
    run_values = temporal.values
    if run_values.size == 0 or run_values.dtype.kind not in "iu" or run_values.dtype == np.uint64:
        return None
    if run_values.size <= _FEW_RUNS:  # a video's few frame grids: min and max in Python integers
        listed = run_values.tolist()
        lo, hi = min(listed), max(listed)
    else:
        lo, hi = int(run_values.min()), int(run_values.max())
    span = hi - lo + 1
    if num_chunks * span > _INT64_MAX:
        return None
    # 0 <= C (t - t_min) < C span <= int64 max: exact in int64.
    if values is not None:
        out = values.astype(np.int64)
        out -= lo
        out *= num_chunks
        out //= span
        return out
    return temporal.expand((num_chunks * (run_values.astype(np.int64) - lo)) // span)


@functools.lru_cache(maxsize=256)
def _random_order(seed: int, n: int, k: int) -> np.ndarray:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]
    out = np.sort(order.numpy())
    out.setflags(write=False)
    return out


def random_picks(positions: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The random rule's ``k`` picks from ``positions`` (ascending), sorted: ``positions[randperm(n)[:k]]`` with
    ``torch.Generator().manual_seed(seed)``, the same on every device. ``randperm`` depends on ``(seed, n)`` only, so
    its sorted first ``k`` entries are cached (``positions`` ascending makes ``sorted(positions[i])`` =
    ``positions[sorted(i)]``)."""
    return positions[_random_order(seed, positions.size, k)]


class PlanCache:
    """A bounded LRU map from an exact prompt-layout key to a plan's host parts, safe across threads (the vLLM
    plugin's scheduler and worker may plan in different threads)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: Hashable, entry: Any) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)
