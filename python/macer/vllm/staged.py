"""MACER's stages inside vLLM's forward, for a batch of requests in one step (V1 model runner; docs/serving.md).

``StagedDecoder`` serves the decoder of one vLLM model (the Qwen2 decoder, the Qwen2.5-Omni thinker's and the
Qwen3-Omni thinker's language model). A step is whatever vLLM's scheduler put in it: new prompts, recomputes after
preemption, decodes, unpruned prompts, in any mix and order. Three jobs, three parts:

* **binding to the runner** (``macer.vllm.runner.RunnerBinding``): the hooks that plan each step before vLLM
  dispatches it to a CUDA graph or not, and build its metadata when the runner builds its own;
* **planning the step on the host** (``macer.vllm.plan.StepPlanner``, ``macer.core.steps``): each request's layout,
  the step's segments, and whether a stage runs (``staged``); the compacted layers' attention metadata for the whole
  step (``macer.vllm.backend.StageMetadata``), from host integers only;
* **the forward** (``forward``, here): one place installs the step's metadata in the forward context by layer name
  (the attention op reads it there at run time), one place runs stages:

  - a step where no stage runs (decodes, prefills with nothing to prune, unpruned requests; any mix) runs vLLM's
    own forward of the decoder (``model``), compiled or captured in CUDA graphs as vLLM runs it: every layer holds
    all of the step's rows, only the compacted layers' metadata differs, and that is read by layer name;
  - a step where a stage runs (a new pruned prefill's readouts and gathers, a recompute's gathers) runs the same
    modules' layers eagerly, for that step only (the runner dispatches it to no CUDA graph): layers run as in vLLM
    until a segment starts; inside a readout layer a forward pre-hook on its ``Attention`` module hands each new
    prefill's post-RoPE queries and keys to its stage (``macer.core.prefill.PrefillState``, the transformers
    engine's own ``run_stage``); before the segment the step's rows are gathered (each staged request's kept rows, a
    recompute's stored keeps, every other row as it is). The output has every row of the step, the kept ones at
    their places and dropped ones zero: the sampler reads a prefill's last prompt row (text, never dropped:
    ``macer.core.layout``) or a decode's row.

The decision between the two is made on the host from the plan, outside any compiled region, so nothing compiled
depends on the batch mix. A prefill's unused tail slots are zeroed before the forward where the backend needs it
(``macer.vllm.backend.needs_tails``).

An architecture that adds something to the hidden states of some rows after a layer (Qwen3-Omni's deepstack
features) passes ``after_layer`` (``AfterLayer``) for the eager path (vLLM's own forward adds them in the other): it is
called after every layer with the rows that layer held (their indices among the step's rows), so it adds exactly the
kept rows' own features.

Beyond one device (``macer.vllm.parallel``): at tensor parallel each stage's scores are reduced over the ranks before
its selection (``TensorRanks``: the tap passes its ``reduce``, and compares the ranks' kept rows after the stage); at
pipeline parallel this decoder holds the rank's layers only (``PipelineRanks``): it plans every request on the
rank's slice of its layout, and a staged step hands the rows it holds to the next rank (``IntermediateTensors`` with
``macer_rows``, and ``macer_flags``: the non-finite flags of the stages run so far, for the last rank's records), after
applying a stage that read the rank's last layer. A step without a stage hands over what
vLLM's own forward hands over.

Dummy, profiling and capture runs are never planned (the MACER worker marks the steps it runs) and take vLLM's own
forward, with, in a FULL CUDA-graph capture, the compacted layers' metadata on the buffers every later FULL step
refills in place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from macer.core.kv_memory import compacted_start
from macer.core.policy import Policy
from macer.vllm.backend import StageMetadata, attention_modules, check_backends, installed, readout, self_test
from macer.vllm.checks import check_policy, refuse
from macer.vllm.parallel import PipelineRanks, TensorRanks
from macer.vllm.plan import PreparedStep, StepPlanner
from macer.vllm.prompt import PromptLabels
from macer.vllm.request_settings import RequestPolicies
from macer.vllm.runner import RunnerBinding
from macer.vllm.settings import SETTINGS_KEY, free_kv
from macer.vllm.state import RequestState

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention.attention import Attention

    from macer.core.prefill import PrefillState

__all__ = ["AfterLayer", "PreparedStep", "StagedDecoder", "capture_bounds"]

logger = logging.getLogger("vllm.macer")

AfterLayer = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``after_layer(index, hidden, rows) -> hidden``: called with the hidden states ``[R, hidden]`` that
``layers[index]`` returned (before the residual is added back) and ``rows``, the ``[R]`` indices of those rows among
the step's input rows (None: all of them, in order; after a stage: the rows the stages kept). Returns the hidden states
that go on to the next layer."""


