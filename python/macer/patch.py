"""Moved: the runtime of ``macer.compress`` is ``macer.runtime`` now (policies in ``macer.policy`` /
``macer.policies``). ``macer.patch.compress`` and ``SUPPORTED_ATTENTION`` keep working; other names say where they
went."""

from __future__ import annotations

import importlib
from typing import Any

from macer.runtime import SUPPORTED_ATTENTION, compress

__all__ = ["SUPPORTED_ATTENTION", "compress"]

_MOVED = {
    "_Session": "macer.runtime._Session (private; the policy interface is macer.policy)",
    "_Prefill": "macer._prefill._Prefill (private; the host plan is macer.policy.plan_prefill)",
    "_ACTIVE": "macer._attention.ACTIVE (private)",
}


# The ops the old module imported by name (benchmarks look them up here): the runtime's and the policy's now.
_OPS = {"modality_scores": "policy", "topk_indices": "policy", "coverage_select": "policy",
        "temporal_chunks": "policy", "compact": "runtime", "compact_many": "runtime"}


def __getattr__(name: str) -> Any:
    if name in _OPS:
        return getattr(importlib.import_module(f"macer.{_OPS[name]}"), name)
    if name in _MOVED:
        raise AttributeError(f"macer.patch.{name} moved to {_MOVED[name]}")
    raise AttributeError(f"module 'macer.patch' has no attribute {name!r} (the runtime is macer.runtime now)")
