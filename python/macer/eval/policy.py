"""Policy by name for the evaluation wrapper: the one place where a ``policy=...`` string becomes a policy, and the
record of the policy object that ran (``describe_policy``), which the sample log writes on every line."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

__all__ = ["describe_policy", "policy_fields", "resolve_policy"]

_NO_QUESTION_SPAN = ("full", "random")
"""Policies without question rows (no ``end_of_turn_token_id`` field)."""

_SET_BY_ABLATION = {"macer_raw": "scoring", "no_coverage": "coverage_weight", "single_readout": "audio_layer"}
"""The ``MacerConfig`` field each ablation fixes itself (``macer.ABLATIONS``); passing it is refused."""

_SHARED_TOPK_UNUSED = ("layer", "query")
"""``FastVConfig`` fields that ``shared_topk`` fixes (``layer=video_layer``, ``query="question"``)."""


def policy_fields(name: str) -> tuple[str, ...]:
    """The fields ``resolve_policy(name, ...)`` takes: the policy's own dataclass fields, less the ones an ablation
    fixes itself; ``shared_topk`` takes the fields it reads (``keep_ratio``, ``video_layer``, the question rows,
    ``trim_early_cache``), not the MACER fields it would ignore (``audio_share``, ``audio_layer``, ...)."""
    import macer

    if name not in macer.POLICY_NAMES:
        raise ValueError(f"policy must be one of {list(macer.POLICY_NAMES)}, got {name!r}")
    if name == "shared_topk":
        kept = [f.name for f in dataclasses.fields(macer.FastVConfig) if f.name not in _SHARED_TOPK_UNUSED]
        return (*kept, "video_layer")
    cls = {"full": macer.FullConfig, "fastv": macer.FastVConfig, "random": macer.RandomConfig}.get(name,
                                                                                                 macer.MacerConfig)
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != _SET_BY_ABLATION.get(name))


def resolve_policy(name: str, model: Any = None, *, im_end: int | None = None, **params: Any) -> Any:
    """``macer.make_policy(name, model, **params)``, with the checkpoint's ``<|im_end|>`` id filled in.

    Args:
        name: a name of ``macer.POLICY_NAMES`` (``full``, ``macer``, ``fastv``, ``random``, ``macer_raw``,
            ``shared_topk``, ``no_coverage``, ``single_readout``).
        model: the loaded thinker (MACER and its ablations start from the paper's defaults for it).
        im_end: the tokenizer's ``<|im_end|>`` id: the ``end_of_turn_token_id`` of the policies that read question
            rows, unless ``params`` sets ``end_of_turn_token_id``.
        params: the policy's fields (``policy_fields(name)``: ``keep_ratio``, ``audio_layer``, ``layer``, ``seed``,
            ...). A field the policy does not take is refused by name, never ignored.
    """
    import macer

    allowed = policy_fields(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        fixed = _SET_BY_ABLATION.get(name)
        why = (f" ({name} sets {fixed} itself: {macer.ABLATIONS[name]})" if fixed in unknown else
               " (shared_topk reads one layer, video_layer, and none of MACER's other settings)"
               if name == "shared_topk" else "")
        raise ValueError(f"policy {name!r} does not take {unknown}{why}; its fields: {list(allowed)}")
    if im_end is not None and name not in _NO_QUESTION_SPAN:
        params.setdefault("end_of_turn_token_id", im_end)
    if name == "shared_topk" and model is not None:
        params = _shared_topk_layers(model, params)
    return macer.make_policy(name, model, **params)


def _shared_topk_layers(model: Any, params: dict[str, Any]) -> dict[str, Any]:
    # make_policy builds shared_topk from MacerConfig.for_model, which on a model without the paper's layers wants
    # both layers; shared_topk reads at video_layer only, so the audio layer it never uses is set to that layer.
    import macer

    if "video_layer" in params:
        return {**params, "audio_layer": params["video_layer"]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a derived-defaults warning is repeated by make_policy itself
            macer.MacerConfig.for_model(model)
    except ValueError as exc:
        raise ValueError("policy 'shared_topk': this model has no paper defaults for its readout layer; pass "
                         "video_layer=N (the layer of the one shared top-K; shared_topk uses no audio_layer)") from exc
    return params


def describe_policy(policy: Any) -> dict[str, Any]:
    """``{"class": ..., "fields": {...}}`` of a policy dataclass: the object that ran, as the sample log records it
    (an ablation resolved to another policy, or a field that did not arrive, shows here)."""
    return {"class": type(policy).__name__,
            "fields": {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}}
