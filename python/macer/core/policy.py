"""The policy interface: what a token-selection policy (MACER, FastV, Random, an ablation) declares, and the host plan
of one prefill. Torch and ``macer_kernels`` only (no engine).

A policy is a small frozen dataclass that says, from the prompt's audio/video counts alone, which stages run
(``stage_specs``): after which decoder layer, which modalities are selected together, how many tokens each selection
keeps, by which rule (top-k, the chunk-coverage greedy, a seeded random draw) and which scores (ANMS or raw attention
probability) from which query rows. Everything that follows from the prompt is then computed once on the host at the
start of a prefill (``plan_prefill``): counts, budgets, question rows, temporal chunk ids and the length of the
sequence after every stage. Inside a stage (``macer.core.stage.run_stage``) only device work remains, with sizes
known on the host, so no stage reads device memory back (``tests/hf/test_macer_sync.py`` fails if one does).

Layers are counted from 1 as in the paper: a stage at ``layer = l`` reads the attention inside ``layers[l - 1]`` and
the dropped tokens are gone from ``layers[l]`` on; ``layer = 0`` prunes before the first decoder layer (no readout).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from macer.core.prompt import (
    PlanCache,
    Runs,
    chunk_ids,
    computed_once,
    host_array,
    last_index,
    random_picks,
    runs_of,
)
from macer.core.prompt import member_mask as host_member_mask
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
    "PolicyLayout",
    "PromptFacts",
    "Selection",
    "StageSpec",
    "cacheable",
    "check_prunable",
    "clear_plan_cache",
    "member_mask",
    "plan_cache_info",
    "plan_prefill",
    "policy_layout",
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

    @computed_once
    def needs_scores(self) -> bool:
        """Whether a selection ranks scores (read once per spec: a plan asks it several times)."""
        for s in self.selections:
            if s.rule != "random":
                return True
        return False


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

    @computed_once
    def length(self) -> int:
        """Prompt tokens (read once: a plan asks several times)."""
        return self.labels.numel()

    def count(self, *modalities: int) -> int:
        counts, total = self._counts, 0
        for m in modalities:
            if m not in counts:
                counts[m] = int(np.count_nonzero(self.host_labels == m))
            total += counts[m]
        return total

    # Host views, computed once per prompt (the dataclass is frozen; ``computed_once`` stores them beside it).
    @computed_once
    def host_labels(self) -> np.ndarray:
        """``labels`` as a numpy array (a view of a CPU tensor)."""
        return host_array(self.labels)

    @computed_once
    def host_ids(self) -> np.ndarray:
        """``input_ids`` as a numpy array (they must be given)."""
        if self.input_ids is None:
            raise ValueError("PromptFacts.input_ids is None: this prompt came without token ids")
        return host_array(self.input_ids)

    @computed_once
    def host_temporal(self) -> np.ndarray:
        """``temporal`` as a numpy array."""
        return host_array(self.temporal)

    @computed_once
    def runs(self) -> Runs:
        """The labels' maximal runs (they determine the labels exactly)."""
        return runs_of(self.host_labels)

    @computed_once
    def _counts(self) -> dict[int, int]:
        return {}  # tokens per label, filled by ``count``


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

    def budget_and_specs(self, n_audio: int, n_video: int) -> tuple[Budget, list[StageSpec]]:
        """``(budget(...), stage_specs(...))`` for these counts; a policy whose stages are sized by its budget
        overrides it to compute the budget once (the plan of a new layout asks for both)."""
        return self.budget(n_audio, n_video), self.stage_specs(n_audio, n_video)

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
        return _layer_tokens(self.stage_specs(n_audio, n_video), n_text, n_audio, n_video, num_layers)


def _layer_tokens(specs: Sequence[StageSpec], n_text: int, n_audio: int, n_video: int, num_layers: int) -> list[int]:
    """Layer ``i`` sees the length after every stage at a layer <= ``i`` (one stage per layer: the last spec given
    for it)."""
    tokens: list[int] = []
    length = n_text + n_audio + n_video
    stages = {spec.layer: spec for spec in specs}
    counts = {AUDIO: n_audio, VISUAL: n_video}
    for layer in sorted(layer for layer in stages if 0 <= layer < num_layers):
        tokens += [length] * (layer - len(tokens))
        length = _after(stages[layer], counts, length)
    tokens += [length] * (num_layers - len(tokens))
    return tokens


