"""Benchmark tools: the per-call counts of ``benchmarks.common`` (launches, host synchronisations and device-to-host
copies from torch.profiler events; the event names are CUDA's, fed here as stand-ins, and a real CPU profile checks
the call marking), wall time and the environment record, and the compute-sanitizer driver of ``gpu_check.sh``."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from benchmarks import common


def _event(name: str, start: int, end: int, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end))


def test_counts_per_call_inside_the_marked_calls_only():
    mark = common._CALL_MARK
    events = [
        _event(mark, 0, 100), _event(mark, 200, 300),
        # call 1: a PyTorch launch, an extension launch, a .item() (async copy + stream synchronize)
        _event("cudaLaunchKernel", 10, 12), _event("cudaLaunchKernelExC", 20, 22),
        _event("cudaMemcpyAsync", 30, 40), _event("cudaStreamSynchronize", 41, 60),
        # call 2: a Triton launch through the driver API
        _event("cuLaunchKernel", 210, 215),
        # outside both calls: the synchronize that ends the profile
        _event("cudaDeviceSynchronize", 400, 500), _event("cudaLaunchKernel", 150, 151),
        # device side: two kernels and the copy of the .item()
        _event("macer::scores_kernel", 15, 35, DeviceType.CUDA), _event("_scores_kernel", 216, 226, DeviceType.CUDA),
        _event("Memcpy DtoH (Device -> Pageable)", 42, 44, DeviceType.CUDA),
        _event(mark, 5, 90, DeviceType.CUDA),  # the GPU copy of the annotation is not device work
    ]
    counts = common.summarize_profile(events, calls=2)
    assert counts == {"launches": 1.5, "syncs": 0.5, "d2h": 0.5, "kernel_us": 16.0}
    with pytest.raises(RuntimeError, match="profile holds 2 marked calls, expected 3"):
        common.summarize_profile(events, calls=3)


def test_kernel_breakdown_names_each_kernel_per_call():
    mark = common._CALL_MARK
    events = [_event(mark, 0, 100), _event(mark, 200, 300),
              _event("void macer::scores::scores_tile_kernel<__nv_bfloat16>(macer::scores::TileArgs)", 10, 40,
                     DeviceType.CUDA),
              _event("void macer::scores::scores_tile_kernel<__nv_bfloat16>(macer::scores::TileArgs)", 210, 230,
                     DeviceType.CUDA),
              _event("_scores_kernel", 50, 54, DeviceType.CUDA), _event(mark, 5, 90, DeviceType.CUDA)]
    assert common.kernel_breakdown(events, calls=2) == "scores_tile_kernel=25.0;_scores_kernel=2.0"
    assert common.profile_call(lambda: None, "cpu", per_kernel=True) == dict.fromkeys(
        (*common.PROFILE_COLUMNS, "kernels"))


def test_a_real_cpu_profile_is_marked_per_call():
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function(common._CALL_MARK):
                torch.ones(4).sum()
    assert common.summarize_profile(prof.events(), calls=3) == {"launches": 0, "syncs": 0, "d2h": 0, "kernel_us": 0}
    assert common.profile_call(lambda: None, "cpu") == dict.fromkeys(common.PROFILE_COLUMNS)


def test_wall_time_fits_the_budget_and_environment_names_threads():
    calls = []
    us = common.wall_time_us(lambda: calls.append(1), "cpu", budget_s=0.0, min_reps=3)
    assert us >= 0 and len(calls) == 1 + 3 + 3  # estimate, warm-up, timed runs
    env = common.environment("cpu")
    assert env["threads"] == torch.get_num_threads() and env["git_sha"] and env["columns"]["wall_us"]


def test_time_provider_gives_a_rows_timing_columns(monkeypatch):
    """``time_provider``, the timing part of every microbenchmark's row: the settings reach the timers, ``quick``
    shortens the wall-time run, ``profile=False`` leaves the counts None without profiling; on CPU for real too."""
    seen = []
    monkeypatch.setattr(common, "median_time_us", lambda fn, device, **kw: seen.append(("median", kw)) or 2.0)
    monkeypatch.setattr(common, "wall_time_us", lambda fn, device, **kw: seen.append(("wall", kw)) or 3.0)
    monkeypatch.setattr(common, "profile_call", lambda fn, device, **kw: seen.append(("profile", kw)) or {
        **dict.fromkeys(common.PROFILE_COLUMNS, 1.0), **({"kernels": "k=1.0"} if kw["per_kernel"] else {})})
    row = common.time_provider(lambda: None, "cpu", quick=True, warmup=3, reps=20, per_kernel=True)
    assert row == {"median_us": 2.0, "wall_us": 3.0, **dict.fromkeys(common.PROFILE_COLUMNS, 1.0), "kernels": "k=1.0"}
    assert list(row)[:2] == ["median_us", "wall_us"]
    assert seen == [("median", {"warmup": 3, "reps": 20}), ("wall", common.QUICK_WALL),
                    ("profile", {"per_kernel": True})]
    seen.clear()
    row = common.time_provider(lambda: None, "cpu", profile=False)
    assert row == {"median_us": 2.0, "wall_us": 3.0, **dict.fromkeys(common.PROFILE_COLUMNS)}
    assert seen == [("median", {"warmup": 5, "reps": 50}), ("wall", {})]
    monkeypatch.undo()
    calls = []
    row = common.time_provider(lambda: calls.append(1), "cpu", quick=True, warmup=1, reps=2)
    assert row["median_us"] >= 0 and row["wall_us"] >= 0 and calls
    assert {key: row[key] for key in common.PROFILE_COLUMNS} == dict.fromkeys(common.PROFILE_COLUMNS)


def test_sanitizer_driver_runs_every_case_and_reports_a_mismatch(capsys, monkeypatch):
    """benchmarks/sanitize_ops.py (what gpu_check.sh runs under compute-sanitizer), on CPU with the PyTorch backend:
    every case's inputs are valid; a backend whose result differs from PyTorch's is reported and fails the run."""
    from benchmarks import sanitize_ops

    assert sanitize_ops.main(["--backends", "torch", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("sanitize pass torch (")
    monkeypatch.setattr(sanitize_ops, "_equal", lambda got, want: False)
    assert sanitize_ops.main(["--backends", "torch", "--device", "cpu"]) == 1
    assert "sanitize MISMATCH torch: modality_scores" in capsys.readouterr().out


def test_ncu_driver_runs_every_hot_path_call_on_cpu(capsys):
    """benchmarks/ncu_hot_path.py (what gpu_check.sh profiles with Nsight Compute), on CPU with the PyTorch backend:
    every call's inputs are valid for the public ops, and each profiled call is named."""
    from benchmarks import ncu_hot_path

    ncu_hot_path.main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert out.count("profiled:") == 6 and "ncu_hot_path done: torch 6 calls" in out


