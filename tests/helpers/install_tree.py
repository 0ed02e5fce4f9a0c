"""The install tests' shared tools: the repository root, its tracked files copied as a fresh clone would have them,
the ``pip install`` lines of a document, and a ``pip install --dry-run`` against this environment (used by
tests/tools/test_eval_install.py, tests/project/test_install_extras.py and tests/serving/test_install_line.py)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "copy_tracked_tree", "dry_run", "install_lines"]

ROOT = Path(__file__).resolve().parents[2]


def copy_tracked_tree(dest: Path) -> Path:
    """The repository's tracked files (the working tree's versions), as a fresh clone would have them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


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
