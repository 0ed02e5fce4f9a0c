"""What the parallel-layout tests (issue 38: ``test_parallel_tp.py``, ``test_parallel_pp.py``,
``test_parallel_dp.py``) share: a mixed batch of requests, their reference (each request alone on a TP=1 engine in
this process, and through transformers with ``macer.compress``), the comparison, the environment of an engine whose
ranks run in processes of their own (one CPU thread per rank, bound to a core of its own), a serving run that counts
preemptions, and what each rank saw (``watch`` / ``watched``: its steps with and without a stage, the calls of vLLM's
eager decoder forward, what it compiled after the engine started).

A request is compared by its tokens, its record (``kv_transfer_params["macer"]``: kept rows per modality, per-layer
lengths, budget, note) and the logprob of every sampled token (fp32; within ``LOGPROB_ATOL`` of the TP=1 engine, whose
single rank sums the heads in another order than the ranks' all-reduces).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

LOGPROB_ATOL = 1e-4
TOKENS = 24
NAN_ID = 509  # a text id only the NaN prompt holds; ``poison`` makes its embedding row NaN


def nan_prompt() -> list[int]:
    """A clip prompt with one text row (``NAN_ID``) whose embedding ``poison`` makes NaN: every stage's scores are
    then non-finite, the first stage's (reading layer 2) included."""
    from macer.vllm.testing import clip_prompt

    prompt = clip_prompt(n_audio=16, n_video=32, question=6, seed=8)
    prompt[4] = NAN_ID
    return prompt


def poison(worker: Any, on: bool = True) -> bool:
    """On this rank (through ``collective_rpc``), where it holds the embedding (the first pipeline rank): make the
    embedding of ``NAN_ID`` NaN (``on``), or stop doing so. A test hook, as the NaN tests of test_batched.py and
    test_conformance.py plant it (no host read in it)."""
    from vllm.distributed import get_pp_group

    handle = getattr(worker, "macer_poison", None)
    if handle is not None:
        handle.remove()
        worker.macer_poison = None
    if on and get_pp_group().is_first_rank:
        import torch

        def hook(module, args, output):
            return torch.where((args[0] == NAN_ID)[:, None], torch.full_like(output, float("nan")), output)

        worker.macer_poison = worker.model_runner.get_model().macer.model.embed_tokens.register_forward_hook(hook)
    return True


def _refused() -> list[int]:
    from macer.vllm.testing import clip_prompt

    prompt = clip_prompt(n_audio=16, n_video=32, question=6, seed=7)
    prompt[len(prompt) - 5] = 17  # no end-of-turn token after the question: the plan refuses it (served unpruned)
    return prompt


def requests() -> list[tuple[str, list[int], dict | None]]:
    """A mixed batch: MACER at the engine's keep ratio and at per-request ones, other policies, audio or video only,
    text only, a prompt the plan refuses. Every prompt fits ``max_model_len`` 256 with ``TOKENS`` generated."""
    from macer.vllm.testing import clip_prompt

    return [
        ("macer", clip_prompt(n_audio=24, n_video=64, question=8, seed=1), None),
        ("macer 2", clip_prompt(n_audio=16, n_video=40, question=6, seed=21), None),
        ("video only, keep 0.5", clip_prompt(n_audio=0, n_video=64, question=8, seed=2), {"macer_keep_ratio": 0.5}),
        ("audio only, keep 1", clip_prompt(n_audio=24, n_video=0, question=8, seed=3), {"macer_keep_ratio": 1.0}),
        ("random, keep 0.5", clip_prompt(n_audio=16, n_video=40, question=6, seed=5),
         {"macer_policy": "random", "macer_keep_ratio": 0.5}),
        ("shared top-k", clip_prompt(n_audio=20, n_video=48, question=8, seed=6), {"macer_policy": "shared_topk"}),
        ("raw scores, keep 0.4", clip_prompt(n_audio=20, n_video=48, question=8, seed=8),
         {"macer_policy": "macer_raw", "macer_keep_ratio": 0.4}),
        ("text only", clip_prompt(n_audio=0, n_video=0, question=12, seed=9), None),
        ("refused plan", _refused(), None),
    ]


def sampling(extra: dict | None) -> Any:
    import vllm

    return vllm.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0,
                               extra_args=extra)


def result(output: Any) -> dict:
    """Tokens, sampled-token logprobs and the MACER record (without its ids) of one ``RequestOutput``."""
    completion = output.outputs[0]
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
    record = dict((output.kv_transfer_params or {}).get("macer") or {})
    for key in ("request_id", "external_id"):
        record.pop(key, None)
    return {"tokens": list(completion.token_ids), "logprobs": logprobs, "record": record}


_REFERENCE: dict[str, dict] = {}


