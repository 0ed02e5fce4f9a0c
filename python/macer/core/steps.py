"""The host plan of one serving step that mixes requests (``plan_step``): which rows every decoder layer runs on, and
the per-request query and sequence lengths and compacted cache indices its attention reads. Plain Python integers
only (no tensor, no engine): a serving engine calls it before the step's forward with numbers it has on the host,
and builds its attention metadata from the result, so nothing in the step waits for the device.

A step is a flattened batch of requests in the engine's order. Each request contributes one of:

* a **whole prefill** (``computed == 0`` and ``query >= prompt_len``): a new prompt, or a recompute after preemption
  (``query = prompt_len + G``, the prompt then its G generated tokens, re-run in one step);
* a **decode** (``computed >= prompt_len``, one query row);
* a **chunk** of a prompt (anything else with ``computed < prompt_len``): only for a request served unpruned.

``layer_tokens[l]`` is the number of prompt rows entering decoder layer ``l`` (``macer.core.layout``); the prompt
rows a request's stages dropped before layer ``l`` are ``D(l) = prompt_len - layer_tokens[l]``. The layers split
into **segments** at every layer where some request's ``layer_tokens`` changes (layer 0 counts when a stage prunes
before the first layer; ``layer_bounds``), and at any further layer the caller names (``boundaries``: an engine
whose CUDA graphs were captured with one metadata per segment of a fixed layout). Inside a segment every request has
the same rows in every layer, so one attention metadata serves the segment's layers. Per request and segment, with
``K = layer_tokens[first layer]``, ``D = P - K``:

| row kind | query rows ``q_s`` | sequence length ``seq_s`` |
|---|---|---|
| whole prefill | ``K + G`` | ``K + G`` |
| decode | 1 | ``computed + 1 - D`` |
| chunk (unpruned) | ``query`` | ``computed + query`` |

Row ``k`` of a request sits at compacted cache index ``seq_s - q_s + k``: the kept prompt rows at ``0..K-1``, then
position ``p >= P`` at ``p - D``, so decode tokens and a recompute's generated tokens land on the same indices.
Before a segment whose first layer prunes some whole prefill (the request is **staged** there), the rows are
gathered: a staged request contributes its stage's kept rows (device indices, relative to its rows entering the
stage) followed by its generated rows; every other request keeps all its rows (host ranges, merged where adjacent).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

__all__ = ["CHUNK", "DECODE", "KINDS", "PREFILL", "Piece", "Row", "Segment", "StepPlan", "layer_bounds", "plan_step",
           "row_kind"]

PREFILL, DECODE, CHUNK = "prefill", "decode", "chunk"
KINDS = (PREFILL, DECODE, CHUNK)


def layer_bounds(prompt_len: int, layer_tokens: tuple[int, ...]) -> tuple[int, ...]:
    """The layers where a request's prompt rows change (layer 0 when a stage prunes before the first layer): where a
    segment must start for it. Empty for an unpruned request. A function of the request's layout only, so an engine
    computes it once per request and hands it to every ``Row`` of it."""
    bounds, previous = [], prompt_len
    for layer, tokens in enumerate(layer_tokens):
        if tokens != previous:
            bounds.append(layer)
        previous = tokens
    return tuple(bounds)


@dataclass(slots=True)
class Row:
    """One request of a step, on the host (a value: never changed once made; slots, not frozen, because an engine
    makes one per request per step and a frozen dataclass takes three times as long to make).

    Attributes:
        prompt_len: P.
        layer_tokens: prompt rows entering each decoder layer (``(P,) * L`` for an unpruned request).
        computed: tokens already in the request's cache before this step.
        query: rows this step feeds the request.
        bounds: ``layer_bounds(prompt_len, layer_tokens)``, computed here when not given (an engine passes the one it
            keeps per request, so a step does not walk every request's layers again).
    """

    prompt_len: int
    layer_tokens: tuple[int, ...]
    computed: int
    query: int
    bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.bounds is None:
            self.bounds = layer_bounds(self.prompt_len, self.layer_tokens)

    @property
    def pruned(self) -> bool:
        return bool(self.bounds)


def row_kind(computed: int, query: int, prompt_len: int) -> str:
    """``PREFILL``, ``DECODE`` or ``CHUNK`` (module docstring); ``ValueError`` for several rows after the prompt
    (speculative decoding's verify rows)."""
    if computed == 0 and query >= prompt_len:
        return PREFILL
    if computed < prompt_len:
        return CHUNK
    if query == 1:
        return DECODE
    raise ValueError(f"a step feeds {query} rows to a request past its prompt ({computed} tokens computed, prompt "
                     f"{prompt_len}): only one row per decode step is supported (speculative decoding is not)")


@dataclass(frozen=True)
class Piece:
    """One piece of a gather, in order. ``request`` None: the host range ``[start, stop)`` of the previous segment's
    rows. Else the staged request's kept rows: ``start`` + its stage's device keep (indices into its ``before`` rows
    entering the stage), then the host range ``[start + before, stop)`` of its generated rows."""

    start: int
    stop: int
    request: int | None = None
    before: int = 0


@dataclass
class Segment:
    """Decoder layers ``[start, stop)`` with one attention layout.

    Attributes:
        query_start: ``[n + 1]`` row offsets of the requests (``query_start_loc``).
        seq_lens: ``[n]`` sequence lengths the layers' attention reads.
        first_index: ``[n]`` compacted cache index of each request's first row (``seq_lens - query lens``).
        staged: requests whose rows a stage selects at ``start`` (whole prefills whose length changes there).
        gather: how this segment's rows come from the previous segment's (the step's rows for the first segment);
            None: the same rows (nothing staged at ``start``).
    """

    start: int
    stop: int
    query_start: list[int]
    seq_lens: list[int]
    first_index: list[int]
    staged: list[int] = field(default_factory=list)
    gather: list[Piece] | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.query_start, self.query_start[1:])]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)