def _after(spec: StageSpec, counts: dict[int, int], length: int) -> int:
    """Length after ``spec`` given the per-modality counts entering it; ``counts`` is updated in place for
    single-modality selections (a joint selection's split is unknown on the host, and only totals size the
    sequence)."""
    for sel in spec.selections:
        modalities = sel.modalities
        if len(modalities) == 1:
            length -= counts[modalities[0]] - sel.k
            counts[modalities[0]] = sel.k
        else:
            length -= sum(counts[m] for m in modalities) - sel.k
    return length


# ---------------------------------------------------------------------------------------------------------------
# Host plan
# ---------------------------------------------------------------------------------------------------------------


def _question_end(facts: PromptFacts, query_tokens: int, question_span: str) -> int:
    """The position closing the question span (its rows are the ``query_tokens`` positions before it), after every
    check ``question_rows`` documents."""
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
        last = last_index(facts.host_ids, eot)
        if last < 0:
            raise ValueError(
                f"macer.compress: end_of_turn_token_id={eot} does not occur in the prompt (searched all {n} "
                "input_ids for the token that closes the user's question); pass the right end_of_turn_token_id, "
                "or question_span='prompt_end' to read the prompt's last query_tokens tokens instead")
        end, where = last, f"the last end-of-turn token {eot} (position {last})"
    if end < query_tokens:
        raise ValueError(f"macer.compress: the question span needs query_tokens={query_tokens} tokens before "
                         f"{where}; the prompt has only {end} there")
    media = last_index(facts.host_labels, TEXT, other=True)
    if media >= 0 and end - query_tokens <= media:
        raise ValueError(
            f"macer.compress: the question rows (prompt positions {end - query_tokens}..{end - 1}: the last "
            f"query_tokens={query_tokens} tokens before {where}) must come after every audio/video token (last at "
            f"{media}); check end_of_turn_token_id, question_span and the prompt layout")
    return end


def question_rows(facts: PromptFacts, query_tokens: int, question_span: str) -> torch.Tensor:
    """Prompt positions of the question rows: the last ``query_tokens`` tokens before the prompt's last
    end-of-turn token (``question_span="end_of_turn"``), or the prompt's last ``query_tokens`` tokens
    (``"prompt_end"``); before ``facts.question_end`` when the adapter gave it. They must all come after every
    audio/video token."""
    end = _question_end(facts, query_tokens, question_span)
    return torch.arange(end - query_tokens, end)


def _check_last_row(facts: PromptFacts, layer_tokens: Sequence[int]) -> None:
    last = int(facts.host_labels[-1]) if facts.length else TEXT
    if last != TEXT and layer_tokens and min(layer_tokens) < facts.length:
        name = MODALITY_NAMES.get(last, f"label-{last}")
        raise ValueError(f"macer.compress: the prompt's last row (position {facts.length - 1}) is a {name} token, "
                         "and the next token is predicted from that row: a policy that drops audio/video tokens "
                         "could drop it. End the prompt with text (the chat template's assistant header), or serve "
                         "it without pruning")


def _asks_question(specs: Sequence[StageSpec]) -> bool:
    return any(spec.needs_scores and spec.query == "question" for spec in specs)


def check_prunable(policy: Policy, facts: PromptFacts, specs: Sequence[StageSpec], layer_tokens: Sequence[int]
                   ) -> None:
    """Raise ``ValueError`` for a prompt ``policy`` cannot prune (both engines then keep the message): its question
    rows are not after every audio/video row (``question_rows``), or its last row, which the next token is predicted
    from, is an audio/video row that the stages could drop (text rows are never dropped). ``specs`` and
    ``layer_tokens``: the policy's stages and per-layer lengths for this prompt."""
    if _asks_question(specs):
        _question_end(facts, policy.query_tokens, policy.question_span)
    _check_last_row(facts, layer_tokens)


@dataclass(frozen=True)
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


class PolicyLayout(NamedTuple):
    """What a policy plans from a prompt's counts alone: the length entering each layer, the budget (None without
    audio/video), the stages, whether a stage reads the question rows and the modality sets a coverage rule chunks."""

    layer_tokens: tuple[int, ...]
    budget: Budget | None
    specs: tuple[StageSpec, ...]
    asks_question: bool = False
    covered: tuple[tuple[int, ...], ...] = ()


