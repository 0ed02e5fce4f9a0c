"""``plan_prefill`` on numpy with its plan cache (issue 37 item 1) against the implementation it replaced
(``plan_oracle``: torch CPU ops and ``Fraction`` arithmetic, commit fd836a2), on fresh random prompts of every policy
and family of layouts: the same budgets, stages, query rows, random picks, chunk ids and per-layer lengths, and the
same refusals with the same messages, with the cache off, cold and hit.

The prompts: chat turns with audio/video blocks or interleaved chunks (either may be empty), a question, end-of-turn
tokens (none, one, several), sometimes media after the question or at the very end; labels other than text/audio/video;
temporal rows as the Qwen-Omni processors lay them out (a constant time per video grid, audio +1 per token), random
integers (negative, spans up to 2**62 so that ``C (t - t_min)`` overflows int64), int32, float32 / float64 (NaN too);
prompts without ``input_ids`` and with an adapter's ``question_end``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import macer
import numpy as np
import plan_oracle
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from macer.core import policy as policy_module
from macer.core.layout import plan_layout
from macer.core.policy import (
    AUDIO,
    TEXT,
    VISUAL,
    Policy,
    PromptFacts,
    Selection,
    StageSpec,
    clear_plan_cache,
    plan_cache_info,
    plan_prefill,
    question_rows,
)

from macer_kernels import Budget

EOT, MEDIA_ID = 2, 300
KEEP_RATIOS = (0.25, 0.35, 0.45, 0.5, 0.7, 1.0, 0.1, 1 / 3, 0.999)
SHARES = (0.3, 0.32, 0.35, 0.5, 0.15, 0.0, 1.0, 2 / 3)


@st.composite
def prompts(draw) -> PromptFacts:
    """A random prompt's host facts (see the module docstring)."""
    labels: list[int] = [TEXT] * draw(st.integers(0, 6))
    media: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        label = draw(st.sampled_from([AUDIO, VISUAL, VISUAL, AUDIO, 3]))
        media += [label] * draw(st.integers(0, 40))
    question = [TEXT] * draw(st.integers(0, 8))
    tail = [TEXT] * draw(st.integers(0, 5))
    layout = draw(st.sampled_from(["chat", "chat", "chat", "media_after", "media_last", "no_eot", "two_eot"]))
    eot_at: list[int] = []
    if layout == "media_after":
        labels += question
        eot_at.append(len(labels))
        labels += [TEXT, *media, *tail]
    elif layout == "media_last":
        labels += question + media
    else:
        labels += media + question
        if layout != "no_eot":
            eot_at.append(len(labels))
            labels.append(TEXT)
        labels += tail
        if layout == "two_eot":
            eot_at.append(len(labels))
            labels += [TEXT, TEXT]
    n = len(labels)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.where(np.array(labels, dtype=np.int64) == TEXT, rng.integers(10, 60, n), MEDIA_ID)
    ids[eot_at] = EOT
    temporal = _temporal(draw(st.sampled_from(["arange", "qwen", "random", "huge", "int32", "float64", "float32",
                                               "nan"])), labels, rng)
    with_ids = draw(st.booleans()) or layout == "two_eot"
    question_end = None
    if draw(st.integers(0, 9)) == 0:
        question_end = draw(st.integers(0, n))
    return PromptFacts(labels=torch.tensor(labels, dtype=torch.long), temporal=temporal,
                       input_ids=torch.from_numpy(ids) if with_ids else None,
                       end_of_turn_token_id=draw(st.sampled_from([EOT, EOT, EOT, None, 77])),
                       num_layers=draw(st.integers(2, 8)), question_end=question_end)


