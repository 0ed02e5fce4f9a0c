"""The host plan as ``macer.core.policy.plan_prefill`` computed it before the numpy rewrite (commit fd836a2, torch CPU
ops, the policy's ``budget`` / ``stage_specs`` called as they were), kept as the oracle of the
rewrite: ``tests/core/test_plan_prefill.py`` compares the two on fresh random prompts of every policy.

The code below is that implementation with two changes only: it returns plain Python values (``OraclePlan``) instead of
the ``Plan`` classes, and it holds its own copies of what it called (the old ``PromptFacts.count``, a torch comparison;
the old ``Policy.layer_tokens``), so nothing of the rewrite is under it. Its refusals raise the same ``ValueError``
messages. (The budget split inside the policies is checked against ``split_budget_ref``'s ``Fraction`` arithmetic in
``tests/kernels/test_split_budget.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from macer.core.policy import AUDIO, MODALITY_NAMES, TEXT, VISUAL, Policy, PromptFacts, StageSpec

from macer_kernels import Budget, temporal_chunks


def count(facts: PromptFacts, *modalities: int) -> int:
    return int(sum(int((facts.labels == m).sum()) for m in modalities))


def member_mask(labels: torch.Tensor, modalities: tuple[int, ...]) -> torch.Tensor:
    mask = labels == modalities[0]
    for modality in modalities[1:]:
        mask |= labels == modality
    return mask


def after(spec: StageSpec, counts: dict[int, int], length: int) -> int:
    for sel in spec.selections:
        members = sum(counts[m] for m in sel.modalities)
        length -= members - sel.k
        if len(sel.modalities) == 1:
            counts[sel.modalities[0]] = sel.k
    return length


def question_rows(facts: PromptFacts, query_tokens: int, question_span: str) -> torch.Tensor:
    n = facts.length
    if facts.question_end is not None:
        end, where = facts.question_end, f"question_end={facts.question_end}"
    elif question_span == "prompt_end":
        end, where = n, "the end of the prompt"
    else:
        eot = facts.end_of_turn_token_id
        if facts.input_ids is None:
            raise ValueError("macer.compress: question_span='end_of_turn' searches input_ids for the end-of-turn "
                             "token, but the prompt came without input_ids (a prefill from inputs_embeds): give the "
                             "position of the token closing the user's turn, LabelledAdapter(question_end=...) "
                             "(BatchLabelledAdapter(question_ends=[...]) for a batch), or pass "
                             "question_span='prompt_end' to read the prompt's last query_tokens rows")
        if eot is None:
            raise ValueError("macer.compress: end_of_turn_token_id is unknown for this model (its adapter cannot "
                             "tell): pass end_of_turn_token_id=<id of the token closing the user's question>, or "
                             "question_span='prompt_end' to read the prompt's last query_tokens tokens")
        hits = (facts.input_ids == eot).nonzero().reshape(-1)
        if not hits.numel():
            raise ValueError(
                f"macer.compress: end_of_turn_token_id={eot} does not occur in the prompt (searched all {n} "
                "input_ids for the token that closes the user's question); pass the right end_of_turn_token_id, "
                "or question_span='prompt_end' to read the prompt's last query_tokens tokens instead")
        end, where = int(hits[-1]), f"the last end-of-turn token {eot} (position {int(hits[-1])})"
    if end < query_tokens:
        raise ValueError(f"macer.compress: the question span needs query_tokens={query_tokens} tokens before "
                         f"{where}; the prompt has only {end} there")
    rows = torch.arange(end - query_tokens, end)
    media = (facts.labels != TEXT).nonzero().reshape(-1)
    if media.numel() and int(rows[0]) <= int(media[-1]):
        raise ValueError(
            f"macer.compress: the question rows (prompt positions {int(rows[0])}..{int(rows[-1])}: the last "
            f"query_tokens={query_tokens} tokens before {where}) must come after every audio/video token (last at "
            f"{int(media[-1])}); check end_of_turn_token_id, question_span and the prompt layout")
    return rows


def check_prunable(policy: Policy, facts: PromptFacts, specs: list[StageSpec], layer_tokens: list[int]) -> None:
    if any(spec.needs_scores and spec.query == "question" for spec in specs):
        question_rows(facts, policy.query_tokens, policy.question_span)
    last = int(facts.labels[-1]) if facts.length else TEXT
    if last != TEXT and any(tokens < facts.length for tokens in layer_tokens):
        name = MODALITY_NAMES.get(last, f"label-{last}")
        raise ValueError(f"macer.compress: the prompt's last row (position {facts.length - 1}) is a {name} token, "
                         "and the next token is predicted from that row: a policy that drops audio/video tokens "
                         "could drop it. End the prompt with text (the chat template's assistant header), or serve "
                         "it without pruning")


@dataclass
class OracleStage:
    spec: StageSpec
    query: list[int]
    tokens_before: int
    tokens_after: int
    members: tuple[int, ...]
    picks: tuple[list[int] | None, ...]


@dataclass
class OraclePlan:
    budget: Budget | None
    stages: list[OracleStage]
    layer_tokens: list[int]
    chunks: list[int] | None


def layer_tokens_of(policy: Policy, n_text: int, n_audio: int, n_video: int, num_layers: int) -> list[int]:
    """The old ``Policy.layer_tokens``."""
    tokens, length = [], n_text + n_audio + n_video
    stages = {spec.layer: spec for spec in policy.stage_specs(n_audio, n_video)}
    counts = {AUDIO: n_audio, VISUAL: n_video}
    for i in range(num_layers):
        if i in stages:
            length = after(stages[i], counts, length)
        tokens.append(length)
    return tokens


def plan_prefill(policy: Policy, facts: PromptFacts) -> OraclePlan:
    n_audio, n_video = count(facts, AUDIO), count(facts, VISUAL)
    n_text = facts.length - n_audio - n_video
    layer_tokens = layer_tokens_of(policy, n_text, n_audio, n_video, facts.num_layers)
    if not n_audio + n_video:
        return OraclePlan(None, [], layer_tokens, None)
    budget = policy.budget(n_audio, n_video)
    specs = policy.stage_specs(n_audio, n_video)
    check_prunable(policy, facts, specs, layer_tokens)
    counts = {AUDIO: n_audio, VISUAL: n_video}
    length, stages = facts.length, []
    chunks: torch.Tensor | None = None
    for spec in specs:
        if spec.needs_scores:
            if spec.query == "last":
                query = torch.tensor([facts.length - 1])
            else:
                query = question_rows(facts, policy.query_tokens, policy.question_span)
        else:
            query = torch.empty(0, dtype=torch.long)
        members, picks = [], []
        for sel in spec.selections:
            in_sel = member_mask(facts.labels, sel.modalities)
            members.append(sum(counts[m] for m in sel.modalities))
            if sel.rule == "random":
                if any(counts[m] != count(facts, m) for m in sel.modalities):
                    raise ValueError("the random rule draws from the prompt's tokens: it must run before any other "
                                     "stage prunes its modalities")
                positions = in_sel.nonzero().reshape(-1)
                generator = torch.Generator().manual_seed(sel.seed)
                order = torch.randperm(positions.numel(), generator=generator)
                picks.append(positions[order[: sel.k]].sort().values.tolist())
            else:
                picks.append(None)
            if sel.rule == "coverage":
                chunks = torch.full((facts.length,), -1, dtype=torch.long) if chunks is None else chunks
                chunks[in_sel] = temporal_chunks(facts.temporal[in_sel], sel.num_chunks)
        after_length = after(spec, counts, length)
        stages.append(OracleStage(spec, query.tolist(), length, after_length, tuple(members), tuple(picks)))
        length = after_length
    return OraclePlan(budget, stages, layer_tokens, None if chunks is None else chunks.tolist())
