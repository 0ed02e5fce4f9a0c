"""``macer.compress``: a selection policy's stages inside every prefill of a transformers decoder, for the duration of
a ``with`` block. The checks on the model and the policy are made here (adapter, depth, one device, attention
implementation, full attention, end-of-turn id); the hooks, the prefill bracket and decoding on compacted caches are
the session's (``macer.hf.session``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from torch import nn

from macer.core.families import text_config
from macer.core.policy import Policy
from macer.hf.adapters import Adapter, DecoderParts, get_adapter
from macer.hf.attention import ACTIVE
from macer.hf.compiled import compile_options
from macer.hf.session import Session
from macer.hf.trace import Trace

__all__ = ["SUPPORTED_ATTENTION", "compress"]

SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations the runtime wraps (the user's choice runs unchanged)."""


def compress(model: nn.Module, config: Policy, *, profile: bool = False, adapter: Adapter | None = None,
             compile: bool | dict[str, Any] = False) -> contextlib.AbstractContextManager[Trace]:
    """Run a selection policy's staged pruning in every prefill of ``model`` inside the ``with`` block.

    ``model(**inputs)`` and ``model.generate(**inputs)`` work as usual, for one prompt or a left-padded batch (each
    prompt planned, scored and selected as if alone, the batch re-packed after every stage: ``macer.hf.batch``); each
    prefill is pruned on its own, decoding runs on the compacted caches, and leaving the block (also by an exception)
    restores the model exactly: hooks removed, attention implementation restored, nothing else touched.

    Args:
        model: a model whose ``config.model_type`` has an adapter (``macer.supported_model_types()``).
        config: a policy: ``MacerConfig`` (MACER), ``FastVConfig``, ``RandomConfig``, ``FullConfig``, or any
            ``macer.make_policy(name)``. Its layers must lie in the decoder (checked here).
        profile: synchronise the device around MACER's own work and record it in ``PrefillRecord.overhead_s``.
        adapter: use this adapter instead of the one registered for the model type, e.g.
            ``macer.LabelledAdapter(labels, ...)`` for any decoder called with ``inputs_embeds``.
        compile: run the decoder layers through ``torch.compile`` (regional: each layer's forward, the sequence
            length dynamic, MACER's stages and hooks between the compiled regions; ``macer.hf.compiled``). ``True``
            for ``torch.compile``'s defaults (Inductor), or a dict of its ``backend``, ``mode``, ``options``,
            ``fullgraph``. Prefills and decode steps both run compiled (the layers a prefill reads a stage's
            scores from run eagerly in that prefill); the graphs are kept for later contexts on the same model. Needs
            transformers' ``DynamicCache`` (the default). Off by default.

    Returns:
        A single-use context manager (one ``with`` block; entering it again is a ``RuntimeError``) whose ``as``
        target is a ``macer.Trace``: budgets, kept tokens, tokens per layer and cache lengths of every prefill
        (``trace.samples``: the last prefill's record per prompt).
    """
    options = compile_options(compile)
    return _Compress(_session(model, config, profile=profile, adapter=adapter, compile_options=options))


class _Compress(contextlib.AbstractContextManager):
    """``compress``'s context manager: single use like a generator's, but entering it twice says so (a generator's
    context manager raises an AttributeError from contextlib's internals)."""

    def __init__(self, context: contextlib.AbstractContextManager[Trace]):
        self._context, self._entered = context, False

    def __enter__(self) -> Trace:
        if self._entered:
            raise RuntimeError("macer.compress: this compress(...) object was already used in a with block (it is "
                               "single use); call macer.compress(model, config) again for each block")
        self._entered = True
        return self._context.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._context.__exit__(*exc)


@contextlib.contextmanager
def _session(model: nn.Module, config: Policy, *, profile: bool, adapter: Adapter | None,
             compile_options: dict[str, Any] | None) -> Iterator[Trace]:
    """The body of ``compress``: checks, install, yield the trace, uninstall."""
    if not isinstance(config, Policy):
        raise TypeError(f"macer.compress: config must be a policy (macer.MacerConfig, FastVConfig, RandomConfig, "
                        f"FullConfig or macer.make_policy(name)), got {type(config).__name__}")
    if adapter is None:
        adapter = get_adapter(model)
    elif not isinstance(adapter, Adapter):
        raise TypeError(f"macer.compress: adapter must be a macer.hf.adapters.Adapter (e.g. macer.LabelledAdapter), "
                        f"got {type(adapter).__name__}")
    parts = adapter.parts(model)
    config.check_depth(len(parts.layers))
    _check_one_device(parts)
    if any(id(module) in ACTIVE for layer in parts.layers for module in layer.modules()):
        raise ValueError("macer.compress: this model is already inside a macer.compress context")
    base = parts.attn_config._attn_implementation
    if base not in SUPPORTED_ATTENTION:
        raise ValueError(f"macer.compress: attention implementation {base!r} is not supported; "
                         f"supported: {list(SUPPORTED_ATTENTION)}")
    layer_types = getattr(parts.attn_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"macer.compress: only full-attention decoders are supported, got layer_types "
                         f"{sorted(set(layer_types))} (sliding-window caches cannot be compacted)")
    end_of_turn = _end_of_turn(model, adapter, config)
    session = Session(model, config, adapter, parts, base, profile, end_of_turn, compile_options)
    session.install()
    try:
        yield session.trace
    finally:
        session.uninstall()


def _check_one_device(parts: DecoderParts) -> None:
    """A decoder split over several devices (``device_map`` over GPUs, CPU or disk offload: parameters on ``meta``)
    is refused: the prefill's tables live on the embeddings' device and a stage's rows would index another device's
    tensors."""
    embeddings = getattr(parts.decoder, "get_input_embeddings", lambda: None)()
    modules = [m for m in (embeddings, *parts.layers) if isinstance(m, nn.Module)]
    devices = {p.device for m in modules for p in itertools.islice(m.parameters(), 1)}
    if len(devices) > 1:
        raise ValueError(f"macer.compress: the decoder's embeddings and layers are on several devices "
                         f"({', '.join(sorted(map(str, devices)))}): a model split by device_map (several GPUs, or CPU "
                         "/ disk offload) is not supported; load the model on one device (device_map={'': 'cuda:0'} "
                         "or model.to(device))")


def _end_of_turn(model: nn.Module, adapter: Adapter, policy: Policy) -> int | None:
    """The policy's end-of-turn id, else the adapter's; an id outside the vocabulary is refused here."""
    eot = policy.end_of_turn_token_id
    if eot is None:
        return adapter.end_of_turn_token_id(model)
    vocab = getattr(text_config(model), "vocab_size", None)
    if isinstance(vocab, int) and eot >= vocab:
        raise ValueError(f"macer.compress: end_of_turn_token_id={eot} is outside this model's vocabulary "
                         f"(vocab_size={vocab}); pass the id of the token that closes the user's question, or "
                         f"leave it None for the model's own ({adapter.end_of_turn_token_id(model)})")
    return eot
