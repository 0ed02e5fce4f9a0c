"""macer.eval.policy without lmms-eval: a policy name plus fields becomes the policy the paper defines for that name,
with every field that was passed, and the sample log's record of it tells which policy ran.

The expected objects are built here from the definitions in ``macer.ABLATIONS`` (the dataclasses themselves), not
through ``make_policy`` or ``resolve_policy``, so a wrong resolution cannot be its own oracle.
"""

from __future__ import annotations

import dataclasses
import json

import macer
import pytest
from macer import FastVConfig, FullConfig, MacerConfig, RandomConfig
from macer.eval.policy import describe_policy, policy_fields, resolve_policy

EOT = 7  # an end-of-turn id, as the wrapper passes the tokenizer's <|im_end|>

# Non-default values for every field a policy takes (the class defaults are 0.25, 0.30, 3, 5, 0.20, 8, 4, 1e-6, ...).
NON_DEFAULT = {"keep_ratio": 0.4, "audio_share": 0.55, "audio_layer": 2, "video_layer": 4, "coverage_weight": 0.7,
               "num_chunks": 3, "query_tokens": 2, "eps": 1e-3, "end_of_turn_token_id": 11, "trim_early_cache": True,
               "question_span": "prompt_end", "scoring": "raw", "layer": 3, "query": "question", "seed": 5}
FASTV_REQUIRED = {"keep_ratio": 0.5, "layer": 2}  # FastVConfig has no default for these two


def _expected(name: str, fields: dict) -> object:
    """The policy ``name`` with ``fields``, written from its definition (``macer.ABLATIONS``, ``tab:ablation``)."""
    if name == "full":
        return FullConfig(**fields)
    if name == "fastv":
        return FastVConfig(**fields)
    if name == "random":
        return RandomConfig(**fields)
    if name == "shared_topk":  # FastVConfig(layer=video_layer, query='question'), MACER's defaults otherwise
        layer = fields.pop("video_layer", MacerConfig().video_layer)
        return FastVConfig(**{"keep_ratio": MacerConfig().keep_ratio, **fields}, layer=layer, query="question")
    fixed = {"macer": {}, "macer_raw": {"scoring": "raw"}, "no_coverage": {"coverage_weight": 0.0}}.get(name)
    if fixed is None:  # single_readout: MacerConfig(audio_layer=video_layer)
        fixed = {"audio_layer": fields.get("video_layer", MacerConfig().video_layer)}
    return MacerConfig(**fields, **fixed)


def test_policy_fields_cover_every_policy_and_exclude_what_an_ablation_fixes():
    assert set(NON_DEFAULT) == {f.name for cls in (MacerConfig, FastVConfig, RandomConfig)
                                for f in dataclasses.fields(cls)}
    assert policy_fields("full") == ("keep_ratio",)
    assert "scoring" not in policy_fields("macer_raw") and "coverage_weight" not in policy_fields("no_coverage")
    assert "audio_layer" not in policy_fields("single_readout") and "audio_layer" in policy_fields("macer")
    assert set(policy_fields("shared_topk")) == {"keep_ratio", "video_layer", "query_tokens", "end_of_turn_token_id",
                                                 "question_span", "trim_early_cache"}
    with pytest.raises(ValueError, match="policy must be one of"):
        policy_fields("omnizip")


@pytest.mark.parametrize("name", [n for n in macer.POLICY_NAMES if n != "full"])
def test_every_field_arrives_with_a_non_default_value(name):
    """Guards: a field (keep_ratio above all) dropped or replaced on the way from the evaluation's model arguments
    to the policy, and an ablation resolved to another policy (e.g. macer_raw / no_coverage / shared_topk run as
    macer): the resolved policy must equal the paper's definition with every non-default field passed."""
    fields = {k: NON_DEFAULT[k] for k in policy_fields(name)}
    if name == "fastv":
        fields["query"] = "question"
    got = resolve_policy(name, None, im_end=EOT, **fields)
    want = _expected(name, dict(fields))
    assert describe_policy(got) == describe_policy(want), (name, got, want)
    # Each field on its own, the others left at their defaults: none is overwritten by another one's default.
    for key in fields:
        one = {**(FASTV_REQUIRED if name == "fastv" else {}), key: fields[key]}
        got = resolve_policy(name, None, **one)
        assert describe_policy(got) == describe_policy(_expected(name, dict(one))), (name, key, got)


