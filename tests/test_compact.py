"""compact / compact_many: keep sorted positions along the sequence axis."""

import pytest
import torch

from macer_kernels import compact, compact_many
from macer_kernels.reference import compact_ref


def _keep(n, k, g):
    return torch.randperm(n, generator=g)[:k].sort().values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long])
def test_compact_matches_reference(backend, dtype, seed):
    _, device = backend
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 37, 24, generator=g) * 100).to(dtype).to(device)
    for k in (0, 1, 19, 37):
        keep = _keep(37, k, g).to(device)
        out = compact(x, keep)
        assert out.dtype == x.dtype and out.shape == (2, k, 24)
        assert torch.equal(out.cpu(), compact_ref(x.cpu(), keep.cpu(), 1)), (seed, k)


def test_compact_other_dims_and_views(backend, seed):
    _, device = backend
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1000, (3, 1, 50), generator=g).to(device)  # M-RoPE position ids [3, B, N]
    keep = _keep(50, 20, g).to(device)
    assert torch.equal(compact(pos, keep, dim=2).cpu(), compact_ref(pos.cpu(), keep.cpu(), 2)), seed
    assert torch.equal(compact(pos, keep, dim=-1).cpu(), compact_ref(pos.cpu(), keep.cpu(), 2)), seed
    view = torch.randn(50, 2, 8, generator=g).to(device).transpose(0, 1)  # non-contiguous [2, 50, 8]
    assert torch.equal(compact(view, keep).cpu(), compact_ref(view.cpu(), keep.cpu(), 1)), seed


def test_compact_many_matches_compact(backend, seed):
    _, device = backend
    g = torch.Generator().manual_seed(seed)
    n = 41
    hidden = torch.randn(1, n, 64, generator=g).to(torch.bfloat16).to(device)
    cos, sin = torch.randn(2, 1, n, 16, generator=g).to(device)
    positions = torch.randint(0, 500, (3, 1, n), generator=g).to(device)
    keep = _keep(n, 17, g).to(device)
    out = compact_many([hidden, cos, sin, positions], keep, [1, 1, 1, 2])
    expected = [compact_ref(t.cpu(), keep.cpu(), d) for t, d in zip([hidden, cos, sin, positions], [1, 1, 1, 2])]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out, expected)), seed
    assert compact_many([], keep, []) == []


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda x: compact(x, torch.tensor([2, 1])), ValueError, "keep must be strictly increasing"),
        (lambda x: compact(x, torch.tensor([1, 1])), ValueError, "keep must be strictly increasing"),
        (lambda x: compact(x, torch.tensor([0, 10])), ValueError, r"keep must hold indices in \[0, 9\]"),
        (lambda x: compact(x, torch.tensor([-1, 3])), ValueError, r"keep must hold indices in \[0, 9\]"),
        (lambda x: compact(x, torch.tensor([0.0, 1.0])), TypeError, "keep must be an integer tensor"),
        (lambda x: compact(x, torch.tensor([[0, 1]])), ValueError, "keep must have 1 dimensions"),
        (lambda x: compact(x, torch.tensor([0]), dim=3), ValueError, r"dim must be an int in \[-3, 2\]"),
        (lambda x: compact_many([x, x], torch.tensor([0]), [1]), ValueError, "dims must give one dimension per"),
        (lambda x: compact_many([x, x], torch.tensor([0]), [1, 2]), ValueError, "must share one sequence length"),
        (lambda x: compact_many([x], torch.tensor([0]), [5]), ValueError, r"dims\[0\] must be an int in \[-3, 2\]"),
    ],
)
def test_errors(call, error, message):
    x = torch.randn(2, 10, 4)
    with pytest.raises(error, match=message):
        call(x)
