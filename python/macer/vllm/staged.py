"""MACER's stages inside vLLM's forward, for a batch of requests in one step (V1 model runner, eager; docs/serving.md).

``StagedDecoder`` replaces the layer loop of vLLM's ``Qwen2Model`` (the Qwen2 decoder and the Qwen2.5-Omni thinker's
language model). A step is whatever vLLM's scheduler put in it: new prompts, recomputes after preemption, decodes,
unpruned prompts, in any mix and order.

* **Before the forward** (the runner builds its attention metadata; ``prepare``, from a hook on the runner's own
  builder of KV group 0): the step's requests are read on the host from the runner (``input_batch`` order, query
  rows, computed tokens, prompt ids, per-request settings); a request seen for the first time is planned
  (``macer.vllm.state.plan_request``); the step's host plan follows (``macer.core.steps.plan_step``), then the
  attention metadata of every compacted layer group for the whole step (``macer.vllm.backend.StageMetadata``). No
  device value is read: a decode step is metadata only.
* **In the forward**: layers run as in vLLM until a segment starts; inside a readout layer a forward pre-hook on its
  ``Attention`` module hands each new prefill's post-RoPE queries and keys to its stage
  (``macer.core.prefill.PrefillState``, the transformers engine's own ``run_stage``); before the segment the step's
  rows are gathered (each staged request's kept rows, a recompute's stored keeps, every other row as it is), the
  segment's layers read its metadata, and a prefill's unused tail slots of each compacted layer are zeroed after the
  layer writes its KV. The output has every row of the step, the kept ones at their places and dropped ones zero:
  the sampler reads a prefill's last prompt row (text, never dropped: ``macer.core.layout``) or a decode's row.

An architecture that adds something to the hidden states of some rows after a layer (Qwen3-Omni's deepstack
features) passes ``after_layer`` (``AfterLayer``): it is called after every layer with the rows that layer held (their
indices among the step's rows), so it adds exactly the kept rows' own features.

Dummy, profiling and capture runs are never planned (the MACER worker marks the steps it runs) and take vLLM's own
layer loop, as does a step where no request is pruned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macer.core.policy import Policy
from macer.core.steps import CHUNK, PREFILL, Row, StepPlan, plan_step, row_kind
from macer.vllm.backend import StageMetadata, attention_modules, check_backends, readout, step_context, zero_tail
from macer.vllm.checks import check_policy, refuse
from macer.vllm.parallel import PipelineRanks, TensorRanks
from macer.vllm.prompt import PromptLabels
from macer.vllm.request_settings import RequestPolicies
from macer.vllm.settings import SETTINGS_KEY, free_kv
from macer.vllm.state import RequestState, RequestStates, plan_request

__all__ = ["AfterLayer", "PreparedStep", "StagedDecoder"]

AfterLayer = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``after_layer(index, hidden, rows) -> hidden``: called with the hidden states ``[R, hidden]`` that
``layers[index]`` returned (before the residual is added back) and ``rows``, the ``[R]`` indices of those rows among
the step's input rows (None: all of them, in order; after a stage: the rows the stages kept). Returns the hidden states
that go on to the next layer."""

# The runner's names the decoder reads (vLLM 0.32's V1 GPU/CPU model runner; checked when it binds).
RUNNER_NAMES = ("input_batch", "query_start_loc", "requests", "attn_groups", "kv_cache_config", "device")
BATCH_NAMES = ("req_ids", "num_reqs", "num_computed_tokens_cpu", "block_table")


@dataclass
class PreparedStep:
    """A step's plan and everything its forward installs (``StagedDecoder.prepare``)."""

    plan: StepPlan
    states: list[RequestState]
    fresh: list[int]  # requests whose stages run in this step (their first whole prefill, pruned)
    query_start: list[int]
    metadata: dict[str, tuple[Any, torch.Tensor]]
    tails: dict[str, torch.Tensor]
    handover: Any = None  # pipeline parallel: the gather the next rank starts with (``PipelineRanks``)


def _check_policy(policy: Policy, num_layers: int, prompt: PromptLabels) -> None:
    policy.check_depth(num_layers)
    end_of_turn = (policy.end_of_turn_token_id if policy.end_of_turn_token_id is not None
                   else prompt.end_of_turn_token_id)
    check_policy(policy, end_of_turn)