@dataclass
class StepPlan:
    """A step's plan: the request kinds, and the segments from the first layer whose rows differ from the step's
    (empty: a **plain** step, vLLM's own layers and metadata)."""

    num_tokens: int
    kinds: list[str]
    segments: list[Segment]

    @property
    def plain(self) -> bool:
        return not self.segments

    @property
    def final_tokens(self) -> int:
        return self.segments[-1].num_tokens if self.segments else self.num_tokens


def plan_step(rows: list[Row], boundaries: tuple[int, ...] = ()) -> StepPlan:
    """The step's plan (module docstring). ``rows``: the step's requests in row order; every ``layer_tokens`` has
    the decoder's depth. ``boundaries``: layers where a segment starts even if no request's rows change there (an
    engine whose CUDA graphs were captured with one metadata per segment of a fixed layout passes that layout's
    starts; such a segment just repeats the rows of the one before). ``ValueError`` for a chunk of a pruned request,
    speculative rows, or a boundary outside the decoder."""
    if not rows:
        raise ValueError("plan_step: a step has at least one request")
    num_layers = len(rows[0].layer_tokens)
    if len({len(row.layer_tokens) for row in rows}) != 1:
        raise ValueError("plan_step: every request's layer_tokens must have the decoder's depth")
    if any(not 0 <= bound < num_layers for bound in boundaries):
        raise ValueError(f"plan_step: boundaries must be layer indices in [0, {num_layers - 1}], got {boundaries}")
    kinds = [DECODE if row.query == 1 and row.computed >= row.prompt_len else
             row_kind(row.computed, row.query, row.prompt_len) for row in rows]
    for row, kind in zip(rows, kinds, strict=True) if CHUNK in kinds else ():
        if kind == CHUNK and row.pruned:
            raise ValueError(f"plan_step: a chunk of a pruned prompt ({row.computed} of {row.prompt_len} prompt "
                             "tokens computed, this step feeds "
                             f"{row.query}): MACER needs the whole prompt in one step; serve it unpruned")
    # Per request, with K its prompt rows entering the segment: sequence length K + offset, where offset =
    # computed + query - P (a whole prefill's G generated rows, a decode's computed + 1 - P, an unpruned chunk's
    # computed + query - P with K = P); query rows K + offset for a whole prefill, else the step's query.
    queries = [row.query for row in rows]
    offsets = [row.computed + row.query - row.prompt_len for row in rows]
    prefills = [i for i, kind in enumerate(kinds) if kind == PREFILL]
    whole = [kind == PREFILL for kind in kinds]
    starts = [0, *itertools.accumulate(queries)]
    bounds = sorted(set(boundaries).union(*(row.bounds for row in rows)))
    segments: list[Segment] = []
    previous_start, previous_tokens = starts, [row.prompt_len for row in rows]
    for j, first in enumerate(bounds):
        stop = bounds[j + 1] if j + 1 < len(bounds) else num_layers
        tokens = [row.layer_tokens[first] for row in rows]
        seq_lens = [k + o for k, o in zip(tokens, offsets, strict=True)]
        query_lens = [s if w else q for s, w, q in zip(seq_lens, whole, queries, strict=True)]
        staged = [i for i in prefills if tokens[i] != previous_tokens[i]]
        query_start = [0, *itertools.accumulate(query_lens)]
        gather = _gather(staged, previous_start, previous_tokens) if staged else None
        first_index = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
        segments.append(Segment(first, stop, query_start, seq_lens, first_index, staged, gather))
        previous_start, previous_tokens = query_start, tokens
    plan = StepPlan(starts[-1], kinds, segments)
    _check(rows, plan, prefills)
    return plan


def _gather(staged: list[int], start: list[int], tokens: list[int]) -> list[Piece]:
    """The pieces of the gather before a boundary: staged requests' kept rows, other rows as merged host ranges."""
    pieces: list[Piece] = []
    for i in range(len(start) - 1):
        begin, end = start[i], start[i + 1]
        if i in staged:
            pieces.append(Piece(begin, end, request=i, before=tokens[i]))
        elif pieces and pieces[-1].request is None and pieces[-1].stop == begin:
            pieces[-1] = Piece(pieces[-1].start, end)
        else:
            pieces.append(Piece(begin, end))
    return pieces


def _check(rows: list[Row], plan: StepPlan, prefills: list[int]) -> None:
    """The plan's invariants (host, cheap): every request keeps >= 1 row in every segment, its sequence holds its
    rows, the step only shrinks, unpruned requests are untouched, and a whole prefill's last prompt row survives."""
    previous = plan.num_tokens
    unpruned = [i for i, row in enumerate(rows) if not row.bounds]
    for segment in plan.segments:
        lens, seqs = segment.query_lens, segment.seq_lens
        if min(lens) < 1 or any(map(operator.lt, seqs, lens)):
            raise AssertionError(f"plan_step: a request lost every row or reads fewer than it holds: {segment}")
        if segment.num_tokens > previous:
            raise AssertionError(f"plan_step: segment at layer {segment.start} grew the step")
        previous = segment.num_tokens
        for i in unpruned:
            row = rows[i]
            if lens[i] != row.query or seqs[i] != row.computed + row.query:
                raise AssertionError(f"plan_step: unpruned request {i} changed at layer {segment.start}")
        for i in prefills:
            if rows[i].layer_tokens[segment.start] < 1:
                raise AssertionError(f"plan_step: request {i} keeps no prompt row at layer {segment.start}")
