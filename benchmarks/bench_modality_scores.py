"""Benchmark ``modality_scores`` (eq:macer_score): naive PyTorch vs every backend, with a roofline for reading K.

    python -m benchmarks.bench_modality_scores            # GPU: Qwen2.5-Omni-7B shapes, writes benchmarks/results/
    python -m benchmarks.bench_modality_scores --quick    # CPU smoke run on tiny shapes, writes nothing

Providers: ``naive`` is the reference definition run in fp32 on the device (K expanded per query head, full causal
softmax, one masked sum per modality); ``torch`` is the PyTorch backend; then every other backend that can run on
the device (``triton``, ``cuda``), ``triton-store``, the Triton kernel storing fp32 logits in phase 1 instead of
recomputing them from K in phase 3 (``macer_kernels.triton.modality_scores.STORE_LOGITS``), timed through the same
public op as ``triton`` so the two rows compare the strategies alone, and ``cuda-sa``, the CUDA backend held to step
S-A where ``cuda`` takes S-B (an sm_90a build on an H100/H200, B = 1): both paths side by side.

Columns: ``median_us``, device time (do_bench: L2 flushed, host time before the first launch hidden; the gaps between
a call's launches are in it); ``wall_us``, what the caller waits for (one call + synchronize, L2 warm; the N = 2.4k
targets "wall <= 15 us" read it); ``launches``, ``syncs``, ``d2h``, ``kernel_us`` per call from torch.profiler (None
on CPU; see ``benchmarks.common``), and ``kernels``, the device time of each kernel of a call (results files; printed
below the table); ``graph_us`` (CUDA providers), do_bench of the call captured in a CUDA graph: the call's kernels
back to back, no host gap, L2 flushed, as a prepared stage runs them; ``path``, the CUDA kernels taken (``sa`` /
``sb``); ``k_gbs``, the bytes of K divided by ``median_us`` (K is the dominant input); ``x_k_read``, the provider's
time (``graph_us`` where measured, else ``median_us``) over the time to read K once at the measured copy bandwidth;
``stream_k_us``, a kernel that only reads K (``macer_kernels.cuda.modality_scores.stream_k_cuda``: the scoring tile
kernel's grid and loads) through the same wrapper, module call and launcher, captured and timed the same way: the
measured "read K once"; ``x_k_stream``, the provider's time over it; ``speedup``, naive time over the provider's
time; ``rel_err`` against the naive output.

Targets (issue 37, printed after the table beside their limits): CUDA scoring <= 1.5 x_k_read at N = 100k and
<= 1.5 x_k_stream at N = 20k (both ratios are printed at 20k: an exact scorer needs one global synchronisation after
the K stream, ~2.5-3 us, which a bandwidth-only number at 20 MB cannot absorb, kernel-plan 2.4.4).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    copy_bandwidth_gbs,
    environment,
    print_table,
    runnable_backends,
    slug,
    time_provider,
    write_results,
)
from macer_kernels import modality_scores, use_backend
from macer_kernels.reference import modality_scores_ref

# Qwen2.5-Omni-7B thinker: 28 query heads, 4 KV heads, D = 128; a 4-token question span; bf16 cache.
SHAPES_7B = {"hq": 28, "hkv": 4, "d": 128, "lq": 4}
SEQ_LENS = (2400, 20_000, 100_000)
QUICK_SEQ_LENS = (64, 200)


def _inputs(n: int, device: str, dtype: torch.dtype, layout: str, hq: int, hkv: int, d: int, lq: int):
    g = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(1, hq, lq, d, generator=g, device=device).to(dtype)
    if layout == "bnhd":  # FlashAttention/vLLM cache layout, read through strides
        key = torch.randn(1, n, hkv, d, generator=g, device=device).to(dtype).transpose(1, 2)
    else:
        key = torch.randn(1, hkv, n, d, generator=g, device=device).to(dtype)
    # Interleaved audio/video/text labels, as in a Qwen-Omni prompt.
    modality = torch.randint(0, 3, (1, n), generator=g, device=device)
    return query, key, modality


def _providers(query, key, modality, device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    providers = {"naive": lambda: modality_scores_ref(query, key, modality, dtype=torch.float32)}
    for name in runnable_backends("modality_scores", device):

        def run(name=name):
            with use_backend(name):
                return modality_scores(query, key, modality)

        providers[name] = run
        if name == "triton":
            providers["triton-store"] = functools.partial(_store_logits, run)
        if name == "cuda" and _cuda_path(query, key) == "sb":
            providers["cuda-sa"] = functools.partial(_cuda_sa, query, key, modality)
    return providers


def _cuda_path(query, key, path: str = "auto") -> str:
    from macer_kernels.cuda.modality_scores import scores_path

    return scores_path(query, key, path=path)[0]


def _cuda_sa(query, key, modality) -> torch.Tensor:
    """The CUDA backend's op held to step S-A (the wrapper the public op dispatches to, with path="sa")."""
    from macer_kernels.cuda.modality_scores import modality_scores_cuda
    from macer_kernels.modality_scores import check_score_inputs

    q, k, m, positions, scale, eps = check_score_inputs(query, key, modality, None, None, 1e-6,
                                                        labels_name="modality")
    return modality_scores_cuda(q, k, m, positions, scale, eps, path="sa")


