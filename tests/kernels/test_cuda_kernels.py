"""The CUDA kernels against the float64 references on fresh random inputs (marker ``cuda``: skipped without a GPU).

Scores: the error of the CUDA path must stay within 2x the error the PyTorch path makes on the same GPU inputs
(both accumulate in fp32), plus a small absolute floor. Selections: exact index equality, ties included.
Run under ``compute-sanitizer --tool memcheck`` on a GPU (see docs/cuda.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from greedy_oracle import coverage_greedy_order

import macer_kernels as mk
from macer_kernels.reference import (
    coverage_select_ref,
    modality_scores_ref,
    topk_indices_ref,
)

pytestmark = pytest.mark.cuda

DEV = "cuda"


@pytest.fixture(autouse=True)
def _cuda_backend():
    reason = mk.backend_status()["cuda"]
    assert reason is None, f"the cuda backend must be usable on a GPU machine: {reason}"
    with mk.use_backend("cuda"):
        yield


def _scores_case(b, hq, hkv, lq, d, n, dtype, *, labels=3, transposed=False, positions="random", offset=False,
                 seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    query = torch.randn(b, hq, lq, d, generator=g, device=DEV).to(dtype)
    if transposed:  # a FlashAttention-layout cache [B, N, Hkv, D] read as [B, Hkv, N, D]
        key = torch.randn(b, n, hkv, d, generator=g, device=DEV).to(dtype).transpose(1, 2)
    elif offset:  # storage offset of one element: 16-byte loads are impossible, the scalar path runs
        key = torch.randn(b * hkv * n * d + 1, generator=g, device=DEV).to(dtype)[1:].view(b, hkv, n, d)
    else:
        key = torch.randn(b, hkv, n, d, generator=g, device=DEV).to(dtype)
    key = key * 2.0  # sharper attention than unit logits: masking and normalisation matter more
    modality = torch.randint(0, labels + 1, (b, n), generator=g, device=DEV)
    if positions == "random":
        qpos = torch.randint(max(0, n // 3), n, (b, lq), generator=g, device=DEV)
    else:
        qpos = None
    return query, key, modality, qpos


def _check_scores(query, key, modality, qpos, eps=1e-6):
    got = mk.modality_scores(query, key, modality, qpos, eps=eps)
    ref = modality_scores_ref(query.cpu(), key.cpu(), modality.cpu(), None if qpos is None else qpos.cpu(), eps=eps)
    with mk.use_backend("torch"):
        torch_path = mk.modality_scores(query, key, modality, qpos, eps=eps)
    assert got.dtype == torch.float32 and got.shape == ref.shape and got.device.type == "cuda"
    err = (got.cpu().double() - ref).abs().max().item()
    torch_err = (torch_path.cpu().double() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-6 * (1 + ref.abs().max().item()), (err, torch_err)
    # A fixed ceiling too, so the bound does not loosen with the PyTorch path (the H100 run: 1e-7 to 2e-6 of the max).
    assert err <= 1e-5 * ref.abs().max().item(), (err, torch_err)
    assert bool((got.cpu()[modality.cpu() == 0] == 0).all())  # label 0 (text) scores exactly 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_modality_scores_head_dims_and_dtypes(dtype, d):
    _check_scores(*_scores_case(1, 7, 1, 4, d, 333, dtype, seed=d))


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (7, 1), (28, 4), (14, 2)])
@pytest.mark.parametrize("lq", [1, 4, 5])
def test_modality_scores_gqa_groups_and_query_rows(hq, hkv, lq):
    # (28, 4) with Lq = 5 has 35 rows per KV head: two row tiles over one K tile.
    _check_scores(*_scores_case(2, hq, hkv, lq, 128, 517, torch.bfloat16, seed=hq * 10 + lq))


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 63, 64, 65, 1001, 2400, 20011])
def test_modality_scores_lengths_and_tails(n):
    lq = min(4, n)
    _check_scores(*_scores_case(1, 28, 4, lq, 128, n, torch.bfloat16, seed=n))
    _check_scores(*_scores_case(1, 4, 2, lq, 64, n, torch.float32, seed=n + 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modality_scores_layouts(dtype):
    _check_scores(*_scores_case(2, 28, 4, 4, 128, 777, dtype, transposed=True))
    _check_scores(*_scores_case(1, 8, 2, 3, 96, 300, dtype, offset=True))
    query, key, modality, qpos = _scores_case(1, 8, 2, 3, 64, 300, dtype)
    _check_scores(query.transpose(2, 3).contiguous().transpose(2, 3), key, modality.to(torch.int8), qpos.int())
    # Q rows contiguous over D but the base one element off 16 bytes: the staging's scalar chunk path
    shifted = torch.empty(query.numel() + 1, dtype=dtype, device=DEV)[1:].view(query.shape)
    shifted.copy_(query)
    _check_scores(shifted, key, modality, qpos)
    # Q in [B, Lq, Hq, D] memory read as [B, Hq, Lq, D] (row offsets from both strides), D = 80 (a partial chunk)
    query, key, modality, qpos = _scores_case(1, 28, 4, 5, 80, 300, dtype)
    _check_scores(query.transpose(1, 2).contiguous().transpose(1, 2), key, modality, qpos)


def test_modality_scores_labels_positions_and_eps():
    _check_scores(*_scores_case(1, 7, 1, 4, 128, 900, torch.bfloat16, labels=8))  # every label 0..8
    _check_scores(*_scores_case(1, 7, 1, 4, 128, 900, torch.bfloat16, positions="default"))
    query, key, modality, _ = _scores_case(1, 7, 1, 4, 128, 900, torch.bfloat16, labels=2)
    modality[:, :3] = torch.tensor([1, 2, 0], device=DEV)  # every query row sees every label: eps = 0 stays finite
    qpos = torch.tensor([[5, 100, 899, 450]], device=DEV)  # rows far from the end: causal masking matters
    _check_scores(query, key, modality, qpos, eps=0.0)
    _check_scores(query, key, modality, qpos, eps=1e-2)
    only_text = torch.zeros_like(modality)
    assert torch.equal(mk.modality_scores(query, key, only_text, qpos), torch.zeros(1, 900, device=DEV))


def test_modality_scores_unseen_modality_matches_reference():
    # A row that sees no key of label 2 contributes 0 to it, with eps > 0 and with eps = 0 (no 0/0 NaN).
    query, key, _, _ = _scores_case(1, 2, 1, 1, 64, 40, torch.float32)
    modality = torch.ones(1, 40, dtype=torch.long, device=DEV)
    modality[:, 30:] = 2
    qpos = torch.tensor([[20]], device=DEV)
    for eps in (1e-6, 0.0):
        got = mk.modality_scores(query, key, modality, qpos, eps=eps).cpu()
        ref = modality_scores_ref(query.cpu(), key.cpu(), modality.cpu(), qpos.cpu(), eps=eps)
        assert torch.equal(got[:, 30:], torch.zeros(1, 10)) and torch.equal(ref[:, 30:], torch.zeros(1, 10).double())
        assert not bool(got.isnan().any())
        assert torch.allclose(got[:, :30].double(), ref[:, :30], rtol=1e-5, atol=1e-7)


def test_modality_scores_empty_and_paper_case():
    query, key, modality, qpos = _scores_case(1, 28, 4, 4, 128, 2400, torch.bfloat16)
    modality[:, :76] = 0
    modality[:, 76:76 + 1460] = 1
    modality[:, 76 + 1460:] = 2
    _check_scores(query, key, modality, qpos)
    # B = 0 through the CUDA wrapper itself: the public op's range checks call min() on the empty labels and raise
    # before any backend is reached.
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    empty = modality_scores_cuda(query[:0], key[:0], modality[:0], qpos[:0], 1 / math.sqrt(128), 1e-6)
    assert empty.shape == (0, 2400)


# --- selection -----------------------------------------------------------------------------------------------------

def _random_scores(n, dtype, ties, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    if ties:
        return (torch.randint(0, 7, (n,), generator=g, device=DEV).to(torch.float64) / 4).to(dtype)
    return torch.randn(n, generator=g, device=DEV).to(dtype)


SIZES = [1, 2, 7, 100, 864, 1460, 2049, 4097, 9000, 32768, 40001]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_topk_indices_exact(n, dtype):
    for ties in (False, True):
        scores = _random_scores(n, dtype, ties, seed=n)
        for k in {0, 1, n // 3, n}:
            got = mk.topk_indices(scores, k)
            want = topk_indices_ref(scores.cpu(), k)  # a Python sort: fast enough at every size here
            assert got.dtype == torch.long and torch.equal(got.cpu(), want), (n, k, ties)


def test_topk_indices_signed_zero_and_infinities_and_strides():
    scores = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), -0.0, 0.0, 1.0], device=DEV)
    for k in range(8):
        assert torch.equal(mk.topk_indices(scores, k).cpu(), topk_indices_ref(scores.cpu(), k))
    strided = _random_scores(2000, torch.float32, True, seed=3)[::2]
    assert torch.equal(mk.topk_indices(strided, 333).cpu(), topk_indices_ref(strided.cpu(), 333))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight", [0.0, 0.05, 1.0, 3e32])
def test_coverage_select_exact(n, weight):
    g = torch.Generator(device=DEV).manual_seed(n)
    for ties, chunk_dtype in ((False, torch.int64), (True, torch.int32), (True, torch.uint8)):
        scores = _random_scores(n, torch.float32, ties, seed=n + 7)
        chunks = torch.randint(0, min(16, n), (n,), generator=g, device=DEV).to(chunk_dtype)
        # The literal greedy is O(k n) in Python; above 500 tokens the step-by-step oracle of
        # tests/helpers/greedy_oracle.py, which shares nothing with the kernels' sort-based method.
        order = coverage_greedy_order(scores.cpu(), chunks.cpu().long(), weight) if n > 500 else None
        for k in {1, n // 4, n}:
            got = mk.coverage_select(scores, chunks, k, weight)
            if order is None:
                want = coverage_select_ref(scores.cpu(), chunks.cpu(), k, weight)
            else:
                want = torch.tensor(sorted(order[:k]), dtype=torch.long)
            assert torch.equal(got.cpu(), want), (n, k, weight, ties, chunk_dtype)


def test_coverage_select_zero_weight_is_topk_and_large_chunk_ids():
    scores = _random_scores(5000, torch.bfloat16, True, seed=11)
    chunks = torch.randint(0, 2**40, (5000,), device=DEV)
    # Against the reference, not against topk_indices (a weight-0 shortcut to it would make that a tautology).
    assert torch.equal(mk.coverage_select(scores, chunks, 1234, 0.0).cpu(), topk_indices_ref(scores.cpu(), 1234))
    chunks = torch.arange(864, device=DEV) // 36  # the paper's 864 video tokens in 24 chunks
    scores = _random_scores(864, torch.float32, False, seed=5)
    want = coverage_select_ref(scores.cpu(), chunks.cpu(), 216, 0.1)
    assert torch.equal(mk.coverage_select(scores, chunks, 216, 0.1).cpu(), want)


def test_select_workspace_too_small_is_reported():
    from macer_kernels.cuda import _ext

    n = 5000
    scores = torch.rand(n, device=DEV)
    out = torch.empty(10, dtype=torch.long, device=DEV)
    arrays_only = 6 * (-(-8 * n // 256) * 256)  # the workspace without CUB's temporary storage (csrc/select.cu)
    scratch = torch.empty(arrays_only, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="topk_indices: workspace too small for CUB's temporary storage"):
        _ext.ext().topk_indices(scores.data_ptr(), 0, n, 1, 10, out.data_ptr(), scratch.data_ptr(), arrays_only,
                                scores.device.index, torch.cuda.current_stream().cuda_stream)


# --- the radix selection kernel: one CTA, clusters, both sides of each limit, PDL -----------------------------------

def _cta_limit(coverage: bool, wide: bool = False) -> int:
    from macer_kernels.cuda._ext import select_cta_max_n

    return select_cta_max_n(torch.cuda.current_device(), coverage, wide)


def _plan(n: int, coverage: bool, wide: bool = False) -> tuple:
    from macer_kernels.cuda._ext import ext

    avail, clusters = ext().select_cta_device_limits(torch.cuda.current_device())
    return ext().select_cta_plan(n, coverage, wide, avail, clusters)


def test_limits_and_plan_are_the_replays_on_this_device():
    """The device's limits (its opt-in shared memory minus the kernels' static shared memory, and the largest
    cluster it co-schedules: 8 on sm_90, none below) give the limits and cluster sizes the CPU replay derives
    (tests/helpers/select_replay.py): the recorded table of docs/cuda.md, if this device's runtime counts the same
    bytes."""
    import select_replay as R

    from macer_kernels.cuda._ext import ext

    major, _ = torch.cuda.get_device_capability()
    avail, clusters = ext().select_cta_device_limits(torch.cuda.current_device())
    optin = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    assert clusters == (R.MAX_CLUSTER if major >= 9 else 1), clusters
    assert optin - avail in (R.STATIC_SMEM[90 if major >= 9 else 89], R.STATIC_SMEM[90 if major >= 9 else 89] + 1024)
    for coverage, wide in ((False, False), (True, False), (False, True)):
        assert _cta_limit(coverage, wide) == R.max_n(coverage, wide, avail, clusters), (coverage, wide)
        for n in (864, 2400, 4096, 4097, 20000, 100000):
            assert _plan(n, coverage, wide) == R.plan(n, coverage, wide, avail, clusters), (n, coverage, wide)
    if major >= 9:  # the paper's sizes: 20k-token rows take clusters, a 2.4k stage one CTA
        assert _plan(20000, True)[0] >= 2 and _plan(20000, False)[0] >= 2 and _plan(2400, True)[0] == 1
        assert _cta_limit(True) >= 60000 and _cta_limit(False) >= 300000


@pytest.mark.parametrize("coverage", [False, True])
def test_selection_on_both_sides_of_each_limit(coverage):
    """At the one-CTA limit and one above, at the plan's single-CTA threshold and one above (sm_90: clusters from
    there), and at the kernel's own limit and one above (the multi-CTA CUB chain from there)."""
    import select_replay as R

    from macer_kernels.cuda._ext import ext

    avail, _ = ext().select_cta_device_limits(torch.cuda.current_device())
    single = R.max_n(coverage, False, avail, 1)
    threshold = R.SINGLE_COVERAGE_MAX if coverage else R.SINGLE_TOPK_MAX
    edges = {single, single + 1, threshold, threshold + 1, _cta_limit(coverage), _cta_limit(coverage) + 1}
    for n in sorted(edges):
        g = torch.Generator(device=DEV).manual_seed(n)
        for ties in (False, True):
            scores = _random_scores(n, torch.float32, ties, seed=n + ties)
            chunks = torch.randint(0, 24, (n,), generator=g, device=DEV)
            # Independent oracles: the step-by-step greedy (tests/helpers/greedy_oracle.py) and the reference's Python
            # sort.
            order = coverage_greedy_order(scores.cpu(), chunks.cpu(), 0.2) if coverage else None
            for k in (1, n // 5, n - 1):
                if coverage:
                    got = mk.coverage_select(scores, chunks, k, 0.2)
                    want = torch.tensor(sorted(order[:k]), dtype=torch.long)
                else:
                    got = mk.topk_indices(scores, k)
                    want = topk_indices_ref(scores.cpu(), k)
                assert torch.equal(got.cpu(), want), (n, k, ties, _plan(n, coverage))


def test_selection_is_a_single_launch_in_one_cta_and_in_a_cluster():
    from torch.profiler import ProfilerActivity, profile

    from macer_kernels.cuda.select import coverage_select_cuda, topk_indices_cuda

    scores = torch.randn(864, device=DEV)
    chunks = torch.arange(864, device=DEV) // 36
    big = torch.randn(20000, device=DEV)
    big_chunks = torch.arange(20000, device=DEV) // 2500
    huge = torch.randn(min(100000, _cta_limit(False)), device=DEV)
    for call in (lambda: topk_indices_cuda(scores, 216), lambda: coverage_select_cuda(scores, chunks, 216, 0.2),
                 lambda: topk_indices_cuda(big, 5000), lambda: coverage_select_cuda(big, big_chunks, 5000, 0.2),
                 lambda: topk_indices_cuda(huge, 25000)):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        assert len(kernels) == 1 and "select_cta_kernel" in kernels[0].name, [e.name for e in kernels]


@pytest.mark.parametrize("n", [300, 20000, 70000])
def test_float64_top_k_and_half_precision_coverage(n):
    """64-bit keys (float64 top-K: one CTA, or a cluster on sm_90 above ~23k); fp16 / bf16 coverage (their scores
    convert to float exactly, so 32-bit keys are exact)."""
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        scores = _random_scores(n, dtype, True, seed=n)
        for k in (1, n // 3):
            assert torch.equal(mk.topk_indices(scores, k).cpu(), topk_indices_ref(scores.cpu(), k)), (n, k, dtype)
        if dtype != torch.float64 and n <= 20000:
            chunks = torch.arange(n, device=DEV) * 8 // n
            order = coverage_greedy_order(scores.cpu(), chunks.cpu(), 0.3)
            got = mk.coverage_select(scores, chunks, n // 4, 0.3)
            assert torch.equal(got.cpu(), torch.tensor(sorted(order[:n // 4]))), (n, dtype)


@pytest.mark.parametrize("n", [2400, 20000])
def test_a_pdl_launch_after_the_scores_kernel_reads_its_output(n):
    """select_cta launched with programmatic stream serialization (the prepared stage's chain) right behind a kernel
    that writes its scores: the kernel waits in griddepcontrol.wait, so it picks what a plain launch picks."""
    from macer_kernels.cuda._ext import dtype_code, ext, launch_args

    for coverage in (False, True):
        g = torch.Generator(device=DEV).manual_seed(n + coverage)
        base = torch.rand(n, generator=g, device=DEV)
        chunks = torch.arange(n, device=DEV) * 8 // n
        k = n // 4
        outs = []
        for pdl in (False, True):
            scores = torch.empty_like(base)
            out = torch.full((k,), -5, dtype=torch.long, device=DEV)
            torch.mul(base, 3.0, out=scores)  # the predecessor on the stream
            device, stream = launch_args(scores)
            modality = (0, k, 0.2 if coverage else 0.0, coverage)
            ext().select_cta("pdl", scores.data_ptr(), dtype_code("pdl", "scores", scores), (0, 1), 0, 0, (0, 0),
                             chunks.data_ptr() if coverage else 0, dtype_code("pdl", "chunks", chunks), (0, 1),
                             out.data_ptr(), 0, k, 1, n, [modality], 0, 0, device, stream, pdl=pdl)
            outs.append(out.cpu())
        assert torch.equal(outs[0], outs[1]), (n, coverage)
        s = (base * 3.0).cpu()
        want = coverage_greedy_order(s, chunks.cpu(), 0.2) if coverage else None
        expected = torch.tensor(sorted(want[:k])) if coverage else topk_indices_ref(s, k)
        assert torch.equal(outs[1], expected), (n, coverage)


def _stage_on_gpu(seed, b, n, ties, stage, label_dtype=torch.uint8, chunk_dtype=torch.int64):
    from test_cuda_select_emulation import STAGES, stage_case, stage_oracle

    from macer_kernels.cuda.stage import stage_select_cuda

    scores, labels, chunk_ids, n_audio, n_video = stage_case(seed, b, n, ties)
    modalities = STAGES[stage](n_audio, n_video)
    counts = {1: n_audio, 2: n_video}
    out_len = n - sum(counts[label] - keep for label, keep, _, _ in modalities)
    got = stage_select_cuda(scores.to(DEV), labels.to(DEV, label_dtype), chunk_ids.to(DEV, chunk_dtype), modalities,
                            out_len)
    assert got.dtype == torch.long and got.shape == (b, out_len)
    if n <= 1500:
        want = stage_oracle(scores, labels, chunk_ids, modalities, out_len)
    else:
        from macer_kernels.cuda.stage import stage_select_sorts

        want = stage_select_sorts(scores, labels, chunk_ids, modalities, out_len)  # equals the oracle (CPU test)
    assert torch.equal(got.cpu(), want), f"seed={seed} b={b} n={n} ties={ties} stage={stage}"


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize(("b", "n"), [(1, 30), (3, 257), (2, 1200), (4, 2400)])
def test_stage_select_matches_the_oracle(stage, b, n):
    for ties in (False, True):
        _stage_on_gpu(1000 * stage + n + ties, b, n, ties, stage)
    _stage_on_gpu(7, b, n, True, stage, torch.int32, torch.int32)


def test_stage_select_above_the_limit_and_bad_rows():
    from test_cuda_select_emulation import stage_case

    from macer_kernels.cuda.stage import stage_select_cuda, stage_select_sorts

    n = _cta_limit(True) + 3  # above the kernel's limit: the sort chain
    _stage_on_gpu(11, 2, n, True, 0)
    scores, labels, chunk_ids, n_audio, n_video = stage_case(5, 2, 100, False)
    labels[1, labels[1] == 1] = 0
    modalities = ((1, 3, None, 1), (2, n_video, 0.2, 8))
    out_len = 100 - (n_audio - 3)
    got = stage_select_cuda(scores.to(DEV), labels.to(DEV), chunk_ids.to(DEV), modalities, out_len)
    assert torch.equal(got.cpu(), stage_select_sorts(scores, labels, chunk_ids, modalities, out_len))
    assert bool((got[1] == -1).all()) and bool((got[0] >= 0).all())


@pytest.mark.parametrize(("n", "lengths"), [(300, [211, 300, 97, 160]), (2400, [2400, 1700, 2033])])
def test_padded_stage_select_with_per_sample_budgets_matches_each_sample_alone(n, lengths):
    from test_cuda_select_emulation import _budgets, padded_case, padded_oracle

    from macer_kernels.cuda.stage import stage_select_cuda, stage_select_sorts

    for seed in (n, n + 1):
        g = torch.Generator().manual_seed(seed)
        counts = [{1: int(length * 0.3), 2: int(length * 0.4)} for length in lengths]
        scores, labels, chunk_ids = padded_case(seed, n, lengths, counts, ties=seed % 2 == 1)
        keeps = _budgets(g, counts, [1, 2])
        modalities = ((1, int(keeps[:, 0].max()), None, 0), (2, int(keeps[:, 1].max()), 0.2, 8))
        out_len = max(length - sum(c[label] - int(keeps[b, m]) for m, label in enumerate((1, 2)))
                      for b, (length, c) in enumerate(zip(lengths, counts)))
        got = stage_select_cuda(scores.to(DEV), labels.to(DEV), chunk_ids.to(DEV), modalities, out_len,
                                keeps.to(DEV))
        want = (padded_oracle if n <= 300 else stage_select_sorts)(scores, labels, chunk_ids, modalities, out_len,
                                                                   keeps)
        assert torch.equal(got.cpu(), want), f"seed={seed}"
        uniform = ((1, 20, None, 0), (2, 30, 0.2, 8))
        out_len = max(length - sum(c[label] for label in (1, 2)) + 50 for length, c in zip(lengths, counts))
        got = stage_select_cuda(scores.to(DEV), labels.to(DEV), chunk_ids.to(DEV), uniform, out_len)
        assert torch.equal(got.cpu(), stage_select_sorts(scores, labels, chunk_ids, uniform, out_len)), f"seed={seed}"


def test_stage_select_single_token_and_everything_kept():
    from macer_kernels.cuda.stage import stage_select_cuda

    scores = torch.tensor([[0.5]], device=DEV)
    labels = torch.tensor([[2]], device=DEV)
    chunks = torch.tensor([[0]], device=DEV)
    for keep, out_len in ((0, 0), (1, 1)):
        got = stage_select_cuda(scores, labels, chunks, ((2, keep, 0.1, 1),), out_len)
        assert got.tolist() == [[0] * out_len]
    text = torch.zeros(1, 5, dtype=torch.long, device=DEV)
    assert stage_select_cuda(torch.randn(1, 5, device=DEV), text, None, ((1, 0, None, 1),), 5).tolist() == [
        [0, 1, 2, 3, 4]]


@pytest.mark.parametrize(("n", "m"), [(3000, 37), (20000, 864), (12000, 11000), (40000, 30000)])
def test_stage_select_coverage_over_the_members_of_a_long_row(n, m):
    """The rank sort over the modality's m members (not the row's n), in one CTA and in clusters (n > 4096 on
    sm_90): vs the greedy references."""
    from test_cuda_select_emulation import _labelled_row, _row_oracle

    from macer_kernels.cuda.stage import stage_select_cuda

    scores, labels, chunks = _labelled_row(n + m, n, m)
    where = torch.from_numpy(labels == 2).nonzero().flatten()
    order = coverage_greedy_order(torch.from_numpy(scores)[where], torch.from_numpy(chunks)[where], 0.3)
    for k in (1, m // 4, m):
        want = _row_oracle(scores, labels, chunks, 2, k, 0.3, order if k > 250 else None)
        t = [torch.from_numpy(x)[None].to(DEV) for x in (scores, labels, chunks)]
        got = stage_select_cuda(*t, ((2, k, 0.3, None),), len(want))
        assert got.cpu()[0].tolist() == want.tolist(), f"seed={n + m} k={k}"


def test_stage_select_nan_keyed_never_picks_no_padding():
    """A NaN with every bit set (whose key was "never", like the PAD token's) is a member ranked after every number
    (the non-finite rule): it is picked before the PAD token could be, and never dropped."""
    from macer_kernels.cuda.stage import stage_select_cuda

    scores = torch.zeros(1, 2, dtype=torch.float64)
    scores.view(torch.int64)[0, 1] = -1  # float64 NaN with every bit set
    labels = torch.tensor([[-1, 0]])
    assert stage_select_cuda(scores.to(DEV), labels.to(DEV), None, ((0, 1, None, 0),), 1).tolist() == [[1]]
    labels = torch.tensor([[-1, 0, 1, 0, 0, -1, 0, 0]])
    scores = torch.tensor([[5.0, 0.5, 1.0, 0.25, 0.5, 9.0, 0.75, 0.0]])
    scores.view(torch.int32)[0, 7] = -1  # fp32 NaN with every bit set; chunk 2^29 - 1: its sort key is ~0
    chunks = torch.tensor([[0, 3, 0, 3, 1, 0, 1, 2**29 - 1]])
    got = stage_select_cuda(scores.to(DEV), labels.to(DEV), chunks.to(DEV), ((0, 5, 0.5, None),), 6)
    assert got.tolist() == [[1, 2, 3, 4, 6, 7]]


def test_stage_select_custom_op_matches_and_compiles():
    from test_cuda_select_emulation import stage_case

    from macer_kernels.cuda.stage import stage_select_cuda

    scores, labels, chunk_ids, n_audio, n_video = stage_case(21, 2, 900, False)
    scores, labels, chunk_ids = scores.to(DEV), labels.to(DEV), chunk_ids.to(DEV)
    out_len = 900 - (n_audio - 50) - (n_video - 60)
    want = stage_select_cuda(scores, labels, chunk_ids, ((1, 50, None, 0), (2, 60, 0.2, 8)), out_len)

    def stage(s, m, c):
        return torch.ops.macer_cuda.stage_select(s, m, c, [1, 2], [50, 60], [-1.0, 0.2], out_len)

    assert torch.equal(stage(scores, labels, chunk_ids), want)
    assert torch.equal(torch.compile(stage, fullgraph=True)(scores, labels, chunk_ids), want)


# --- compaction ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 37, 2400, 9001])
def test_compact_many_hidden_cos_sin_positions(n):
    g = torch.Generator(device=DEV).manual_seed(n)
    hidden = torch.randn(2, n, 3584, generator=g, device=DEV).to(torch.bfloat16)
    cos, sin = torch.randn(2, n, 128, generator=g, device=DEV), torch.randn(2, n, 128, generator=g, device=DEV)
    positions = torch.randint(0, 10**6, (3, 2, n), generator=g, device=DEV)
    odd = torch.randn(n, 7, generator=g, device=DEV).half()
    transposed = torch.randn(2, 6, n, generator=g, device=DEV).transpose(1, 2)
    view = torch.randn(2, n + 1, 9, generator=g, device=DEV)[:, 1:, 1:5]
    # Copied to contiguous memory first (its dims after N do not flatten to one stride); with k = n the next output
    # has the copy's size, so a copy freed before the launch would become that output's memory.
    tangled = torch.randn(2, n, 3, 2, generator=g, device=DEV).transpose(2, 3)
    after = torch.randn(2, n, 2, 3, generator=g, device=DEV)
    for k in sorted({0, 1, n // 2, n}):
        keep = torch.randperm(n, generator=g, device=DEV)[:k].sort().values
        tensors = [hidden, cos, sin, positions, odd, transposed, view, tangled, after]
        dims = [1, 1, -2, 2, 0, 1, 1, 1, 1]
        got = mk.compact_many(tensors, keep, dims)
        for t, d, out in zip(tensors, dims, got):
            assert torch.equal(out, t.index_select(d % t.dim(), keep))
        assert torch.equal(mk.compact(hidden, keep, 1), hidden[:, keep])


def test_compact_many_more_tensors_than_one_launch_holds():
    from macer_kernels.cuda import _ext

    tensors = [torch.randn(1, 50, i + 1, device=DEV) for i in range(2 * _ext.ext().MAX_COMPACT_TENSORS + 3)]
    keep = torch.tensor([0, 7, 49], device=DEV)
    for t, out in zip(tensors, mk.compact_many(tensors, keep, [1] * len(tensors))):
        assert torch.equal(out, t[:, keep])


@pytest.mark.parametrize("n", [1, 37, 2400])
def test_batched_compact_many_with_right_aligned_keep_rows(n):
    from test_cuda_build import _right_aligned_keep

    from macer_kernels.compact import _compact_many_torch
    from macer_kernels.cuda import _ext

    g = torch.Generator().manual_seed(n)
    b = 3
    hidden = torch.randn(b, n, 3584, generator=g).to(torch.bfloat16).to(DEV)
    cos = torch.randn(b, n, 128, generator=g).to(DEV)
    positions = torch.randint(0, 10**6, (3, b, n), generator=g).to(DEV)
    transposed = torch.randn(b, 6, n, generator=g).to(DEV).transpose(1, 2)
    strided_batch = torch.randn(2 * b, n, 5, generator=g).to(DEV)[::2]
    tensors = [hidden, cos, positions, transposed, strided_batch]
    tensors += [torch.randn(b, n, i + 1, device=DEV) for i in range(_ext.ext().MAX_COMPACT_TENSORS + 2)]
    dims = [1, 1, 2, 1, 1] + [1] * (len(tensors) - 5)
    for w in sorted({1, max(1, n // 2), n}):
        keep = _right_aligned_keep(g, b, n, w).to(DEV)
        for got, want in zip(mk.compact_many(tensors, keep, dims), _compact_many_torch(tensors, keep, dims)):
            assert got.is_contiguous() and torch.equal(got, want), (n, w)
        assert torch.equal(mk.compact(hidden, keep, 1), _compact_many_torch([hidden], keep, [1])[0])


# --- torch.library ops and torch.compile ---------------------------------------------------------------------------

def test_custom_ops_match_the_backend_and_compile():
    query, key, modality, qpos = _scores_case(1, 28, 4, 4, 128, 2400, torch.bfloat16)
    chunks = torch.arange(2400, device=DEV) // 100
    hidden = torch.randn(1, 2400, 512, device=DEV, dtype=torch.bfloat16)

    def readout(query, key, modality, qpos, chunks, hidden):
        s = torch.ops.macer_cuda.modality_scores(query, key, modality, qpos, 1 / math.sqrt(128), 1e-6)[0]
        keep = torch.ops.macer_cuda.coverage_select(s, chunks, 600, 0.1)
        return s, keep, torch.ops.macer_cuda.compact(hidden, keep, 1)

    s, keep, out = readout(query, key, modality, qpos, chunks, hidden)
    assert torch.equal(s[None], mk.modality_scores(query, key, modality, qpos))
    assert torch.equal(keep, mk.coverage_select(s, chunks, 600, 0.1))
    assert torch.equal(out, hidden[:, keep])
    compiled = torch.compile(readout, fullgraph=True)
    for a, b in zip(compiled(query, key, modality, qpos, chunks, hidden), (s, keep, out)):
        assert torch.equal(a, b)


def test_ops_on_another_gpu_leave_the_current_device_alone():
    """Guards issue 23 item 4: every launcher made its tensors' device current in the extension's CUDA runtime and
    left it so; the thread's driver context is shared with torch, whose later work then went to that GPU. Each op on
    cuda:0 tensors with cuda:1 current must leave cuda:1 current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    query, key, modality, qpos = _scores_case(1, 4, 2, 2, 64, 300, torch.float32)
    scores = torch.rand(300, device=DEV)
    chunks = torch.randint(0, 5, (300,), device=DEV)
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        for name, run in [("modality_scores", lambda: mk.modality_scores(query, key, modality, qpos)),
                          ("topk_indices", lambda: mk.topk_indices(scores, 20)),
                          ("coverage_select", lambda: mk.coverage_select(scores, chunks, 20, coverage_weight=0.5)),
                          ("compact", lambda: mk.compact(key, torch.arange(0, 300, 7, device=DEV), dim=2))]:
            run()
            assert torch.cuda.current_device() == 1, name
            assert torch.empty(1, device="cuda").device.index == 1, name
    finally:
        torch.cuda.set_device(previous)