def _check_policy(policy: Policy, num_layers: int, prompt: PromptLabels) -> None:
    policy.check_depth(num_layers)
    end_of_turn = (policy.end_of_turn_token_id if policy.end_of_turn_token_id is not None
                   else prompt.end_of_turn_token_id)
    check_policy(policy, end_of_turn)


def capture_bounds(policy: Policy, num_layers: int) -> tuple[int, ...]:
    """The layers where the segments of the engine policy's layout start (its stage layers inside the decoder): the
    layout a FULL decode CUDA graph is captured with, one attention metadata per segment."""
    return tuple(sorted({spec.layer for spec in policy.stage_specs(1, 1) if spec.layer < num_layers}))


def _compacted(attns: list[Attention], policy: Policy, settings: Any, first: int, num_layers: int) -> int | None:
    """The first layer whose KV cache groups hold only the kept rows (``macer.vllm.kv``), its layers made to declare
    so; None where the engine does not free KV memory (``free_kv`` off, or nothing to compact). ``attns``: the
    decoder's layers ``first ..`` of ``num_layers`` (a pipeline rank holds some of them)."""
    if not free_kv(settings):
        return None
    from macer.vllm.kv import declare_compacted

    start = compacted_start(policy, num_layers)
    if start is not None:
        declare_compacted(attns[max(start - first, 0):])
    return start


PLATFORM_KERNELS = frozenset({"rms_norm", "silu_and_mul", "rotary_embedding"})
"""vLLM custom ops (registered names) that a stage step runs through the platform's kernel even in a compiled
engine: tensor ops without state, which an eager engine runs that way in every step."""


