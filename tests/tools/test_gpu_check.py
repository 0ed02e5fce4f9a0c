"""``benchmarks/gpu_check.sh`` on a machine without a GPU: its dry run (every step's command line resolves through the
stand-ins of ``benchmarks/gpu_dry.py``), the stand-ins catching each kind of typo, the prebuilt module's matching
and the commit the results name, and ``benchmarks/gpu_targets.py`` reading real and new-format result files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common, gpu_targets

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
RUN1 = ROOT / "benchmarks" / "results" / "h200-2026-11-27" / "run1-5133407"

# The steps in the order the script runs them (pytest_cuda to sanitize_prepared_memcheck side by side); a step
# dropped or renamed fails the dry-run test.
STEPS = [
    "environment", "l2_setaside", "build",
    "pytest_cuda", "pytest_cuda_ops", "sanitize_scores_memcheck", "sanitize_scores_racecheck",
    "sanitize_scores_initcheck", "sanitize_scores_synccheck",
    "sanitize_ops_memcheck", "sanitize_ops_racecheck", "sanitize_ops_initcheck",
    "sanitize_ops_synccheck", "select_sanitize_memcheck", "select_sanitize_racecheck", "select_sanitize_synccheck",
    "sanitize_prepared_memcheck",
    "bench_modality_scores", "bench_select", "bench_readout", "ncu_scores", "ncu_l2_setaside", "ncu_hot_path",
    "bench_e2e_paper", "bench_e2e_long",
    "host_profile", "bench_own_work", "pytest_triton", "sanitize_triton_racecheck", "flash_attention_2",
    "bench_e2e_decode_eager", "bench_batch", "vllm_admission", "vllm_graphs",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "MACER_GIT_SHA", "OUT"))}
    env.update(GPU_CHECK_DRY="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", **extra)
    return env


def _dry(out: Path, timeout: int = 900, **extra: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=_env(**extra),
                          timeout=timeout, cwd=ROOT)
    status = {}
    for line in (out / "summary.txt").read_text().splitlines():
        name, _, rest = line.partition(" ")
        status[name] = rest.split()[0] if rest.split() else ""
    return proc, status


def _log(out: Path, step: str) -> str:
    return (out / "files" / f"{step}.log").read_text()


def test_scripts_parse():
    for script in ("gpu_check.sh", "gpu_prepare.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="the dry run compiles the L2 microbenchmark with nvcc")
def test_dry_run_resolves_every_step(tmp_path):
    """The whole script in dry mode: every step runs, in order, and resolves; nothing is skipped for budget."""
    proc, status = _dry(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    names = [name for name in status if name != "total"]
    # The correctness group runs side by side: its lines come in the order its steps end.
    group = slice(STEPS.index("pytest_cuda"), STEPS.index("bench_modality_scores"))
    assert names[:group.start] + names[group.stop:] == STEPS[:group.start] + STEPS[group.stop:]
    assert sorted(names[group]) == sorted(STEPS[group])
    assert all(status[name] == "ok" for name in STEPS), status
    # The ops' GPU tests, every file of both lists (a list read short selected 3 files of 13 once).
    counts = {}
    for step, first, last in (
            ("pytest_cuda", "tests/kernels/test_cuda_kernels.py", "tests/kernels/test_cuda_kernels.py"),
            ("pytest_cuda_ops", "tests/kernels/test_select.py", "tests/hf/test_prefill_packing.py")):
        log = _log(tmp_path, step)
        selected = re.search(r"pytest .*: (\d+) tests selected", log)
        assert selected and first in log and last in log, log
        counts[step] = int(selected.group(1))
    assert counts["pytest_cuda"] > 150 and counts["pytest_cuda_ops"] > 200, counts
    assert "arguments ok (--check-args" in _log(tmp_path, "l2_setaside")
    assert "compute-sanitizer --tool synccheck: options known" in _log(tmp_path, "select_sanitize_synccheck")
    assert "benchmarks.ncu_hot_path : imported, arguments parse" in _log(tmp_path, "ncu_hot_path")
    assert "bench_e2e.py --mode gpu --text-shapes 7B --clips long" in _log(tmp_path, "bench_e2e_long")
    # The probes for packages the device image lacks take the skip branch, as they do there.
    assert "vLLM is not importable here" in _log(tmp_path, "vllm_graphs")
    targets = (tmp_path / "targets.txt").read_text()
    assert targets.startswith("targets: 0 met, 0 missed,") and "compiled prefill speedup" in targets
    assert (tmp_path / "gpu_check.tar.gz").is_file()


def test_dry_run_fails_a_step_whose_command_does_not_resolve(tmp_path):
    """A typo in a knob (a test file that does not exist) fails its step and the script's exit status; the other
    selected step still resolves."""
    proc, status = _dry(tmp_path, GPU_CHECK_STEPS="pytest_cuda bench_select",
                        GPU_CHECK_TESTS="tests/test_no_such_file.py")
    assert proc.returncode == 1
    assert status["pytest_cuda"] == "FAILED" and status["bench_select"] == "ok"
    assert status["pytest_cuda_ops"] == "not"  # "not run (GPU_CHECK_TESTS: ...)"
    assert status["build"] == "not"  # "not selected (GPU_CHECK_STEPS)"
    assert "dry: FAILED: pytest" in _log(tmp_path, "pytest_cuda")


@pytest.fixture
def stand_in(monkeypatch, capsys):
    """``python -m benchmarks.gpu_dry ARGV`` in this process: (exit code, what it printed)."""
    from benchmarks import gpu_dry

    monkeypatch.delenv("GPU_DRY_CACHE", raising=False)
    monkeypatch.chdir(ROOT)

    def run(*argv: str) -> tuple[int, str]:
        code = gpu_dry.main(list(argv))
        return code, capsys.readouterr().out

    return run


@pytest.mark.parametrize(("argv", "message"), [
    (["python", "-m", "benchmarks.bench_select", "--sizez", "5"], "exited 2"),
    (["python", "-m", "benchmarks.bench_selct"], "no module named 'benchmarks.bench_selct'"),
    (["python", "benchmarks/bench_e2e.py", "--clips", "paper", "short"], "exited 2"),
    (["python", "-m", "pytest", "-m", "cuda", "tests/kernels/test_stage.py", "-k", "no_such_test_name"],
     "0 tests selected"),
    (["python", "setup.py", "-q", "build_ext", "--inplac"], "unknown options ['--inplac']"),
    (["python", "-c", "import no_such_module_xyz"], "not importable here"),
    (["python", "-c", "print(("], "does not compile"),
    (["ncu", "--secton", "SpeedOfLight", "python", "-m", "benchmarks.ncu_hot_path"], "'--secton' is not one"),
    (["ncu", "--section", "SpeedOfLite", "python", "-m", "benchmarks.ncu_hot_path"], "section 'SpeedOfLite'"),
    (["ncu", "--metrics", "gpu__time_duration.sum,dram_bytes_read.sum", "python", "-m", "benchmarks.ncu_scores"],
     "['dram_bytes_read.sum']"),
    (["ncu", "--clock-control", "off", "python", "-m", "benchmarks.ncu_scores"], "--clock-control 'off'"),
    (["ncu", "--clock-control", "none", "python", "-m", "benchmarks.ncu_scorez"], "no module named"),
    (["compute-sanitizer", "--tool", "racechek", "python", "-m", "benchmarks.sanitize_select"], "racechek"),
    (["compute-sanitizer", "--tool", "memcheck", "--leak-check", "yes", "python", "-m", "benchmarks.sanitize_ops"],
     "--leak-check 'yes'"),
])
def test_stand_ins_catch_each_kind_of_typo(stand_in, argv, message):
    code, out = stand_in(*argv)
    assert code == 1, out
    assert message in out, out


def test_a_script_without_argparse_is_refused(stand_in, tmp_path):
    script = tmp_path / "no_parser.py"
    script.write_text("print('ran')\n")
    code, out = stand_in("python", str(script))
    assert code == 1 and "returned without parsing arguments" in out


def test_stand_ins_pass_what_the_script_runs_and_run_nothing(stand_in):
    code, out = stand_in("compute-sanitizer", "--tool", "synccheck", "--error-exitcode", "9", "--print-limit", "30",
                         "python", "-m", "benchmarks.sanitize_select")
    assert code == 0 and "benchmarks.sanitize_select : imported, arguments parse" in out
    # A probe is not run: the exit it would take does not happen.
    code, out = stand_in("python", "-c", "import json; raise SystemExit(3)")
    assert code == 0 and "not run" in out
    # A benchmark stops right after its arguments parse: without a GPU its body would exit with an error.
    code, out = stand_in("python", "-m", "benchmarks.bench_readout", "--overhead", "--out", "/nonexistent/x")
    assert code == 0 and "'overhead': True" in out


def _manifest(folder: Path, **values: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "manifest").write_text("".join(f"{k}={v}\n" for k, v in values.items()))


def test_build_uses_a_matching_prebuilt_module_only(tmp_path):
    """The build step copies .gpu-run's module only when the sources' hash, the arch list and the Python ABI match;
    otherwise it says why and builds from source."""
    import sysconfig

    prebuilt = tmp_path / "prebuilt"
    _manifest(prebuilt, source_hash="0000000000000000", archs="90;90a", built="test")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    (prebuilt / f"_C{suffix}").write_bytes(b"not a real module: the dry run never loads it")
    out = tmp_path / "a"
    _dry(out, GPU_CHECK_STEPS="build", GPU_CHECK_PREBUILT=str(prebuilt))
    log = _log(out, "build")
    found = re.search(r"its sources' hash 0000000000000000 is not this tree's ([0-9a-f]{16})", log)
    assert found, log
    assert "dry: setup.py -q build_ext --inplace: command and options known" in log

    _manifest(prebuilt, source_hash=found.group(1), archs="90;90a", built="test")
    out = tmp_path / "b"
    _, status = _dry(out, GPU_CHECK_STEPS="build", GPU_CHECK_PREBUILT=str(prebuilt))
    log = _log(out, "build")
    assert status["build"] == "ok" and f"would copy {prebuilt}/_C{suffix}" in log and "setup.py" not in log

    out = tmp_path / "c"
    _dry(out, GPU_CHECK_STEPS="build", GPU_CHECK_PREBUILT=str(prebuilt), MACER_CUDA_ARCHS="90")
    assert "built for '90;90a', not MACER_CUDA_ARCHS='90'" in _log(out, "build")

    (prebuilt / f"_C{suffix}").rename(prebuilt / "_C.cpython-399-x86_64-linux-gnu.so")
    out = tmp_path / "d"
    _dry(out, GPU_CHECK_STEPS="build", GPU_CHECK_PREBUILT=str(prebuilt))
    assert f"no prebuilt module for this Python ({suffix})" in _log(out, "build")


def _tree_hash(root: Path, files: list[str]) -> str:
    """The manifest's tree hash, as gpu_prepare.sh writes it: sha256sum's lines over the listed files, hashed."""
    lines = "".join(f"{hashlib.sha256((root / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def test_results_name_the_manifest_commit_where_the_tree_has_no_git(tmp_path):
    prebuilt = tmp_path / "prebuilt"
    files = ["README.md", "benchmarks/gpu_check.sh"]
    _manifest(prebuilt, git_sha="abc1234", tree_hash=_tree_hash(ROOT, files))
    (prebuilt / "files").write_text("".join(f + "\n" for f in files))
    no_git = {"GIT_DIR": str(tmp_path / "no-git"), "GPU_CHECK_STEPS": "environment",
              "GPU_CHECK_PREBUILT": str(prebuilt)}
    _dry(tmp_path / "a", **no_git)
    assert "git sha: abc1234\n" in _log(tmp_path / "a", "environment")
    _manifest(prebuilt, git_sha="abc1234", tree_hash="ffffffffffffffff")
    _dry(tmp_path / "b", **no_git)
    assert "git sha: abc1234-modified" in _log(tmp_path / "b", "environment")


# ---- gpu_targets ---------------------------------------------------------------------------------------------------


def _by_target(rows: list[dict]) -> dict[str, dict]:
    return {r["target"]: r for r in rows}


def test_targets_of_the_first_h200_run():
    """The committed files of the first run (real GPU output, older format): the verdicts its README states."""
    rows = _by_target(gpu_targets.target_rows(RUN1))
    assert rows["scoring x_k_read at N=100k (cuda)"]["verdict"] == "MISSED"
    assert rows["scoring x_k_read at N=100k (cuda)"]["measured"] == pytest.approx(5.15, abs=0.01)
    assert rows["scoring x_k_stream at N=20k (cuda)"]["verdict"] == "not measured"  # no K stream then
    assert rows["coverage_select n=20k median_us (cuda)"]["measured"] == pytest.approx(317.1, abs=0.1)
    assert rows["MACER own work, 2.4k clip (eager)"]["measured"] == pytest.approx(3.40, abs=0.01)
    assert rows["MACER own work, 16.3k clip (eager)"]["verdict"] == "MISSED"
    assert rows["eager prefill speedup, 16.3k clip"]["measured"] == pytest.approx(2.796, abs=0.001)
    assert rows["compiled prefill speedup, 2.4k clip"]["verdict"] == "not measured"
    assert rows["extra host syncs per prefill, 2.4k clip, eager"]["verdict"] == "met"
    assert rows["readout wall_us (prepared-cuda)"]["verdict"] == "not measured"
    report = gpu_targets.report(RUN1, RUN1 / "summary.txt")
    assert "pytest_cuda: 483 passed, 5 failed, 0 errors, 9 skipped" in report
    assert "sanitize_racecheck: RACECHECK SUMMARY: 3 hazards displayed" in report
    assert "steps FAILED or TIMEOUT (summary.txt): 3" in report


def test_targets_of_the_new_result_formats(tmp_path):
    """Rows as this round's benchmarks write them (through their own writer and target helpers)."""
    from benchmarks import bench_modality_scores

    scores = [
        {"provider": "cuda", "N": 100_000, "path": "sb", "graph_us": 33.0, "median_us": 40.0, "x_k_read": 1.34,
         "x_k_stream": 1.2},
        {"provider": "cuda-sa", "N": 100_000, "path": "sa", "graph_us": 47.0, "median_us": 50.0, "x_k_read": 1.9,
         "x_k_stream": 1.7},
        {"provider": "cuda", "N": 20_000, "path": "sb", "graph_us": 9.0, "median_us": 20.0, "x_k_read": 1.8,
         "x_k_stream": 1.6},
    ]
    meta = {"device": "NVIDIA H200", "git_sha": "feedbee", "targets": bench_modality_scores.target_rows(scores)}
    common.write_results("modality_scores_bhnd_nvidia_h200", scores, meta, tmp_path)
    select = [{"op": "coverage_select", "provider": "cuda", "n": 20_000, "median_us": 21.0, "wall_us": 30.0,
               "ctas": "8", "exact": True},
              {"op": "topk_indices", "provider": "cuda", "n": 20_000, "median_us": 12.0, "wall_us": 25.0,
               "ctas": "1", "exact": False}]
    common.write_results("select_nvidia_h200", select, {"device": "NVIDIA H200"}, tmp_path)
    readout = [{"provider": "prepared-cuda", "wall_us": 31.0, "exact": True},
               {"provider": "stage-cuda", "wall_us": 120.0, "exact": True},
               {"provider": "cuda", "wall_us": 300.0, "exact": True}]
    common.write_results("readout_nvidia_h200", readout,
                         {"targets": [{"provider": "prepared-cuda", "limit_us": 3.2}]}, tmp_path)
    e2e = [{"model": "7B", "clip": "paper", "method": m, "keep_ratio": k, "compiled": c, "overhead_ms": o,
            "stage_ms": None, "speedup": s, "speedup_vs_eager_full": v, "llm_prefill_ratio": None,
            "extra_host_syncs": x, "decode_ms_per_token": d}
           for m, k, c, o, s, v, x, d in [("full", 1.0, False, None, 1.0, 1.0, 0, 30.0),
                                          ("macer", 0.25, False, 0.25, 1.5, 1.5, 2, 29.0),
                                          ("full", 1.0, True, None, 1.0, 1.9, 0, 12.0),
                                          ("macer", 0.25, True, 0.28, 2.5, 2.3, 3, 12.5)]]
    (tmp_path / "bench_e2e_paper.json").write_text(json.dumps({"meta": {"machine": {"device": "NVIDIA H200"}},
                                                               "rows": e2e}))
    rows = _by_target(gpu_targets.target_rows(tmp_path))
    assert rows["scoring x_k_read at N=100k (cuda, path sb)"]["verdict"] == "met"
    assert rows["scoring x_k_read at N=100k (cuda-sa, path sa)"]["verdict"] == "-"
    assert rows["scoring x_k_stream at N=20k (cuda, path sb)"]["verdict"] == "MISSED"
    assert rows["coverage_select n=20k median_us (cuda)"]["verdict"] == "met"
    assert rows["topk_indices n=20k median_us (cuda)"]["verdict"] == "MISSED"
    assert "NOT EXACT" in rows["topk_indices n=20k median_us (cuda)"]["note"]
    assert rows["readout wall_us (prepared-cuda)"]["verdict"] == "met"
    assert "limit 3.2 us" in rows["readout wall_us (prepared-cuda)"]["note"]
    assert rows["readout wall_us (stage-cuda)"]["verdict"] == "MISSED"
    assert rows["MACER own work, 2.4k clip (eager)"]["verdict"] == "met"
    # Against the faster full model: 2.3x to the eager full one misses 2.4x although 2.5x to the compiled full.
    speedup = rows["compiled prefill speedup, 2.4k clip"]
    assert speedup["measured"] == pytest.approx(2.3) and speedup["verdict"] == "MISSED"
    assert rows["compiled prefill speedup, 16.3k clip"]["verdict"] == "not measured"
    assert rows["extra host syncs per prefill, 2.4k clip, compiled"]["verdict"] == "MISSED"
    assert rows["decode ms/token vs full, 2.4k clip, eager"]["verdict"] == "met"
    assert rows["decode ms/token vs full, 2.4k clip, compiled"]["verdict"] == "MISSED"