@pytest.mark.parametrize("name", [n for n in macer.POLICY_NAMES if n not in ("full", "random")])
def test_end_of_turn_id_is_filled_unless_given(name):
    extra = FASTV_REQUIRED if name == "fastv" else {}
    assert resolve_policy(name, None, im_end=EOT, **extra).end_of_turn_token_id == EOT
    assert resolve_policy(name, None, im_end=EOT, end_of_turn_token_id=9, **extra).end_of_turn_token_id == 9


def test_ablations_are_the_policies_they_name():
    """Guards: resolving macer_raw, no_coverage or shared_topk to macer (the runs would have MACER's budgets and
    kept counts, so only the policy's class and fields can tell)."""
    runs = {name: describe_policy(resolve_policy(name, None, keep_ratio=0.25)) for name in
            ("macer", "macer_raw", "no_coverage", "shared_topk", "single_readout")}
    assert runs["macer"]["class"] == "MacerConfig" and runs["macer"]["fields"]["scoring"] == "anms"
    assert runs["macer_raw"]["fields"] == {**runs["macer"]["fields"], "scoring": "raw"}
    assert runs["no_coverage"]["fields"] == {**runs["macer"]["fields"], "coverage_weight": 0.0}
    assert runs["single_readout"]["fields"] == {**runs["macer"]["fields"],
                                                "audio_layer": runs["macer"]["fields"]["video_layer"]}
    assert runs["shared_topk"]["class"] == "FastVConfig"
    assert runs["shared_topk"]["fields"]["query"] == "question"
    assert runs["shared_topk"]["fields"]["layer"] == runs["macer"]["fields"]["video_layer"]


@pytest.mark.parametrize(("name", "field", "match"), [
    ("shared_topk", "audio_share", "reads one layer, video_layer"),
    ("shared_topk", "audio_layer", "reads one layer, video_layer"),
    ("macer_raw", "scoring", "sets scoring itself"),
    ("no_coverage", "coverage_weight", "sets coverage_weight itself"),
    ("single_readout", "audio_layer", "sets audio_layer itself"),
    ("random", "layer", "does not take"),
    ("fastv", "audio_share", "does not take"),
    ("macer", "seed", "does not take"),
])
def test_a_field_the_policy_does_not_take_is_refused(name, field, match):
    extra = FASTV_REQUIRED if name == "fastv" else {}
    with pytest.raises(ValueError, match=match) as info:
        resolve_policy(name, None, **extra, **{field: NON_DEFAULT[field]})
    assert f"'{field}'" in str(info.value) and "its fields" in str(info.value)


def test_shared_topk_on_a_model_without_paper_layers_needs_only_video_layer():
    """Guards: shared_topk on a non-paper model asked for an audio_layer it never uses (issue 21 item 6)."""
    from macer.testing import build_thinker

    model = build_thinker(num_layers=4)
    policy = resolve_policy("shared_topk", model, im_end=EOT, keep_ratio=0.3, video_layer=2)
    assert describe_policy(policy) == describe_policy(FastVConfig(keep_ratio=0.3, layer=2, query="question",
                                                                  end_of_turn_token_id=EOT))
    with pytest.raises(ValueError, match=r"pass video_layer=N .*uses no audio_layer"):
        resolve_policy("shared_topk", model, keep_ratio=0.3)
    with pytest.raises(ValueError, match="must be in"):  # the layer is still checked against the model's depth
        resolve_policy("shared_topk", model, keep_ratio=0.3, video_layer=4)


def test_describe_policy_is_json():
    for name in macer.POLICY_NAMES:
        extra = FASTV_REQUIRED if name == "fastv" else {}
        record = describe_policy(resolve_policy(name, None, **extra))
        assert json.loads(json.dumps(record)) == record
