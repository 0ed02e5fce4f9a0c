"""Microbenchmarks of every op against its naive PyTorch form (``macer_kernels.reference``). The end-to-end
benchmark's tests are in ``tests/tools/test_bench_e2e.py``.

No test here asserts a time. In CI pyproject's ``--benchmark-disable`` runs each benchmark body once, as a smoke
test that also checks the op against the reference on the benchmark's inputs. The full run:

    pytest tests/tools/test_microbench.py --benchmark-enable            # CPU: the paper's clip sizes
    pytest tests/tools/test_microbench.py --benchmark-enable -m cuda    # GPU: every backend present, up to N = 20k

Providers: ``naive`` (the reference: GQA expanded per head, full softmax materialised, literal greedy; the scorer
in fp32 like ``benchmarks/bench_modality_scores.py``, the rest in float64),
``torch`` (the PyTorch path), and on a GPU ``triton`` and ``cuda`` where built.
"""

from __future__ import annotations

import os

import pytest
import torch

import macer_kernels as mk
from macer_kernels import reference as ref

_PROVIDERS = [
    pytest.param(("naive", "cpu"), id="naive-cpu"),
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("naive", "cuda"), id="naive-cuda", marks=pytest.mark.cuda),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.cuda),
    pytest.param(("triton", "cuda"), id="triton-cuda", marks=[pytest.mark.cuda, pytest.mark.triton]),
    pytest.param(("cuda", "cuda"), id="cuda-cuda", marks=pytest.mark.cuda),
]

# Sizes: the paper's clip (1460 audio + 864 video tokens, 7B attention heads) on CPU; on a GPU also a 20k context.
_SCORE_SIZES = {"cpu": [2400], "cuda": [2400, 20000]}


@pytest.fixture(params=_PROVIDERS)
def provider(request):
    name, device = request.param
    if name in ("triton", "cuda") and name not in mk.available_backends():
        pytest.skip(f"backend {name} not available: {mk.backend_status()[name]}")
    return name, device


def _expected(provider, reference_fn, torch_fn):
    """What a provider's output is checked against, on CPU: the float64 reference for the fast forms, and for the
    naive form (which *is* the reference) the PyTorch path, so that no provider is compared with itself."""
    if provider[0] == "naive":
        with mk.use_backend("torch"):
            return torch_fn()
    return reference_fn()


def _run(benchmark, provider, naive_fn, fast_fn):
    """Benchmark the provider's form; return its result. CUDA work is synchronised inside the timed call."""
    name, device = provider
    fn = naive_fn if name == "naive" else fast_fn
    # Recorded with the results (benchmarks/microbench_summary.py): a shared machine's load moves every time.
    benchmark.extra_info.update(torch_threads=torch.get_num_threads(), load_average=os.getloadavg()[0])

    def call():
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    if name in ("naive", "torch"):
        with mk.use_backend("torch"):
            return benchmark(call)
    with mk.use_backend(name):
        return benchmark(call)


@pytest.mark.parametrize("n", [2400, 20000], ids=["N2.4k", "N20k"])
def test_bench_modality_scores(benchmark, provider, n):
    _, device = provider
    if n not in _SCORE_SIZES[device]:
        pytest.skip(f"N={n} runs on GPU only")
    g = torch.Generator().manual_seed(n)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    query = torch.randn(1, 28, 4, 128, generator=g).to(device, dtype)  # 7B: 28 query heads, 4 KV heads, d = 128
    key = torch.randn(1, 4, n, 128, generator=g).to(device, dtype)
    modality = torch.randint(0, 3, (1, n), generator=g).to(device)
    benchmark.extra_info.update(bytes_read=key.numel() * key.element_size())
    # The naive form in fp32, as benchmarks/bench_modality_scores.py times it: the float64 reference would charge
    # the naive side for float64 arithmetic (2x the time on CPU) and flatter the speed-up.
    out = _run(benchmark, provider, lambda: ref.modality_scores_ref(query, key, modality, dtype=torch.float32),
               lambda: mk.modality_scores(query, key, modality))
    assert out.dtype == torch.float32
    # Every provider, the naive one included, against the float64 reference on the same (rounded) inputs: fp32
    # accumulation stays below 1e-6 relative per score (measured 4e-7 on CPU).
    expected = ref.modality_scores_ref(query.cpu(), key.cpu(), modality.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-9)


def test_bench_topk_indices(benchmark, provider):
    _, device = provider
    scores = torch.rand(1460, generator=torch.Generator().manual_seed(1)).to(device)
    out = _run(benchmark, provider, lambda: ref.topk_indices_ref(scores, 174), lambda: mk.topk_indices(scores, 174))
    s = scores.cpu()
    assert torch.equal(out.cpu(), _expected(provider, lambda: ref.topk_indices_ref(s, 174),
                                            lambda: mk.topk_indices(s, 174)))