def test_nothing_is_met_without_results(tmp_path):
    rows = gpu_targets.target_rows(tmp_path)
    assert rows and {r["verdict"] for r in rows} == {"not measured"}


def test_readme_draft_of_a_results_folder():
    text = gpu_targets.readme(RUN1, "2026-11-27")
    assert text.startswith("# NVIDIA H200, 2026-11-27: the GPU check at 5133407")
    assert "{{" not in text
    assert "pytest_cuda: 483 passed, 5 failed" in text and "scoring x_k_read at N=100k (cuda)" in text


# ---- gpu_build_check -----------------------------------------------------------------------------------------------


def test_build_check_refuses_an_unusable_backend(monkeypatch):
    from benchmarks import gpu_build_check

    monkeypatch.setattr(gpu_build_check.mk, "backend_status", lambda: {"cuda": "no CUDA device/driver", "torch": None})
    with pytest.raises(SystemExit, match="the cuda backend is not usable: no CUDA device/driver"):
        gpu_build_check.check("cpu")


@pytest.mark.parametrize(("archs", "path", "why", "ok"), [
    ("90;90a", "sb", "", True),
    ("90;90a", "sa", "not built with 90a in MACER_CUDA_ARCHS", False),  # a module without the S-B object library
    ("90", "sa", "not built with 90a in MACER_CUDA_ARCHS", True),  # S-B not asked for
    # built, but not taken for this call (csrc/modality_scores_sm90a.cu's reasons): reported, not a build error
    ("90;90a", "sa", "S-B takes B = 1, at most 8 KV heads and at most 32 query rows per KV head", True),
])
def test_build_check_wants_s_b_where_90a_is_asked_for(monkeypatch, archs, path, why, ok):
    """The module's report through the real extension's architecture queries (no GPU needed for those); the device's
    backend status and the scoring-path query (which reads the device) stand in."""
    pytest.importorskip("macer_kernels._C")
    from benchmarks import gpu_build_check
    from macer_kernels.cuda import modality_scores

    monkeypatch.setenv("MACER_CUDA_ARCHS", archs)
    monkeypatch.setattr(gpu_build_check.mk, "backend_status", lambda: {"cuda": None, "torch": None})
    seen = []
    monkeypatch.setattr(modality_scores, "scores_path", lambda q, k: seen.append((q.shape, k.shape)) or (path, why))
    if ok:
        report = gpu_build_check.check("cpu")
        assert f"scoring path at the 7B shape, N = 20000: {path}" in report and "module: SASS [" in report
    else:
        with pytest.raises(SystemExit, match="MACER_CUDA_ARCHS has 90a but the module has no S-B"):
            gpu_build_check.check("cpu")
    assert seen == [((1, 28, 4, 128), (1, 4, 20000, 128))]