def test_host_profile_driver_runs_every_readout_on_cpu(capsys):
    """benchmarks/host_profile.py (gpu_check.sh's host-time profile of one readout), on CPU with the PyTorch backend:
    the prepared stage, the fused stage and the per-op readout keep the same rows, and each gets its host time per
    stage and its profiler table."""
    from benchmarks import host_profile

    host_profile.main(["--device", "cpu", "--rows", "3"])
    out = capsys.readouterr().out
    assert out.count("same kept rows as the first: True") == 3 and out.count("Self CPU time total") == 3
    assert out.count(" us per stage,") == 3 and out.startswith("prepared[torch]: device")
    assert "host_profile done: 3 readouts" in out


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "32"], r"--block-size must be a positive integer and goes with --admission, got 32"),
    (["--admission", "--block-size", "0"], r"--block-size must be a positive integer and goes with --admission, got 0"),
    (["--kv-cache-mib", "100"], r"--kv-cache-mib must be a positive integer and goes with --admission, got 100"),
    (["--admission", "--sweep"], r"not allowed with argument"),
])
def test_bench_vllm_refuses_admission_flags_by_name(argv, message, capsys):
    """benchmarks/bench_vllm.py's admission flags are checked before any engine (or vLLM import): usage errors."""
    from benchmarks import bench_vllm

    with pytest.raises(SystemExit) as info:
        bench_vllm.main(argv)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_own_work_bench_adds_up_one_launch_per_stage_on_cpu(tmp_path, monkeypatch):
    """``bench_own_work`` on CPU (recording ``_C``): every part of a 7B prefill is a row, each stage's host call made
    exactly one ``StagePlan.launch`` per prefill (a stage falling back to the composed ops, or launching twice,
    changes the count), the totals are the sums of their parts against issue 37's bounds, and the stand-in is
    removed afterwards (the real backend state restored)."""
    import json

    from benchmarks import bench_own_work
    from macer_kernels import backend
    from macer_kernels.cuda import _ext

    before = (_ext._ext_module, dict(backend._status_cache))
    prefills = []
    real = bench_own_work._prefill

    def counted(*args, **kwargs):
        prefills.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_own_work, "_prefill", counted)
    assert bench_own_work.main(["--clips", "paper", "--calls", "3", "--warmup", "1", "--out", str(tmp_path)]) == 0
    assert (_ext._ext_module, dict(backend._status_cache)) == before
    data = json.loads((tmp_path / "bench_own_work_cpu.json").read_text())
    rows = {r["part"]: r for r in data["rows"]}
    assert set(rows) == {"plan (cold)", "plan (cached)", "setup", "stage 3", "stage 5", "flag read",
                         "total (plan cold)", "total (plan cached)"}
    assert data["meta"]["recorded_launches"] == 2 * len(prefills) and len(prefills) == 3 + 3 + 1
    for setting, other in (("cold", "cached"), ("cached", "cold")):
        total = rows[f"total (plan {setting})"]
        parts = [r for name, r in rows.items() if not name.startswith(("total", f"plan ({other})"))]
        assert total["host_us"] == pytest.approx(sum(r["host_us"] + r["launch_us_est"] for r in parts), abs=0.2)
        assert total["device_us"] == pytest.approx(sum(r["device_us"] for r in parts), abs=0.2)
        assert total["target_us"] == 300.0 and total["own_work_us"] == pytest.approx(
            total["host_us"] + total["device_us"], abs=0.2)
    assert rows["stage 3"]["device_source"].startswith("estimate")


