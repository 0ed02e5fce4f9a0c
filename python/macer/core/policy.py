"""The policy interface: what a token-selection policy (MACER, FastV, Random, an ablation) declares, and the host plan
of one prefill. Torch and ``macer_kernels`` only (no engine).

A policy is a small frozen dataclass that says, from the prompt's audio/video counts alone, which stages run
(``stage_specs``): after which decoder layer, which modalities are selected together, how many tokens each selection
keeps, by which rule (top-k, the chunk-coverage greedy, a seeded random draw) and which scores (ANMS or raw attention
probability) from which query rows. Everything that follows from the prompt is then computed once on the host at the
start of a prefill (``plan_prefill``): counts, budgets, question rows, temporal chunk ids and the length of the
sequence after every stage. Inside a stage (``macer.core.stage.run_stage``) only device work remains, with sizes
known on the host, so no stage reads device memory back (``tests/test_macer_sync.py`` fails if one does).

Layers are counted from 1 as in the paper: a stage at ``layer = l`` reads the attention inside ``layers[l - 1]`` and
the dropped tokens are gone from ``layers[l]`` on; ``layer = 0`` prunes before the first decoder layer (no readout).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

import torch

from macer_kernels import Budget, temporal_chunks

__all__ = [
    "AUDIO",
    "MODALITY_NAMES",
    "QUESTION_SPANS",
    "SCORINGS",
    "TEXT",
    "VISUAL",
    "Plan",
    "PlannedStage",
    "Policy",
    "PromptFacts",
    "Selection",
    "StageSpec",
    "check_prunable",
    "member_mask",
    "plan_prefill",
    "question_rows",
]

TEXT, AUDIO, VISUAL = 0, 1, 2
"""Modality labels (video and image tokens are both ``VISUAL``)."""

MODALITY_NAMES = {AUDIO: "audio", VISUAL: "video"}

Rule = Literal["topk", "coverage", "random"]
Scoring = Literal["anms", "raw"]
SCORINGS = ("anms", "raw")
QUESTION_SPANS = ("end_of_turn", "prompt_end")


@dataclass(frozen=True)
class Selection:
    """Keep ``k`` of the tokens whose label is in ``modalities`` (the others of the stage are dropped).

    Attributes:
        modalities: the labels selected together (``(AUDIO, VISUAL)`` = one joint ranking over both).
        k: tokens kept, ``0 <= k <=`` the number of such tokens in the sequence entering the stage.
        rule: ``"topk"`` (``topk_indices``), ``"coverage"`` (``coverage_select`` over ``num_chunks`` temporal
            chunks of the prompt's tokens of these modalities) or ``"random"`` (a uniform ``k``-subset drawn on the
            host from ``torch.Generator().manual_seed(seed)``: the same on every device).
        coverage_weight, num_chunks: lambda_c and C of the coverage rule.
        seed: seed of the random rule.
    """

    modalities: tuple[int, ...]
    k: int
    rule: Rule = "topk"
    coverage_weight: float = 0.0
    num_chunks: int = 8
    seed: int = 0


@dataclass(frozen=True)
class StageSpec:
    """One stage: after decoder layer ``layer`` (1-based; 0 = before the first layer), the ``selections``.

    ``scoring`` says which scores the top-k / coverage rules rank: ``"anms"`` (``eq:macer_score``, each
    (row, head) renormalised over the token's own modality) or ``"raw"`` (the attention probability itself, averaged
    over heads and query rows). ``query`` says which rows read it: ``"question"`` (the policy's question span) or
    ``"last"`` (the prompt's final row, as FastV).
    """

    layer: int
    selections: tuple[Selection, ...]
    scoring: Scoring = "anms"
    query: Literal["question", "last"] = "question"

    @property
    def needs_scores(self) -> bool:
        return any(s.rule != "random" for s in self.selections)


@dataclass(frozen=True)
class PromptFacts:
    """What the host knows about one prompt (batch 1) at the start of its prefill.

    Attributes:
        labels: ``[N]`` int64 modality labels, on the CPU.
        temporal: ``[N]`` temporal positions (integer or floating), on the CPU.
        input_ids: ``[N]`` token ids on the CPU, or None (a prefill from ``inputs_embeds``).
        end_of_turn_token_id: the resolved id of the token closing the user's question (None: unknown).
        num_layers: decoder depth.
        question_end: the position of the token closing the user's question when the adapter knows it without
            token ids (``Adapter.question_end``); it takes precedence over the end-of-turn search.
    """

    labels: torch.Tensor
    temporal: torch.Tensor
    input_ids: torch.Tensor | None
    end_of_turn_token_id: int | None
    num_layers: int
    question_end: int | None = None

    @property
    def length(self) -> int:
        return self.labels.numel()

    def count(self, *modalities: int) -> int:
        return int(sum(int((self.labels == m).sum()) for m in modalities))


class Policy(abc.ABC):
    """Base of every selection policy. Subclasses are frozen dataclasses with at least ``keep_ratio``."""

    #: the name ``macer.make_policy`` knows it by
    name: str = ""
    keep_ratio: float

    @abc.abstractmethod
    def budget(self, n_audio: int, n_video: int) -> Budget:
        """The prompt's retained budget (``K_mm`` and, where the policy fixes it, its audio/video split)."""

    @abc.abstractmethod
    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        """The stages for a prompt with these counts, in layer order (empty: nothing is pruned)."""

    @property
    @abc.abstractmethod
    def prune_layer(self) -> int:
        """``L_p`` of the paper's cost model: layers that still see every multimodal token (0 = input pruning)."""

    def check_depth(self, num_layers: int) -> None:
        """Raise ``ValueError`` unless every stage layer lies in the decoder (a later layer must exist). Policies
        with readout layers override this; a policy that prunes before the first layer has nothing to check."""
        return None

    # Question-span settings; policies that read question rows override them as dataclass fields.
    query_tokens: int = 4
    end_of_turn_token_id: int | None = None
    question_span: str = "end_of_turn"
    eps: float = 1e-6
    trim_early_cache: bool = False

    def layer_tokens(self, n_text: int, n_audio: int, n_video: int, num_layers: int) -> list[int]:
        """Sequence length entering each of ``num_layers`` decoder layers for a prompt with these counts."""
        tokens, length = [], n_text + n_audio + n_video
        stages = {spec.layer: spec for spec in self.stage_specs(n_audio, n_video)}
        counts = {AUDIO: n_audio, VISUAL: n_video}
        for i in range(num_layers):
            if i in stages:
                length = _after(stages[i], counts, length)
            tokens.append(length)
        return tokens


def _after(spec: StageSpec, counts: dict[int, int], length: int) -> int:
    """Length after ``spec`` given the per-modality counts entering it; ``counts`` is updated in place for
    single-modality selections (a joint selection's split is unknown on the host, and only totals size the
    sequence)."""
    for sel in spec.selections:
        members = sum(counts[m] for m in sel.modalities)
        length -= members - sel.k
        if len(sel.modalities) == 1:
            counts[sel.modalities[0]] = sel.k
    return length


# ---------------------------------------------------------------------------------------------------------------
# Host plan
# ---------------------------------------------------------------------------------------------------------------


def question_rows(facts: PromptFacts, query_tokens: int, question_span: str) -> torch.Tensor:
    """Prompt positions of the question rows: the last ``query_tokens`` tokens before the prompt's last
    end-of-turn token (``question_span="end_of_turn"``), or the prompt's last ``query_tokens`` tokens
    (``"prompt_end"``); before ``facts.question_end`` when the adapter gave it. They must all come after every
    audio/video token."""
    n = facts.length
    if facts.question_end is not None:
        end, where = facts.question_end, f"question_end={facts.question_end}"
    elif question_span == "prompt_end":
        end, where = n, "the end of the prompt"
    else:
        eot = facts.end_of_turn_token_id
        if facts.input_ids is None:  # first: no end_of_turn_token_id can help a prompt without token ids
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
    """Raise ``ValueError`` for a prompt ``policy`` cannot prune (both engines then keep the message): its question
    rows are not after every audio/video row (``question_rows``), or its last row, which the next token is predicted
    from, is an audio/video row that the stages could drop (text rows are never dropped). ``specs`` and
    ``layer_tokens``: the policy's stages and per-layer lengths for this prompt."""
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
class PlannedStage:
    """A stage with everything the host knows: its spec, the query rows (prompt positions), the random picks
    (prompt positions) and the sequence length entering and leaving it."""

    spec: StageSpec
    query: torch.Tensor
    tokens_before: int
    tokens_after: int
    members: tuple[int, ...]  # tokens of each selection's modalities entering the stage
    picks: tuple[torch.Tensor | None, ...]  # random rule: kept prompt positions, sorted


@dataclass
class Plan:
    """The host plan of one prefill: the budget, the stages, the length entering every layer, and the per-prompt
    tables a stage reads on the device (``chunks``: temporal chunk id of each prompt position, -1 where unused)."""

    facts: PromptFacts
    budget: Budget | None
    stages: list[PlannedStage]
    layer_tokens: list[int]
    chunks: torch.Tensor | None = None


def plan_prefill(policy: Policy, facts: PromptFacts) -> Plan:
    """Everything a prefill needs that the prompt determines, on the host, before layer 1 runs."""
    n_audio, n_video = facts.count(AUDIO), facts.count(VISUAL)
    n_text = facts.length - n_audio - n_video
    layer_tokens = policy.layer_tokens(n_text, n_audio, n_video, facts.num_layers)
    if not n_audio + n_video:
        return Plan(facts, None, [], layer_tokens)
    budget = policy.budget(n_audio, n_video)
    specs = policy.stage_specs(n_audio, n_video)
    check_prunable(policy, facts, specs, layer_tokens)  # macer.core.layout.plan_layout makes the same check
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
                if any(counts[m] != facts.count(m) for m in sel.modalities):
                    raise ValueError("the random rule draws from the prompt's tokens: it must run before any other "
                                     "stage prunes its modalities")
                positions = in_sel.nonzero().reshape(-1)
                generator = torch.Generator().manual_seed(sel.seed)
                order = torch.randperm(positions.numel(), generator=generator)
                picks.append(positions[order[: sel.k]].sort().values)
            else:
                picks.append(None)
            if sel.rule == "coverage":
                # Chunk ids over the prompt's tokens of these modalities: the set the stage sees when no earlier
                # stage pruned them (MACER's video stage).
                chunks = torch.full((facts.length,), -1, dtype=torch.long) if chunks is None else chunks
                chunks[in_sel] = temporal_chunks(facts.temporal[in_sel], sel.num_chunks)
        after = _after(spec, counts, length)
        stages.append(PlannedStage(spec, query, length, after, tuple(members), tuple(picks)))
        length = after
    return Plan(facts, budget, stages, layer_tokens, chunks)


def member_mask(labels: torch.Tensor, modalities: tuple[int, ...]) -> torch.Tensor:
    # Comparisons with Python scalars: no small tensor is copied to the device inside a stage.
    mask = labels == modalities[0]
    for modality in modalities[1:]:
        mask |= labels == modality
    return mask
