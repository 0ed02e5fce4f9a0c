"""The host plan of one serving step of a MACER engine (``StepPlanner.plan``), from what vLLM's V1 model runner holds
on the host once it has prepared the step's inputs: the request order (``input_batch``), each request's query rows
(``query_start_loc``), computed tokens and prompt ids. Nothing here reads a device value.

A request seen for the first time is planned (``macer.vllm.state.plan_request``); so is one whose prompt length
changed (a streaming-input session grows its prompt under the same id: the plan of its earlier turn says nothing about
the new one) and one presented as a chunk while its plan prunes (the scheduler cut a recompute before a multimodal
item: served unpruned from then on, as the scheduler sized its KV blocks; its first record stays the request's
record, with the new note appended: ``macer.vllm.records``). The step's rows then go to ``macer.core.steps.plan_step``.

What the step needs from the forward follows from the plan alone (``PreparedStep``):

* ``staged``: some segment gathers rows (a new pruned prefill runs its stages, or a recompute re-applies the rows its
  stages kept): the forward runs the decoder's layers itself, eagerly, and the step gets no CUDA graph;
* otherwise every layer runs on all of the step's rows and only the attention metadata of the compacted layers
  differs: vLLM's own (compiled) forward runs the step;
* ``graphable``: every request's segments start at layers of the engine's captured layout (``capture_bounds``, the
  engine policy's stage layers), so a FULL decode CUDA graph captured with one metadata per segment of that layout
  can serve the step.

At pipeline parallel (``pipe``: ``macer.vllm.parallel.PipelineRanks``) every rank plans every request from its prompt
and plans the step on its own layers' slice of each layout; a stage that reads the rank's last layer is applied before
the hand-over to the next rank (``handover``: the gather the next rank's layers start with), which makes the step
staged on this rank too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from macer.core.steps import CHUNK, DECODE, PREFILL, Row, StepPlan, plan_step, row_kind
from macer.vllm.prompt import PromptLabels
from macer.vllm.request_settings import RequestPolicies
from macer.vllm.state import RequestState, RequestStates, plan_request

__all__ = ["PreparedStep", "StepPlanner"]


@dataclass
class PreparedStep:
    """A step's plan and what its forward installs.

    Attributes:
        plan: the step's segments (``macer.core.steps``); replaced by the captured layout's when the step replays a
            FULL CUDA graph (``graph``).
        rows: the step's requests, as planned.
        states: each request's state, in row order.
        fresh: rows whose stages run in this step (their first whole prefill, pruned).
        query_start: the step's ``[n + 1]`` query row offsets.
        staged: some segment gathers rows (the forward runs the layers itself; no CUDA graph).
        graphable: every request's segments start at layers of the captured layout.
        graph: the dispatcher chose a FULL CUDA graph for the step (set by the runner binding).
        num_tokens_padded: the step's rows with the CUDA-graph padding (set by the runner binding).
        metadata: ``{layer name: (attention metadata, slot mapping)}`` of the compacted layers (the metadata build).
        tails: ``{layer name: slots}`` zeroed before the forward (``macer.vllm.backend.StageMetadata.tails``).
        built: the step's metadata build ran (the forward refuses a step whose build never ran).
        handover: pipeline parallel: the gather applied before the rows go to the next rank (a stage read this
            rank's last layer), or None.
    """

    plan: StepPlan
    rows: list[Row]
    states: list[RequestState]
    fresh: list[int]
    query_start: list[int]
    staged: bool
    graphable: bool
    graph: bool = False
    num_tokens_padded: int = 0
    metadata: dict[str, tuple[Any, torch.Tensor]] = field(default_factory=dict)
    tails: dict[str, torch.Tensor] = field(default_factory=dict)
    built: bool = False
    handover: Any = None

    @property
    def seq_lens(self) -> list[int]:
        """Sequence lengths of the layers before the first segment (every layer of a plain step)."""
        return [row.computed + row.query for row in self.rows]


class StepPlanner:
    """Plans the steps of one engine (module docstring).

    Args:
        policies: the engine's and the requests' policies (``macer.vllm.request_settings.RequestPolicies``).
        prompt: labels and end-of-turn id of the architecture.
        num_layers: the decoder's depth.
        device: where a pruned request's stage tables live.
        capture_bounds: the layers where the captured CUDA-graph layout's segments start (empty: no graph can
            serve a pruned request's decode); of the rank's layers at pipeline parallel.
        pipe: pipeline parallel: this rank's layers (``macer.vllm.parallel.PipelineRanks``), or None.
        records: whether this worker makes the requests' records (the worker whose outputs reach the scheduler).
    """

    def __init__(self, policies: RequestPolicies, prompt: PromptLabels, num_layers: int, device: torch.device,
                 capture_bounds: tuple[int, ...] = (), *, pipe: Any = None, records: bool = True):
        self.policies, self.prompt, self.num_layers, self.device = policies, prompt, num_layers, device
        self.capture_bounds = tuple(capture_bounds)
        self.pipe, self.records = pipe, records
        self.states = RequestStates()
        self.quiet: set[str] = set()  # request ids planned without a record (the load-time graph check's)

    def plan(self, runner: Any) -> PreparedStep:
        """The step the runner is about to run (module docstring); host values only."""
        batch = runner.input_batch
        n = batch.num_reqs
        self.states.keep_only(runner.requests)
        query_start = runner.query_start_loc.np[: n + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:n].tolist()
        rows, states, fresh = [], [], []
        capture = set(self.capture_bounds)
        graphable = True
        requests, known = runner.requests, self.states.get
        for i, request_id in enumerate(batch.req_ids[:n]):
            request = requests[request_id]
            prompt_len, query = len(request.prompt_token_ids), query_start[i + 1] - query_start[i]
            if query == 1 and computed[i] >= prompt_len:
                kind = DECODE  # most rows of most steps: row_kind's answer without the call
            else:
                try:
                    kind = row_kind(computed[i], query, prompt_len)
                except ValueError as error:
                    raise RuntimeError(f"macer: {error}") from None
            state = known(request_id)
            grown = state is not None and state.layout.prompt_len != prompt_len
            if state is None or grown or (kind == CHUNK and state.layout.pruned):
                state = self._replan(request_id, request, kind, state, grown)
            if kind == PREFILL and state.prefill is not None and not state.prefilled:
                fresh.append(i)
            graphable = graphable and capture.issuperset(state.bounds)
            rows.append(Row(prompt_len, state.layout.layer_tokens, computed[i], query, state.bounds))
            states.append(state)
        handover = None
        if self.pipe is not None:  # this rank's layers
            handover = self.pipe.handover_segment(rows)
            rows = [self.pipe.local_row(row) for row in rows]
            graphable = all(capture.issuperset(row.bounds or ()) for row in rows)  # Row sets bounds
        plan = plan_step(rows)
        staged = handover is not None or any(segment.gather is not None for segment in plan.segments)
        return PreparedStep(plan, rows, states, fresh, query_start, staged, graphable, handover=handover)

    def graph_plan(self, step: PreparedStep) -> None:
        """Re-plan ``step`` on the captured layout's segments (a FULL CUDA graph reads one metadata per segment of
        that layout, whatever the step's requests prune)."""
        step.plan = plan_step(step.rows, self.capture_bounds)

    def _replan(self, request_id: str, request: Any, kind: str, previous: RequestState | None,
                grown: bool) -> RequestState:
        if grown and previous is not None and previous.layout.pruned and previous.prefilled:
            raise RuntimeError(f"macer: request {request_id}'s prompt changed from {previous.layout.prompt_len} to "
                               f"{len(request.prompt_token_ids)} tokens after its pruned prefill; its compacted "
                               "layers hold the kept rows of the old prompt (the scheduler serves such requests "
                               "unpruned; please report this)")
        return self.states.add(self.plan_request(request_id, request, whole=kind != CHUNK))

    def plan_request(self, request_id: str, request: Any, whole: bool = True) -> RequestState:
        """A request's state from the runner's host copy of it (``CachedRequestState``), and the record of one served
        unpruned (host values only: complete now; a request planned again keeps its first record, to which
        ``macer.vllm.records.record`` appends what the new one says)."""
        mrope = getattr(request, "mrope_positions", None)
        params = getattr(request, "sampling_params", None)
        state = plan_request(request_id, request.prompt_token_ids, None if mrope is None else mrope[0],
                             getattr(params, "extra_args", None), self.policies, self.prompt, self.num_layers,
                             self.device, whole=whole)
        if request_id in self.quiet or not self.records:
            state.recorded = True
        elif not state.layout.pruned:
            state.record_unpruned()
        return state

    def drop(self, request_ids: Any) -> None:
        """Forget finished or aborted requests."""
        self.states.drop(request_ids)
