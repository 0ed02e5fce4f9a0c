"""The documented evaluation install keeps the user's torch (issue 21 item 5).

``pip install "macer-kernels[eval]"`` used to pull lmms-eval's declared torchvision, and with it a new torch (a CPU
torch 2.13.0 became a CUDA torch 2.14.1 with 3 GB of CUDA wheels, triton 3.9 became 3.8). The fast tests here check
the install line and the extra without a network; ``test_documented_eval_install_keeps_torch`` runs the README's
line as written in a scratch virtual environment that holds the torch of this test run, then the docs' smoke test
there. It installs ~60 packages from the package index (several minutes), so it is opt-in: ``MACER_TEST_INSTALL=1``.
Even then it cannot pull a new torch: a pip constraint pins torch to the version running the tests and makes
torchvision uninstallable, so a regression fails the install instead of downloading CUDA wheels.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from install_tree import ROOT, copy_tracked_tree

EVAL_LINE = re.compile(r'^pip install "\.\[eval\]" && pip install --no-deps "lmms-eval==(?P<version>[^"]+)"')


def _install_line(path: Path) -> str:
    """The eval install line of a document (the first line that starts with the documented command)."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if EVAL_LINE.match(line)]
    assert lines, f"{path.name}: no line starts with the eval install command (pattern {EVAL_LINE.pattern})"
    return lines[0]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower().replace("_", "-") for r in requirements}


def test_eval_extra_pulls_neither_torchvision_nor_torch():
    """Guards: an eval extra that lists lmms-eval (which declares torchvision) or torch again, and documents that
    disagree on the command or with the pinned lmms-eval that CI tests."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = _requirement_names(extras["eval"])
    assert not names & {"lmms-eval", "torch", "torchvision", "torchaudio", "timm", "peft", "sentence-transformers"}
    # CI installs requirements-ci.txt, then requirements-eval.txt with --no-deps: every package of the extra is in
    # that tested set.
    pinned = [line.split("#")[0].strip() for name in ("requirements-ci.txt", "requirements-eval.txt")
              for line in (ROOT / name).read_text().splitlines()]
    pinned = [line for line in pinned if line]
    assert names <= _requirement_names(pinned), names - _requirement_names(pinned)
    ci_lmms = next(line.split("==")[1] for line in pinned if line.startswith("lmms-eval=="))
    for doc in ("README.md", "docs/evaluation.md"):
        assert EVAL_LINE.match(_install_line(ROOT / doc))["version"] == ci_lmms, doc


def _smoke_block() -> str:
    """The bash block of docs/evaluation.md's "Smoke test without weights or data" section."""
    text = (ROOT / "docs" / "evaluation.md").read_text(encoding="utf-8")
    section = text.split("## Smoke test without weights or data", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def _run(cmd: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, **kwargs)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MACER_TEST_INSTALL") != "1",
                    reason="installs ~60 packages from the package index (minutes): set MACER_TEST_INSTALL=1")
def test_documented_eval_install_keeps_torch(tmp_path):
    torch_version = importlib.metadata.version("torch")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    guard = tmp_path / "guard.txt"  # torch stays the tested one; torchvision cannot be installed at all
    guard.write_text(f"torch=={torch_version}\ntorchvision==0+never\n")
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
           "PIP_CONSTRAINT": str(guard), "MACER_NO_CUDA": "1", "HF_HOME": str(tmp_path / "hf"),
           "LMMS_EVAL_DATASETS_CACHE": str(tmp_path / "datasets_cache")}
    env.pop("PYTHONPATH", None)
    user_torch = _run([python, "-m", "pip", "install", "-q", f"torch=={torch_version}"], env=env)
    if user_torch.returncode:
        pytest.skip(f"torch=={torch_version} (the tests' torch) is not installable from the configured package "
                    f"indexes: {user_torch.stderr[-500:]}")

    line = _install_line(ROOT / "README.md")
    installed = _run(["bash", "-c", line], cwd=copy_tracked_tree(tmp_path / "clone"), env=env)
    assert installed.returncode == 0, (line, installed.stdout[-3000:], installed.stderr[-3000:])
    listing = _run([python, "-m", "pip", "list", "--format", "json"], env=env, check=True).stdout
    versions = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(listing)}
    assert versions["torch"] == torch_version, versions
    assert not {n for n in versions if n in ("torchvision", "triton") or n.startswith("nvidia-")}, versions
    assert versions["lmms-eval"] == EVAL_LINE.match(line)["version"] and "macer-kernels" in versions

    # The docs' smoke test in that environment, with the default video frontend: lmms-eval exits 0 even when a
    # sample fails, so the sample log is the evidence that both questions were answered, and that MACER pruned
    # (with transformers 5.24, which this install once resolved to, it silently pruned nothing: n_audio 0).
    work = tmp_path / "smoke"
    work.mkdir()
    smoke = _run(["bash", "-e", "-c", _smoke_block().replace("/tmp/", f"{work}/")], cwd=work, env=env)
    assert smoke.returncode == 0, (smoke.stdout[-3000:], smoke.stderr[-3000:])
    lines = [json.loads(x) for x in (work / "macer_samples.jsonl").read_text().splitlines()]
    assert [x["doc_id"] for x in lines] == [0, 1] and all(x["policy"] == "macer" for x in lines), lines
    for x in lines:
        assert x["n_audio"] > 0 and x["n_video"] > 0, x
        assert x["audio_kept"] + x["video_kept"] == x["budget_total"] < x["n_audio"] + x["n_video"], x