def test_batched_stage_bench_counts_one_module_call_for_the_prepared_stage(tmp_path):
    """``bench_batched_stage`` on CPU (recording ``_C``): per batch size the composed path (182449c's op sequence)
    makes three module calls (scoring, selection, compaction) and the prepared stage one, with fewer torch ops (the
    per-sample question rows one ``gather.out`` more); every stand-in is removed afterwards."""
    import json

    from benchmarks import bench_batched_stage
    from macer_kernels import backend
    from macer_kernels.cuda import _ext, compact, modality_scores

    before = (_ext._ext_module, dict(backend._status_cache), compact.launch_args, modality_scores.check_cuda_tensor)
    assert bench_batched_stage.main(["--batch", "2", "3", "--calls", "2", "--warmup", "0", "--out",
                                     str(tmp_path)]) == 0
    assert (_ext._ext_module, dict(backend._status_cache), compact.launch_args,
            modality_scores.check_cuda_tensor) == before
    rows = json.loads((tmp_path / "bench_batched_stage_cpu.json").read_text())["rows"]
    assert [(r["batch"], r["path"]) for r in rows] == [
        (b, p) for b in (2, 3) for p in ("composed (before)", "prepared (now)", "prepared, per-sample rows (now)")]
    for b in (2, 3):
        composed, prepared, per_sample = (r for r in rows if r["batch"] == b)
        assert (composed["ext_calls"], prepared["ext_calls"], per_sample["ext_calls"]) == (3, 1, 1)
        assert "searchsorted.Tensor" in composed["torch_op_names"]
        assert prepared["torch_ops"] < composed["torch_ops"] and "gather" not in prepared["torch_op_names"]
        assert per_sample["torch_ops"] == prepared["torch_ops"] + 1 and "gather.out" in per_sample["torch_op_names"]
