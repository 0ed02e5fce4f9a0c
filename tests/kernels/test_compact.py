"""compact / compact_many: keep sorted positions along the sequence axis."""

import pytest
import torch

from macer_kernels import compact, compact_many, use_backend
from macer_kernels.backend import _REGISTRY, resolve
from macer_kernels.reference import compact_ref


def _runs_named(backend, op):
    """The backend named by the fixture really runs ``op`` (a backend without it is skipped, so a test can no longer
    pass on the PyTorch path under another backend's name)."""
    name, device = backend
    if name not in _REGISTRY[op]:
        pytest.skip(f"backend {name!r} has no {op}")
    assert resolve(op, torch.device(device))[0] == name
    return device



def _keep(n, k, g):
    return torch.randperm(n, generator=g)[:k].sort().values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long])
def test_compact_matches_reference(backend, dtype, seed):
    device = _runs_named(backend, "compact")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 37, 24, generator=g) * 100).to(dtype).to(device)
    for k in (0, 1, 19, 37):
        keep = _keep(37, k, g).to(device)
        out = compact(x, keep)
        assert out.dtype == x.dtype and out.shape == (2, k, 24)
        assert torch.equal(out.cpu(), compact_ref(x.cpu(), keep.cpu(), 1)), f"seed={seed} k={k}"


def test_compact_other_dims_and_views(backend, seed):
    device = _runs_named(backend, "compact")
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1000, (3, 1, 50), generator=g).to(device)  # M-RoPE position ids [3, B, N]
    keep = _keep(50, 20, g).to(device)
    assert torch.equal(compact(pos, keep, dim=2).cpu(), compact_ref(pos.cpu(), keep.cpu(), 2)), f"seed={seed}"
    assert torch.equal(compact(pos, keep, dim=-1).cpu(), compact_ref(pos.cpu(), keep.cpu(), 2)), f"seed={seed}"
    view = torch.randn(50, 2, 8, generator=g).to(device).transpose(0, 1)  # non-contiguous [2, 50, 8]
    assert torch.equal(compact(view, keep).cpu(), compact_ref(view.cpu(), keep.cpu(), 1)), f"seed={seed}"
    # Views whose dimensions before / after the sequence do not merge into one strided block, and a strided inner
    # dimension (a head-sliced cache [B, H, N, D] seen as [H, B, N, D/2]).
    cache = torch.randn(2, 3, 50, 8, generator=g).to(device)
    other = torch.randn(2, 50, 4, 6, generator=g).to(device).transpose(2, 3)
    for x, dim in ((cache.permute(1, 0, 2, 3), 2), (cache[..., ::2], 2), (other, 1)):
        assert torch.equal(compact(x, keep, dim).cpu(), compact_ref(x.cpu(), keep.cpu(), dim)), f"seed={seed}"


def test_compact_many_matches_compact(backend, seed):
    device = _runs_named(backend, "compact_many")
    g = torch.Generator().manual_seed(seed)
    n = 41
    hidden = torch.randn(1, n, 64, generator=g).to(torch.bfloat16).to(device)
    cos, sin = torch.randn(2, 1, n, 16, generator=g).to(device)
    positions = torch.randint(0, 500, (3, 1, n), generator=g).to(device)
    keep = _keep(n, 17, g).to(device)
    out = compact_many([hidden, cos, sin, positions], keep, [1, 1, 1, 2])
    expected = [compact_ref(t.cpu(), keep.cpu(), d) for t, d in zip([hidden, cos, sin, positions], [1, 1, 1, 2])]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out, expected)), f"seed={seed}"
    assert compact_many([], keep, []) == []


@pytest.mark.triton
def test_triton_compact_many_is_one_launch_per_eight_tensors(monkeypatch, seed):
    """Every dtype in one launch (each slot has its own typed pointers); nine tensors take two launches."""
    pytest.importorskip("triton")
    from gating import HAS_GPU

    from macer_kernels.triton import compact as triton_compact

    launches = []
    kernel = triton_compact._compact_kernel

    class Counting:
        arg_names = kernel.arg_names

        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_compact, "_compact_kernel", Counting())
    device = "cuda" if HAS_GPU else "cpu"
    g = torch.Generator().manual_seed(seed)
    n = 23
    dtypes = [torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
              torch.bool, torch.float16]
    tensors = [(torch.randn(2, n, 5, generator=g) * 50).to(dtype).to(device) for dtype in dtypes]
    tensors[3] = tensors[3].transpose(0, 1).contiguous()  # [N, 2, 5] with dim 0
    dims = [1, 1, 1, 0, 1, 1, 1, 1, 1]
    keep = _keep(n, 9, g).to(device)
    with use_backend("triton"):
        out = compact_many(tensors[:4], keep, dims[:4])
        assert len(launches) == 1, launches
        out = compact_many(tensors, keep, dims)
        assert len(launches) == 3, launches
    for t, d, o in zip(tensors, dims, out):
        assert torch.equal(o.cpu(), compact_ref(t.cpu(), keep.cpu(), d)), f"seed={seed} {t.dtype}"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda x: compact(x, torch.tensor([2, 1])), ValueError, "keep must be strictly increasing"),
        (lambda x: compact(x, torch.tensor([1, 1])), ValueError, "keep must be strictly increasing"),
        (lambda x: compact(x, torch.tensor([0, 10])), ValueError, r"keep must hold indices in \[0, 9\]"),
        (lambda x: compact(x, torch.tensor([-1, 3])), ValueError, r"keep must hold indices in \[0, 9\]"),
        (lambda x: compact(x, torch.tensor([0.0, 1.0])), TypeError, "keep must be an integer tensor"),
        (lambda x: compact(x, torch.tensor([[[0, 1]]])), ValueError, r"keep must be 1-D \[k\] or, for a batch, 2-D"),
        (lambda x: compact(x, torch.tensor([[0, 1]] * 5)), ValueError,
         r"with a 2-D keep \[B=5, W\], tensors\[0\] needs a batch dimension of size B"),
        (lambda x: compact(x, torch.tensor([[0, -1]] * x.shape[0])), ValueError, "-1 fill first"),
        (lambda x: compact(x, torch.tensor([[-2, 1]] * x.shape[0])), ValueError, r"or -1 \(fill\)"),
        (lambda x: compact(x, torch.tensor([[-1, 3, 3]] * x.shape[0])), ValueError, "strictly increasing"),
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


@pytest.mark.parametrize(
    ("tensors", "dims", "message"),
    [
        (lambda x: x, [1, 1], r"tensors must be a list or tuple of tensors, got Tensor \(for one tensor use compact"),
        (lambda x: x, 1, "tensors must be a list or tuple of tensors, got Tensor"),
        (lambda x: [x], 1, r"dims must be a list or tuple of ints, one per tensor, got int 1"),
        (lambda x: [x], torch.tensor([1]), "dims must be a list or tuple of ints, one per tensor, got Tensor"),
        (lambda x: [x], "1", "dims must be a list or tuple of ints, one per tensor, got str"),
    ],
)
def test_compact_many_refuses_a_tensor_or_an_int_for_a_list(tensors, dims, message):
    """Guards issue 21.8: ``compact_many(x, keep, [1, 1])`` with a tensor [2, N, D] for the list silently iterated over
    dim 0 and returned two wrong [N', D] tensors; ``compact_many([x], keep, 1)`` failed with "'int' object is not
    iterable". Both are refused up front, naming the parameter."""
    x = torch.randn(2, 10, 4)
    with pytest.raises(TypeError, match=message):
        compact_many(tensors(x), torch.tensor([0, 3]), dims)