def _compacted(attns: list[nn.Module], policy: Policy, settings: Any, first: int = 0,
               num_layers: int | None = None) -> int | None:
    """The first layer whose KV cache groups hold only the kept rows (issue 29, ``macer.vllm.kv``), its layers made
    to declare so; None where the engine does not free KV memory (``free_kv`` off, or nothing to compact).
    ``attns``: the decoder's layers ``first ..`` of ``num_layers`` (a pipeline rank holds some of them)."""
    if not free_kv(settings):
        return None
    from macer.core.kv_memory import compacted_start
    from macer.vllm.kv import declare_compacted

    start = compacted_start(policy, len(attns) if num_layers is None else num_layers)
    if start is not None:
        declare_compacted(attns[max(start - first, 0):])
    return start


def _gather_rows(step: PreparedStep, segment: Any, device: torch.device) -> torch.Tensor:
    """The rows of the previous segment that enter ``segment`` (sizes from the host plan; the staged requests'
    kept rows are device indices)."""
    parts = []
    for piece in segment.gather:
        if piece.request is None:
            parts.append(torch.arange(piece.start, piece.stop, device=device))
            continue
        state = step.states[piece.request]
        if piece.request in step.fresh:
            prefill = state.prefill
            keep, prefill.pending = prefill.pending, None
            if keep is None:
                raise RuntimeError(f"macer: request {state.request_id}'s stage before layer {segment.start + 1} "
                                   "did not run (please report this)")
            prefill.current = prefill.current[keep]
            state.keeps[segment.start] = keep
        else:
            keep = state.keeps.get(segment.start)
            if keep is None:
                raise RuntimeError(f"macer: request {state.request_id} is recomputed without the rows its stage "
                                   f"before layer {segment.start + 1} kept (please report this)")
        parts.append(keep + piece.start)
        if piece.stop > piece.start + piece.before:
            parts.append(torch.arange(piece.start + piece.before, piece.stop, device=device))
    return torch.cat(parts)


