"""How transformers hands a KV cache around: the argument a decoder call receives it by, and the attribute a model
output carries it in (both renamed in transformers 5.24).
"""

from __future__ import annotations

from typing import Any

__all__ = ["cache_argument", "output_cache"]


def cache_argument(kwargs: dict[str, Any]) -> Any:
    """The KV cache a decoder call received: ``cache=`` (transformers >= 5.24, whose ``generate`` passes it by that
    name) or ``past_key_values=`` (earlier releases). Reading only the old name made every decode step on 5.24 look
    like a new prompt, so nothing was pruned."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries: ``output.cache`` (transformers >= 5.24) or ``output.past_key_values``."""
    cache = getattr(output, "cache", None)
    return getattr(output, "past_key_values", None) if cache is None else cache