def graph_time_us(fn: Callable[[], object], device: torch.device) -> float | None:
    """do_bench of ``fn`` captured in a CUDA graph (warmed up on a side stream first); None where it cannot be
    captured."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return 1e3 * do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def _store_logits(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run`` (the public op on the Triton backend) with the stored-logits strategy switched on for the call."""
    from macer_kernels.triton import modality_scores as triton_scores

    saved, triton_scores.STORE_LOGITS = triton_scores.STORE_LOGITS, True
    try:
        return run()
    finally:
        triton_scores.STORE_LOGITS = saved


def run(seq_lens, device: torch.device, dtype: torch.dtype, layout: str, shapes: dict, copy_bytes: int, *,
        quick: bool = False) -> list[dict]:
    bandwidth = copy_bandwidth_gbs(device, copy_bytes)
    rows = []
    for n in seq_lens:
        query, key, modality = _inputs(n, device.type, dtype, layout, **shapes)
        key_bytes = key.numel() * key.element_size()
        read_k_us = key_bytes / (bandwidth * 1e9) * 1e6
        stream_us = None
        if device.type == "cuda" and "cuda" in runnable_backends("modality_scores", device):
            from macer_kernels.cuda.modality_scores import stream_k_cuda

            stream_us = graph_time_us(lambda k=key: stream_k_cuda(k), device)
        providers = _providers(query, key, modality, device)
        expected = providers["naive"]().double()
        naive_us = None
        for name, fn in providers.items():
            err = ((fn().double() - expected).norm() / expected.norm()).item()
            times = time_provider(fn, device, quick=quick, per_kernel=True)
            cuda_provider = name in ("cuda", "cuda-sa")
            graph_us = graph_time_us(fn, device) if cuda_provider and device.type == "cuda" else None
            path = (_cuda_path(query, key, "sa" if name == "cuda-sa" else "auto") if cuda_provider else None)
            us = times["median_us"]
            best = graph_us if graph_us is not None else us
            naive_us = us if name == "naive" else naive_us
            rows.append({"provider": name, "N": n, **times, "graph_us": graph_us, "path": path,
                         "k_gbs": key_bytes / (us * 1e-6) / 1e9, "copy_gbs": bandwidth, "x_k_read": best / read_k_us,
                         "stream_k_us": stream_us, "x_k_stream": best / stream_us if stream_us else None,
                         "speedup": naive_us / us, "rel_err": err})
        del query, key, modality, expected
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# (provider prefix, N, ratio column, limit): the targets for the scoring kernels (kernel-plan 2.4.4).
TARGETS = (("cuda", 100_000, "x_k_read", 1.5), ("cuda", 20_000, "x_k_stream", 1.5), ("cuda", 20_000, "x_k_read", None))


def target_rows(rows: list[dict]) -> list[dict]:
    """Each target beside its limit and the measured ratio, for every CUDA provider row at its N (a limit of None:
    the ratio reported for comparison, no target)."""
    out = []
    for provider, n, column, limit in TARGETS:
        for r in rows:
            if r["provider"].startswith(provider) and r["N"] == n and r[column] is not None:
                out.append({"target": f"{r['provider']} ({r['path']}) {column} at N={n}", "limit": limit,
                            "measured": r[column], "met": None if limit is None else r[column] <= limit})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run on tiny shapes; writes no results")
    parser.add_argument("--layout", choices=("bhnd", "bnhd"), default="bhnd", help="KV cache layout of K")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="override the key counts N")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.quick:
        device = torch.device("cpu")
        shapes = {"hq": 8, "hkv": 2, "d": 64, "lq": 4}
        rows = run(args.seq_lens or QUICK_SEQ_LENS, device, torch.float32, args.layout, shapes, 1 << 24, quick=True)
        print_table(rows, skip=("kernels",))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_modality_scores needs a CUDA GPU (use --quick for a CPU smoke run)")
    device = torch.device("cuda")
    rows = run(args.seq_lens or SEQ_LENS, device, torch.bfloat16, args.layout, SHAPES_7B, 1 << 30)
    print_table(rows, skip=("kernels",))
    for r in rows:
        print(f"kernels {r['provider']} N={r['N']}: {r['kernels']}")
    targets = target_rows(rows)
    print()
    print_table(targets)
    meta = {**environment(device), "shapes": {**SHAPES_7B, "dtype": "bfloat16", "layout": args.layout, "B": 1},
            "targets": targets}
    paths = write_results(f"modality_scores_{args.layout}_{slug(meta['device'])}", rows, meta, args.out)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
