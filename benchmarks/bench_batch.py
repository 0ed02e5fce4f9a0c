"""Batch throughput, full vs MACER: prompts/s and new tokens/s of ``generate`` at batch sizes 1, 4 and 8 (issue #11).

    python -m benchmarks.bench_batch --threads 1      # CPU mode here (small thinker, small clip), GPU mode on CUDA
    python -m benchmarks.bench_batch --mode gpu       # the paper's clip on the 7B text shape, bf16

A batch holds ``B`` chat prompts about the same synthetic interleaved audio-video clip with questions of different
lengths (so the batch is left-padded, as a server's would be), built by ``macer.testing.batch_inputs``. For each
batch size it times ``model.generate(**batch, max_new_tokens=T, min_new_tokens=T)`` unpatched ("full") and inside
``macer.compress`` ("macer"), alternating the two in one process, and reports medians after warm-up:

* ``generate_s``: wall time of one ``generate`` (prefill + ``T`` new tokens; CUDA synchronised on GPU);
* ``prefill_s``: the same with one new token (prefill, encoders and LM head included);
* ``prompts_per_s`` = B / generate_s and ``tokens_per_s`` = B * T / generate_s; ``prefill_prompts_per_s`` =
  B / prefill_s; ``speedup`` = full's generate_s / MACER's at the same batch size;
* on CPU also ``generate_cpu_s`` / ``prefill_cpu_s`` (the process's CPU time over the same call: steady on a machine
  shared with other work, where wall time is not; read it with ``--threads 1``), ``tokens_per_cpu_s`` and
  ``cpu_speedup``.

MACER runs each stage once for the whole batch (one ``select_stage`` with the padding labelled ``PAD_LABEL`` and
per-sample budgets, one ``compact_many``: the same launches for any B; docs/integration.md "Batches"). Results go
to ``benchmarks/results/bench_batch_<mode>.{csv,json}`` with the device, threads, versions, git SHA and settings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_results

MODES = {
    # CPU: small enough for 2 shared cores; the clip is scaled down (the paper's is 864 video + 1460 audio tokens).
    "cpu": {"shape": {"num_layers": 6, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2},
            "clip": {"frames": 4, "grid_hw": (12, 12), "audio_tokens": 250}, "dtype": torch.float32,
            "decode_tokens": 8, "warmup": 1, "reps": 3},
    # GPU: the paper's clip (12 frames at 24x24 -> 864 video tokens, 1460 audio tokens) on the 7B text shape.
    "gpu": {"shape": {"text_shape": "7B", "vocab_size": 152064},
            "clip": {"frames": 12, "grid_hw": (24, 24), "audio_tokens": 1460}, "dtype": torch.bfloat16,
            "decode_tokens": 32, "warmup": 2, "reps": 5},
}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(model, size: int, clip: dict, device: torch.device, dtype: torch.dtype) -> dict:
    from macer.testing import batch_inputs, clip_inputs

    prompts = [clip_inputs(model, **clip, question_tokens=12 + 5 * i, seed=i) for i in range(size)]
    batch = batch_inputs(prompts)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def _time(model, batch: dict, config, new_tokens: int, device: torch.device) -> tuple[float, float]:
    """Wall and process CPU seconds of one ``generate``."""
    import macer

    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if config is None:
            model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        else:
            with macer.compress(model, config):
                model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (CPU mode)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    mode = ("gpu" if torch.cuda.is_available() else "cpu") if args.mode == "auto" else args.mode
    spec = MODES[mode]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if any(b < 1 for b in args.batch_sizes):
        raise SystemExit(f"--batch-sizes must be integers >= 1, got {args.batch_sizes}")
    if not 0.0 < args.keep_ratio <= 1.0:
        raise SystemExit(f"--keep-ratio must be in (0, 1], got {args.keep_ratio}")
    load_at_start = list(os.getloadavg())
    new_tokens = args.decode_tokens or spec["decode_tokens"]
    warmup = spec["warmup"] if args.warmup is None else args.warmup
    reps = spec["reps"] if args.reps is None else args.reps
    if new_tokens < 1 or warmup < 0 or reps < 1:
        raise SystemExit("--decode-tokens >= 1, --warmup >= 0 and --reps >= 1 are required")

    from macer.core.config import paper_defaults
    from macer.testing import build_thinker, macer_config_for

    device = torch.device("cuda" if mode == "gpu" else "cpu")
    with torch.device(device):
        model = build_thinker(dtype=spec["dtype"], device=device, attn_implementation="sdpa", **spec["shape"])
    layers = paper_defaults(model) or {"audio_layer": 2, "video_layer": 3}
    config = macer_config_for(model, keep_ratio=args.keep_ratio, **layers)
    rows = []
    for size in args.batch_sizes:
        batch = _batch(model, size, spec["clip"], device, spec["dtype"])
        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        methods = [("full", None), ("macer", config)]
        for rep in range(warmup + reps):
            for name, cfg in methods if rep % 2 == 0 else methods[::-1]:  # alternate so noise hits both alike
                for tokens in (1, new_tokens):
                    elapsed = _time(model, batch, cfg, tokens, device)
                    if rep >= warmup:
                        times.setdefault((name, tokens), []).append(elapsed)
        for name, _ in methods:
            gen = statistics.median(t[0] for t in times[(name, new_tokens)])
            pre = statistics.median(t[0] for t in times[(name, 1)])
            row = {"batch": size, "method": name, "prompt_tokens": int(batch["input_ids"].shape[1]),
                   "generate_s": gen, "prefill_s": pre, "prompts_per_s": size / gen,
                   "tokens_per_s": size * new_tokens / gen, "prefill_prompts_per_s": size / pre}
            if device.type == "cpu":
                gen_cpu = statistics.median(t[1] for t in times[(name, new_tokens)])
                row.update(generate_cpu_s=gen_cpu, prefill_cpu_s=statistics.median(t[1] for t in times[(name, 1)]),
                           tokens_per_cpu_s=size * new_tokens / gen_cpu)
            rows.append(row)
        rows[-2]["speedup"], rows[-1]["speedup"] = 1.0, rows[-2]["generate_s"] / rows[-1]["generate_s"]
        if device.type == "cpu":
            rows[-2]["cpu_speedup"] = 1.0
            rows[-1]["cpu_speedup"] = rows[-2]["generate_cpu_s"] / rows[-1]["generate_cpu_s"]
        print(f"batch {size} done", file=sys.stderr, flush=True)
    meta = {**environment(device), "mode": mode, "threads": torch.get_num_threads(), "keep_ratio": args.keep_ratio,
            "decode_tokens": new_tokens, "warmup": warmup, "reps": reps, "shape": spec["shape"],
            "clip": {k: list(v) if isinstance(v, tuple) else v for k, v in spec["clip"].items()},
            "dtype": str(spec["dtype"]), "macer_layers": layers, "cpu_model": _cpu_model(),
            "load_average_at_start": load_at_start}
    print_table(rows)
    paths = write_results(f"bench_batch_{mode}", rows, meta, args.out)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
