"""Microbenchmarks of every op against its naive PyTorch form (``macer_kernels.reference``), and tests of the
end-to-end benchmark's logic (``macer.bench``) on a tiny model.

No test here asserts a time. In CI pyproject's ``--benchmark-disable`` runs each benchmark body once, as a smoke
test that also checks the op against the reference on the benchmark's inputs. The full run:

    pytest tests/test_microbench.py --benchmark-enable            # CPU: the paper's clip sizes
    pytest tests/test_microbench.py --benchmark-enable -m cuda    # GPU: every backend present, up to N = 20k

Providers: ``naive`` (the reference: GQA expanded per head, full softmax materialised, literal greedy; the scorer
in fp32 like ``benchmarks/bench_modality_scores.py``, the rest in float64),
``torch`` (the PyTorch path), and on a GPU ``triton`` and ``cuda`` where built.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import os
import time

import pytest
import torch
from macer import bench, cost

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


# ---------------------------------------------------------------------------------------------------------------
# macer.bench on a tiny model (logic only)
# ---------------------------------------------------------------------------------------------------------------

_TINY = ["--mode", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128", "--audio-tokens", "100", "--frames", "4", "--grid", "8", "8",
         "--audio-layer", "1", "--video-layer", "2", "--warmup", "0", "--reps", "1", "--profile-reps", "1",
         "--decode-tokens", "3", "--keep-ratios", "0.25", "0.45"]


def _args(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(extra)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench.run(_args([*_TINY, "--out", str(out), "--name", "tiny"])) == 0
    with (out / "tiny.csv").open() as f:
        rows = list(csv.DictReader(f))
    return out, rows, json.loads((out / "tiny.json").read_text())


def test_bench_writes_csv_json_and_plot(tiny_results):
    out, rows, data = tiny_results
    assert (out / "tiny.png").stat().st_size > 0
    expected_columns = {"model", "method", "keep_ratio", "prefill_ms", "llm_prefill_ms", "encoders_ms",
                        "decode_ms_per_token", "peak_extra_mib", "kv_cache_mib", "overhead_ms", "overhead_share",
                        "scoring_ms", "selection_ms", "compaction_ms", "llm_prefill_ratio", "token_layer_ratio",
                        "paper_proxy", "flops_ratio", "ratio_over_proxy", "layer_tokens"}
    assert expected_columns <= set(rows[0])
    assert [(r["method"], float(r["keep_ratio"])) for r in rows] == [("full", 1.0), ("macer", 0.25), ("macer", 0.45)]
    env = data["meta"]["env"]
    assert {"device", "torch", "transformers", "git_sha"} <= set(env) and env["torch"] == torch.__version__
    assert data["meta"]["settings"]["keep_ratios"] == [0.25, 0.45] and data["meta"]["settings"]["reps"] == 1
    assert "cpu_model" in data["meta"] and "load_average_at_end" in data["meta"]
    assert len(data["rows"]) == 3


def test_bench_accounting_matches_cost_model(tiny_results):
    # Recompute every accounting column from the prompt's counts alone (split_budget + staged_layer_tokens +
    # macer.cost) and compare with what the benchmark read from the trace and the returned KV cache.
    _, rows, _ = tiny_results
    shape = cost.DecoderShape(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                              head_dim=16)
    full = rows[0]
    n, n_audio, n_video = int(full["tokens"]), int(full["audio_tokens"]), int(full["video_tokens"])
    assert (n_audio, n_video) == (100, 4 // 2 * 8 * 8 // 4)
    assert float(full["kv_cache_mib"]) * 2**20 == cost.kv_cache_bytes([n] * 4, shape, dtype_bytes=4)
    for row in rows[1:]:
        rho = float(row["keep_ratio"])
        budget = mk.split_budget(n_audio, n_video, rho, 0.30)  # MacerConfig's default audio share (7B)
        assert (int(row["kept_audio"]), int(row["kept_video"])) == (budget.audio, budget.video)
        tokens = cost.staged_layer_tokens(n - n_audio - n_video, n_audio, n_video, budget.audio, budget.video, 1, 2, 4)
        assert [int(t) for t in row["layer_tokens"].split()] == tokens
        assert row["cache_matches_trace"] == "True"
        expected = cost.run_cost(tokens, shape, n_audio + n_video)
        for column in ("token_layer_ratio", "paper_proxy", "flops_ratio"):
            assert math.isclose(float(row[column]), getattr(expected, column), rel_tol=1e-12), column
        assert float(row["kv_cache_mib"]) * 2**20 == cost.kv_cache_bytes(tokens, shape, dtype_bytes=4)
        # One round: the median of per-round ratios is that round's ratio.
        assert math.isclose(float(row["llm_prefill_ratio"]),
                            float(row["llm_prefill_ms"]) / float(full["llm_prefill_ms"]), rel_tol=1e-9)
        assert math.isclose(float(row["ratio_over_proxy"]),
                            float(row["llm_prefill_ratio"]) / float(row["token_layer_ratio"]), rel_tol=1e-9)
        # The overhead is measured in the profiled runs and split over the three groups of ops.
        assert row["overhead_ms"] not in ("", "None") and row["scoring_ms"] not in ("", "None")


def test_timed_ops_counts_macer_ops_and_restores_them():
    from macer import patch
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    model = build_thinker(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1)
    inputs = clip_inputs(model, frames=2, grid_hw=(4, 4), audio_tokens=30)
    originals = (patch.modality_scores, patch.topk_indices, mk.compact_many)
    m = bench.measure_generate(model, inputs, macer_config_for(model, keep_ratio=0.5, audio_layer=1, video_layer=2),
                               2, profile=True)
    assert (patch.modality_scores, patch.topk_indices, mk.compact_many) == originals
    assert m.trace.last.overhead_s is not None and m.overhead_s == m.trace.last.overhead_s
    assert set(m.op_seconds) == set(bench.SCORING_OPS + bench.SELECTION_OPS + bench.COMPACTION_OPS)
    assert m.cache_layer_lengths == m.trace.layer_tokens


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decode-tokens", "1"], "--decode-tokens must be >= 2"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--profile-reps", "-1"], "--profile-reps must be >= 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--keep-ratios", "0.25", "1.5"], r"--keep-ratios must be in \(0, 1\]"),
    ],
)
def test_bench_argument_errors(extra, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        bench.run(_args([*_TINY, *extra, "--out", str(tmp_path)]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_mode_without_gpu_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--mode gpu needs a CUDA GPU"):
        bench.run(_args(["--mode", "gpu", "--out", str(tmp_path)]))


@pytest.mark.cuda
def test_gpu_paths_on_a_tiny_model():
    # The GPU mode's code paths (CUDA events, allocator peaks, the naive output_attentions comparison) on a tiny
    # bf16 thinker; the real run uses the 7B/3B shapes (`--mode gpu`).
    from macer.testing import build_thinker

    model = build_thinker(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16,
                          device="cuda")
    settings = bench._settings(_args([*_TINY, "--mode", "gpu"]), "gpu")
    rows = bench.benchmark_model(model, "tiny-gpu", settings, log=lambda _: None)
    assert [r["method"] for r in rows] == ["full", "macer", "macer"]
    assert all(r["cache_matches_trace"] for r in rows) and rows[0]["peak_extra_mib"] is not None
    assert rows[1]["llm_prefill_cpu_ms"] is None  # CPU-time columns are CPU-mode only
    naive = bench.naive_scores_rows(model, "tiny-gpu", [256], readout_layer=2)
    assert [r["method"] for r in naive] == ["eager+output_attentions", "sdpa+modality_scores"]
    assert not any(r["oom"] for r in naive)


# ---------------------------------------------------------------------------------------------------------------
# macer.bench's gpu mode on CPU, through stand-ins for torch.cuda
# ---------------------------------------------------------------------------------------------------------------


def _checked(real, impl):
    """A stand-in that accepts exactly the arguments ``real`` accepts (a wrong keyword fails here, not on the GPU)."""
    signature = inspect.signature(real)

    def stand_in(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return impl(*args, **kwargs)

    return stand_in


class _CudaStandIns:
    """``torch.cuda`` timing and memory functions with the real signatures, working on CPU tensors."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.allocated = 0
        real_event = torch.cuda.Event
        stand_ins = self

        class Event:
            def __init__(self, *args, **kwargs):
                inspect.signature(real_event).bind(*args, **kwargs)
                stand_ins._count("Event")
                self.stamp = None

            def record(self, *args, **kwargs):
                inspect.signature(real_event.record).bind(self, *args, **kwargs)
                self.stamp = time.perf_counter()

            def synchronize(self):
                assert self.stamp is not None, "synchronize() on an event that was never recorded"

            def elapsed_time(self, end_event):
                assert self.stamp is not None and end_event.stamp is not None, "elapsed_time of unrecorded events"
                return 1e3 * (end_event.stamp - self.stamp)

        self.Event = Event

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def install(self, monkeypatch) -> None:
        def counting(name, result):
            def impl(*args, **kwargs):
                self._count(name)
                return result() if callable(result) else result
            return impl

        def allocated():
            self.allocated += 1000  # grows, so peaks above a base are positive
            return self.allocated

        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        for name, result in (("synchronize", None), ("reset_peak_memory_stats", None), ("empty_cache", None),
                             ("memory_allocated", allocated), ("max_memory_allocated", lambda: self.allocated + 2**20),
                             ("is_available", True)):
            monkeypatch.setattr(torch.cuda, name, _checked(getattr(torch.cuda, name), counting(name, result)))


