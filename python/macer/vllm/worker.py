"""The MACER worker: vLLM's own worker (``CPUWorker``, or ``Worker`` on a GPU) with four additions, installed by the
config hook through ``parallel_config.worker_cls`` (the public ``--worker-cls``):

* once the KV cache exists (``initialize_from_config``) it hands the V1 model runner to the model's staged decoder
  (``StagedDecoder.bind``: the request order, prompt ids, per-request settings and block tables of each step, all on
  the host; copies of the runner's attention groups; the load-time self-test);
* once vLLM compiled the model and captured its CUDA graphs (``compile_or_warm_up_model``) it has the decoder prove
  the FULL decode graphs against the same decode without them (``macer.vllm.graphcheck``);
* each step (``execute_model``) it drops the state of the requests vLLM finished or aborted, and marks the step, so
  that only a step the scheduler made is planned (profiling, warm-up and graph-capture runs never are);
* after the step's sampler (``sample_tokens``) it finishes the step's records (``macer.vllm.records``): at once
  under synchronous scheduling, and in the asynchronous output's ``get_output`` (the executor's output thread, after
  vLLM's own wait for the step) under asynchronous scheduling, so that the worker's thread never waits for a
  forward.

A model without a MACER decoder is served exactly as by vLLM's worker. The runner is used, never patched or
subclassed; the private runner names the decoder reads are checked when it binds.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from macer.vllm import parallel, records

logger = logging.getLogger("vllm.macer")

# MacerCPUWorker and MacerGPUWorker are attributes too, built on first access (``__getattr__``).
__all__ = ["MacerWorkerMixin", "configure_engine", "worker_problems"]

_WORKERS = {"cpu": "macer.vllm.worker.MacerCPUWorker", "gpu": "macer.vllm.worker.MacerGPUWorker"}
_SCHEDULER = "macer.vllm.scheduler.make_scheduler"


class MacerWorkerMixin:
    """The additions to vLLM's worker (module docstring); first base of ``MacerCPUWorker`` / ``MacerGPUWorker``.

    Typing: a mixin, so mypy sees neither its ``super()`` (vLLM's worker, the second base) nor the worker's attributes;
    each ``# type: ignore[misc]`` / ``[attr-defined]`` below is one of those."""

    def _macer(self) -> Any:
        runner = getattr(self, "model_runner", None)
        model = runner.get_model() if runner is not None and hasattr(runner, "model") else None
        return getattr(model, "macer", None)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        decoder = self._macer()
        if decoder is not None:
            from vllm.config import set_current_vllm_config

            # Builders made under the engine's config, as the runner makes its own (FlashInfer's __init__ reads it).
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                decoder.bind(self.model_runner)  # type: ignore[attr-defined]
            if decoder.pipe is not None:
                parallel.intermediate_buffers(self.model_runner)  # type: ignore[attr-defined]

    def compile_or_warm_up_model(self) -> Any:
        out = super().compile_or_warm_up_model()  # type: ignore[misc]
        decoder = self._macer()
        if decoder is not None:
            decoder.check_graphs(self)  # FULL decode CUDA graphs, proven before any request (macer.vllm.graphcheck)
        return out

    def execute_model(self, scheduler_output: Any) -> Any:
        records.finish_pending()
        decoder = self._macer()
        if decoder is None:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        decoder.begin_step(scheduler_output.finished_req_ids)
        try:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        finally:
            decoder.end_step()

    def sample_tokens(self, grammar_output: Any) -> Any:
        out = super().sample_tokens(grammar_output)  # type: ignore[misc]
        # The records this step started wait for one device copy of their kept rows, enqueued before the sampler.
        step = records.claim_pending()
        agree = parallel.claim_agreement()  # tensor parallel: the guard's flags of this step (macer.vllm.parallel)
        if hasattr(out, "get_output"):
            # Asynchronous scheduling: vLLM's output waits for the step on the executor's output thread
            # (AsyncModelRunnerOutput.get_output); the records are finished there, after that wait, so that this
            # thread prepares the next step meanwhile.
            return _with_records(parallel.after_output(out, agree), records.drain(), step)
        # Synchronous: the step is done by now (the sampler's tokens went to the host), so waiting costs nothing, and
        # a request that finishes in this step still gets its record.
        agree()
        return _with_records(out, records.drain() + records.finish(step))


def _with_records(out: Any, entries: list[dict[str, Any]], step: list[Any] | None = None) -> Any:
    """The step's output carrying ``entries`` to the scheduler (``macer.vllm.scheduler``) as ``macer_records``: an
    attribute of the pickled ``ModelRunnerOutput`` (on a copy: the empty output is a shared object); for an
    asynchronous output, of what its ``get_output`` returns, with the records of ``step`` (``records.claim_pending``)
    finished there."""
    if hasattr(out, "get_output"):
        get_output = out.get_output

        def with_records() -> Any:
            result = get_output()  # returns once the step's forward (and the records' copies) are done
            return _with_records(result, entries + records.finish(step or []))

        out.get_output = with_records
        return out
    if not entries:
        return out
    if out is None:
        records.receive(entries)  # no output to carry them: kept here (an in-process scheduler reads them)
        return out
    out = copy.copy(out)
    out.macer_records = entries
    return out


def _worker_class(name: str) -> type:
    # Built on first use: the GPU worker module is not what a CPU engine loads, nor the CPU one on a GPU.
    if name == "MacerCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        return type("MacerCPUWorker", (MacerWorkerMixin, CPUWorker), {"__module__": __name__})
    from vllm.v1.worker.gpu_worker import Worker

    return type("MacerGPUWorker", (MacerWorkerMixin, Worker), {"__module__": __name__})


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name in ("MacerCPUWorker", "MacerGPUWorker"):
        if name not in _CLASSES:
            _CLASSES[name] = _worker_class(name)
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def worker_problems(vllm_config: Any) -> list[str]:
    """A worker or scheduler the user set, which the MACER engine would replace (``--worker-cls``,
    ``--scheduler-cls``), one line each."""
    arch = vllm_config.model_config.architecture
    problems = []
    worker = vllm_config.parallel_config.worker_cls
    if worker != "auto" and worker not in _WORKERS.values():
        problems.append(f"{arch} (macer) runs on its own worker (it hands each step's requests to the model): drop "
                        f"--worker-cls {worker} (a worker of another extension needs a class that mixes in "
                        "macer.vllm.worker.MacerWorkerMixin)")
    scheduler = vllm_config.scheduler_config.scheduler_cls
    if scheduler is not None and scheduler != _SCHEDULER:
        problems.append(f"{arch} (macer) runs on its own scheduler (it attaches each request's MACER record to the "
                        f"request's output): drop --scheduler-cls {scheduler}")
    return problems


def configure_engine(vllm_config: Any) -> None:
    """The config hook's part for batched serving (after ``worker_problems``): the MACER worker (``--worker-cls``)
    and scheduler (``--scheduler-cls``: it attaches each request's record to its output); the engine's settings kept
    in this process for the per-request admission check."""
    from vllm.platforms import current_platform

    from macer.vllm.request_settings import remember_engine
    from macer.vllm.runner import would_use_v2
    from macer.vllm.settings import SETTINGS_KEY

    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = _WORKERS["cpu" if current_platform.is_cpu() else "gpu"]
    if not current_platform.is_cpu() and not vllm_config.use_v2_model_runner and would_use_v2(vllm_config):
        logger.info("macer: %s runs on vLLM's V1 model runner (the compacted layers' metadata is built for it; "
                    "vLLM's default here would be Model Runner V2)", vllm_config.model_config.architecture)
    vllm_config.scheduler_config.scheduler_cls = _SCHEDULER
    additional = vllm_config.additional_config or {}
    remember_engine(additional.get(SETTINGS_KEY) if hasattr(additional, "get") else None,
                    vllm_config.model_config.hf_config, vllm_config.model_config.architecture)