def _make_layout(policy: Policy, n_text: int, n_audio: int, n_video: int, num_layers: int) -> PolicyLayout:
    if not n_audio + n_video:
        specs = policy.stage_specs(n_audio, n_video)
    else:
        budget, specs = policy.budget_and_specs(n_audio, n_video)
    if type(policy).layer_tokens is Policy.layer_tokens:  # the base rule, on the specs just made
        layer_tokens = tuple(_layer_tokens(specs, n_text, n_audio, n_video, num_layers))
    else:
        layer_tokens = tuple(policy.layer_tokens(n_text, n_audio, n_video, num_layers))
    if not n_audio + n_video:
        return PolicyLayout(layer_tokens, None, ())
    covered = dict.fromkeys(sel.modalities for spec in specs for sel in spec.selections if sel.rule == "coverage")
    return PolicyLayout(layer_tokens, budget, tuple(specs), _asks_question(specs), tuple(covered))


_cached_layout = functools.lru_cache(maxsize=1024)(_make_layout)


def cacheable(policy: Policy) -> bool:
    """Whether plans of ``policy`` may be cached: a frozen dataclass (its fields cannot change, and ``Policy``'s
    contract makes its stages a function of its fields and the prompt's counts) whose fields hash."""
    params = getattr(type(policy), "__dataclass_params__", None)
    if params is None or not params.frozen:
        return False
    try:
        hash(policy)
    except TypeError:
        return False
    return True


def policy_layout(policy: Policy, n_text: int, n_audio: int, n_video: int, num_layers: int, *,
                  cache: bool = True) -> PolicyLayout:
    """``PolicyLayout`` for a prompt with these counts (cached per policy and counts when ``cacheable``)."""
    if cache and cacheable(policy):
        return _cached_layout(policy, n_text, n_audio, n_video, num_layers)
    return _make_layout(policy, n_text, n_audio, n_video, num_layers)


class _StageEntry(NamedTuple):
    query: tuple[int, int]  # prompt positions start .. stop - 1
    tokens_before: int
    tokens_after: int
    members: tuple[int, ...]
    picks: tuple[np.ndarray | None, ...]
    drawn: bool  # whether a pick is not None


class _PlanEntry(NamedTuple):
    stages: tuple[_StageEntry, ...]
    chunks: np.ndarray | None


PLAN_CACHE_SIZE = 32
"""Plans kept by prompt layout (a 16k-token prompt's plan holds ~130 KB of chunk ids)."""

_PLANS = PlanCache(PLAN_CACHE_SIZE)

_NUMPY_KEYED = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float64,
                          torch.float32, torch.float16))
"""Temporal dtypes read as numpy (others, e.g. bfloat16, go to ``temporal_chunks`` and are not cached)."""


def plan_cache_info() -> dict[str, int]:
    """Hits, misses and entries of the plan cache (``plan_prefill``)."""
    return {"hits": _PLANS.hits, "misses": _PLANS.misses, "entries": len(_PLANS), "maxsize": _PLANS.maxsize}


def clear_plan_cache() -> None:
    """Empty the plan and layout caches (and reset their counters)."""
    _PLANS.clear()
    _cached_layout.cache_clear()


def plan_prefill(policy: Policy, facts: PromptFacts, *, cache: bool = True) -> Plan:
    """Everything a prefill needs that the prompt determines, on the host, before layer 1 runs.

    The plan is a function of the policy, the decoder depth, the prompt's labels (by their runs), the question's end
    and the temporal positions of the tokens a coverage stage chunks; with ``cache`` (and a ``cacheable`` policy) it
    is cached under exactly that key (``PLAN_CACHE_SIZE`` layouts, least recently used first out), so a prompt with
    the layout of an earlier one (the same clip shape and question position, other token ids) is planned without
    recomputing its tables. Every returned plan holds its own tensors. Refusals (``ValueError``) are never cached.
    """
    n = facts.length
    n_audio, n_video = facts.count(AUDIO), facts.count(VISUAL)
    cache = cache and cacheable(policy)
    layout = policy_layout(policy, n - n_audio - n_video, n_audio, n_video, facts.num_layers, cache=cache)
    if not n_audio + n_video:
        return Plan(facts, None, [], list(layout.layer_tokens))
    end = _question_end(facts, policy.query_tokens, policy.question_span) if layout.asks_question else None
    _check_last_row(facts, layout.layer_tokens)
    # The tokens each coverage selection chunks, and their temporal positions (the key's last part).
    covered = {m: _coverage_input(facts, m) for m in layout.covered}  # modalities -> (mask, temporal runs)
    key = None
    if cache and facts.temporal.dtype in _NUMPY_KEYED:
        key = (type(policy), policy, facts.num_layers, facts.runs.key(), end,
               tuple((m, None if c.runs is None else c.runs.key()) for m, c in covered.items()))
        entry = _PLANS.get(key)
        if entry is not None:
            return _plan_from(facts, layout, entry, copy=True)
    entry = _plan_entry(facts, layout, (n_audio, n_video), policy.query_tokens, end, covered)
    if key is not None:
        _PLANS.put(key, entry)
    return _plan_from(facts, layout, entry, copy=key is not None)