def test_gpu_mode_code_paths_on_cpu(monkeypatch, tmp_path):
    """``--mode gpu`` end to end (7B/3B text shapes shrunk, bf16, CUDA events, allocator peaks, the naive
    output_attentions comparison with one simulated out-of-memory) on CPU, so that a typo, a wrong keyword or a shape
    error in the never-run GPU mode surfaces here."""
    from macer import testing

    cuda = _CudaStandIns()
    cuda.install(monkeypatch)
    monkeypatch.setattr(bench, "_GPU_DEVICE", "cpu")
    monkeypatch.setattr(bench, "_uses_cuda", lambda device: True)
    tiny = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
    monkeypatch.setitem(testing.TEXT_SHAPES, "7B", {**tiny, "num_layers": 6})
    monkeypatch.setitem(testing.TEXT_SHAPES, "3B", {**tiny, "num_layers": 8})
    monkeypatch.setitem(bench.REAL_VOCAB, "7B", 512)
    monkeypatch.setitem(bench.REAL_VOCAB, "3B", 256)
    naive = bench._scores_from_output_attentions

    def oom_at_96(text_model, embeds, *args):
        if embeds.shape[1] == 96:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")
        return naive(text_model, embeds, *args)

    monkeypatch.setattr(bench, "_scores_from_output_attentions", oom_at_96)
    args = ["--mode", "gpu", "--text-shapes", "7B", "3B", "--audio-tokens", "100", "--frames", "4", "--grid", "8",
            "8", "--warmup", "0", "--reps", "1", "--profile-reps", "1", "--decode-tokens", "3", "--keep-ratios", "0.25",
            "--audio-layer", "4", "--video-layer", "2", "--naive-lengths", "64", "96", "--out", str(tmp_path),
            "--name", "gpu"]
    assert bench.run(_args(args)) == 0

    with (tmp_path / "gpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["method"]) for r in rows] == [("7B", "full"), ("7B", "macer"), ("3B", "full"),
                                                          ("3B", "macer")]
    assert all(r["cache_matches_trace"] == "True" for r in rows)
    assert all(r["llm_prefill_cpu_ms"] == "" and r["decode_cpu_ms_per_token"] == "" for r in rows)  # CPU mode only
    assert all(float(r["peak_extra_mib"]) > 0 and float(r["llm_prefill_ms"]) > 0 for r in rows)
    assert [len(r["layer_tokens"].split()) for r in rows] == [6, 6, 8, 8]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["meta"]["settings"]["dtype"] == "bfloat16" and data["meta"]["settings"]["mode"] == "gpu"
    assert (tmp_path / "gpu.png").stat().st_size > 0

    with (tmp_path / "gpu_naive.csv").open() as f:
        naive_rows = list(csv.DictReader(f))
    assert [(r["model"], r["tokens"], r["method"], r["oom"]) for r in naive_rows] == [
        (model, n, method, str(model_oom))
        for model in ("7B", "3B") for n in ("64", "96")
        for method, model_oom in (("eager+output_attentions", n == "96"), ("sdpa+modality_scores", False))]
    # The later of the two readout layers, L_p = max(l_a, l_v), here the audio layer.
    assert {r["readout_layer"] for r in naive_rows} == {"4"}
    assert all((r["time_ms"] == "") == (r["oom"] == "True") for r in naive_rows)
    assert cuda.calls["Event"] > 0 and cuda.calls["reset_peak_memory_stats"] > 0 and cuda.calls["empty_cache"] > 0


