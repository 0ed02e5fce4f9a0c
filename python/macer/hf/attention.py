"""The attention function that ``macer.compress`` registers with transformers: the user's own attention, with a tap.

While a prefill runs, the function hands the question rows' queries and the layer's keys of every readout layer to
the session that registered the module (``ACTIVE``); then it calls the user's attention implementation unchanged. A
name ``macer_<base>`` is registered once per base implementation and removed when its last session ends.

The user's function runs with ``module.config._attn_implementation`` reading ``<base>`` again (``call_as``): some
implementations read that name inside the call (transformers' FlashAttention-2 passes it to the import of its
kernels, which knows ``flash_attention_2`` but not ``macer_flash_attention_2``).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

_PREFIX = "macer_"
_lock = threading.Lock()
ACTIVE: dict[int, tuple[Any, int]] = {}
"""id(attention module) -> (session, layer index): how the registered attention function finds its session."""
# registered macer attention names -> number of live sessions using them
_NAMES_IN_USE: dict[str, int] = {}


def _make_attention(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager: dict[type, Any] = {}

    def macer_attention(module, query, key, value, attention_mask, **kwargs):
        entry = ACTIVE.get(id(module))
        if entry is not None:
            entry[0].readout(entry[1], module, query, key, kwargs)
        if base == "eager":  # the modeling file's own eager function (some families change it)
            fn = eager.get(type(module)) or eager.setdefault(
                type(module), inspect.getmodule(type(module)).eager_attention_forward)
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return call_as(base, fn, module, query, key, value, attention_mask, **kwargs)

    macer_attention.__name__ = f"{_PREFIX}{base}"
    return macer_attention


def call_as(name: str, fn: Callable, module: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(module, *args, **kwargs)`` with ``module.config._attn_implementation`` set to ``name`` for the call (and
    back to the wrapper's name after it, also on an exception): the wrapped function sees the name it was registered
    under, as without ``macer``."""
    config = getattr(module, "config", None)
    renamed = getattr(config, "_attn_implementation", name)
    if config is None or renamed == name:
        return fn(module, *args, **kwargs)
    config._attn_implementation = name
    try:
        return fn(module, *args, **kwargs)
    finally:
        config._attn_implementation = renamed


def register_names(base: str) -> str:
    """Register ``macer_<base>`` (the runtime's tapped attention over ``base``) for one more session; its name."""
    return register_refcounted(f"{_PREFIX}{base}", base, lambda: _make_attention(base))


def register_refcounted(name: str, base: str, make_function: Callable[[], Callable]) -> str:
    """Register attention function ``name`` (made by ``make_function`` on first use) with ``base``'s mask function,
    counting users: ``unregister_names`` removes both when the last one ends. Shared by the runtime and
    ``macer.diagnose``'s tap."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    with _lock:
        if _NAMES_IN_USE.get(name, 0) == 0:
            AttentionInterface.register(name, make_function())
            # Without a mask function of the same name, create_causal_mask silently returns None.
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
        _NAMES_IN_USE[name] = _NAMES_IN_USE.get(name, 0) + 1
    return name


def unregister_names(name: str) -> None:
    """One user of ``name`` fewer; the last one removes the attention and mask functions from transformers."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    with _lock:
        _NAMES_IN_USE[name] -= 1
        if _NAMES_IN_USE[name] == 0:
            del _NAMES_IN_USE[name]
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