class _Covered(NamedTuple):
    """The tokens a coverage selection chunks: which positions (a mask: cheaper than indices here), their temporal
    positions and the runs of those (both None for a dtype numpy does not hold)."""

    mask: np.ndarray
    temporal: np.ndarray | None
    runs: Runs | None


def _coverage_input(facts: PromptFacts, modalities: tuple[int, ...]) -> _Covered:
    if facts.temporal.numel() != facts.length:
        raise ValueError(f"PromptFacts.temporal must hold one position per prompt token ({facts.length}), got "
                         f"{facts.temporal.numel()}")
    mask = host_member_mask(facts.host_labels, modalities)
    if facts.temporal.dtype not in _NUMPY_KEYED:
        return _Covered(mask, None, None)
    temporal = facts.host_temporal[mask]
    return _Covered(mask, temporal, runs_of(temporal))


def _plan_entry(facts: PromptFacts, layout: PolicyLayout, media: tuple[int, int], query_tokens: int, end: int | None,
                covered: dict[tuple[int, ...], _Covered]) -> _PlanEntry:
    """The plan's host tables as numpy (what the cache keeps); ``media``: the prompt's audio and video counts."""
    n = facts.length
    prompt_counts = {AUDIO: media[0], VISUAL: media[1]}
    counts = dict(prompt_counts)
    length, stages = n, []
    chunks: np.ndarray | None = None
    for spec in layout.specs:
        if not spec.needs_scores:
            query = (0, 0)
        elif spec.query == "last":
            query = (n - 1, n)
        else:
            if end is None:
                raise RuntimeError("macer: a stage reads the question rows but the plan found no question end "
                                   "(please report this)")
            query = (end - query_tokens, end)
        members: list[int] = []
        picks: list[np.ndarray | None] = []
        for sel in spec.selections:
            modalities = sel.modalities
            members.append(counts[modalities[0]] if len(modalities) == 1 else sum(counts[m] for m in modalities))
            if sel.rule == "random":
                if any(counts[m] != prompt_counts[m] for m in sel.modalities):
                    raise ValueError("the random rule draws from the prompt's tokens: it must run before any other "
                                     "stage prunes its modalities")
                positions = np.nonzero(host_member_mask(facts.host_labels, sel.modalities))[0]
                picks.append(random_picks(positions, sel.k, sel.seed))
            else:
                picks.append(None)
            if sel.rule == "coverage":
                # Chunk ids over the prompt's tokens of these modalities: the set the stage sees when no earlier
                # stage pruned them (MACER's video stage).
                mask, t, runs = covered[sel.modalities]
                ids = chunk_ids(runs, sel.num_chunks, t) if runs is not None else None
                if ids is None:  # floating positions or a huge span: the op's own arithmetic (and refusals)
                    ids = temporal_chunks(facts.temporal[torch.from_numpy(mask)], sel.num_chunks).numpy()
                chunks = np.full(n, -1, dtype=np.int64) if chunks is None else chunks
                chunks[mask] = ids
        after = _after(spec, counts, length)
        drawn = any(p is not None for p in picks)
        stages.append(_StageEntry(query, length, after, tuple(members), tuple(picks), drawn))
        length = after
    return _PlanEntry(tuple(stages), chunks)


def _plan_from(facts: PromptFacts, layout: PolicyLayout, entry: _PlanEntry, *, copy: bool) -> Plan:
    """A ``Plan`` with tensors of its own (``copy``: the entry's arrays are cached, and a caller may change a plan's
    tensors in place)."""

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array.copy() if copy else array)

    stages = [PlannedStage(spec, torch.from_numpy(np.arange(*st.query, dtype=np.int64)), st.tokens_before,
                           st.tokens_after, st.members,
                           tuple(None if p is None else tensor(p) for p in st.picks) if st.drawn else
                           (None,) * len(st.picks))
              for spec, st in zip(layout.specs, entry.stages, strict=True)]
    chunks = None if entry.chunks is None else tensor(entry.chunks)
    return Plan(facts, layout.budget, stages, list(layout.layer_tokens), chunks)


def member_mask(labels: torch.Tensor, modalities: tuple[int, ...]) -> torch.Tensor:
    # Comparisons with Python scalars: no small tensor is copied to the device inside a stage.
    mask = labels == modalities[0]
    for modality in modalities[1:]:
        mask |= labels == modality
    return mask