def test_naive_scores_restore_attention_after_an_error(monkeypatch):
    from macer.testing import build_thinker, decoder_parts

    model = build_thinker(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1)

    def broken(*args):
        raise RuntimeError("not an OOM")

    monkeypatch.setattr(bench, "_scores_from_output_attentions", broken)
    with pytest.raises(RuntimeError, match="not an OOM"):
        bench.naive_scores_rows(model, "tiny", [16], readout_layer=2)
    assert decoder_parts(model).decoder.config._attn_implementation == "sdpa"


def test_output_attentions_scores_equal_modality_scores():
    """The naive comparison computes the same ANMS: from eager's probabilities vs from the cached keys with the
    readout layer's own question-row queries."""
    from macer.testing import build_thinker, decoder_parts

    model = build_thinker(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1, attn_implementation="eager")
    decoder = decoder_parts(model).decoder
    embeds = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(0))
    modality = torch.randint(0, 3, (1, 40), generator=torch.Generator().manual_seed(1))
    captured = {}

    def grab(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 1:
            captured["query"] = query[:, :, -4:]
        return eager(module, query, key, value, attention_mask, **kwargs)

    eager = inspect.getmodule(type(decoder.layers[0].self_attn)).eager_attention_forward
    from transformers import AttentionInterface

    AttentionInterface.register("grab_query", grab)
    with torch.no_grad():
        want = bench._scores_from_output_attentions(decoder, embeds, modality, 2, 4)
        decoder.config._attn_implementation = "grab_query"
        try:
            decoder(inputs_embeds=embeds, use_cache=False)
        finally:
            decoder.config._attn_implementation = "eager"
        got = bench._scores_from_cache(decoder, embeds, captured["query"], modality, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