def _temporal(kind: str, labels: list[int], rng: np.random.Generator) -> torch.Tensor:
    n = len(labels)
    if kind == "arange":
        return torch.arange(n)
    if kind == "qwen":  # video: one time per grid of 6 tokens, +25 per grid; audio +1 per token; text +1
        t, clock, grid = [], 0, 0
        for label in labels:
            if label == VISUAL:
                t.append(25 * (grid // 6))
                grid += 1
            else:
                t.append(clock)
                clock += 1
        return torch.tensor(t)
    if kind == "random":
        return torch.from_numpy(rng.integers(-1000, 1000, n))
    if kind == "huge":  # spans past 2**63 / C: the integer fast path must hand over to temporal_chunks
        return torch.from_numpy(rng.integers(-(2**61), 2**61, n))
    if kind == "int32":
        return torch.from_numpy(rng.integers(0, 500, n).astype(np.int32))
    if kind == "nan":
        t = rng.normal(0, 100, n)
        if n:
            t[rng.integers(0, n)] = np.nan
        return torch.from_numpy(t)
    t = rng.normal(0, 100, n) * rng.choice([1e-3, 1.0, 1e12])
    return torch.from_numpy(t.astype(np.float32 if kind == "float32" else np.float64))


@st.composite
def policies(draw, num_layers: int) -> Policy:
    depth = num_layers - 1
    keep = draw(st.sampled_from(KEEP_RATIOS))
    question = {"end_of_turn_token_id": draw(st.sampled_from([None, EOT])),
                "query_tokens": draw(st.integers(1, 5)),
                "question_span": draw(st.sampled_from(["end_of_turn", "end_of_turn", "prompt_end"]))}
    kind = draw(st.sampled_from(["macer", "macer", "macer", "fastv", "random", "full", "macer_raw", "shared_topk",
                                 "no_coverage", "single_readout"]))
    if kind == "full":
        return macer.FullConfig()
    if kind == "random":
        return macer.RandomConfig(keep_ratio=keep, seed=draw(st.integers(0, 2**40)))
    if kind == "fastv":
        return macer.FastVConfig(keep_ratio=keep, layer=draw(st.integers(1, depth)),
                                 query=draw(st.sampled_from(["last", "question"])), **question)
    fields = {"keep_ratio": keep, "audio_share": draw(st.sampled_from(SHARES)),
              "audio_layer": draw(st.integers(1, depth)), "video_layer": draw(st.integers(1, depth)),
              "coverage_weight": draw(st.sampled_from([0.0, 0.2, 1.5])), "num_chunks": draw(st.integers(1, 12)),
              **question}
    if kind == "single_readout":
        fields.pop("audio_layer")
    if kind == "no_coverage":
        fields.pop("coverage_weight")
    return macer.make_policy(kind, **fields)


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs), None
    except ValueError as error:
        return None, str(error)


def as_values(plan) -> tuple:
    """A plan as plain values; every tensor must be int64 on the CPU."""
    def values(t: torch.Tensor | None) -> list[int] | None:
        if t is None:
            return None
        assert t.dtype == torch.int64 and t.device.type == "cpu" and t.dim() == 1
        return t.tolist()

    stages = [(s.spec, values(s.query), s.tokens_before, s.tokens_after, s.members,
               tuple(values(p) for p in s.picks)) for s in plan.stages]
    return plan.budget, stages, list(plan.layer_tokens), values(plan.chunks)


def oracle_values(plan: plan_oracle.OraclePlan) -> tuple:
    stages = [(s.spec, s.query, s.tokens_before, s.tokens_after, s.members, s.picks) for s in plan.stages]
    return plan.budget, stages, plan.layer_tokens, plan.chunks


def check_against_oracle(policy: Policy, facts: PromptFacts) -> str:
    """Plan ``facts`` with the oracle and with ``plan_prefill`` (cache off, cold, hit, and on a copy of the facts);
    every outcome must agree. Returns what happened ("planned" or "refused")."""
    expected, expected_error = outcome(plan_oracle.plan_prefill, policy, facts)
    fresh = dataclasses.replace  # a new PromptFacts object: no host arrays computed yet
    for cache, facts_of in ((False, fresh), (True, fresh), (True, fresh), (True, lambda f: f)):
        got, error = outcome(plan_prefill, policy, facts_of(facts), cache=cache)
        assert error == expected_error, (policy, cache)
        if expected is not None:
            assert as_values(got) == oracle_values(expected), (policy, cache)
            assert got.facts.length == facts.length
    # plan_layout reads no temporal row: it refuses what the plan refuses, but for a temporal row the op refuses.
    layout, layout_error = outcome(plan_layout, policy, fresh(facts))
    if layout_error is not None:
        assert layout_error == expected_error
    elif expected is not None:
        assert list(layout.layer_tokens) == expected.layer_tokens and layout.budget == expected.budget
    return "planned" if expected is not None else "refused"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_plan_equals_the_old_implementation_on_random_prompts(data):
    facts = data.draw(prompts())
    policy = data.draw(policies(facts.num_layers))
    check_against_oracle(policy, facts)


def test_random_prompts_reach_both_outcomes_and_the_fast_and_fallback_chunk_paths():
    """The property test above is only as good as its prompts: on a fixed sample of them, MACER plans and refuses,
    its coverage stage runs on integer rows (numpy) and on floating / huge rows (the op's own arithmetic), and the
    plan cache hits."""
    clear_plan_cache()
    outcomes, kinds = set(), set()
    rng = np.random.default_rng(0)
    for i in range(300):
        facts = _fixed_prompt(rng, i)
        policy = macer.MacerConfig(keep_ratio=0.25, audio_layer=2, video_layer=3, end_of_turn_token_id=EOT)
        facts = dataclasses.replace(facts, num_layers=6)
        result = check_against_oracle(policy, facts)
        outcomes.add(result)
        if result == "planned" and int((facts.labels == VISUAL).sum()):
            kinds.add(str(facts.temporal.dtype))
    assert outcomes == {"planned", "refused"}
    assert {"torch.int64", "torch.float64"} <= kinds
    assert plan_cache_info()["hits"] > 0


def _fixed_prompt(rng: np.random.Generator, i: int) -> PromptFacts:
    labels = [TEXT] * 3
    for _ in range(int(rng.integers(1, 5))):
        labels += [int(rng.choice([AUDIO, VISUAL]))] * int(rng.integers(1, 30))
    if i % 7 == 0:
        labels += [TEXT]  # too short a question: refused
    else:
        labels += [TEXT] * 6
    eot = len(labels)
    labels += [TEXT, TEXT, TEXT]
    ids = torch.tensor([EOT if j == eot else (MEDIA_ID if lab else 11) for j, lab in enumerate(labels)])
    kind = ["qwen", "float64", "huge", "arange"][i % 4]
    return PromptFacts(labels=torch.tensor(labels), temporal=_temporal(kind, labels, rng), input_ids=ids,
                       end_of_turn_token_id=EOT, num_layers=6)


# ---------------------------------------------------------------------------------------------------------------
# The real clips, the cache's key and its isolation
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip_facts():
    """The Qwen2.5-Omni processor layout of the paper's clip (12 frames, 1460 audio tokens: 2385 tokens) and a
    longer one, with the temporal row of the model's own ``get_rope_index``."""
    from macer.testing import SYNTHETIC_TOKENS, build_thinker

    from benchmarks.bench_plan import clip_facts as make

    model = build_thinker(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1)
    return [make(model, frames, audio, num_layers=28, end_of_turn=SYNTHETIC_TOKENS.im_end)
            for frames, audio in ((12, 1460), (48, 900))]


def test_real_clip_layouts_equal_the_old_implementation(clip_facts):
    from macer.testing import SYNTHETIC_TOKENS

    eot = SYNTHETIC_TOKENS.im_end
    for facts in clip_facts:
        for policy in (macer.MacerConfig(end_of_turn_token_id=eot), macer.MacerConfig(keep_ratio=0.35, audio_share=0.32,
                                                                                     audio_layer=4, video_layer=7,
                                                                                     coverage_weight=0.3,
                                                                                     end_of_turn_token_id=eot),
                       macer.FastVConfig(keep_ratio=0.25, layer=5), macer.RandomConfig(keep_ratio=0.25, seed=3),
                       macer.make_policy("no_coverage", end_of_turn_token_id=eot)):
            assert check_against_oracle(policy, facts) == "planned"


def test_a_cached_plan_is_isolated_from_the_caller_and_keyed_by_layout():
    """A hit returns tensors of its own (changing a plan's tensors in place cannot change a later plan); a prompt
    with other token ids but the same layout hits; other temporal positions of the chunked tokens, another question
    end, another depth or policy miss."""
    clear_plan_cache()
    labels = [TEXT] * 4 + [AUDIO] * 10 + [VISUAL] * 12 + [TEXT] * 6 + [TEXT] * 3
    ids = [11] * 4 + [MEDIA_ID] * 22 + [12] * 6 + [EOT, 13, 14]
    policy = macer.MacerConfig(keep_ratio=0.5, audio_layer=1, video_layer=2, end_of_turn_token_id=EOT)

    def facts(ids=ids, temporal=None, num_layers=4):
        return PromptFacts(labels=torch.tensor(labels), temporal=torch.arange(len(labels)) if temporal is None
                           else temporal, input_ids=torch.tensor(ids), end_of_turn_token_id=EOT,
                           num_layers=num_layers)

    first = plan_prefill(policy, facts())
    expected = as_values(first)
    first.chunks.fill_(5)
    first.stages[0].query.fill_(0)
    assert plan_cache_info()["misses"] == 1
    other_text = ids[:4] + [MEDIA_ID] * 22 + [40] * 6 + [EOT, 41, 42]
    second = plan_prefill(policy, facts(ids=other_text))
    assert plan_cache_info()["hits"] == 1 and as_values(second) == expected
    assert second.chunks.data_ptr() != first.chunks.data_ptr()
    shifted = torch.arange(len(labels)) * 3
    shifted[14:26] = torch.arange(12) * 100
    assert as_values(plan_prefill(policy, facts(temporal=shifted)))[3] != expected[3]
    moved = ids[:4] + [MEDIA_ID] * 22 + [12] * 6 + [15, EOT, 14]  # the question ends one token later
    assert as_values(plan_prefill(policy, facts(ids=moved)))[1][0][1] != expected[1][0][1]
    plan_prefill(policy, facts(num_layers=5))
    plan_prefill(policy.replace(keep_ratio=0.25), facts())
    assert plan_cache_info()["misses"] == 5 and plan_cache_info()["hits"] == 1
    for step in (facts(), facts(temporal=shifted), facts(ids=moved)):  # each hits now, and equals the oracle
        check_against_oracle(policy, step)
    assert plan_cache_info()["hits"] >= 4


@dataclass  # not frozen: a policy whose fields may change after a plan is never cached
class _MutablePolicy(Policy):
    keep_ratio: float = 0.5
    name = "mutable"

    @property
    def prune_layer(self) -> int:
        return 0

    def budget(self, n_audio: int, n_video: int) -> Budget:
        k = int(self.keep_ratio * n_audio)
        return Budget(k, k, 0)

    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        return [StageSpec(0, (Selection((AUDIO,), int(self.keep_ratio * n_audio), "random"),))] if n_audio else []


def test_a_policy_that_is_not_a_frozen_dataclass_is_planned_afresh_every_time():
    clear_plan_cache()
    policy = _MutablePolicy()
    facts = PromptFacts(labels=torch.tensor([0, 1, 1, 1, 1, 0]), temporal=torch.arange(6), input_ids=None,
                        end_of_turn_token_id=None, num_layers=2)
    assert plan_prefill(policy, facts).stages[0].tokens_after == 4
    policy.keep_ratio = 0.25
    assert plan_prefill(policy, facts).stages[0].tokens_after == 3
    assert plan_cache_info() == {"hits": 0, "misses": 0, "entries": 0, "maxsize": policy_module.PLAN_CACHE_SIZE}


def test_the_cache_is_bounded():
    clear_plan_cache()
    policy = macer.RandomConfig(keep_ratio=0.5)
    for n in range(policy_module.PLAN_CACHE_SIZE + 5):
        labels = torch.tensor([0] + [1] * (n + 1) + [0])
        plan_prefill(policy, PromptFacts(labels=labels, temporal=torch.arange(n + 3), input_ids=None,
                                         end_of_turn_token_id=None, num_layers=2))
    assert plan_cache_info()["entries"] == policy_module.PLAN_CACHE_SIZE


def test_question_rows_and_its_refusals():
    labels = torch.tensor([0, 0, 1, 1, 0, 0, 0, 0, 0])
    ids = torch.tensor([5, 5, 300, 300, 6, 7, 8, EOT, 9])
    facts = PromptFacts(labels=labels, temporal=torch.arange(9), input_ids=ids, end_of_turn_token_id=EOT,
                        num_layers=3)
    assert question_rows(facts, 3, "end_of_turn").tolist() == [4, 5, 6]
    assert question_rows(facts, 2, "prompt_end").tolist() == [7, 8]
    with pytest.raises(ValueError, match=r"the question rows \(prompt positions 3..6.*last at 3\)"):
        question_rows(facts, 4, "end_of_turn")
    with pytest.raises(ValueError, match="end_of_turn_token_id=77 does not occur in the prompt"):
        question_rows(dataclasses.replace(facts, end_of_turn_token_id=77), 2, "end_of_turn")
    with pytest.raises(ValueError, match="needs query_tokens=9 tokens before"):
        question_rows(facts, 9, "end_of_turn")
    # The last end-of-turn token far from the end (the tail search widens its window until it finds it).
    long_ids = torch.cat([ids, torch.full((5000,), 9)])
    long = dataclasses.replace(facts, labels=torch.cat([labels, torch.zeros(5000, dtype=torch.long)]),
                               input_ids=long_ids, temporal=torch.arange(5009))
    assert question_rows(long, 3, "end_of_turn").tolist() == [4, 5, 6]


def test_a_temporal_row_of_another_length_is_refused_by_name():
    facts = PromptFacts(labels=torch.tensor([0, 2, 2, 0, 0]), temporal=torch.arange(4), input_ids=None,
                        end_of_turn_token_id=None, num_layers=3)
    policy = macer.MacerConfig(audio_layer=1, video_layer=1, question_span="prompt_end", query_tokens=2)
    with pytest.raises(ValueError, match=r"PromptFacts.temporal must hold one position per prompt token \(5\), got 4"):
        plan_prefill(policy, facts)


def _macer_specs_before(policy, n_audio: int, n_video: int) -> list[StageSpec]:
    """``MacerConfig.stage_specs`` as it was before the plan's speed-up (issue 37): the oracle of its rewrite."""
    if not n_audio + n_video:
        return []
    budget = policy.budget(n_audio, n_video)
    wanted = [(policy.audio_layer, n_audio, Selection((AUDIO,), budget.audio)),
              (policy.video_layer, n_video, Selection((VISUAL,), budget.video, "coverage", policy.coverage_weight,
                                                      policy.num_chunks))]
    specs = []
    for layer in sorted({policy.audio_layer, policy.video_layer}):
        selections = tuple(sel for at, count, sel in wanted if at == layer and count > 0)
        if selections:
            specs.append(StageSpec(layer, selections, policy.scoring))
    return specs


@pytest.mark.parametrize("layers", [(3, 5), (5, 3), (4, 4), (1, 2), (2, 1)])
def test_macer_stage_specs_and_budget_and_specs_equal_the_rule_before(layers):
    """The rewritten ``MacerConfig.stage_specs`` (one budget, no sorting) gives the stages in the same order with the
    same selections for every layer order and every empty modality; ``budget_and_specs`` is ``(budget,
    stage_specs)`` for every policy, so ``policy_layout`` plans exactly as before."""
    rng = np.random.default_rng(37)
    policies = [macer.MacerConfig(keep_ratio=r, audio_layer=layers[0], video_layer=layers[1], audio_share=a)
                for r, a in zip(KEEP_RATIOS, (*SHARES, 0.3), strict=True)]
    policies += [macer.FastVConfig(keep_ratio=0.3, layer=layers[0]), macer.RandomConfig(keep_ratio=0.4, seed=3)]
    for policy in policies:
        for n_audio, n_video in [(0, 0), (0, 7), (9, 0), (1, 1), *rng.integers(0, 5000, (6, 2)).tolist()]:
            specs = policy.stage_specs(n_audio, n_video)
            if isinstance(policy, macer.MacerConfig):
                assert specs == _macer_specs_before(policy, n_audio, n_video), (policy, n_audio, n_video)
            assert policy.budget_and_specs(n_audio, n_video) == (policy.budget(n_audio, n_video), specs)


def test_a_macer_subclass_with_its_own_stages_is_planned_by_them():
    """``MacerConfig.budget_and_specs`` (the plan's one-budget shortcut) defers to a subclass's own
    ``stage_specs`` (found when the shortcut bypassed it: tests/hf/test_macer_batch.py's per-prompt policy)."""

    @dataclass(frozen=True)
    class OneStage(macer.MacerConfig):
        def stage_specs(self, n_audio, n_video):
            return [StageSpec(1, (Selection((AUDIO, VISUAL), (n_audio + n_video) // 2),))] if n_audio + n_video else []

    policy = OneStage(keep_ratio=0.5)
    assert policy.budget_and_specs(10, 20) == (policy.budget(10, 20), policy.stage_specs(10, 20))
    clear_plan_cache()
    facts = PromptFacts(labels=torch.tensor([TEXT] * 3 + [AUDIO] * 10 + [VISUAL] * 20 + [TEXT] * 6),
                        temporal=torch.arange(39), input_ids=None, end_of_turn_token_id=None, num_layers=4,
                        question_end=38)
    assert [s.spec for s in plan_prefill(policy, facts).stages] == policy.stage_specs(10, 20)


def test_host_array_views_a_plain_cpu_tensor_and_copies_what_numpy_refuses(seed):
    """``host_array``'s fast path (``Tensor.numpy`` tried first) against the checked one: a 1-D CPU tensor is viewed
    (the same memory), a tensor that requires grad or has more dims comes back flattened with equal values, and a
    strided view keeps its values."""
    from macer.core.prompt import host_array

    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 9, (37,), generator=g)
    a = host_array(t)
    assert a.ndim == 1 and np.shares_memory(a, t.numpy()) and (a == t.numpy()).all()
    f = torch.rand(5, generator=g, requires_grad=True)
    np.testing.assert_array_equal(host_array(f), f.detach().numpy())
    m = torch.randint(0, 9, (3, 4), generator=g)
    np.testing.assert_array_equal(host_array(m), m.reshape(-1).numpy())
    np.testing.assert_array_equal(host_array(t[::3]), t.numpy()[::3])


@given(n_audio=st.integers(0, 30_000), n_video=st.integers(0, 30_000),
       keep_ratio=st.one_of(st.sampled_from([0.25, 0.35, 0.45, 0.7, 1 / 3]), st.floats(1e-6, 1.0)),
       audio_share=st.one_of(st.sampled_from([0.3, 0.32, 0.35, 0.15]), st.floats(0.0, 1.0)))
def test_policy_budgets_equal_the_fraction_reference(n_audio, n_video, keep_ratio, audio_share):
    """(Moved from tests/kernels/test_split_budget.py: it is the policies' budget.) MacerConfig, FastVConfig and
    RandomConfig budget with ``split_budget_exact``: the same numbers as the public
    ``split_budget`` and as ``split_budget_ref`` on the fields as written."""
    from macer_kernels import split_budget
    from macer_kernels.reference import split_budget_ref

    want = split_budget_ref(n_audio, n_video, keep_ratio, audio_share)
    assert macer.MacerConfig(keep_ratio=keep_ratio, audio_share=audio_share).budget(n_audio, n_video) == want
    assert split_budget(n_audio, n_video, keep_ratio, audio_share) == want
    joint = split_budget_ref(n_audio, n_video, keep_ratio, 0.5).total
    assert macer.FastVConfig(keep_ratio=keep_ratio, layer=1).budget(n_audio, n_video).total == joint
    assert macer.RandomConfig(keep_ratio=keep_ratio).budget(n_audio, n_video).total == joint