def platform_kernels_of(model: nn.Module) -> list[tuple[nn.Module, Callable[..., Any]]]:
    """``(module, platform method)`` of each of ``model``'s ``PLATFORM_KERNELS`` modules. In a compiled engine vLLM
    turns its custom ops off (``custom_ops`` "none" under Inductor) and they run ``forward_native``, which Inductor
    fuses into the compiled forward but which, in a stage step's eager layers, is plain torch: the rotary embedding
    alone is some 35 small ops per layer instead of one kernel (vLLM 0.32 ``CustomOp.dispatch_forward``; its private
    ``_forward_method`` is replaced for a stage step only, ``platform_kernels``)."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.platforms import current_platform as platform

    method = ("forward_hip" if platform.is_rocm() else "forward_cpu" if platform.is_cpu() else "forward_tpu"
              if platform.is_tpu() else "forward_xpu" if platform.is_xpu() else "forward_oot"
              if platform.is_out_of_tree() else "forward_cuda")
    return [(module, getattr(module, method)) for module in model.modules()
            if isinstance(module, CustomOp) and getattr(type(module), "name", None) in PLATFORM_KERNELS
            and hasattr(module, "_forward_method")]


@contextlib.contextmanager
def platform_kernels(kernels: list[tuple[Any, Callable[..., Any]]]) -> Iterator[None]:
    """Inside the block each module of ``kernels`` (``platform_kernels_of``) runs the platform's kernel; its own
    forward is back after it."""
    saved = [module._forward_method for module, _ in kernels]
    try:
        for module, method in kernels:
            module._forward_method = method
        yield
    finally:
        for (module, _), forward in zip(kernels, saved, strict=True):
            module._forward_method = forward


class StagedDecoder:
    """Serves the decoder of one vLLM model with each request's stages (module docstring).

    Args:
        model: the decoder: vLLM's ``Qwen2Model`` or the Qwen3-Omni thinker's ``Qwen3MoeLLMModel``
            (``embed_input_ids``, ``layers``, ``norm``; calling it runs vLLM's own, compiled, forward).
        policy: the engine's policy (``macer.vllm.settings.policy_from_config``); a request may set its own.
        prompt: labels and end-of-turn id of the architecture.
        vllm_config: the engine's config.
        after_layer: what the architecture adds to the hidden states after each layer (``AfterLayer``), or None.
    """

    def __init__(self, model: Any, policy: Policy, prompt: PromptLabels, vllm_config: Any,
                 after_layer: AfterLayer | None = None):
        self.model, self.prompt, self.vllm_config = model, prompt, vllm_config
        self.after_layer = after_layer
        self.pipe = PipelineRanks.of(vllm_config, model)  # pipeline parallel: this rank's layers, the hand-over
        self.num_layers = len(model.layers)  # the decoder's depth (a pipeline rank holds a slice)
        self.first = 0 if self.pipe is None else self.pipe.first  # index of layers[0] in the decoder
        self.layers = list(model.layers)[self.first: None if self.pipe is None else self.pipe.stop]
        self.attns = attention_modules(self.layers)
        self.names = [attn.layer_name for attn in self.attns]
        model_config = vllm_config.model_config
        check_backends(self.attns, model_config.architecture)
        settings = (vllm_config.additional_config or {}).get(SETTINGS_KEY)
        _check_policy(policy, self.num_layers, prompt)
        self.policies = RequestPolicies(settings, model_config.hf_config, model_config.architecture, policy)
        self.kv_start = _compacted(self.attns, policy, settings, self.first, self.num_layers)
        bounds = capture_bounds(policy, self.num_layers)
        self.bounds = bounds if self.pipe is None else self.pipe.local_bounds(bounds)  # of self.layers
        self.ranks = TensorRanks.of(vllm_config)  # tensor parallel: the stages' score reduce and guard
        self.planner: StepPlanner | None = None
        self.binding: RunnerBinding | None = None
        self.metadata: StageMetadata | None = None
        self.on_step: Any = None  # tests: called with each step's PreparedStep and the runner once it is built
        self._armed: tuple[int, list[tuple[RequestState, int, int]]] | None = None
        self._kernels = platform_kernels_of(model)  # what a stage step runs as an eager engine does

    # ------------------------------------------------------------------------------------------- the runner
    def bind(self, runner: Any) -> None:
        """Serve steps of ``runner`` (the MACER worker calls this once the KV cache exists): the planner, the stage
        metadata's builder copies and its load-time self-test, the hooks on the runner (``RunnerBinding``)."""
        import vllm

        from macer.vllm.kv import check_groups

        local = None if self.kv_start is None else min(max(self.kv_start - self.first, 0), len(self.names))
        check_groups(runner.kv_cache_config, self.names, local)
        self.planner = StepPlanner(self.policies, self.prompt, self.num_layers, runner.device, self.bounds,
                                   pipe=self.pipe, records=_output_rank(self.vllm_config))
        # The hooks sit on the builder of this rank's first layer's KV group (a later pipeline rank may hold no layer
        # of group 0).
        group = next(gid for gid, kv_group in enumerate(runner.kv_cache_config.kv_cache_groups)
                     if self.names[0] in kv_group.layer_names)
        self.binding = RunnerBinding(self.planner, self._build, self._capture, group=group)
        self.binding.bind(runner)
        self.metadata = StageMetadata(runner, self.names, self.attns, self.bounds)
        try:
            self_test(self.metadata, vllm.__version__)
        except RuntimeError as error:
            refuse([str(error)], f"{self.vllm_config.model_config.architecture} (macer)")

    @property
    def runner(self) -> Any:
        return None if self.binding is None else self.binding.runner

    @property
    def states(self) -> Any:
        """The requests' states (``macer.vllm.state.RequestStates``)."""
        return self.planner.states if self.planner is not None else _NO_STATES

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

    def begin_step(self, finished: Any) -> None:
        """A step the scheduler made starts (the worker): forget the finished requests."""
        if self.binding is not None:
            self.binding.begin_step(finished)

    def end_step(self) -> None:
        if self.binding is not None:
            self.binding.end_step()

    def plan(self, request_id: str, request: Any, whole: bool = True) -> RequestState:
        """A request's state from the runner's host copy of it (``StepPlanner.plan_request``)."""
        return _present(self.planner, "the step planner").plan_request(request_id, request, whole)

    def _build(self, step: PreparedStep, common: Any) -> None:
        """The step's metadata (the runner binding calls this when the runner builds its own)."""
        metadata = _present(self.metadata, "the stage metadata")
        if step.graph:
            _present(self.planner, "the step planner").graph_plan(step)
        metadata.check_owned(step.plan, step.seq_lens)
        metadata.build(step, common)
        if self.on_step is not None:
            self.on_step(step, self.runner)

    def _capture(self, common: Any) -> dict[str, Any]:
        return _present(self.metadata, "the stage metadata").capture(common)

    def check_graphs(self, worker: Any) -> None:
        """After the engine captured its CUDA graphs (the worker): if FULL decode graphs were captured with the
        compacted layers' buffers, prove them against the same decode without them
        (``macer.vllm.graphcheck.check_decode_graphs``); on any difference serve without FULL graphs, saying why."""
        if self.metadata is None or self.metadata.graphs is None:
            return
        from macer.vllm.graphcheck import check_decode_graphs

        if self.pipe is not None:
            # The check feeds made-up requests to one runner, and a pipeline rank's forward needs its neighbours':
            # unproven, so unused (docs/serving.md, "Parallel layouts").
            _present(self.binding, "the runner binding").full_graphs = False
            logger.info("macer: FULL decode CUDA graphs are off for %s's steps with compacted layers at pipeline "
                        "parallel (their load-time check runs on one rank's runner alone); those steps run with "
                        "piecewise CUDA graphs", self.vllm_config.model_config.architecture)
            return
        reason = check_decode_graphs(worker, self)
        if self.ranks is not None:  # the tensor-parallel ranks take the same graphs, or their forwards differ
            reason = self.ranks.verdict(reason)
        if reason is not None:
            _present(self.binding, "the runner binding").full_graphs = False
            logger.warning("macer: FULL decode CUDA graphs are off for %s's steps with compacted layers: %s; they "
                           "run with piecewise CUDA graphs or none (please report this)",
                           self.vllm_config.model_config.architecture, reason)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None, intermediate_tensors: Any = None,
                **model_kwargs: Any) -> Any:
        """vLLM's forward of the decoder with the step's metadata and stages; ``model_kwargs`` go to vLLM's forward
        (Qwen3-Omni: its deepstack features). A pipeline rank after the first receives ``intermediate_tensors``; one
        before the last returns them (``PipelineRanks``)."""
        from vllm.forward_context import get_forward_context

        step, captured = self.binding.take() if self.binding is not None else (None, None)
        context = get_forward_context()
        received = None if self.pipe is None else self.pipe.for_vllm(intermediate_tensors)
        if step is None:  # profiling, warm-up or capture: vLLM's forward (FULL capture: the compacted buffers)
            from vllm.config import CUDAGraphMode

            full = captured and context.cudagraph_runtime_mode == CUDAGraphMode.FULL
            with installed(context, captured if full and captured is not None else {}):
                return self.model(input_ids, positions, received, inputs_embeds, **model_kwargs)
        with installed(context, step.metadata):
            if not step.staged:
                return self.model(input_ids, positions, received, inputs_embeds, **model_kwargs)
            residual = None
            if received is not None:
                hidden, residual = _present(self.pipe, "the pipeline ranks").receive(intermediate_tensors)
            else:
                hidden = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
            if hidden.shape[0] != step.plan.num_tokens:
                raise RuntimeError(f"macer: the forward has {hidden.shape[0]} rows for the step's "
                                   f"{step.plan.num_tokens} tokens (a padded batch in a step that runs stages: the "
                                   "dispatch hook should have kept it unpadded; please report this)")
            # Eager for this step only, so a stage step never compiles anything; vLLM's ops that a compiled engine
            # leaves to Inductor run the platform's kernels, as in an eager engine (``platform_kernels``).
            with self._readouts(), torch.compiler.set_stance("force_eager"), platform_kernels(self._kernels):
                hidden = self._staged(step, hidden, positions, residual)
        for i in step.fresh:
            step.states[i].prefilled = True
            step.states[i].start_record()  # (a state planned without a record makes none: StepPlanner's records)
        return hidden

    @contextlib.contextmanager
    def _readouts(self) -> Iterator[None]:
        """The readout taps on the attention modules, for an eager step only (a compiled forward never sees them)."""
        handles = [attn.register_forward_pre_hook(self._tap(index)) for index, attn in enumerate(self.attns)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _staged(self, step: PreparedStep, hidden: torch.Tensor, positions: torch.Tensor,
                residual: torch.Tensor | None) -> Any:
        total = hidden.shape[0]
        segments = {segment.start: segment for segment in step.plan.segments}
        offsets, origin = step.query_start, None
        for i in step.fresh:  # a stage before the first layer (the random rule): no readout
            prefill = _prefill(step.states[i])
            if self.first == 0 and prefill.stage_at(0) is not None:
                prefill.run(None, None, None, 0.0)
        for index, layer in enumerate(self.layers):
            segment = segments.get(index)
            if segment is not None:
                if segment.gather is not None:
                    # A later pipeline rank's first gather: the rows the previous rank handed over.
                    pipe = self.pipe
                    rows = pipe.entered(step, segment) if pipe is not None and index == 0 and not pipe.is_first \
                        else _gather_rows(step, segment, hidden.device)
                    hidden, positions = hidden[rows], positions[..., rows]
                    residual = None if residual is None else residual[rows]
                    origin = rows if origin is None else origin[rows]
                offsets = segment.query_start
            at = self.first + index  # in the whole decoder
            armed = [(step.states[i], offsets[i], step.states[i].layout.layer_tokens[at]) for i in step.fresh
                     if _prefill(step.states[i]).stage_at(at + 1) is not None]
            self._armed = (index, armed) if armed else None
            try:
                hidden, residual = layer(positions, hidden, residual)
            finally:
                self._armed = None
            if self.after_layer is not None:
                hidden = self.after_layer(at, hidden, origin)
        if self.pipe is not None and not self.pipe.is_last:
            if step.handover is not None:  # the stage that read this rank's last layer is applied before the send
                rows = _gather_rows(step, step.handover, hidden.device)
                hidden, residual = hidden[rows], _present(residual, "the residual")[rows]
                origin = rows if origin is None else origin[rows]
            return self.pipe.send(hidden, _present(residual, "the residual"), origin, total,
                                  self.pipe.stage_flags(step, total, hidden.device))
        hidden, _ = self.model.norm(hidden, residual)
        if origin is None:
            return hidden
        return hidden.new_zeros(total, hidden.shape[-1]).index_copy_(0, origin, hidden)

    def _tap(self, index: int) -> Callable[[Any, tuple], None]:
        def hook(module: Attention, args: tuple) -> None:
            armed = self._armed
            if armed is None or armed[0] != index:
                return
            query, key = args[0], args[1]
            ranks = self.ranks
            for state, offset, count in armed[1]:
                q, k, scale = readout(module, query[offset: offset + count], key[offset: offset + count])
                prefill = _prefill(state)
                prefill.run(q, k, scale, getattr(state.policy, "eps", 0.0),
                            reduce=None if ranks is None else ranks.reduce)
                if ranks is not None:
                    ranks.agree(state.request_id, self.first + index + 1, prefill.pending)

        return hook


_T = TypeVar("_T")


def _present(value: _T | None, what: str) -> _T:
    """``value``, which the worker's binding (``StagedDecoder.bind``), the step's plan or the layers made before this
    point; a clear error where it is missing."""
    if value is None:
        raise RuntimeError(f"macer: {what} is missing here (please report this)")
    return value


def _prefill(state: RequestState) -> PrefillState:
    """The prefill state of a request in the step's ``fresh`` list (the planner lists only requests that have one)."""
    return _present(state.prefill, f"request {state.request_id}'s prefill state")


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


def _output_rank(vllm_config: Any) -> bool:
    """Whether this worker's outputs reach the scheduler (vLLM's output rank: the first tensor-parallel rank of the
    last pipeline stage), the one worker that makes the requests' records."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size <= 1 and parallel.pipeline_parallel_size <= 1:
        return True
    from vllm.distributed import get_pp_group, get_tp_group

    return get_pp_group().is_last_rank and get_tp_group().rank_in_group == 0


class _NoStates:
    """The states of a decoder not bound to a runner yet: none."""

    def __len__(self) -> int:
        return 0

    def __contains__(self, request_id: object) -> bool:
        return False

    def ids(self) -> list[str]:
        return []


_NO_STATES = _NoStates()