def reference(tiny_checkpoint: Any, hf_model: Any) -> dict[str, dict]:
    """Each request alone on a TP=1 engine in this process (the session's engine settings, started for this and shut
    down after: an in-process engine that another engine's shutdown outlives loses its distributed groups), plus its
    ``macer.compress`` tokens and kept rows (``hf``); computed once per session. Under ``"NaN"``: ``nan_prompt`` on
    that engine with its embedding row poisoned (``poison``), its record noting the non-finite scores."""
    if _REFERENCE:
        return _REFERENCE
    from macer.vllm.request_settings import request_overrides, request_policy
    from macer.vllm.testing import ARCHITECTURE
    from transformers import AutoConfig
    from vllm_cases import ENGINE_ARGS, engine_settings, hf_run, in_process_llm

    config = AutoConfig.from_pretrained(tiny_checkpoint)
    settings = engine_settings()
    llm = in_process_llm(model=str(tiny_checkpoint), additional_config={"macer": settings}, **ENGINE_ARGS)
    try:
        for name, prompt, extra in requests():
            got = result(llm.generate([{"prompt_token_ids": prompt}], sampling(extra), use_tqdm=False)[0])
            policy = request_policy(settings, request_overrides(extra), config, ARCHITECTURE)
            hf = hf_run(hf_model, None if name == "refused plan" else policy, prompt, steps=TOKENS)
            got["hf"] = {"tokens": hf["tokens"], "record": hf["record"]}
            _REFERENCE[name] = got
        from vllm_cases import worker_of

        poison(worker_of(llm))
        try:
            _REFERENCE["NaN"] = result(llm.generate([{"prompt_token_ids": nan_prompt()}], sampling(None),
                                                    use_tqdm=False)[0])
        finally:
            poison(worker_of(llm), on=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return _REFERENCE


def check(name: str, got: dict, want: dict) -> None:
    """``got`` (a parallel engine's result) equals ``want`` (the TP=1 engine's) and transformers: tokens, record,
    logprobs within ``LOGPROB_ATOL``."""
    assert got["tokens"] == want["tokens"] == want["hf"]["tokens"], name
    assert got["record"] == want["record"], name
    assert len(got["logprobs"]) == len(want["logprobs"]) == TOKENS
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst <= LOGPROB_ATOL, (name, worst)
    hf = want["hf"]["record"]
    if hf is not None:
        assert got["record"]["kept_rows"]["audio"] == list(hf.audio_kept), name
        assert got["record"]["kept_rows"]["video"] == list(hf.video_kept), name
        assert got["record"]["layer_tokens"] == list(hf.layer_tokens), name


def two_cores() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks with a core each (vLLM refuses to bind two ranks on one NUMA
    node by itself); skips where the process may run on fewer than two cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two engine ranks need two CPU cores")
    return f"{cores[0]}|{cores[1]}"


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (vLLM's engine processes inherit them)."""
    import vllm.envs

    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def serve_counting_preemptions(llm: Any) -> tuple[list[Any], list[str]]:
    """The mixed batch in one ``generate`` on ``llm`` (engine core in this process), and the requests its scheduler
    preempted."""
    from vllm_cases import scheduler_of

    scheduler = scheduler_of(llm)
    preempted: list[str] = []
    preempt = scheduler._preempt_request

    def counted(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt} for _, prompt, _ in requests()],
                               [sampling(extra) for _, _, extra in requests()], use_tqdm=False)
    finally:
        del scheduler._preempt_request
    return outputs, preempted


def _compile_counters() -> dict:
    """vLLM's counters of its model compilations (the decoder's graphs, their backend compilations). Dynamo's own
    counters are not read: vLLM's sampler compiles its logprob-rank count (``batched_count_greater_than``) at its
    first use, a graph of vLLM's own that a TP=1 engine asked for logprobs compiles too."""
    from vllm.compilation.counter import compilation_counter

    return dataclasses.asdict(compilation_counter)


def watch(worker: Any) -> bool:
    """From now on, on this rank (through ``collective_rpc``): its steps' ``staged`` flags, the calls of vLLM's
    decoder ``forward`` as a Python method (a compiled engine's decoder runs its compiled code instead), and its
    compilation counters."""
    decoder = worker.model_runner.get_model().macer
    model = decoder.model
    seen: dict = {"staged": [], "eager": 0, "counters": _compile_counters()}
    forward = model.forward

    def counted(*args, **kwargs):
        seen["eager"] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    decoder.on_step = lambda step, runner: seen["staged"].append(step.staged)
    worker.macer_seen = seen
    return True


def watched(worker: Any) -> dict:
    """What this rank saw since ``watch``: its pipeline and tensor-parallel ranks, the records it made (only the
    output rank makes them), the steps with and without a stage, the eager forwards, what it compiled."""
    from macer.vllm import records
    from vllm.distributed import get_pp_group, get_tp_group

    seen = worker.macer_seen
    return {"pp": get_pp_group().rank_in_group, "tp": get_tp_group().rank_in_group, "records": len(records.RECORDS),
            "staged": sum(seen["staged"]), "plain": len(seen["staged"]) - sum(seen["staged"]),
            "eager": seen["eager"], "compiled": _changed(seen["counters"], _compile_counters())}


def _changed(before: dict, after: dict) -> dict:
    return {key: (before.get(key), value) for key, value in after.items() if before.get(key) != value}


def check_modes(facts: list[dict], eager: bool) -> None:
    """Every rank ran steps with and without a stage; the steps without one ran vLLM's eager decoder forward in an
    eager engine, its compiled code in a compiled engine (no eager forward, nothing compiled after the start)."""
    for fact in facts:
        assert fact["staged"] and fact["plain"], fact
        if eager:
            assert fact["eager"] == fact["plain"], fact
        else:
            assert fact["eager"] == 0 and not fact["compiled"], fact


def preempting_blocks(prompts: list[list[int]]) -> int:
    """KV cache blocks (32 rows) that admit every one of ``prompts`` but not every whole sequence: serving them all at
    once preempts."""
    return 2 + sum(-(-(len(p) + 8) // 32) for p in prompts)
