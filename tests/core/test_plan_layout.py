"""``macer.core.layout.plan_layout``: a request's per-layer lengths from its labels alone (what a serving engine needs
before the forward), against ``plan_prefill`` (what the stages run on), on random prompts for every policy; and the
refusal of a prompt whose last row, the one the next token is predicted from, a policy could drop (issue 28 item 5).
"""

from __future__ import annotations

import macer
import pytest
import torch
from macer.core.layout import plan_layout, unpruned_layout
from macer.core.policy import AUDIO, TEXT, VISUAL, PromptFacts, plan_prefill

EOT = 2
LAYERS = 6


def policies(ratio: float) -> dict:
    base = {"audio_layer": 2, "video_layer": 4, "end_of_turn_token_id": EOT}
    out = {name: macer.make_policy(name, keep_ratio=ratio, **base)
           for name in ("macer", "macer_raw", "shared_topk", "no_coverage")}
    out["single_readout"] = macer.make_policy("single_readout", keep_ratio=ratio, video_layer=3,
                                              end_of_turn_token_id=EOT)
    out["fastv"] = macer.FastVConfig(keep_ratio=ratio, layer=2)
    out["fastv_question"] = macer.FastVConfig(keep_ratio=ratio, layer=3, query="question", end_of_turn_token_id=EOT)
    out["random"] = macer.RandomConfig(keep_ratio=ratio, seed=5)
    out["full"] = macer.FullConfig()
    return out


def facts(labels: list[int], ids: list[int] | None = None) -> PromptFacts:
    labels_t = torch.tensor(labels, dtype=torch.long)
    if ids is None:
        ids = [17 if label == TEXT else 300 for label in labels]
    return PromptFacts(labels=labels_t, temporal=torch.arange(len(labels)), input_ids=torch.tensor(ids),
                       end_of_turn_token_id=EOT, num_layers=LAYERS)


def random_prompt(generator: torch.Generator) -> list[int]:
    """A chat turn: head text, blocks of audio/video (either may be empty, interleaved or not), question, <eot>,
    assistant header; sometimes the media come after the end of turn (a prompt MACER refuses)."""
    head = [TEXT] * int(torch.randint(1, 6, (1,), generator=generator))
    media = []
    for _ in range(int(torch.randint(0, 4, (1,), generator=generator))):
        label = AUDIO if torch.rand(1, generator=generator) < 0.5 else VISUAL
        media += [label] * int(torch.randint(0, 20, (1,), generator=generator))
    question = [TEXT] * int(torch.randint(1, 8, (1,), generator=generator))
    tail = [TEXT] * int(torch.randint(0, 4, (1,), generator=generator))
    if torch.rand(1, generator=generator) < 0.15:
        return head + question + [EOT] + media + tail  # media after the question
    return head + media + question + [EOT] + tail


def outcome(fn, *args):
    try:
        return fn(*args), None
    except ValueError as error:
        return None, str(error)


@pytest.mark.parametrize("ratio", [0.25, 1.0])
def test_layout_equals_the_prefill_plan_on_random_prompts(ratio):
    """Guards the engine's host layout (metadata for a whole step, KV sizes) drifting from the plan the stages run:
    the same per-layer lengths, and the same refusals with the same messages."""
    generator = torch.Generator().manual_seed(int(ratio * 100))
    refused = planned = 0
    for _ in range(60):
        labels = random_prompt(generator)
        ids = [EOT if label == EOT else (17 if label == TEXT else 300) for label in labels]
        labels = [TEXT if label == EOT else label for label in labels]
        for name, policy in policies(ratio).items():
            layout, layout_error = outcome(plan_layout, policy, facts(labels, ids))
            plan, plan_error = outcome(plan_prefill, policy, facts(labels, ids))
            assert layout_error == plan_error, (name, labels)
            if plan is None:
                refused += 1
                continue
            planned += 1
            assert list(layout.layer_tokens) == plan.layer_tokens, (name, labels)
            assert layout.budget == plan.budget and layout.prompt_len == len(labels)
            assert layout.pruned == (plan.layer_tokens[-1] < len(labels) or min(plan.layer_tokens) < len(labels))
            assert [layout.drop(i) for i in range(LAYERS)] == [len(labels) - t for t in plan.layer_tokens]
    assert refused and planned  # both outcomes were exercised


@pytest.mark.parametrize("policy", [macer.FastVConfig(keep_ratio=0.25, layer=2), macer.RandomConfig(keep_ratio=0.25)])
def test_a_prompt_ending_in_a_media_row_is_refused_by_every_pruning_policy(policy):
    """FastV (the last row as query, a joint top-k) and Random read no question rows, so nothing checked the
    prompt's end: a prompt ending in a video row could lose the row the next token is predicted from (vLLM then
    samples from a zero row). Refused by the plan (served unpruned in vLLM), with the same message from the layout.
    MACER's question rows must come after every media row, so MACER refuses such a prompt by that rule."""
    labels = [TEXT] * 3 + [AUDIO] * 8 + [VISUAL] * 12 + [TEXT] * 5 + [TEXT, VISUAL]
    ids = [17] * 3 + [300] * 20 + [17] * 5 + [EOT, 300]
    with pytest.raises(ValueError, match=r"the prompt's last row \(position 29\) is a video token") as planned:
        plan_prefill(policy, facts(labels, ids))
    with pytest.raises(ValueError) as laid_out:
        plan_layout(policy, facts(labels, ids))
    assert str(laid_out.value) == str(planned.value)
    # Nothing is dropped at keep ratio 1: the same prompt is no risk and is planned.
    keep_all = policy.replace(keep_ratio=1.0)
    assert not plan_layout(keep_all, facts(labels, ids)).pruned
    plan_prefill(keep_all, facts(labels, ids))
    macer_policy = macer.make_policy("macer", keep_ratio=0.25, audio_layer=2, video_layer=4, end_of_turn_token_id=EOT)
    with pytest.raises(ValueError, match="must come after every audio/video token"):
        plan_layout(macer_policy, facts(labels, ids))


def test_unpruned_layout_keeps_every_row():
    layout = unpruned_layout(40, 3, note="why")
    assert layout.layer_tokens == (40, 40, 40) and not layout.pruned and layout.note == "why"
    assert layout.drop(2) == 0