class StagedDecoder:
    """Runs the layers of one vLLM ``Qwen2Model`` with each request's stages (module docstring).

    Args:
        model: vLLM's ``Qwen2Model`` (``embed_input_ids``, ``layers``, ``norm``).
        policy: the engine's policy (``macer.vllm.settings.policy_from_config``); a request may set its own.
        prompt: labels and end-of-turn id of the architecture.
        vllm_config: the engine's config.
        after_layer: what the architecture adds to the hidden states after each layer (``AfterLayer``), or None.
    """

    def __init__(self, model: nn.Module, policy: Policy, prompt: PromptLabels, vllm_config: Any,
                 after_layer: AfterLayer | None = None):
        self.model, self.prompt, self.vllm_config = model, prompt, vllm_config
        self.after_layer = after_layer
        self.pipe = PipelineRanks.of(vllm_config, model)  # pipeline parallel: this rank's layers, the hand-over
        self.num_layers = len(model.layers)
        self.first = 0 if self.pipe is None else self.pipe.first  # index of self.layers[0] in the decoder
        self.layers = list(model.layers)[self.first: None if self.pipe is None else self.pipe.stop]
        self.attns = attention_modules(self.layers)
        self.names = [attn.layer_name for attn in self.attns]
        model_config = vllm_config.model_config
        check_backends(self.attns, model_config.architecture)
        settings = (vllm_config.additional_config or {}).get(SETTINGS_KEY)
        _check_policy(policy, self.num_layers, prompt)
        self.policies = RequestPolicies(settings, model_config.hf_config, model_config.architecture, policy)
        self.kv_start = _compacted(self.attns, policy, settings, self.first, self.num_layers)
        self.ranks = TensorRanks.of(vllm_config)  # tensor parallel: the stages' score reduce and guard
        self.states = RequestStates()
        self.runner: Any = None
        self.metadata: StageMetadata | None = None
        self.in_step = False
        self.prepared: PreparedStep | None = None
        self.on_step: Any = None  # tests: called with each PreparedStep and the runner
        self._armed: tuple[int, list[tuple[RequestState, int, int]]] | None = None
        for index, attn in enumerate(self.attns):
            attn.register_forward_pre_hook(self._tap(index))

    def use_policy(self, policy: Policy) -> None:
        """Serve the requests that set no policy of their own with ``policy`` (the engine's comes from its
        settings; the conformance tests switch it in-process between requests to run every policy on one engine).
        Where the engine frees KV memory its scheduler plans requests too, and must follow: it has to run in this
        process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        from macer.vllm.kv import follow_default

        _check_policy(policy, self.num_layers, self.prompt)
        if self.kv_start is not None and not follow_default(self.vllm_config, policy):
            raise RuntimeError("macer: use_policy on an engine that frees KV memory (free_kv) needs the engine's "
                               "scheduler in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): it sizes each request's "
                               "compacted KV blocks from the same policy")
        self.policies.use_default(policy)

    # ------------------------------------------------------------------------------------------- the runner
    def bind(self, runner: Any) -> None:
        """Serve steps of ``runner`` (the MACER worker calls this once the KV cache exists): check the runner names
        read later, make the stage metadata's builder copies, run the metadata self-test, and hook the runner's
        group-0 metadata builder, whose ``build`` runs once per step before the forward."""
        import vllm

        missing = [n for n in RUNNER_NAMES if not hasattr(runner, n)]
        missing += [f"input_batch.{n}" for n in BATCH_NAMES if not hasattr(getattr(runner, "input_batch", None), n)]
        if missing or not hasattr(getattr(runner, "query_start_loc", None), "np"):
            raise RuntimeError(f"macer: vLLM {vllm.__version__}'s model runner ({type(runner).__name__}) lacks "
                               f"{missing or ['query_start_loc.np']}, which the MACER architectures read; they run "
                               "on vLLM's V1 model runner of the tested releases")
        from macer.vllm.kv import check_groups

        self.runner = runner
        local = None if self.kv_start is None else min(max(self.kv_start - self.first, 0), len(self.names))
        check_groups(runner.kv_cache_config, self.names, local)
        self.metadata = StageMetadata(runner, self.names)
        try:
            self.metadata.self_test(vllm.__version__)
        except RuntimeError as error:
            refuse([str(error)], f"{self.vllm_config.model_config.architecture} (macer)")
        # The KV group of this rank's first layer (a later pipeline rank holds no layer of group 0).
        builder = runner.attn_groups[self.metadata.group_of[self.names[0]]][0].get_metadata_builder()
        build = builder.build

        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = build(*args, **kwargs)
            if self.in_step:
                common = args[1] if len(args) > 1 else kwargs["common_attn_metadata"]
                self.prepared = self.prepare(common)
            return out

        builder.build = hooked

    def begin_step(self, finished: Any) -> None:
        """A step the scheduler made starts (the worker): forget the finished requests."""
        self.states.drop(finished or ())
        self.in_step, self.prepared = True, None

    def end_step(self) -> None:
        self.in_step, self.prepared = False, None

    # ------------------------------------------------------------------------------------------- the step's plan
    def prepare(self, common: Any) -> PreparedStep:
        """The step's plan and stage metadata, from host values only (module docstring)."""
        runner = self.runner
        batch = runner.input_batch
        n = batch.num_reqs
        request_ids = batch.req_ids[:n]
        self.states.keep_only(runner.requests)
        query_start = runner.query_start_loc.np[: n + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:n].tolist()
        rows, states, fresh = [], [], []
        for i, request_id in enumerate(request_ids):
            request = runner.requests[request_id]
            prompt_len, query = len(request.prompt_token_ids), query_start[i + 1] - query_start[i]
            try:
                kind = row_kind(computed[i], query, prompt_len)
            except ValueError as error:
                raise RuntimeError(f"macer: {error}") from None
            state = self.states.get(request_id)
            if state is None or (kind == CHUNK and state.layout.pruned):
                state = self.states.add(self.plan(request_id, request, whole=kind != CHUNK))
            if kind == PREFILL and state.prefill is not None and not state.prefilled:
                fresh.append(i)
            rows.append(Row(prompt_len, state.layout.layer_tokens, computed[i], query))
            states.append(state)
        handover = None
        if self.pipe is not None:  # this rank's layers; the gather the next rank starts with
            handover = self.pipe.handover_segment(rows)
            rows = [Row(r.prompt_len, self.pipe.local(r.layer_tokens), r.computed, r.query) for r in rows]
        plan = plan_step(rows)
        metadata = {} if plan.plain else self.metadata.build(plan, common)
        seq_lens = [row.computed + row.query for row in rows]
        self.metadata.check_owned(plan, seq_lens)
        tails = self.metadata.tails(plan, seq_lens)
        step = PreparedStep(plan, states, fresh, query_start, metadata, tails, handover)
        if self.on_step is not None:
            self.on_step(step, runner)
        return step

    def plan(self, request_id: str, request: Any, whole: bool = True) -> RequestState:
        """A request's state from the runner's host copy of it (``CachedRequestState``)."""
        mrope = getattr(request, "mrope_positions", None)
        params = getattr(request, "sampling_params", None)
        state = plan_request(request_id, request.prompt_token_ids, None if mrope is None else mrope[0],
                             getattr(params, "extra_args", None), self.policies, self.prompt, self.num_layers,
                             self.runner.device, whole=whole)
        if not state.layout.pruned:
            state.record_unpruned()  # host values only: its record is complete now
        return state

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, intermediate_tensors: Any = None) -> Any:
        """vLLM's ``Qwen2Model.forward`` with the stages; ``[T, hidden]`` rows (a pipeline rank that is not the
        last returns ``IntermediateTensors``: ``PipelineRanks``)."""
        from vllm.forward_context import get_forward_context

        residual = None
        if self.pipe is not None and not self.pipe.is_first:
            hidden, residual = self.pipe.receive(intermediate_tensors)
        else:
            hidden = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        step, self.prepared = self.prepared, None
        if step is None or (step.plan.plain and step.handover is None):
            return self._layers(hidden, positions, {} if step is None else step.tails, residual)
        if hidden.shape[0] != step.plan.num_tokens:
            raise RuntimeError(f"macer: the forward has {hidden.shape[0]} rows for the step's "
                               f"{step.plan.num_tokens} tokens (a padded batch: CUDA graphs or data parallel, which "
                               "the MACER architectures refuse)")
        context = get_forward_context()
        with step_context(context):
            for name, (metadata, slots) in step.metadata.items():
                context.attn_metadata[name], context.slot_mapping[name] = metadata, slots
            hidden = self._staged(step, hidden, positions, residual)
        for i in step.fresh:
            step.states[i].prefilled = True
            if self.pipe is None or self.pipe.is_last:  # the rank whose output reaches the scheduler
                step.states[i].start_record()
        return hidden

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, tails: dict[str, torch.Tensor],
                residual: torch.Tensor | None = None) -> Any:
        """The layers as vLLM runs them, with whatever metadata the forward context holds (and the step's tails
        zeroed: ``StageMetadata.tails``)."""
        for index, layer in enumerate(self.layers):
            tail = tails.get(self.names[index])
            if tail is not None:
                zero_tail(self.attns[index], tail, hidden.dtype)
            hidden, residual = layer(positions, hidden, residual)
            if self.after_layer is not None:
                hidden = self.after_layer(self.first + index, hidden, None)
        if self.pipe is not None and not self.pipe.is_last:
            return self.pipe.send(hidden, residual, None, hidden.shape[0])
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _staged(self, step: PreparedStep, hidden: torch.Tensor, positions: torch.Tensor,
                residual: torch.Tensor | None = None) -> Any:
        total = hidden.shape[0]
        segments = {segment.start: segment for segment in step.plan.segments}
        offsets, origin = step.query_start, None
        for i in step.fresh:  # a stage before the first layer (the random rule): no readout
            if self.first == 0 and step.states[i].prefill.stage_at(0) is not None:
                step.states[i].prefill.run(None, None, None, 0.0)
        for index, layer in enumerate(self.layers):
            segment = segments.get(index)
            if segment is not None:
                if segment.gather is not None:
                    received = index == 0 and self.pipe is not None and not self.pipe.is_first
                    rows = self.pipe.entered(step, segment) if received else _gather_rows(step, segment, hidden.device)
                    hidden, positions = hidden[rows], positions[..., rows]
                    residual = None if residual is None else residual[rows]
                    origin = rows if origin is None else origin[rows]
                offsets = segment.query_start
            layer_index = self.first + index  # in the whole decoder
            armed = [(step.states[i], offsets[i], step.states[i].layout.layer_tokens[layer_index]) for i in step.fresh
                     if step.states[i].prefill.stage_at(layer_index + 1) is not None]
            self._armed = (index, armed) if armed else None
            tail = step.tails.get(self.names[index])
            if tail is not None:
                zero_tail(self.attns[index], tail, hidden.dtype)
            try:
                hidden, residual = layer(positions, hidden, residual)
            finally:
                self._armed = None
            if self.after_layer is not None:
                hidden = self.after_layer(layer_index, hidden, origin)
        if self.pipe is not None and not self.pipe.is_last:
            if step.handover is not None:  # the stage that read this rank's last layer is applied here
                rows = _gather_rows(step, step.handover, hidden.device)
                hidden, residual = hidden[rows], residual[rows]
                origin = rows if origin is None else origin[rows]
            return self.pipe.send(hidden, residual, origin, total)
        hidden, _ = self.model.norm(hidden, residual)
        if origin is None:
            return hidden
        return hidden.new_zeros(total, hidden.shape[-1]).index_copy_(0, origin, hidden)

    def _tap(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            armed = self._armed
            if armed is None or armed[0] != index:
                return
            query, key = args[0], args[1]
            for state, offset, count in armed[1]:
                q, k, scale = readout(module, query[offset: offset + count], key[offset: offset + count])
                reduce = None if self.ranks is None else self.ranks.reduce
                state.prefill.run(q, k, scale, getattr(state.policy, "eps", 0.0), reduce=reduce)
                if self.ranks is not None:
                    self.ranks.agree(state.request_id, self.first + index + 1, state.prefill.pending)

        return hook
