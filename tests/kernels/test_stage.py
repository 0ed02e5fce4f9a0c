"""select_stage: the fused readout (scores + every selection of a stage) on every backend, against reference.stage_ref.

Shapes are small: the Triton kernels run in the interpreter on machines without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from score_inputs import rel_err, stage_inputs

from macer_kernels import MAX_MODALITIES, StageModality, modality_scores, select_stage, use_backend, validation
from macer_kernels.reference import stage_ref, stage_select_ref

Mod = StageModality


def _fresh_seed() -> int:
    return torch.seed() % 2**31


def check_stage(seed, query, key, labels, mods, chunk_ids=None, **kwargs):
    """keep equals stage_ref's (float64 scores), the scores are as accurate as the fp32 PyTorch path's (at most 2x
    its error, floor 2e-6), and the selection equals the reference selection on the returned scores themselves."""
    uses_chunks = any(m.coverage_weight is not None for m in mods)
    chunk_arg = chunk_ids if uses_chunks else None
    keep, scores = select_stage(query, key, labels, mods, chunk_ids=chunk_arg, return_scores=True, **kwargs)
    b, n = labels.shape
    out_len = n - sum(m.count - m.keep for m in mods)
    assert keep.dtype == torch.long and keep.shape == (b, out_len) and keep.device == labels.device, seed
    assert scores.dtype == torch.float32 and scores.shape == (b, n), seed
    cpu_chunks = None if chunk_arg is None else chunk_arg.cpu()
    positions = kwargs.get("query_positions")
    ref_keep, ref_scores = stage_ref(query, key, labels, mods, cpu_chunks, positions,
                                     scale=kwargs.get("scale"), eps=kwargs.get("eps", 1e-6))
    with use_backend("torch"):
        torch_err = rel_err(modality_scores(query.cpu(), key.cpu(), labels.cpu(), None if positions is None else
                                            positions.cpu(), scale=kwargs.get("scale"), eps=kwargs.get("eps", 1e-6)),
                            ref_scores)
    err = rel_err(scores, ref_scores)
    assert err <= max(2 * torch_err, 2e-6), f"seed={seed}: scores rel err {err}, torch path {torch_err}"
    own = stage_select_ref(scores.cpu(), labels.cpu(), mods, cpu_chunks)
    assert torch.equal(keep.cpu(), own), f"seed={seed}: selection differs from the reference on the same scores"
    assert torch.equal(keep.cpu(), ref_keep), f"seed={seed}: keep differs from stage_ref"
    return keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stage_topk_and_coverage_match_the_reference(backend, dtype):
    _, device = backend
    seed = _fresh_seed()
    counts = {1: 23, 2: 31, 3: 5}  # label 3 is not a stage modality: all its tokens stay
    q, k, labels, chunks = stage_inputs(seed, 2, 77, counts, dtype=dtype, device=device)
    mods = [Mod(1, 23, 9), Mod(2, 31, 12, coverage_weight=0.3)]
    check_stage(seed, q, k, labels, mods, chunks)


def test_stage_awkward_budgets(backend):
    _, device = backend
    seed = _fresh_seed()
    counts = {1: 12, 2: 20, 4: 9}
    q, k, labels, chunks = stage_inputs(seed, 2, 53, counts, device=device, chunks=3)
    # Each case with its own eps (the default moves scores below any tolerance; a large one changes the selection).
    cases = [
        ([Mod(1, 12, 0), Mod(2, 20, 20, coverage_weight=1.5)], 1e-6),  # keep 0 and keep = count
        ([Mod(1, 12, 12), Mod(2, 20, 0, coverage_weight=0.2), Mod(4, 9, 4)], 0.25),
        ([Mod(5, 0, 0), Mod(2, 20, 7)], 0.0),  # one modality with no tokens at all
        ([Mod(2, 20, 7, coverage_weight=0.0), Mod(4, 9, 9, coverage_weight=2.0, num_chunks=3)], 2.0),
    ]
    for mods, eps in cases:
        check_stage(seed, q, k, labels, mods, chunks, eps=eps)


def test_stage_exact_ties(backend):
    # Keys after every question row's causal limit score exactly 0 in every implementation, so the budgets below end
    # inside a run of exact ties: they go to the lower index (top-K) and to the greedy's rule (coverage), as in the
    # references. (Repeated key vectors would not do: no implementation, the float64 one included, gives bitwise
    # equal logits at different key positions.)
    _, device = backend
    seed = _fresh_seed()
    q, k, labels, chunks = stage_inputs(seed, 2, 61, {1: 30, 2: 10}, device=device, chunks=2)
    positions = torch.tensor([[20, 25, 31], [31, 12, 29]], device=device)
    visible = [int(((labels[i] == 1) & (torch.arange(61, device=device) <= 31)).sum()) for i in range(2)]
    for selector in (None, 0.4):
        for keep in (min(visible) + 2, 28):
            mods = [Mod(1, 30, keep, coverage_weight=selector), Mod(2, 10, 3)]
            check_stage(seed, q, k, labels, mods, chunks, query_positions=positions)


def test_stage_views_gqa_positions_and_scale(backend):
    _, device = backend
    seed = _fresh_seed()
    q, k, labels, chunks = stage_inputs(seed, 2, 70, {1: 20, 2: 25}, hq=6, hkv=2, lq=4, d=24, device=device,
                                        layout="bnhd")
    assert not k.is_contiguous()
    mods = [Mod(1, 20, 8, coverage_weight=0.7), Mod(2, 25, 10)]
    positions = torch.tensor([[40, 52, 60, 69], [69, 10, 33, 5]], device=device)
    check_stage(seed, q, k, labels, mods, chunks, query_positions=positions, scale=0.3, eps=1e-3)
    # A key cache longer than the sequence (a narrowed view: strides of the full cache).
    cache = torch.randn(2, 2, 90, 24, generator=torch.Generator().manual_seed(seed)).to(device)
    check_stage(seed, q, cache[:, :, :70], labels, mods, chunks)


def test_stage_one_sample_is_the_ops_composed(backend):
    # B = 1 with a single top-K modality is modality_scores followed by topk_indices on that modality's tokens.
    from macer_kernels import topk_indices

    _, device = backend
    seed = _fresh_seed()
    q, k, labels, _ = stage_inputs(seed, 1, 40, {2: 25}, device=device)
    keep = select_stage(q, k, labels, [Mod(2, 25, 6)])
    where = (labels[0] == 2).nonzero().flatten()
    picks = where[topk_indices(modality_scores(q, k, labels)[0, where], 6)]
    expected = torch.sort(torch.cat([(labels[0] != 2).nonzero().flatten(), picks])).values
    assert torch.equal(keep[0].cpu(), expected.cpu()), f"seed={seed}"


def _args(n=20, b=1):
    q, k, labels, chunks = stage_inputs(0, b, n, {1: 6, 2: 8})
    return q, k, labels, chunks


@pytest.mark.parametrize(
    ("mods", "kwargs", "error", "message"),
    [
        ([], {}, ValueError, "modalities must be a non-empty sequence of StageModality"),
        ([(1, 6, 2)], {}, TypeError, r"modalities\[0\] must be a StageModality"),
        ([Mod(0, 6, 2)], {}, ValueError, rf"modalities\[0\].label must be in \[1, {MAX_MODALITIES}\]"),
        ([Mod(MAX_MODALITIES + 1, 0, 0)], {}, ValueError, r"modalities\[0\].label must be in"),
        ([Mod(1, 6, 2), Mod(1, 6, 2)], {}, ValueError, r"modalities\[1\].label 1 appears twice"),
        ([Mod(1, 6, 7)], {}, ValueError, r"modalities\[0\].keep must be in \[0, 6\]"),
        ([Mod(1, -1, 0)], {}, ValueError, r"modalities\[0\].count must be a non-negative integer"),
        ([Mod(1, 21, 0)], {}, ValueError, r"modalities\[0\].count must be in \[0, 20\]"),
        ([Mod(1, 15, 0), Mod(2, 15, 0)], {}, ValueError,
         "counts of modalities plus its padding must add up to at most N=20"),
        ([Mod(1, 6, 2, coverage_weight=-1.0)], {"chunk": True}, ValueError, r"coverage_weight must be in \[0.0"),
        ([Mod(1, 6, 2, num_chunks=4)], {}, ValueError, r"num_chunks is only for coverage"),
        ([Mod(1, 6, 2, coverage_weight=0.5)], {}, ValueError, "chunk_ids is required"),
        ([Mod(1, 6, 2)], {"chunk": True}, ValueError, "chunk_ids must be None"),
        ([Mod(1, 5, 2)], {}, ValueError,
         r"modalities\[0\].count says sample 0 holds 5 tokens of label 1, but labels hold 6"),
        ([Mod(1, 6, 2, coverage_weight=0.5, num_chunks=2)], {"chunk": True}, ValueError,
         r"chunk_ids must be in \[0, 1\] \(modalities\[0\].num_chunks\)"),
        ([Mod(1, 6, 2)], {"eps": -1.0}, ValueError, r"eps must be in \[0.0"),
        ([Mod(1, 6, 2)], {"return_scores": 1}, ValueError, "return_scores must be a bool"),
    ],
)
def test_errors_name_the_parameter_and_range(mods, kwargs, error, message):
    q, k, labels, chunks = _args()
    kwargs = dict(kwargs)
    if kwargs.pop("chunk", False):
        kwargs["chunk_ids"] = chunks
    with pytest.raises(error, match=message):
        select_stage(q, k, labels, mods, **kwargs)


def test_value_errors_on_cpu_tensors():
    q, k, labels, chunks = _args()
    bad = labels.clone()
    bad[0, 0] = MAX_MODALITIES + 1
    with pytest.raises(ValueError, match=rf"labels must be in \[-1, {MAX_MODALITIES}\] \(-1 = padding\)"):
        select_stage(q, k, bad, [Mod(1, 6, 2)])
    bad[0, 0] = -2
    with pytest.raises(ValueError, match=rf"labels must be in \[-1, {MAX_MODALITIES}\]"):
        select_stage(q, k, bad, [Mod(1, 6, 2)])
    negative = chunks.clone()
    negative[labels == 1] = -1
    with pytest.raises(ValueError, match="chunk_ids must be non-negative at the tokens of label 1"):
        select_stage(q, k, labels, [Mod(1, 6, 2, coverage_weight=0.1)], chunk_ids=negative)
    with pytest.raises(ValueError, match=r"query_positions must be in \[0, N-1=19\]"):
        select_stage(q, k, labels, [Mod(1, 6, 2)], query_positions=torch.tensor([[1, 2, 20]]))
    with pytest.raises(ValueError, match=r"chunk_ids must be \[B=1, N=20\]"):
        select_stage(q, k, labels, [Mod(1, 6, 2, coverage_weight=0.1)], chunk_ids=chunks[:, :5])
    with pytest.raises(ValueError, match=r"labels must be \[B=1, N=20\]"):
        select_stage(q, k, labels[:, :5], [Mod(1, 6, 2)])


@pytest.mark.cuda
def test_cuda_stage_no_sync_few_launches_and_graph_capture(backend):
    """On a GPU: no host synchronisation (torch's sync debug mode raises on one), at most 4 kernels in the profile,
    and a captured CUDA graph replayed on fresh inputs equals eager."""
    name, device = backend
    if device != "cuda":
        pytest.skip("CUDA tensors only")
    seed = _fresh_seed()
    q, k, labels, chunks = stage_inputs(seed, 2, 300, {1: 100, 2: 150}, dtype=torch.bfloat16, device="cuda")
    mods = [Mod(1, 100, 30), Mod(2, 150, 40, coverage_weight=0.5)]

    def call():
        # Validation off, as in serving: conftest runs cuda-marked tests in validation mode, whose value checks read
        # back to the host by design (one synchronisation per call) and cannot run inside a graph capture.
        with validation(False):
            return select_stage(q, k, labels, mods, chunk_ids=chunks)

    call()  # warm-up: compiles, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if name in ("triton", "cuda"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        assert len(kernels) <= 4, [e.name for e in kernels]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    fresh = stage_inputs(seed + 1, 2, 300, {1: 100, 2: 150}, dtype=torch.bfloat16, device="cuda")
    for dst, src in zip((q, k, labels, chunks), fresh):
        dst.copy_(src)
    graph.replay()
    assert torch.equal(captured, call()), f"seed={seed}"
@pytest.mark.triton
def test_triton_stage_is_at_most_four_launches(monkeypatch):
    """Every Triton launch of one select_stage call is counted (the kernels' run method); the bound is 4: the three
    scoring launches and one stage_select. A fifth launch (e.g. a selection split into several kernels) fails."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches = []
    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def counting(self, *args, _original=original, **kwargs):
            if not kwargs.get("warmup", False):
                launches.append(getattr(self, "__name__", getattr(self.fn, "__name__", "?")))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", counting)
    seed = _fresh_seed()
    from gating import HAS_GPU

    q, k, labels, chunks = stage_inputs(seed, 2, 45, {1: 15, 2: 20}, device="cuda" if HAS_GPU else "cpu")
    mods = [Mod(1, 15, 4), Mod(2, 20, 6, coverage_weight=0.5)]
    with use_backend("triton"):
        keep = select_stage(q, k, labels, mods, chunk_ids=chunks)
    assert len(launches) <= 4, launches
    assert launches[-1] == "_stage_select_kernel", launches
    assert torch.equal(keep.cpu(), stage_ref(q, k, labels, mods, chunks)[0]), f"seed={seed}"




def _select_inputs(seed, b, n, counts, *, ties, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    labels = torch.zeros(b, n, dtype=torch.long)
    for i in range(b):
        row = torch.cat([torch.full((c,), label) for label, c in counts.items()] +
                        [torch.zeros(n - sum(counts.values()), dtype=torch.long)])
        labels[i] = row[torch.randperm(n, generator=g)]
    scores = torch.randint(0, 5, (b, n), generator=g).to(dtype) if ties else torch.rand(b, n, generator=g).to(dtype)
    return scores, labels, torch.randint(0, 3, (b, n), generator=g)


@pytest.mark.parametrize(("dtype", "path"), [(torch.float32, "one-program"), (torch.float64, "one-program"),
                                             (torch.float32, "composed")], ids=["fp32", "fp64", "fp32-composed"])
def test_stage_select_op_matches_the_reference_selection(backend, dtype, path, monkeypatch):
    """The backend's stage_select alone (no scoring, so many budgets are cheap), on coarse scores full of exact ties
    and on distinct ones, for both Triton paths (the composition above the one-program limits is forced here)."""
    from macer_kernels.backend import resolve

    name, device = backend
    if path == "composed":
        if name != "triton":
            pytest.skip("the composition is the Triton backend's path above its one-program limits")
        from macer_kernels.triton import stage as triton_stage

        monkeypatch.setattr(triton_stage, "ONE_PROGRAM_MAX_N", 0)
        monkeypatch.setattr(triton_stage, "COVERAGE_ONE_PROGRAM_MAX_N", 0)
    impl_name, impl = resolve("stage_select", torch.device(device))
    if impl_name != name:
        pytest.skip(f"backend {name!r} has no stage_select")
    seed = _fresh_seed()
    counts = {1: 40, 3: 70, 7: 9}
    cases = [((0, 70, 9), (None, 0.5, None)), ((13, 1, 0), (0.0, None, 2.0)), ((40, 35, 4), (None, 0.5, 2.0)),
             ((39, 69, 8), (None, None, None))]
    for ties in (True, False):
        scores, labels, chunks = _select_inputs(seed, 2, 150, counts, ties=ties, dtype=dtype)
        for keeps, weights in cases:
            mods = [Mod(label, c, kp, coverage_weight=w) for (label, c), kp, w in zip(counts.items(), keeps, weights)]
            spec = tuple((m.label, m.keep, m.coverage_weight, 0 if m.coverage_weight is None else None) for m in mods)
            out_len = 150 - sum(m.count - m.keep for m in mods)
            keep = impl(scores.to(device), labels.to(device), chunks.to(device), spec, out_len)
            expected = stage_select_ref(scores, labels, mods, chunks)
            assert torch.equal(keep.cpu(), expected), f"seed={seed} ties={ties} keeps={keeps} weights={weights}"


@pytest.mark.triton
def test_triton_paths_read_nothing_back_to_the_host(monkeypatch):
    """Outside the kernel launches themselves (the interpreter copies arguments to the host there), select_stage,
    compact_many and topk_indices on the Triton backend call none of the tensor methods that synchronise on CUDA
    tensors. The value checks are off here, as on CUDA tensors (they are the CPU-only part)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from macer_kernels import stage
    from macer_kernels.triton.compact import compact_many_triton
    from macer_kernels.triton.select import topk_indices_triton

    in_launch = [0]
    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def launching(self, *args, _original=original, **kwargs):
            in_launch[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                in_launch[0] -= 1

        monkeypatch.setattr(cls, "run", launching)
    readbacks = []
    for method in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, method)

        def guarded(self, *args, _original=original, _name=method, **kwargs):
            if not in_launch[0]:
                readbacks.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, guarded)
    monkeypatch.setattr(stage, "values_checked", lambda t: False)
    from gating import HAS_GPU

    # The interpreter on CPU tensors; on a GPU machine the compiled kernels on CUDA tensors (there the interpreter is
    # off and the Triton backend refuses CPU tensors).
    device = "cuda" if HAS_GPU else "cpu"
    seed = _fresh_seed()
    q, k, labels, chunks = stage_inputs(seed, 2, 40, {1: 10, 2: 20}, device=device)
    scores = torch.rand(300, generator=torch.Generator().manual_seed(seed)).to(device)
    with use_backend("triton"), validation(False):
        keep = select_stage(q, k, labels, [Mod(1, 10, 3), Mod(2, 20, 5, coverage_weight=0.5)], chunk_ids=chunks)
        compact_many_triton([k.transpose(1, 2), chunks], keep[0], [1, 1])
        topk_indices_triton(scores, 40)
    assert readbacks == [], readbacks
