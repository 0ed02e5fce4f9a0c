"""How a MACER architecture rides vLLM's V1 model runner (``RunnerBinding``), and the runner it asks for
(``prefer_v1_runner``).

The runner is used, never patched as a class or subclassed: the MACER worker hands it to the model once the KV cache
exists (``bind``), and three of its objects get a wrapper on the instance:

* the CUDA-graph dispatcher's ``dispatch`` (called once per step after the runner prepared the step's inputs, before
  any metadata is built): the step is planned here (``macer.vllm.plan.StepPlanner``) and dispatched so that a step
  whose forward runs stages (``staged``) gets no CUDA graph and no padding, and a step whose segments are not the
  captured layout's (``graphable``) no FULL graph;
* the metadata builder of KV cache group 0 (on a later pipeline rank, of its first layer's group): its ``build``
  (once per step) then builds the compacted layers' metadata for the step the dispatcher saw
  (``macer.vllm.backend.StageMetadata.build``), on the buffers a FULL graph reads when the dispatcher chose one; its
  ``build_for_cudagraph_capture`` (FULL captures and dummy runs, never a step the scheduler made) the capture's
  metadata on those buffers (``StageMetadata.capture``).

Only steps the scheduler made are planned: the MACER worker marks them (``begin_step`` / ``end_step``); profiling,
warm-up and capture runs are not. A step the worker marked whose plan or metadata build did not happen raises, naming
the hook that did not run: serving it with vLLM's own metadata would read and write the compacted layers' caches at
the wrong slots.

vLLM 0.32.0 names used that are not public (checked when the runner binds): ``input_batch`` (``req_ids``,
``num_reqs``, ``num_computed_tokens_cpu``, ``block_table``), ``query_start_loc``, ``requests``, ``attn_groups``,
``kv_cache_config``, ``device``, ``cudagraph_dispatcher``; ``VllmConfig.use_v2_model_runner`` (``prefer_v1_runner``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable
from typing import Any

from macer.vllm.plan import PreparedStep, StepPlanner

__all__ = ["RunnerBinding", "prefer_v1_runner", "would_use_v2"]

logger = logging.getLogger("vllm.macer")

RUNNER_NAMES = ("input_batch", "query_start_loc", "requests", "attn_groups", "kv_cache_config", "device",
                "cudagraph_dispatcher")
BATCH_NAMES = ("req_ids", "num_reqs", "num_computed_tokens_cpu", "block_table")
_V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class RunnerBinding:
    """The hooks of one MACER model on its runner (module docstring).

    Args:
        planner: the model's step planner.
        build: ``build(step, common)``: the step's metadata (``StageMetadata.build`` and its checks).
        capture: ``capture(common) -> {layer name: (metadata, slots)}``: a FULL capture's metadata.
        group: the KV cache group whose metadata builder is hooked (0; a later pipeline rank's first layer's).
    """

    def __init__(self, planner: StepPlanner, build: Callable[[PreparedStep, Any], None],
                 capture: Callable[[Any], dict[str, Any]], group: int = 0):
        self.planner, self._build, self._capture, self.group = planner, build, capture, group
        self.runner: Any = None
        self.in_step = False
        self.prepared: PreparedStep | None = None
        self.captured: dict[str, Any] | None = None  # the last FULL capture's metadata, until its forward takes it
        self.full_graphs = True  # FULL CUDA graphs may serve decode steps (the load-time graph self-test may say no)

    def bind(self, runner: Any) -> None:
        """Check the runner names read later and install the hooks."""
        import vllm

        missing = [n for n in RUNNER_NAMES if not hasattr(runner, n)]
        missing += [f"input_batch.{n}" for n in BATCH_NAMES if not hasattr(getattr(runner, "input_batch", None), n)]
        if missing or not hasattr(getattr(runner, "query_start_loc", None), "np"):
            raise RuntimeError(f"macer: vLLM {vllm.__version__}'s model runner ({type(runner).__name__}) lacks "
                               f"{missing or ['query_start_loc.np']}, which the MACER architectures read; they run "
                               "on vLLM's V1 model runner of the tested releases")
        self.runner = runner
        self._hook_dispatch(runner.cudagraph_dispatcher)
        self._hook_builder(runner.attn_groups[self.group][0].get_metadata_builder())

    def _hook_dispatch(self, dispatcher: Any) -> None:
        from vllm.config import CUDAGraphMode

        self.dispatch = dispatcher.dispatch  # vLLM's (an attribute: the graph tests emulate one on CPU)

        def planned_dispatch(*args: Any, **kwargs: Any) -> Any:
            if not self.in_step:
                return self.dispatch(*args, **kwargs)
            step = self.prepared
            if step is None:
                step = self.prepared = self.planner.plan(self.runner)
            if step.staged:  # the layers run eagerly on fewer rows from the first stage on: no graph, no padding
                kwargs["valid_modes"] = {CUDAGraphMode.NONE}
            elif not (step.graphable and self.full_graphs):
                kwargs["invalid_modes"] = {*(kwargs.get("invalid_modes") or ()), CUDAGraphMode.FULL}
            mode, descriptor = self.dispatch(*args, **kwargs)
            step.graph = mode == CUDAGraphMode.FULL
            step.num_tokens_padded = descriptor.num_tokens
            return mode, descriptor

        dispatcher.dispatch = planned_dispatch

    def _hook_builder(self, builder: Any) -> None:
        build, capture = builder.build, builder.build_for_cudagraph_capture

        def hooked_build(*args: Any, **kwargs: Any) -> Any:
            out = build(*args, **kwargs)
            if self.in_step:
                step = self.prepared
                if step is None:
                    raise RuntimeError("macer: the runner built a step's attention metadata without dispatching it "
                                       "first (the hook that plans the step did not run; please report this)")
                if not step.built:
                    self._build(step, args[1] if len(args) > 1 else kwargs["common_attn_metadata"])
                    step.built = True
            return out

        def hooked_capture(common: Any) -> Any:
            out = capture(common)
            if not self.in_step:
                self.captured = self._capture(common)
            return out

        builder.build, builder.build_for_cudagraph_capture = hooked_build, hooked_capture

    def begin_step(self, finished: Iterable[str] | None) -> None:
        """A step the scheduler made starts (the worker): forget the finished requests."""
        self.planner.drop(finished or ())
        self.in_step, self.prepared = True, None

    def end_step(self) -> None:
        step = self.prepared
        self.in_step, self.prepared = False, None
        if step is not None and step.graph and not step.built:
            raise RuntimeError("macer: a step replayed a CUDA graph without the compacted layers' metadata build "
                               "(the hook on the runner's metadata builder did not run; please report this)")

    def take(self) -> tuple[PreparedStep | None, dict[str, Any] | None]:
        """For the forward: the step the runner is running (None outside a step the scheduler made), and outside a
        step the metadata of a FULL capture, if one was just built."""
        if self.in_step:
            step, self.prepared = self.prepared, None
            if step is None or not step.built:
                raise RuntimeError("macer: the forward of a scheduled step found no "
                                   f"{'plan' if step is None else 'metadata build'} for it (a hook on vLLM's model "
                                   "runner did not run); serving it with vLLM's own metadata would read and write the "
                                   "compacted layers' caches at the wrong slots (please report this)")
            return step, None
        captured, self.captured = self.captured, None
        return None, captured


# ----------------------------------------------------------------------------------------- the runner asked for
def _is_macer(vllm_config: Any, architectures: Collection[str]) -> bool:
    model_config = getattr(vllm_config, "model_config", None)
    return model_config is not None and getattr(model_config, "architecture", None) in architectures


def _forces_v2(vllm_config: Any) -> bool:
    """A feature for which vLLM itself requires Model Runner V2 (the MACER checks then refuse the engine)."""
    attention = getattr(vllm_config, "attention_config", None)
    return (getattr(attention, "hisparse_config", None) is not None
            or getattr(vllm_config, "watermark_config", None) is not None)


def would_use_v2(vllm_config: Any) -> bool:
    """Whether vLLM itself would run this engine on Model Runner V2 (its GPU default) with the environment as it is."""
    original = _ORIGINAL[0].fget if _ORIGINAL else None
    return bool(original(vllm_config)) if original is not None else bool(vllm_config.use_v2_model_runner)


_ORIGINAL: list[property] = []


def prefer_v1_runner(architectures: Iterable[str]) -> None:
    """Make ``VllmConfig.use_v2_model_runner`` false for the MACER ``architectures`` unless ``VLLM_USE_V2_MODEL_RUNNER``
    is set (vLLM 0.32 reads it, through that property, in every process it starts; the plugin's entry point calls
    this in each of them, and the config hook says so once, at INFO: ``macer.vllm.worker.configure_engine``). Other
    architectures get vLLM's own choice. Idempotent."""
    from vllm.config import VllmConfig

    if _ORIGINAL:
        return
    original: property = VllmConfig.__dict__["use_v2_model_runner"]
    _ORIGINAL.append(original)
    names = frozenset(architectures)
    read: Any = original.fget

    def use_v2_model_runner(self: Any) -> bool:
        if _is_macer(self, names) and os.environ.get(_V2_ENV) is None and not _forces_v2(self):
            return False
        return bool(read(self))

    # vLLM's property replaced on purpose (mypy sees a method of VllmConfig assigned).
    VllmConfig.use_v2_model_runner = property(  # type: ignore[method-assign,assignment]
        use_v2_model_runner, doc=original.__doc__)