def test_bench_coverage_select(benchmark, provider):
    _, device = provider
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(864, generator=g, dtype=torch.float64).to(device) / 864
    chunks = ref.temporal_chunks_ref(torch.arange(864) // 144, 8).to(device)  # 6 temporal grids of 144 tokens
    out = _run(benchmark, provider, lambda: ref.coverage_select_ref(scores, chunks, 407, 0.2),
               lambda: mk.coverage_select(scores, chunks, 407, 0.2))
    s, c = scores.cpu(), chunks.cpu()
    assert torch.equal(out.cpu(), _expected(provider, lambda: ref.coverage_select_ref(s, c, 407, 0.2),
                                            lambda: mk.coverage_select(s, c, 407, 0.2)))


def test_bench_temporal_chunks(benchmark, provider):
    _, device = provider
    t = (torch.arange(864) // 144 * 50).to(device)
    out = _run(benchmark, provider, lambda: ref.temporal_chunks_ref(t, 8), lambda: mk.temporal_chunks(t, 8))
    assert torch.equal(out.cpu(), _expected(provider, lambda: ref.temporal_chunks_ref(t.cpu(), 8),
                                            lambda: mk.temporal_chunks(t.cpu(), 8)))


def test_bench_split_budget(benchmark, provider):
    out = _run(benchmark, provider, lambda: ref.split_budget_ref(1460, 864, 0.25, 0.3),
               lambda: mk.split_budget(1460, 864, 0.25, 0.3))
    assert out == mk.Budget(581, 174, 407)


def _hidden_and_keep(device: str, hidden: int = 3584, n: int = 2400, kept: int = 640):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, n, hidden, generator=g).to(device, torch.bfloat16)
    keep = torch.sort(torch.randperm(n, generator=g)[:kept]).values.to(device)
    return x, keep


def test_bench_compact(benchmark, provider):
    _, device = provider
    x, keep = _hidden_and_keep(device)
    out = _run(benchmark, provider, lambda: ref.compact_ref(x, keep, 1), lambda: mk.compact(x, keep, 1))
    assert torch.equal(out.cpu(), _expected(provider, lambda: ref.compact_ref(x.cpu(), keep.cpu(), 1),
                                            lambda: mk.compact(x.cpu(), keep.cpu(), 1)))


def test_bench_compact_many(benchmark, provider):
    # One stage boundary: hidden states, RoPE cos and sin, 3-row M-RoPE position ids.
    _, device = provider
    x, keep = _hidden_and_keep(device)
    cos, sin = torch.randn(2, 1, x.shape[1], 128).to(device, torch.bfloat16)
    pos = torch.arange(3 * x.shape[1]).reshape(3, 1, -1).to(device)
    tensors, dims = [x, cos, sin, pos], [1, 1, 1, 2]
    out = _run(benchmark, provider, lambda: [ref.compact_ref(t, keep, d) for t, d in zip(tensors, dims)],
               lambda: mk.compact_many(tensors, keep, dims))
    cpu = [t.cpu() for t in tensors]
    expected = _expected(provider, lambda: [ref.compact_ref(t, keep.cpu(), d) for t, d in zip(cpu, dims)],
                         lambda: mk.compact_many(cpu, keep.cpu(), dims))
    for got, want in zip(out, expected, strict=True):
        assert torch.equal(got.cpu(), want)


def test_microbench_summary_keeps_medians_ratios_and_the_machine():
    from benchmarks.microbench_summary import summarize

    def bench(name, median, threads=2, load=1.5):
        return {"name": name, "stats": {"median": median, "iqr": median / 10, "rounds": 7},
                "extra_info": {"torch_threads": threads, "load_average": load}}

    raw = {"machine_info": {"node": "vm", "processor": "", "cpu": {"brand_raw": "Xeon", "count": 2}},
           "commit_info": {"id": "634b1c2abcdef", "dirty": True}, "datetime": "2026-11-26T05:00:00",
           "benchmarks": [bench("test_bench_modality_scores[naive-cpu-N2.4k]", 0.015),
                          bench("test_bench_modality_scores[torch-cpu-N2.4k]", 0.001, load=3.0),
                          bench("test_bench_coverage_select[naive-cpu]", 0.04),
                          bench("test_bench_coverage_select[torch-cpu]", 0.0002)]}
    summary = summarize(raw)
    assert summary["naive_over_torch"] == {"modality_scores[cpu-N2.4k]": 15.0, "coverage_select[cpu]": 200.0}
    meta = summary["meta"]
    assert meta["machine"] == "Xeon, 2 cores (vm)" and meta["torch_threads"] == [2]
    assert meta["commit"] == "634b1c2-dirty" and meta["load_average_1min_during_run"] == [1.5, 3.0]
    assert [(r["op"], r["provider"], r["median_ms"]) for r in summary["rows"]][:2] == [
        ("modality_scores", "naive", 15.0), ("modality_scores", "torch", 1.0)]
