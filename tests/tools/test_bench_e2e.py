"""The end-to-end benchmark's logic (``python -m benchmarks.bench_e2e``) on tiny models: accounting against the cost
model, the output files and where they go, the gpu mode's code paths through stand-ins for ``torch.cuda``.

No test here asserts a time measured on this machine; the stand-ins for ``torch.cuda`` return known values and the
tests check that exactly those reach the results.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import json
import math

import pytest
import torch
from budget_oracle import exact_budget
from macer import cost

from benchmarks import bench_e2e, common
from benchmarks.e2e import measure, naive, output

_TINY = ["--mode", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128", "--audio-tokens", "100", "--frames", "4", "--grid", "8", "8",
         "--audio-layer", "1", "--video-layer", "2", "--warmup", "0", "--reps", "1", "--profile-reps", "1",
         "--decode-tokens", "3", "--keep-ratios", "0.25", "0.45", "--threads", "1"]


def _args(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_e2e.add_arguments(parser)
    return parser.parse_args(extra)


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    sha = common.git_sha()  # the run reads the commit at its start
    try:
        assert bench_e2e.run(_args([*_TINY, "--out", str(out), "--name", "tiny"])) == 0
    finally:
        torch.set_num_threads(threads)
    with (out / "tiny.csv").open() as f:
        rows = list(csv.DictReader(f))
    return out, rows, json.loads((out / "tiny.json").read_text()), sha


def test_bench_writes_csv_json_and_plot(tiny_results):
    out, rows, data, sha = tiny_results
    assert (out / "tiny.png").stat().st_size > 0
    expected_columns = {"model", "clip", "method", "keep_ratio", "prefill_ms", "llm_prefill_ms", "encoders_ms",
                        "decode_ms_per_token", "peak_extra_mib", "kv_cache_mib", "overhead_ms", "overhead_share",
                        "scoring_ms", "selection_ms", "compaction_ms", "llm_prefill_ratio", "token_layer_ratio",
                        "paper_proxy", "flops_ratio", "ratio_over_proxy", "layer_tokens", "host_syncs",
                        "extra_host_syncs"}
    assert expected_columns <= set(rows[0])
    policies = bench_e2e.available_policies()
    assert [(r["method"], float(r["keep_ratio"])) for r in rows] == [("full", 1.0)] + [
        (p, rho) for p in policies for rho in (0.25, 0.45)]
    assert {r["clip"] for r in rows} == {"custom"}
    # Every results file names its machine: device, CPU model, thread count, versions, commit.
    env = data["meta"]["machine"]
    assert env["torch"] == torch.__version__ and env["torch_threads"] == 1
    assert env["cpu_model"] == output.cpu_model() and env["git_sha"] == sha
    import transformers

    assert env["transformers"] == transformers.__version__ and env["device"].startswith("CPU")
    settings = data["meta"]["settings"]
    assert settings["keep_ratios"] == [0.25, 0.45] and settings["reps"] == 1 and settings["threads"] == 1
    assert settings["clips"] == {"custom": {"frames": 4, "audio_tokens": 100}}
    assert "load_average_at_end" in data["meta"] and len(data["rows"]) == len(rows)
    assert all(r["host_syncs"] == "" for r in rows)  # counted on a GPU only


def test_bench_accounting_matches_cost_model(tiny_results):
    # Recompute every accounting column from the prompt's counts alone (the budget oracle + staged_layer_tokens +
    # macer.cost) and compare with what the benchmark read from the trace and the returned KV cache.
    _, rows, _, _ = tiny_results
    shape = cost.DecoderShape(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                              head_dim=16)
    full = rows[0]
    n, n_audio, n_video = int(full["tokens"]), int(full["audio_tokens"]), int(full["video_tokens"])
    assert (n_audio, n_video) == (100, 4 // 2 * 8 * 8 // 4)
    assert float(full["kv_cache_mib"]) * 2**20 == cost.kv_cache_bytes([n] * 4, shape, dtype_bytes=4)
    for row in rows[1:]:
        assert row["cache_matches_trace"] == "True"
        tokens = [int(t) for t in row["layer_tokens"].split()]
        assert float(row["kv_cache_mib"]) * 2**20 == cost.kv_cache_bytes(tokens, shape, dtype_bytes=4)
        assert math.isclose(float(row["token_layer_ratio"]), sum(tokens) / (4 * n), rel_tol=1e-12)
        flops = cost.decoder_flops(tokens, shape).total / cost.decoder_flops([n] * 4, shape).total
        assert math.isclose(float(row["flops_ratio"]), flops, rel_tol=1e-12)
        # One round: the median of per-round ratios is that round's ratio.
        assert math.isclose(float(row["llm_prefill_ratio"]),
                            float(row["llm_prefill_ms"]) / float(full["llm_prefill_ms"]), rel_tol=1e-9)
        assert math.isclose(float(row["ratio_over_proxy"]),
                            float(row["llm_prefill_ratio"]) / float(row["token_layer_ratio"]), rel_tol=1e-9)
        assert row["overhead_ms"] != "" and row["stage_ms"] != ""
        if row["method"] != "macer":
            continue
        rho = float(row["keep_ratio"])
        budget = exact_budget(n_audio, n_video, rho, 0.30)  # MacerConfig's default audio share (7B)
        assert (int(row["kept_audio"]), int(row["kept_video"])) == (budget.audio, budget.video)
        assert tokens == cost.staged_layer_tokens(n - n_audio - n_video, n_audio, n_video, budget.audio,
                                                  budget.video, 1, 2, 4)
        expected = cost.run_cost(tokens, shape, n_audio + n_video)
        assert math.isclose(float(row["paper_proxy"]), expected.paper_proxy, rel_tol=1e-12)


def test_default_output_is_outside_the_committed_results(tmp_path):
    assert output.output_dir(None, record=False) == output.DEFAULT_OUT
    assert common.RESULTS_DIR not in output.DEFAULT_OUT.parents and output.DEFAULT_OUT != common.RESULTS_DIR
    assert output.output_dir(None, record=True) == common.RESULTS_DIR
    assert output.output_dir(tmp_path, record=False) == tmp_path
    with pytest.raises(SystemExit, match="--out and --record exclude each other"):
        output.output_dir(tmp_path, record=True)
    # /out/ is ignored by git, so a default run leaves the tree clean.
    assert "/out/" in (output.REPO_ROOT / ".gitignore").read_text().split()


def test_timed_ops_counts_macer_ops_and_restores_them():
    import sys

    from macer.testing import build_thinker, clip_inputs, macer_config_for

    model = build_thinker(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1)
    inputs = clip_inputs(model, frames=2, grid_hw=(4, 4), audio_tokens=30)
    modules = [m for name, m in list(sys.modules.items()) if name.startswith(("macer.", "macer_kernels"))]
    before = [(m, n, getattr(m, n)) for m in modules for n in measure.SCORING_OPS + measure.SELECTION_OPS
              + measure.COMPACTION_OPS if hasattr(m, n)]
    m = measure.measure_generate(model, inputs, macer_config_for(model, keep_ratio=0.5, audio_layer=1, video_layer=2),
                                 2, profile=True)
    assert all(getattr(mod, n) is fn for mod, n, fn in before)
    assert m.trace.last.overhead_s is not None and m.overhead_s == m.trace.last.overhead_s
    assert set(m.op_seconds) == set(measure.SCORING_OPS + measure.SELECTION_OPS + measure.COMPACTION_OPS
                                    + measure.STAGE_OPS)
    # MACER's stages run a prepared stage, deferred to the next layer, whose call also gathers the layer inputs (a
    # prompt alone: hfstage-37): it ran and was timed, no compact_many ran and nothing else scored.
    assert m.op_seconds["prepared_stage"] > 0 and m.op_seconds["compact_many"] == 0
    assert m.op_seconds["modality_scores"] == 0
    assert m.cache_layer_lengths == m.trace.layer_tokens


def test_count_sync_events():
    names = ["aten::add", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize",
             "cudaLaunchKernel", "cudaDeviceSynchronize", "cudaEventSynchronize"]
    assert measure.count_sync_events(names) == {"cudaStreamSynchronize": 2, "cudaDeviceSynchronize": 1,
                                                "cudaEventSynchronize": 1, "cudaMemcpy": 1, "cudaMemcpy2D": 0}


def test_compiled_rows_beside_eager_rows(tmp_path):
    """``--compile both``: every configuration eager and with compiled decoder layers (aot_eager here: Dynamo's graphs
    run by eager kernels, so the two settings prune and decode alike), each policy's ratio to the full model of its
    own setting, the speedups to both full models, and the first round's prefill (where compilation happens)."""
    threads = torch.get_num_threads()
    try:
        bench_e2e.run(_args([*_TINY, "--policies", "macer", "--compile", "both", "--compile-backend", "aot_eager",
                             "--profile-reps", "0", "--no-plot", "--out", str(tmp_path), "--name", "compiled"]))
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "compiled.json").read_text())
    rows = data["rows"]
    assert data["meta"]["settings"]["compile"] == "both"
    assert data["meta"]["settings"]["compile_options"] == {"backend": "aot_eager"}
    assert [(r["method"], r["keep_ratio"], r["compiled"]) for r in rows] == [
        ("full", 1.0, False), ("macer", 0.25, False), ("macer", 0.45, False),
        ("full", 1.0, True), ("macer", 0.25, True), ("macer", 0.45, True)]
    eager, compiled = rows[:3], rows[3:]
    for e, c in zip(eager, compiled):
        assert (c["layer_tokens"], c["kept_audio"], c["kept_video"]) == (e["layer_tokens"], e["kept_audio"],
                                                                       e["kept_video"])
        assert c["cache_matches_trace"] and c["first_prefill_ms"] > 0
    for group in (eager, compiled):
        full = group[0]
        for row in group[1:]:  # one round: each ratio is that round's, against the full model of the same setting
            assert math.isclose(row["llm_prefill_ratio"], row["llm_prefill_ms"] / full["llm_prefill_ms"], rel_tol=1e-9)
            assert math.isclose(row["speedup"], full["llm_prefill_ms"] / row["llm_prefill_ms"], rel_tol=1e-9)
            assert math.isclose(row["speedup_vs_eager_full"], eager[0]["llm_prefill_ms"] / row["llm_prefill_ms"],
                                rel_tol=1e-9)
            assert row["target_speedup"] is None  # a custom clip has no target
            assert math.isclose(row["speedup_cpu"], full["llm_prefill_cpu_ms"] / row["llm_prefill_cpu_ms"],
                                rel_tol=1e-9)
    # The targets: compiled MACER rows at rho = 0.25 on the two clips of issue 37, like-for-like speedup read.
    base = measure.Measurement(**{f.name: None for f in dataclasses.fields(measure.Measurement)})
    fast, slow = dataclasses.replace(base, llm_prefill_s=1.0), dataclasses.replace(base, llm_prefill_s=2.5)
    assert bench_e2e._speedups("macer", 0.25, "paper", True, [fast], [slow], None) == {
        "speedup": 2.5, "speedup_vs_eager_full": None, "speedup_cpu": None, "target_speedup": 2.4,
        "meets_target": True}
    assert bench_e2e._speedups("macer", 0.25, "long", True, [fast], [slow], [slow])["meets_target"] is False
    # Met only against the faster full model: 2.5x over a slow compiled full model, 2x over the eager one.
    eager_full = dataclasses.replace(base, llm_prefill_s=2.0)
    assert bench_e2e._speedups("macer", 0.25, "paper", True, [fast], [slow], [eager_full])["meets_target"] is False
    assert bench_e2e._speedups("macer", 0.25, "long", False, [fast], [slow], [slow])["target_speedup"] is None
    assert bench_e2e._speedups("macer", 0.45, "paper", True, [fast], [slow], None)["target_speedup"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decode-tokens", "1"], "--decode-tokens must be >= 2"),
        (["--reps", "0"], "--reps must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--profile-reps", "-1"], "--profile-reps must be >= 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--keep-ratios", "0.25", "1.5"], r"--keep-ratios must be in \(0, 1\]"),
        (["--clips", "paper"], "--clips and --frames/--audio-tokens exclude each other"),
        (["--record"], "--out and --record exclude each other"),
    ],
)
def test_bench_argument_errors(extra, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        bench_e2e.run(_args([*_TINY, *extra, "--out", str(tmp_path)]))


def test_custom_clip_needs_both_counts(tmp_path):
    with pytest.raises(SystemExit, match="--frames and --audio-tokens go together"):
        bench_e2e.run(_args(["--mode", "cpu", "--frames", "4", "--out", str(tmp_path)]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_gpu_mode_without_gpu_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--mode gpu needs a CUDA GPU"):
        bench_e2e.run(_args(["--mode", "gpu", "--out", str(tmp_path)]))


@pytest.mark.cuda
def test_gpu_paths_on_a_tiny_model():
    # The GPU mode's code paths (CUDA events, allocator peaks, profiler sync counts, the naive output_attentions
    # comparison) on a tiny bf16 thinker; the real run uses the 7B/3B shapes (`--mode gpu`).
    from macer.testing import build_thinker

    model = build_thinker(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16,
                          device="cuda")
    settings = bench_e2e._settings(_args([*_TINY, "--mode", "gpu", "--policies", "macer"]), "gpu")
    rows = bench_e2e.benchmark_model(model, "tiny-gpu", settings, frames=4, audio_tokens=100, log=lambda _: None)
    assert [r["method"] for r in rows] == ["full", "macer", "macer"]
    assert all(r["cache_matches_trace"] for r in rows) and rows[0]["peak_extra_mib"] is not None
    assert rows[1]["llm_prefill_cpu_ms"] is None  # CPU-time columns are CPU-mode only
    assert all(isinstance(r["host_syncs"], int) for r in rows)
    rows_naive = naive.naive_scores_rows(model, "tiny-gpu", [256], readout_layer=2)
    assert [r["method"] for r in rows_naive] == ["eager+output_attentions", "sdpa+modality_scores"]
    assert not any(r["oom"] for r in rows_naive)


# ---------------------------------------------------------------------------------------------------------------
# The gpu mode on CPU, through stand-ins for torch.cuda that return known values
# ---------------------------------------------------------------------------------------------------------------


def _checked(real, impl):
    """A stand-in that accepts exactly the arguments ``real`` accepts (a wrong keyword fails here, not on the GPU)."""
    signature = inspect.signature(real)

    def stand_in(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return impl(*args, **kwargs)

    return stand_in


class _CudaStandIns:
    """``torch.cuda`` timing and memory functions with the real signatures, returning known values: every
    ``Event.record`` advances a fake clock by ``TICK_MS`` (so an interval between two consecutive records is exactly
    one tick), the allocator holds ``ALLOCATED`` bytes and peaks ``PEAK_EXTRA`` bytes above it."""

    TICK_MS = 1.5
    ALLOCATED = 4096
    PEAK_EXTRA = 3 * 2**20

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.clock = 0.0
        real_event = torch.cuda.Event
        stand_ins = self

        class Event:
            def __init__(self, *args, **kwargs):
                inspect.signature(real_event).bind(*args, **kwargs)
                stand_ins._count("Event")
                self.stamp = None

            def record(self, *args, **kwargs):
                inspect.signature(real_event.record).bind(self, *args, **kwargs)
                stand_ins.clock += stand_ins.TICK_MS
                self.stamp = stand_ins.clock

            def synchronize(self):
                assert self.stamp is not None, "synchronize() on an event that was never recorded"

            def elapsed_time(self, end_event):
                assert self.stamp is not None and end_event.stamp is not None, "elapsed_time of unrecorded events"
                return end_event.stamp - self.stamp

        self.Event = Event

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def install(self, monkeypatch) -> None:
        def counting(name, result):
            def impl(*args, **kwargs):
                self._count(name)
                return result
            return impl

        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        for name, result in (("synchronize", None), ("reset_peak_memory_stats", None), ("empty_cache", None),
                             ("memory_allocated", self.ALLOCATED),
                             ("max_memory_allocated", self.ALLOCATED + self.PEAK_EXTRA), ("is_available", True)):
            monkeypatch.setattr(torch.cuda, name, _checked(getattr(torch.cuda, name), counting(name, result)))


def test_gpu_mode_code_paths_on_cpu(monkeypatch, tmp_path):
    """``--mode gpu`` end to end (7B/3B text shapes shrunk, bf16, CUDA events, allocator peaks, the profiler's sync
    count, the naive output_attentions comparison with one simulated out-of-memory) on CPU, so that a typo, a wrong
    keyword or a shape error in the never-run GPU mode surfaces here; the known values of the stand-ins must come
    out exactly in the results."""
    from macer import testing

    cuda = _CudaStandIns()
    cuda.install(monkeypatch)
    monkeypatch.setattr(bench_e2e, "GPU_DEVICE", "cpu")
    monkeypatch.setattr(measure, "uses_cuda", lambda device: True)
    tiny = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
    monkeypatch.setitem(testing.TEXT_SHAPES, "7B", {**tiny, "num_layers": 6})
    monkeypatch.setitem(testing.TEXT_SHAPES, "3B", {**tiny, "num_layers": 8})
    monkeypatch.setitem(bench_e2e.REAL_VOCAB, "7B", 512)
    monkeypatch.setitem(bench_e2e.REAL_VOCAB, "3B", 256)
    real_naive = naive._scores_from_output_attentions

    def oom_at_96(text_model, embeds, *args):
        if embeds.shape[1] == 96:
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")
        return real_naive(text_model, embeds, *args)

    monkeypatch.setattr(naive, "_scores_from_output_attentions", oom_at_96)
    args = ["--mode", "gpu", "--text-shapes", "7B", "3B", "--audio-tokens", "100", "--frames", "4", "--grid", "8",
            "8", "--warmup", "0", "--reps", "1", "--profile-reps", "1", "--decode-tokens", "3", "--keep-ratios", "0.25",
            "--audio-layer", "4", "--video-layer", "2", "--naive-lengths", "64", "96", "--out", str(tmp_path),
            "--name", "gpu", "--policies", "macer"]
    assert bench_e2e.run(_args(args)) == 0

    with (tmp_path / "gpu.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["method"]) for r in rows] == [("7B", "full"), ("7B", "macer"), ("3B", "full"),
                                                          ("3B", "macer")]
    assert all(r["cache_matches_trace"] == "True" for r in rows)
    assert all(r["llm_prefill_cpu_ms"] == "" and r["decode_cpu_ms_per_token"] == "" for r in rows)  # CPU mode only
    # The decoder's and each encoder's call are bracketed by two consecutive event records: exactly one tick each.
    assert all(float(r["llm_prefill_ms"]) == cuda.TICK_MS for r in rows)
    assert all(float(r["encoders_ms"]) == 2 * cuda.TICK_MS for r in rows)
    assert all(float(r["peak_extra_mib"]) == cuda.PEAK_EXTRA / 2**20 for r in rows)
    # No CUDA runtime on this machine: the profiler sees no synchronisation.
    assert all((r["host_syncs"], r["extra_host_syncs"]) == ("0", "0") for r in rows)
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
    assert all(float(r["peak_mib"]) == cuda.PEAK_EXTRA / 2**20 for r in naive_rows if r["oom"] == "False")
    assert cuda.calls["Event"] > 0 and cuda.calls["reset_peak_memory_stats"] > 0 and cuda.calls["empty_cache"] > 0


def test_naive_scores_restore_attention_after_an_error(monkeypatch):
    from macer.testing import build_thinker, decoder_parts

    model = build_thinker(num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1)

    def broken(*args):
        raise RuntimeError("not an OOM")

    monkeypatch.setattr(naive, "_scores_from_output_attentions", broken)
    with pytest.raises(RuntimeError, match="not an OOM"):
        naive.naive_scores_rows(model, "tiny", [16], readout_layer=2)
    assert decoder_parts(model).decoder.config._attn_implementation == "sdpa"


def test_output_attentions_scores_equal_modality_scores():
    """The naive comparison computes the same ANMS: from eager's probabilities vs from the cached keys with the
    readout layer's own question-row queries."""
    from macer.testing import build_thinker, decoder_parts
    from transformers import AttentionInterface

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
    AttentionInterface.register("grab_query", grab)
    with torch.no_grad():
        want = naive._scores_from_output_attentions(decoder, embeds, modality, 2, 4)
        decoder.config._attn_implementation = "grab_query"
        try:
            decoder(inputs_embeds=embeds, use_cache=False)
        finally:
            decoder.config._attn_implementation = "eager"
        got = naive._scores_from_cache(decoder, embeds, captured["query"], modality, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
