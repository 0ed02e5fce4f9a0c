"""The maps point inside the repository: every relative link of README.md and docs/ names a file of the checkout, and
no document or source file names a place outside it (a sibling folder of the checkout, a machine's absolute path).
A reader of a clone has only the clone; recorded logs under ``benchmarks/results/`` are left as they were written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile("|".join([r"\.\./" + "shared\\b", "/" + "work/"]))
"""Paths of the machines the project was built on, not of a clone (split so that this file does not name them)."""
SOURCES = ("README.md", "Makefile", "pyproject.toml", "setup.py", ".ci", "docs", "python", "macer_kernels", "csrc",
           "benchmarks", "tests")
SUFFIXES = {".md", ".py", ".toml", ".sh", ".cpp", ".cu", ".cuh", ".h", ".txt", ""}


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def _sources() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in candidates if p.suffix in SUFFIXES and "results" not in p.relative_to(ROOT).parts
                  and "__pycache__" not in p.parts and not p.name.startswith(".")]
    return files


def test_every_relative_link_of_the_docs_names_a_file_of_the_checkout():
    broken = []
    for doc in _documents():
        for target in LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in (path, *path.parents):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_no_file_names_a_place_outside_the_checkout():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _sources() for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert found == []
