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


@dataclass(frozen=True)
class Row:
    """One request of a step, on the host.

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
            object.__setattr__(self, "bounds", layer_bounds(self.prompt_len, self.layer_tokens))

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
    if any(len(row.layer_tokens) != num_layers for row in rows):
        raise ValueError("plan_step: every request's layer_tokens must have the decoder's depth")
    if any(not 0 <= bound < num_layers for bound in boundaries):
        raise ValueError(f"plan_step: boundaries must be layer indices in [0, {num_layers - 1}], got {boundaries}")
    kinds = [row_kind(row.computed, row.query, row.prompt_len) for row in rows]
    for row, kind in zip(rows, kinds, strict=True):
        if kind == CHUNK and row.pruned:
            raise ValueError(f"plan_step: a chunk of a pruned prompt ({row.computed} of {row.prompt_len} prompt "
                             "tokens computed, this step feeds "
                             f"{row.query}): MACER needs the whole prompt in one step; serve it unpruned")
    starts = [0]
    for row in rows:
        starts.append(starts[-1] + row.query)
    bounds = sorted(set(boundaries).union(*(row.bounds for row in rows)))
    segments: list[Segment] = []
    previous_start, previous_tokens = starts, [row.prompt_len for row in rows]
    for j, first in enumerate(bounds):
        stop = bounds[j + 1] if j + 1 < len(bounds) else num_layers
        query_lens, seq_lens, staged = [], [], []
        for i, (row, kind) in enumerate(zip(rows, kinds, strict=True)):
            k = row.layer_tokens[first]
            drop = row.prompt_len - k
            if kind == PREFILL:
                generated = row.query - row.prompt_len
                query_lens.append(k + generated)
                seq_lens.append(k + generated)
                if k != previous_tokens[i]:
                    staged.append(i)
            elif kind == DECODE:
                query_lens.append(1)
                seq_lens.append(row.computed + 1 - drop)
            else:
                query_lens.append(row.query)
                seq_lens.append(row.computed + row.query)
        query_start = [0]
        for length in query_lens:
            query_start.append(query_start[-1] + length)
        gather = _gather(staged, previous_start, previous_tokens) if staged else None
        first_index = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
        segments.append(Segment(first, stop, query_start, seq_lens, first_index, staged, gather))
        previous_start = query_start
        previous_tokens = [row.layer_tokens[first] for row in rows]
    plan = StepPlan(starts[-1], kinds, segments)
    _check(rows, plan)
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


def _check(rows: list[Row], plan: StepPlan) -> None:
    """The plan's invariants (host, cheap): every request keeps >= 1 row in every segment, its sequence holds its
    rows, the step only shrinks, unpruned requests are untouched, and a whole prefill's last prompt row survives."""
    previous = plan.num_tokens
    for segment in plan.segments:
        lens = segment.query_lens
        if min(lens) < 1 or any(s < q for s, q in zip(segment.seq_lens, lens, strict=True)):
            raise AssertionError(f"plan_step: a request lost every row or reads fewer than it holds: {segment}")
        if segment.num_tokens > previous:
            raise AssertionError(f"plan_step: segment at layer {segment.start} grew the step")
        previous = segment.num_tokens
        for i, row in enumerate(rows):
            if not row.pruned and (lens[i] != row.query or segment.seq_lens[i] != row.computed + row.query):
                raise AssertionError(f"plan_step: unpruned request {i} changed at layer {segment.start}")
            if plan.kinds[i] == PREFILL and row.layer_tokens[segment.start] < 1:
                raise AssertionError(f"plan_step: request {i} keeps no prompt row at layer {segment.start}")
