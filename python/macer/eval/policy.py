"""Policy by name for the evaluation wrapper: the one place where a ``policy=...`` string becomes a policy."""

from __future__ import annotations

from typing import Any

__all__ = ["resolve_policy"]

_NO_QUESTION_SPAN = ("full", "random")
"""Policies without question rows (no ``end_of_turn_token_id`` field)."""


def resolve_policy(name: str, model: Any = None, *, end_of_turn_token_id: int | None = None, **params: Any) -> Any:
    """``macer.make_policy(name, model, **params)``, with the checkpoint's ``<|im_end|>`` id filled in.

    Args:
        name: a name of ``macer.POLICY_NAMES`` (``full``, ``macer``, ``fastv``, ``random``, ``macer_raw``,
            ``shared_topk``, ``no_coverage``, ``single_readout``).
        model: the loaded thinker (MACER and its ablations start from the paper's defaults for it).
        end_of_turn_token_id: the tokenizer's ``<|im_end|>`` id; used by the policies that read question rows
            unless ``params`` sets it.
        params: the policy's fields (``keep_ratio``, ``audio_layer``, ``layer``, ``seed``, ...).
    """
    import macer

    if name not in macer.POLICY_NAMES:
        raise ValueError(f"policy must be one of {list(macer.POLICY_NAMES)}, got {name!r}")
    if end_of_turn_token_id is not None and name not in _NO_QUESTION_SPAN:
        params.setdefault("end_of_turn_token_id", end_of_turn_token_id)
    return macer.make_policy(name, model, **params)
