"""The radix selection kernel (csrc/kernels/select_cta.cuh) replayed step by step in numpy on CPU
(tests/helpers/select_replay.py) and compared with the float64 references; plus the multi-CTA stage path (batched torch
sorts), which runs on CPU as is.

No GPU is needed: the replay follows the kernel's row split over a cluster's CTAs, its token codes and chunk bytes,
the rank sort's stable counting passes (warp segments, the places from the scan over (digit, CTA, warp), skipped
digits, the rank pass) and the direct count for chunk ids outside a byte, the float64 bonus table, the radix select's
passes over the 96-bit composite (histograms summed over the cluster, the bin search, the candidate bitmap, the small
list ranked pairwise, the tie scan across CTAs), the non-finite flags and the row assembly at its output stride. Its
constants are read from the headers; where ``_C`` is built, its launch plan, limits, constants and keys are checked
against the module's host code (``test_replay_matches_the_built_module``). What it cannot show is that the CUDA code
matches it (races, barriers, the device's float conversions, distributed shared memory):
tests/kernels/test_cuda_kernels.py
and tests/kernels/test_nonfinite_select.py do that on a GPU (docs/cuda.md lists the rest).
"""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import numpy as np
import pytest
import select_replay as R
import torch
from select_replay import NAN_KEY32, NAN_KEY64, descending_key32, descending_key64

from macer_kernels.cuda.stage import stage_select_sorts
from macer_kernels.reference import coverage_select_ref, topk_indices_ref
from macer_kernels.select import _coverage_select_torch, _topk_indices_torch


def _cuda_module_built() -> bool:
    return importlib.util.find_spec("macer_kernels._C") is not None


STATIC_SMEM_BYTES = 19920  # sizeof(cta::Shared) on the host: checked against _C where built
# The kernels' static shared memory as ptxas reports it (benchmarks/results/select_resources.json, checked by
# tests/kernels/test_select_resources.py): what the launcher subtracts from the opt-in maximum on each architecture.
SM90_AVAIL = R.OPTIN_BYTES[90] - R.STATIC_SMEM[90]
SM89_AVAIL = R.OPTIN_BYTES[89] - R.STATIC_SMEM[89]
# The limits these give (checked against _C where built; docs/cuda.md's table): one CTA / a cluster of 8 on sm_90.
SM90_SINGLE_TOPK = R.max_n(False, False, SM90_AVAIL, 1)
SM90_SINGLE_COVERAGE = R.max_n(True, False, SM90_AVAIL, 1)


def select_row(scores, labels, chunks, modalities, out_len, keeps=None, trace=None, seed=0, cluster=1):
    """The kernel's row (replay_row) for one row; labels None = every token a candidate of the single modality.
    ``keeps``: the row's budgets (its row of the [B, M] table), None = each modality's spec keep; ``cluster``: the
    CTAs the row is split over. ``seed`` is unused (kept for the callers written for the previous kernel)."""
    del seed
    out, _ = R.replay_row(scores, labels, chunks, modalities, out_len, keeps, cluster, trace)
    return out


def select_cta(scores, labels, chunks, modalities, out_len, out_stride, keeps=None, flags=False, cluster=1):
    """The kernel's launch over B rows (replay_launch): returns (out, nonfinite)."""
    return R.replay_launch(scores, labels, chunks, modalities, out_len, out_stride, keeps, cluster, flags)


def _scores(rng, n, ties, dtype=np.float32):
    if ties:
        return (rng.integers(0, 7, n) / 4).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


CLUSTERS = [1, 2, 3, 8]


@pytest.mark.parametrize("n", [1, 2, 31, 100, 864, 1025, 3001])
@pytest.mark.parametrize("ties", [False, True])
def test_emulated_topk_matches_reference(n, ties, seed):
    rng = np.random.default_rng(seed)
    for dtype in (np.float32, np.float64, np.float16):
        scores = _scores(rng, n, ties, dtype)
        if n > 5:
            scores[:3] = np.array([0.0, -0.0, -np.inf], dtype=dtype)
        for cluster in [c for c in CLUSTERS if c <= n]:
            for k in sorted({1, n // 3, n - 1, n} - {0}):
                got = select_row(scores, None, None, [(0, k, None)], k, cluster=cluster)
                want = topk_indices_ref(torch.from_numpy(scores.astype(np.float64)), k).numpy()
                assert np.array_equal(got, want), f"seed={seed} dtype={dtype} k={k} cluster={cluster}"


@pytest.mark.parametrize("n", [1, 2, 33, 300, 864, 2049])
@pytest.mark.parametrize("weight", [0.0, 0.05, 1.0, 3e32])
def test_emulated_coverage_matches_reference(n, weight, seed):
    rng = np.random.default_rng(seed)
    for ties in (False, True):
        scores = _scores(rng, n, ties)
        chunks = rng.integers(0, max(1, min(24, n)), n)
        s, c = torch.from_numpy(scores), torch.from_numpy(chunks)
        for cluster in [c for c in CLUSTERS if c <= n]:
            for k in sorted({1, n // 4, n} - {0}):
                got = select_row(scores, None, chunks, [(0, k, weight)], k, cluster=cluster)
                want = coverage_select_ref(s, c, k, weight) if n <= 300 else _coverage_select_torch(s, c, k, weight)
                assert np.array_equal(got, want.numpy()), f"seed={seed} ties={ties} k={k} cluster={cluster}"


def test_emulated_coverage_large_chunk_ids_take_the_direct_count(seed):
    rng = np.random.default_rng(seed)
    scores = _scores(rng, 200, True)
    for chunks in (rng.integers(0, 3, 200) * (2**40), rng.integers(-2, 300, 200)):  # outside [0, 254]
        for k in (1, 50, 199):
            for cluster in (1, 3):
                trace = {}
                got = select_row(scores, None, chunks, [(0, k, 0.3)], k, trace=trace, cluster=cluster)
                want = coverage_select_ref(torch.from_numpy(scores), torch.from_numpy(chunks), k, 0.3)
                assert np.array_equal(got, want.numpy()), f"seed={seed} k={k}"
                assert trace[0]["ranks"] == "direct"


def test_emulated_radix_select_splits_a_tie_group_by_score():
    # Equal float64 values with different scores (1 + 1e-20 == 1 + 0): the tie rule takes the higher score first,
    # then the lower index -- here token 2 before tokens 0 and 3, though its index is higher. The composite's low 32
    # bits (the score key) decide it.
    scores = np.array([0.0, -5.0, 1e-20, 0.0], dtype=np.float32)
    chunks = np.array([0, 1, 2, 3])
    for k in range(1, 5):
        got = select_row(scores, None, chunks, [(0, k, 1.0)], k)
        want = coverage_select_ref(torch.from_numpy(scores), torch.from_numpy(chunks), k, 1.0)
        assert np.array_equal(got, want.numpy()), k
    assert np.array_equal(select_row(scores, None, chunks, [(0, 1, 1.0)], 1), [2])


@pytest.mark.parametrize("weight", [0.0, 0.2, 3.0])
def test_emulated_coverage_equals_the_literal_loop_of_the_tie_rule(weight, seed):
    """tests/kernels/test_coverage_tie_rule.py's cases through the replay: coarse scores (many exact ties),
    infinities, chunks
    of uneven sizes, against its literal Python loop over the key (value, score, -index); and the absorbed score
    differences (s + sqrt(0.2) equal for all four scores: the higher score wins, not the first index)."""
    from test_coverage_tie_rule import _literal_greedy

    g = torch.Generator().manual_seed(seed)
    n = 60
    scores = torch.randint(-3, 4, (n,), generator=g).to(torch.float32) / 4
    scores[torch.randint(0, n, (3,), generator=g)] = float("-inf")
    scores[torch.randint(0, n, (2,), generator=g)] = float("inf")
    chunks = torch.randint(0, 5, (n,), generator=g) * 7
    for cluster in (1, 3):
        for k in (1, 17, n - 1):
            want = _literal_greedy(scores.tolist(), chunks.tolist(), k, weight)
            got = select_row(scores.numpy(), None, chunks.numpy(), [(0, k, weight)], k, cluster=cluster)
            assert got.tolist() == want, (seed, k, cluster)
    absorbed = np.array([1e-30, 1e-20, 3e-25, 0.0], dtype=np.float32)
    for chunk_ids in ([0, 1, 2, 3], [5, 5, 5, 5]):
        for k in (1, 3):
            want = _literal_greedy(absorbed.tolist(), chunk_ids, k, 0.2)
            assert select_row(absorbed, None, np.array(chunk_ids), [(0, k, 0.2)], k).tolist() == want
    assert select_row(absorbed, None, np.array([5, 5, 5, 5]), [(0, 1, 0.2)], 1).tolist() == [1]


# --- the rank sort: stable counting passes over (digit, CTA, warp) ---------------------------------------------------

@pytest.mark.parametrize("cluster", [1, 2, 5, 8])
def test_counting_pass_is_a_stable_sort_and_a_rank(cluster, seed):
    """One pass of the kernel's counting sort over sequences split across CTAs (uneven, some empty, some shorter
    than a warp, lengths not multiples of 32): the places form the stable sort by digit, placed evenly over the CTAs;
    the rank pass counts the earlier items of each digit. (counting_pass asserts both against numpy itself; this
    feeds it the awkward shapes and few / many distinct digits.)"""
    rng = np.random.default_rng(seed)
    for lengths in ([5] * cluster, [0] * (cluster - 1) + [77], list(rng.integers(0, 1500, cluster)),
                    [31, 33, 1024, 1025, 0, 1, 32, 2][:cluster]):
        m = int(sum(lengths))
        if m == 0:
            continue
        items = rng.permutation(4 * m)[:m]
        seqs = np.split(items, np.cumsum(lengths)[:-1])
        for spread in (1, 3, 256):
            digit = rng.integers(0, spread, 4 * m)
            out, _ = R.counting_pass(seqs, lambda t, d=digit: d[t], False, m)
            per = -(-m // cluster)
            assert [len(o) for o in out] == [max(0, min(per, m - r * per)) for r in range(cluster)]
            flat = np.concatenate(out)
            assert np.array_equal(flat, items[np.argsort(digit[items], kind="stable")]), f"seed={seed}"
            _, ranks = R.counting_pass(seqs, lambda t, d=digit: d[t], True, m)
            for dig in np.unique(digit[items]):
                same = items[digit[items] == dig]
                assert [ranks[int(t)] for t in same] == list(range(len(same))), f"seed={seed}"


def test_rank_sort_skips_the_digits_every_member_shares(seed):
    """A sort digit equal over every member (here the top byte: positive scores of one exponent range) moves
    nothing: the kernel skips it (row OR ^ AND). The ranks equal the reference's with and without the skip."""
    rng = np.random.default_rng(seed)
    scores = (1 + rng.random(3000)).astype(np.float32)  # [1, 2): sign and exponent bits shared
    chunks = rng.integers(0, 8, 3000)
    trace = {}
    got = select_row(scores, None, chunks, [(0, 700, 0.2)], 700, trace=trace)
    assert trace[0]["sort_passes"] == [0, 1, 2]  # byte 3 (sign + 7 exponent bits) is the same for all
    want = _coverage_select_torch(torch.from_numpy(scores), torch.from_numpy(chunks), 700, 0.2)
    assert np.array_equal(got, want.numpy()), f"seed={seed}"
    same = np.full(300, 0.5, dtype=np.float32)  # every byte shared: no score pass, the rank pass alone
    trace = {}
    got = select_row(same, None, chunks[:300], [(0, 40, 0.2)], 40, trace=trace)
    assert trace[0]["sort_passes"] == []
    assert np.array_equal(got, coverage_select_ref(torch.from_numpy(same), torch.from_numpy(chunks[:300]), 40,
                                                   0.2).numpy())


# --- the radix select: pass geometry, the four ends of a pass, the tie rule -------------------------------------------

def test_select_pass_geometry_covers_the_composite_once():
    for bits, passes in ((32, 3), (64, 6), (96, 9)):
        covered = []
        for p in range(passes):
            low, width = R.pass_low(p, bits), R.pass_width(p, bits)
            assert 1 <= width <= R.SELECT_BITS
            covered += range(low, low + width)
        assert sorted(covered) == list(range(R.COMPOSITE_BITS - bits, R.COMPOSITE_BITS)), bits
        assert -(-bits // R.SELECT_BITS) == passes
    # digit_of reads the 96-bit number hi * 2^32 + lo, including the digits that straddle the two words
    rng = np.random.default_rng(5)
    hi = rng.integers(0, 2**64, 200, dtype=np.uint64)
    lo = rng.integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)
    for p in range(9):
        low, width = R.pass_low(p, 96), R.pass_width(p, 96)
        want = [((int(h) << 32 | int(v)) >> low) & ((1 << width) - 1) for h, v in zip(hi, lo, strict=True)]
        assert R.digit_of(hi, lo, p, 96).tolist() == want, p


def test_find_bin_is_the_bin_of_the_need_th_candidate(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        hist = rng.integers(0, 4, R.SELECT_BINS) * (rng.random(R.SELECT_BINS) < 0.05)
        total = int(hist.sum())
        if total == 0:
            continue
        for need in {1, total, int(rng.integers(1, total + 1))}:
            b, below, cnt = R.find_bin(hist, need)
            cum = np.cumsum(hist)
            assert b == int(np.searchsorted(cum, need)) and below == cum[b] - hist[b] and cnt == hist[b] > 0
            assert below < need <= below + cnt


@pytest.mark.parametrize("cluster", [1, 4])
def test_every_way_a_select_ends_is_exercised_and_exact(cluster, seed):
    """The four ends of a pass, each reached by its own data: the bin is exactly what is still needed (all), a small
    bin ranked pairwise (small), the last pass's tie group taken in index order across the CTAs (tie), and passes
    that continue (next). Against the reference each time."""
    rng = np.random.default_rng(seed)
    n = 5000
    cases = {
        "tie": (np.full(n, 0.25, dtype=np.float32), 1234),  # one value: every pass keeps the whole group
        "few values": (rng.choice(np.array([0.5, -1.0, 3.0], dtype=np.float32), n), 2000),
        # 200 exponents x 25 mantissas: pass 0's bins hold 9 or 16 tokens, so the need-th is in a small bin
        "spread": ((2.0 ** (np.arange(n) % 200 - 100) * (1 + np.arange(n) // 200 / 64)).astype(np.float32), 1253),
        "distinct": (rng.standard_normal(n).astype(np.float32), 1250),
        "one below": (np.arange(n, dtype=np.float32), n - 1),
    }
    ends = set()
    for name, (scores, k) in cases.items():
        trace = {}
        got = select_row(scores, None, None, [(0, k, None)], k, trace=trace, cluster=cluster)
        assert np.array_equal(got, topk_indices_ref(torch.from_numpy(scores), k).numpy()), f"{name} seed={seed}"
        kinds = [kind for *_, kind in trace[0]["passes"]]
        assert all(kind == R.NEXT for kind in kinds[:-1]) and kinds[-1] != R.NEXT, name
        ends.add(kinds[-1])
        if name == "tie":
            assert kinds == [R.NEXT, R.NEXT, R.TIE]
    assert ends == {R.TIE, R.ALL, R.SMALL_SET}


def test_coverage_ties_in_value_and_score_go_to_the_lower_index(seed):
    """Equal scores in one chunk get different ranks, so different values; equal scores in different chunks at the
    same rank share the whole composite (value, score): those ties go to the lower index, across the cluster's CTAs
    (the tie scan) and inside a small bin (pairwise)."""
    rng = np.random.default_rng(seed)
    n = 4000
    scores = np.full(n, 0.125, dtype=np.float32)
    chunks = rng.integers(0, 40, n)
    for cluster in (1, 3, 8):
        for k in (1, 39, 40, 41, 1000):
            got = select_row(scores, None, chunks, [(0, k, 0.7)], k, cluster=cluster)
            want = _coverage_select_torch(torch.from_numpy(scores), torch.from_numpy(chunks), k, 0.7)
            assert np.array_equal(got, want.numpy()), f"seed={seed} cluster={cluster} k={k}"


def test_bonus_table_and_direct_bonus_are_ieee_numbers():
    """The kernel takes sqrt(lambda_c / (1 + t)) from a float64 table below its entries and computes it above, with
    the same IEEE operations (__ddiv_rn, __dsqrt_rn) either way: the replay's numbers must be those, i.e. Python's
    (IEEE double, one rounding per operation), bit for bit for every rank a 16-bit rank slot holds. (Not torch's on
    CPU: torch 2.13's float64 sqrt there is not correctly rounded -- sqrt(2.0) gives 1.414213562373095 -- and a
    Python float divided by a tensor is not an IEEE division; the CUDA kernels and torch on a GPU are IEEE.)"""
    t = np.arange(2**16)
    for weight in (0.0, 1e-300, 0.2, 1.0, 7.3, 3e32):
        got = R.bonus(weight, t)
        want = np.array([R.bonus_reference(weight, int(i)) for i in t])
        assert np.array_equal(got.view(np.uint64), want.view(np.uint64)), weight


def test_table_misses_take_the_direct_bonus(seed):
    """A chunk longer than the table (2048 entries): its members' ranks run past it and use the direct bonus."""
    rng = np.random.default_rng(seed)
    n = 6000
    scores = rng.standard_normal(n).astype(np.float32)
    chunks = np.where(np.arange(n) < 5000, 0, 1)  # one chunk of 5000 members
    trace = {}
    got = select_row(scores, None, chunks, [(0, 1500, 0.4)], 1500, trace=trace)
    assert trace[0]["table_misses"] == 5000 - R.MAX_TABLE
    want = _coverage_select_torch(torch.from_numpy(scores), torch.from_numpy(chunks), 1500, 0.4)
    assert np.array_equal(got, want.numpy()), f"seed={seed}"


# --- the launch plan: one CTA up to its shared memory, a cluster above (sm_90) ----------------------------------------

def test_launch_plan_and_limits():
    """The recorded limits (docs/cuda.md): per architecture and path, the largest n and the cluster sizes chosen.
    The plan's feasible n are 1..max_n (max_n relies on it), checked on a grid."""
    assert (SM90_SINGLE_TOPK, SM90_SINGLE_COVERAGE) == (40476, 19132)
    assert R.max_n(False, True, SM90_AVAIL, 1) == 22974  # float64 top-K: 64-bit keys
    assert R.max_n(False, False, SM90_AVAIL, 8) == 323808 and R.max_n(True, False, SM90_AVAIL, 8) == 64688
    assert R.max_n(False, True, SM90_AVAIL, 8) == 183792
    assert (R.max_n(False, False, SM89_AVAIL, 1), R.max_n(True, False, SM89_AVAIL, 1)) == (15508, 6344)
    assert R.max_n(False, True, SM89_AVAIL, 1) == 8804
    # the paper's shapes on sm_90: one CTA for a 2.4k stage; clusters of 3 (top-K) and 8 (coverage) for 20k rows
    assert R.cluster_for(2400, True) == 1 and R.cluster_for(2400, False) == 1
    assert R.cluster_for(20000, False) == 3 and R.cluster_for(20000, True) == 8 and R.cluster_for(100000, False) == 8
    assert R.cluster_for(4096, True) == 1 and R.cluster_for(4097, True) == 2
    assert R.cluster_for(8192, False) == 1 and R.cluster_for(8193, False) == 2
    assert R.cluster_for(15000, False, arch=89) == 1 and R.cluster_for(6000, True, arch=89) == 1  # no clusters
    assert R.plan(20000, True, False, SM90_AVAIL, 8)[:3] == (8, 2500, R.LAYOUT_COVERAGE_CLUSTER)
    for coverage, wide in ((False, False), (True, False), (False, True)):
        for avail, clusters in ((SM90_AVAIL, 8), (SM90_AVAIL, 1), (SM89_AVAIL, 1), (4096, 1), (4096, 8)):
            top = R.max_n(coverage, wide, avail, clusters)
            grid = sorted({1, 2, 63, 64, 65, 4095, 4096, 4097, top - 1, top, top + 1, top * 2} | set(
                np.linspace(1, 2 * top + 2, 60).astype(int).tolist()))
            for n in [n for n in grid if n >= 1]:
                c, cap, kind, _table, nbytes = R.plan(n, coverage, wide, avail, clusters)
                assert (c > 0) == (n <= top), (coverage, wide, avail, clusters, n)
                if c:
                    assert cap == -(-n // c) and nbytes <= avail and c <= clusters
                    assert kind == (R.LAYOUT_TOPK if not coverage else R.LAYOUT_COVERAGE_SINGLE if c == 1
                                    else R.LAYOUT_COVERAGE_CLUSTER)


@pytest.mark.parametrize("arch", [89, 90])
@pytest.mark.parametrize("coverage", [False, True])
def test_rows_on_both_sides_of_the_one_cta_limit(coverage, arch, seed):
    """n at the largest one-CTA row and one above, and at the single-CTA thresholds of sm_90's plan
    (kSingleTopKMax / kSingleCoverageMax) and one above: on sm_90 rows above the threshold take a cluster, on sm_89
    (no clusters) the row above the one-CTA limit does not fit (the callers take the multi-CTA chain). The replay of
    each row that fits, with the cluster the launcher picks, gives the references' picks."""
    from greedy_oracle import coverage_greedy_order

    avail = R.OPTIN_BYTES[arch] - R.STATIC_SMEM[arch]
    limit = R.max_n(coverage, False, avail, 1)
    threshold = R.SINGLE_COVERAGE_MAX if coverage else R.SINGLE_TOPK_MAX
    edges = [limit, limit + 1, threshold, threshold + 1]
    rng = np.random.default_rng(seed)
    for n in edges:
        c = R.plan(n, coverage, False, avail, R.MAX_CLUSTER if arch >= 90 else 1)[0]
        if arch < 90:
            assert (c == 1) == (n <= limit), n
        else:
            assert (c == 1) == (n <= threshold) and c >= 1, n
        if c == 0:
            continue
        scores = _scores(rng, n, ties=n % 2 == 0)
        if coverage:
            chunks = rng.integers(0, 8, n)
            order = coverage_greedy_order(torch.from_numpy(scores), torch.from_numpy(chunks), 0.2)
            for k in (1, n // 4):
                got = select_row(scores, None, chunks, [(0, k, 0.2)], k, cluster=c)
                assert np.array_equal(got, np.sort(order[:k])), f"seed={seed} n={n} k={k}"
        else:
            for k in (1, n // 4, n - 1):
                got = select_row(scores, None, None, [(0, k, None)], k, cluster=c)
                assert np.array_equal(got, _topk_indices_torch(torch.from_numpy(scores), k).numpy()), \
                    f"seed={seed} n={n} k={k}"


# --- stage_select: the emulated kernel and the torch multi-CTA path against a literal oracle ------------------------



# --- stage_select: the emulated kernel and the torch multi-CTA path against a literal oracle ------------------------

def stage_oracle(scores, labels, chunk_ids, modalities, out_len):
    """Per sample and modality, the float64 references on the modality's tokens; other labels are kept."""
    rows = []
    for b in range(scores.shape[0]):
        keep = torch.ones(scores.shape[1], dtype=torch.bool)
        for label, k, weight, _ in modalities:
            idx = torch.nonzero(labels[b] == label).flatten()
            keep[idx] = False
            if weight is None:
                picks = topk_indices_ref(scores[b, idx], k)
            else:
                picks = coverage_select_ref(scores[b, idx], chunk_ids[b, idx], k, weight)
            keep[idx[picks]] = True
        rows.append(torch.nonzero(keep).flatten())
    assert all(len(r) == out_len for r in rows)
    return torch.stack(rows)


def stage_case(seed, b, n, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:
        scores = torch.randint(0, 5, (b, n), generator=g).float() / 4
    else:
        scores = torch.randn(b, n, generator=g)
    # The same counts per sample (the contract): a fixed label multiset, shuffled per row.
    base = torch.tensor([0] * (n // 10) + [1] * (n // 3) + [2] * (n - n // 10 - n // 3))
    labels = torch.stack([base[torch.randperm(n, generator=g)] for _ in range(b)]).to(torch.uint8)
    chunk_ids = torch.randint(0, 8, (b, n), generator=g)
    n_audio, n_video = n // 3, n - n // 10 - n // 3
    return scores, labels, chunk_ids, n_audio, n_video


STAGES = [
    lambda a, v: ((1, a // 4, None, 0), (2, v // 4, 0.2, 8)),  # the paper's stage: audio top-K, video coverage
    lambda a, v: ((2, v, 0.0, 8),),  # k = n for one modality, coverage weight 0
    lambda a, v: ((1, 0, None, 0), (2, 1, 3.0, None)),  # k = 0 and k = 1
    lambda a, v: ((2, v // 2, None, 1), (1, a, 0.5, 8)),
]


@pytest.mark.parametrize("stage", range(len(STAGES)))
@pytest.mark.parametrize(("b", "n"), [(1, 30), (3, 257), (2, 1200)])
def test_stage_select_emulated_kernel_and_torch_path_match_the_oracle(stage, b, n):
    for ties in (False, True):
        seed = 1000 * stage + n + ties
        scores, labels, chunk_ids, n_audio, n_video = stage_case(seed, b, n, ties)
        modalities = STAGES[stage](n_audio, n_video)
        counts = {1: n_audio, 2: n_video}
        out_len = n - sum(counts[label] - keep for label, keep, _, _ in modalities)
        want = stage_oracle(scores, labels, chunk_ids, modalities, out_len)
        sorts = stage_select_sorts(scores, labels, chunk_ids, modalities, out_len)
        assert torch.equal(sorts, want), f"seed={seed}"
        mods = [(label, keep, weight) for label, keep, weight, _ in modalities]
        for row in range(b):
            for cluster in (1, 3):
                got = select_row(scores[row].numpy(), labels[row].numpy(), chunk_ids[row].numpy(), mods, out_len,
                                 cluster=cluster)
                assert np.array_equal(got, want[row].numpy()), f"seed={seed} row={row} cluster={cluster}"


def test_stage_select_ignores_chunk_ids_of_other_tokens():
    scores, labels, chunk_ids, n_audio, n_video = stage_case(17, 2, 300, True)
    modalities = ((1, n_audio // 2, None, 0), (2, n_video // 3, 0.3, 8))
    out_len = 300 - (n_audio - n_audio // 2) - (n_video - n_video // 3)
    want = stage_oracle(scores, labels, chunk_ids, modalities, out_len)
    garbage = torch.where(labels == 2, chunk_ids, torch.where(labels == 1, -5, 2**40))
    assert torch.equal(stage_select_sorts(scores, labels, garbage, modalities, out_len), want), "seed=17"
    for row in range(2):
        got = select_row(scores[row].numpy(), labels[row].numpy(), garbage[row].numpy(),
                         [(1, n_audio // 2, None), (2, n_video // 3, 0.3)], out_len)
        assert np.array_equal(got, want[row].numpy()), f"seed=17 row={row}"


def test_stage_select_rows_contradicting_the_counts_are_minus_one():
    scores, labels, chunk_ids, n_audio, n_video = stage_case(5, 2, 100, False)
    labels[1, labels[1] == 1] = 0  # row 1 has no audio token: keep 3 cannot be met
    modalities = ((1, 3, None, 1), (2, n_video, 0.2, 8))
    out_len = 100 - (n_audio - 3)
    got = stage_select_sorts(scores, labels, chunk_ids, modalities, out_len)
    assert torch.equal(got[1], torch.full((out_len,), -1))
    assert torch.equal(got[0], stage_oracle(scores[:1], labels[:1], chunk_ids[:1], modalities, out_len)[0])
    row = select_row(scores[1].numpy(), labels[1].numpy(), chunk_ids[1].numpy(),
                     [(1, 3, None), (2, n_video, 0.2)], out_len)
    assert np.array_equal(row, np.full(out_len, -1))
    # a total other than out_len: every row is flagged
    assert torch.equal(stage_select_sorts(scores, labels, chunk_ids, modalities, out_len - 1),
                       torch.full((2, out_len - 1), -1))


def test_stage_select_sorts_matches_torch_paths_at_larger_sizes():
    scores, labels, chunk_ids, n_audio, n_video = stage_case(9, 2, 6000, True)
    modalities = ((1, n_audio // 3, None, 1), (2, n_video // 5, 0.1, 8))
    out_len = 6000 - (n_audio - n_audio // 3) - (n_video - n_video // 5)
    got = stage_select_sorts(scores.double(), labels.long(), chunk_ids.int(), modalities, out_len)
    for b in range(2):
        keep = torch.ones(6000, dtype=torch.bool)
        a_idx, v_idx = torch.nonzero(labels[b] == 1).flatten(), torch.nonzero(labels[b] == 2).flatten()
        keep[a_idx] = False
        keep[v_idx] = False
        keep[a_idx[_topk_indices_torch(scores[b, a_idx], n_audio // 3)]] = True
        keep[v_idx[_coverage_select_torch(scores[b, v_idx], chunk_ids[b, v_idx], n_video // 5, 0.1)]] = True
        assert torch.equal(got[b], torch.nonzero(keep).flatten()), "seed=9"
    assert math.isfinite(float(got.float().sum()))


# --- stage_select on a padded batch: per-sample budgets, PAD_LABEL (-1) tokens, right-aligned rows ------------------

PAD = -1


def padded_case(seed, n, lengths, counts, ties=False, scattered_pad_row=None):
    """Sample b: ``n - lengths[b]`` PAD tokens on the left (or, for ``scattered_pad_row``, at random places), then
    ``counts[b][label]`` tokens of each label at random places among its real tokens, label 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    scores = (torch.randint(0, 5, (b, n), generator=g).float() / 4) if ties else torch.randn(b, n, generator=g)
    labels = torch.full((b, n), PAD, dtype=torch.long)
    for i, length in enumerate(lengths):
        body = torch.cat([torch.full((c,), label) for label, c in counts[i].items()] +
                         [torch.zeros(length - sum(counts[i].values()), dtype=torch.long)])
        body = body[torch.randperm(length, generator=g)]
        if i == scattered_pad_row:
            where = torch.sort(torch.randperm(n, generator=g)[:length]).values
            labels[i, where] = body
        else:
            labels[i, n - length:] = body
    chunk_ids = torch.randint(0, 8, (b, n), generator=g)
    return scores, labels, chunk_ids


def padded_oracle(scores, labels, chunk_ids, modalities, out_len, keeps):
    """Per sample: reference.stage_select_ref on its non-PAD tokens with its own budgets, mapped back to positions of
    the padded row and right-aligned after -1s (all -1 where the sample cannot meet its budgets or out_len)."""
    from types import SimpleNamespace

    from macer_kernels.reference import stage_select_ref

    rows = []
    for b in range(scores.shape[0]):
        real = torch.nonzero(labels[b] != PAD).flatten()
        row_keeps = [keep if keeps is None else int(keeps[b, m]) for m, (_, keep, _, _) in enumerate(modalities)]
        counts = [int((labels[b] == label).sum()) for label, _, _, _ in modalities]
        out = torch.full((out_len,), -1, dtype=torch.long)
        spec_ok = all(0 <= k <= spec[1] for k, spec in zip(row_keeps, modalities))
        if spec_ok and all(c >= k for c, k in zip(counts, row_keeps)):
            mods = [SimpleNamespace(label=label, keep=k, coverage_weight=weight)
                    for (label, _, weight, _), k in zip(modalities, row_keeps)]
            kept = real[stage_select_ref(scores[b:b + 1, real], labels[b:b + 1, real], mods,
                                         chunk_ids[b:b + 1, real])[0]]
            if len(kept) <= out_len:
                out[out_len - len(kept):] = kept
        rows.append(out)
    return torch.stack(rows)


def _check_stage(scores, labels, chunk_ids, modalities, out_len, keeps, what):
    want = padded_oracle(scores, labels, chunk_ids, modalities, out_len, keeps)
    for dtype in (scores.dtype, torch.float64):
        got = stage_select_sorts(scores.to(dtype), labels, chunk_ids, modalities, out_len, keeps)
        assert torch.equal(got, want), f"{what} (torch sorts, {dtype})"
    mods = [(label, keep, weight) for label, keep, weight, _ in modalities]
    for b in range(scores.shape[0]):
        for cluster in (1, 2):
            got = select_row(scores[b].numpy(), labels[b].numpy(), chunk_ids[b].numpy(), mods, out_len,
                             None if keeps is None else keeps[b].numpy(), cluster=cluster)
            assert np.array_equal(got, want[b].numpy()), f"{what} (emulated kernel) row={b} cluster={cluster}"
    return want


def _budgets(g, counts, labels_of):
    """Random per-sample budgets in [0, count], with a 0 and a full count among them."""
    keeps = torch.tensor([[int(torch.randint(0, c[label] + 1, (1,), generator=g)) for label in labels_of]
                          for c in counts], dtype=torch.int32)
    keeps[0, 0] = 0
    keeps[-1, -1] = counts[-1][labels_of[-1]]
    return keeps


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("n", "lengths"), [(40, [40, 23, 31]), (300, [211, 300, 97, 160]), (1500, [1500, 1100])])
def test_padded_stage_with_per_sample_budgets_is_each_sample_alone(n, lengths, ties, seed):
    g = torch.Generator().manual_seed(seed)
    counts = [{1: int(length * 0.3), 2: int(length * 0.4), 3: int(length * 0.1)} for length in lengths]
    counts[-1][3] = 0  # a sample without one modality
    scores, labels, chunk_ids = padded_case(seed, n, lengths, counts, ties, scattered_pad_row=1)
    keeps = _budgets(g, counts, [1, 2, 3])
    spec = [int(keeps[:, m].max()) for m in range(3)]
    modalities = ((1, spec[0], None, 0), (2, spec[1], 0.2, 8), (3, spec[2], 1.0, None))
    lens = [length - sum(c[label] - int(keeps[b, m]) for m, label in enumerate((1, 2, 3)))
            for b, (length, c) in enumerate(zip(lengths, counts))]
    out_len = max(lens)
    want = _check_stage(scores, labels, chunk_ids, modalities, out_len, keeps, f"seed={seed}")
    assert [int((row >= 0).sum()) for row in want] == lens, f"seed={seed}"  # no row was flagged
    assert all(labels[b, want[b][want[b] >= 0]].ge(0).all() for b in range(len(lengths))), "padding kept"


def test_padded_stage_with_uniform_budgets_right_aligns_shorter_rows(seed):
    lengths = [120, 77, 101]
    counts = [{1: 30, 2: 40}, {1: 20, 2: 30}, {1: 25, 2: 50}]
    scores, labels, chunk_ids = padded_case(seed, 120, lengths, counts)
    modalities = ((1, 10, None, 0), (2, 20, 0.3, 8))
    out_len = 120 - 20 - 20
    want = _check_stage(scores, labels, chunk_ids, modalities, out_len, None, f"seed={seed}")
    assert [int((row < 0).sum()) for row in want] == [0, 23, 24], f"seed={seed}"


def test_rows_contradicting_their_budgets_are_minus_one_and_others_are_not(seed):
    lengths = [60, 60, 50, 60, 45]
    counts = [{1: 10, 2: 20}] * 5
    scores, labels, chunk_ids = padded_case(seed, 60, lengths, counts)
    modalities = ((1, 6, None, 0), (2, 9, 0.5, 8))
    keeps = torch.tensor([[6, 9], [11, 3], [-1, 2], [7, 9], [0, 1]], dtype=torch.int32)
    # row 1: more than its 10 tokens of label 1; row 2: a negative budget; row 3: above the spec's keep 6
    out_len = 60 - 4 - 11  # row 0's length; row 4 (45 - 10 - 19 = 16 kept) is right-aligned
    want = _check_stage(scores, labels, chunk_ids, modalities, out_len, keeps, f"seed={seed}")
    assert [bool((row == -1).all()) for row in want] == [False, True, True, True, False], f"seed={seed}"
    # an out_len below a row's length flags exactly that row (row 0 keeps 45, row 4 keeps 16)
    want = _check_stage(scores, labels, chunk_ids, modalities, 44, keeps, f"seed={seed}")
    assert [bool((row == -1).all()) for row in want] == [True, True, True, True, False], f"seed={seed}"


# --- rows of several labels for the coverage cases below -------------------------------------------------------------

def _labelled_row(seed, n, m):
    """A row of n tokens, m of them label 2 (the coverage modality) at random places; the rest PAD (-1), label 1 (a
    top-K modality) and label 0 (kept as is). Ties in the scores, and chunk ids of non-members out of any field."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(np.array([PAD, 0, 1]), n, p=[0.1, 0.5, 0.4])
    labels[rng.permutation(n)[:m]] = 2
    scores = (rng.integers(0, 9, n) / 8).astype(np.float32) if seed % 2 else rng.standard_normal(n).astype(np.float32)
    chunks = np.where(labels == 2, rng.integers(0, 12, n), 2**40)
    return scores, labels, chunks


def _row_oracle(scores, labels, chunks, label, k, weight, order=None):
    """Every token of a label >= 0 other than ``label``, plus the coverage picks among ``label``'s members (the
    literal greedy coverage_select_ref, or the first k of a precomputed greedy order at large k)."""
    where = np.flatnonzero(labels == label)
    if order is None:
        picks = coverage_select_ref(torch.from_numpy(scores[where]), torch.from_numpy(chunks[where]), k,
                                    weight).numpy()
    else:
        picks = np.sort(order[:k])
    kept = (labels >= 0) & (labels != label)
    kept[where[picks]] = True
    return np.flatnonzero(kept)



# --- coverage over the members of a long row, and modalities in sequence -------------------------------------------

@pytest.mark.parametrize(("n", "m"), [(3000, 37), (3000, 3000), (500, 2), (1025, 1024), (20000, 864),
                                      (20000, 19000)])
def test_emulated_coverage_sorts_only_the_members(n, m):
    """The rank sort runs over the modality's m members (compacted in index order), in one CTA or over the cluster
    the launcher picks for the row; against the literal greedy (small k) and the step-by-step greedy oracle."""
    from greedy_oracle import coverage_greedy_order

    seed = n + 7 * m
    scores, labels, chunks = _labelled_row(seed, n, m)
    where = np.flatnonzero(labels == 2)
    order = None
    if m > 300:
        order = coverage_greedy_order(torch.from_numpy(scores[where]), torch.from_numpy(chunks[where]), 0.3)
    for cluster in sorted({1, R.cluster_for(n, True)}):
        if cluster == 1 and n > SM90_SINGLE_COVERAGE:
            continue
        for k in sorted({1, m // 4, m - 1} - {0}):
            want = _row_oracle(scores, labels, chunks, 2, k, 0.3, order if k > 250 else None)
            trace = {}
            got = select_row(scores, labels, chunks, [(2, k, 0.3)], len(want), trace=trace, cluster=cluster)
            assert np.array_equal(got, want), f"seed={seed} n={n} m={m} k={k} cluster={cluster}"
            assert trace[0]["path"] == "select" and trace[0]["ranks"] == "sort"


@pytest.mark.parametrize(("n", "m"), [(300, 40), (1200, 1200), (257, 2)])
def test_emulated_stage_coverage_after_topk_matches_stage_select_ref(n, m):
    """A top-K modality first, then coverage over m members, in one CTA and split over CTAs: the coverage step reads
    nothing the top-K step left behind (the candidate bitmap, the histograms). Against reference.stage_select_ref."""
    seed = 3 * n + m
    scores, labels, chunks = _labelled_row(seed, n, m)
    labels = np.where(labels == PAD, 0, labels)  # stage_select_ref has no padding; padded cases are tested below
    a = int((labels == 1).sum())
    for k_a, k_v in ((a // 2, max(1, m // 3)), (a, m), (0, 1)):
        modalities = ((1, k_a, None, 0), (2, k_v, 0.25, None))
        t = (torch.from_numpy(scores)[None], torch.from_numpy(labels)[None], torch.from_numpy(chunks)[None])
        out_len = n - (a - k_a) - (m - k_v)
        want = padded_oracle(*t, modalities, out_len, None)
        assert torch.equal(stage_select_sorts(*t, modalities, out_len), want), f"seed={seed}"
        for cluster in (1, 3):
            got = select_row(scores, labels, chunks, [(1, k_a, None), (2, k_v, 0.25)], out_len, seed=seed,
                             cluster=cluster)
            assert np.array_equal(got, want[0].numpy()), f"seed={seed} n={n} m={m} k={k_a, k_v}"


def test_emulated_coverage_absent_zero_or_full_budget_costs_no_sort():
    """keep = 0 (absent modality or none kept): nothing runs; keep = m: every member is taken without a sort or a
    select; a standalone coverage (no labels) sorts all n."""
    scores, labels, chunks = _labelled_row(11, 400, 50)
    trace = {}
    kept = np.flatnonzero((labels >= 0) & (labels != 2))
    out = select_row(scores, labels, chunks, [(2, 0, 0.3), (5, 0, 0.3)], len(kept), trace=trace)
    assert np.array_equal(out, kept) and [trace[s]["path"] for s in (0, 1)] == ["none", "none"]
    trace = {}
    out = select_row(scores, labels, chunks, [(2, 50, 0.3)], len(kept) + 50, trace=trace)
    assert np.array_equal(out, np.flatnonzero(labels >= 0)) and trace[0] == {"path": "all"}
    trace = {}
    select_row(scores, None, chunks % 2**7, [(0, 3, 0.3)], 3, trace=trace)
    assert trace[0]["ranks"] == "sort" and trace[0]["path"] == "select"


# --- NaN scores: the kernels' key rule (NaN by value, after every number), checked against the built module -------

NAN64 = np.array([2**64 - 1], dtype=np.uint64).view(np.float64)[0]
NAN32 = np.array([2**32 - 1], dtype=np.uint32).view(np.float32)[0]
NAN32_BITS = np.array([0x7FC00000, 0xFFC00000, 0xFFFFFFFF, 0x7F800001, 0xFF800001], dtype=np.uint32)
NAN64_BITS = np.array([0x7FF8000000000000, 0xFFF8000000000000, 2**64 - 1, 0x7FF0000000000001], dtype=np.uint64)


def _bit_patterns(rng, width: int) -> np.ndarray:
    """Random bit patterns of a float of ``width`` bits plus the specials: zeros, infinities, NaNs, subnormals."""
    if width == 32:
        special = [0, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, *NAN32_BITS]
        return np.concatenate([np.array(special, dtype=np.uint32), rng.integers(0, 2**32, 4000, dtype=np.uint32)])
    special = [0, 2**63, 0x7FF0000000000000, 0xFFF0000000000000, 1, 2**63 + 1, *NAN64_BITS]
    return np.concatenate([np.array(special, dtype=np.uint64), rng.integers(0, 2**64, 4000, dtype=np.uint64)])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_keys_depend_on_the_value_not_the_bits(seed):
    """Issue 20 item 2: every NaN (sign, payload, signalling) has one key, the largest of all (after -inf's): the old
    keys came from the bits, so a positive NaN ranked best. -0.0 and +0.0 share a key; the score decoded from a key
    is the score (the coverage value's s), -0.0 as +0.0 and a NaN as a NaN."""
    k32 = descending_key32(NAN32_BITS.view(np.float32))
    k64 = descending_key64(NAN64_BITS.view(np.float64))
    assert (k32 == NAN_KEY32).all() and (k64 == NAN_KEY64).all()
    assert descending_key32(np.float32(-np.inf)) < NAN_KEY32 and descending_key64(-np.inf) < NAN_KEY64
    assert descending_key32(np.float32(-0.0)) == descending_key32(np.float32(0.0))
    assert descending_key64(-0.0) == descending_key64(0.0)
    rng = np.random.default_rng(seed)
    x = _bit_patterns(rng, 64).view(np.float64)
    nan = np.isnan(x)
    order = np.lexsort((np.arange(len(x)), np.where(nan, 0.0, -x), nan))  # NaN last, then score desc, index asc
    ranked = np.argsort(descending_key64(x), kind="stable")
    assert np.array_equal(ranked, order), f"seed={seed}"
    x32 = _bit_patterns(rng, 32).view(np.float32)
    back = R.score_of_key(descending_key32(x32))
    numbers = ~np.isnan(x32)
    assert np.array_equal(back[numbers], np.where(x32 == 0, 0.0, x32)[numbers].astype(np.float64))
    assert np.isnan(back[~numbers]).all() and not np.signbit(back[x32 == 0]).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not _cuda_module_built(), reason="macer_kernels._C is not built")
def test_replay_matches_the_built_module(seed):
    """The replay's constants, keys, launch plan and limits against ``_C``'s host code (the kernel's own constants,
    common.cuh's key functions, select_cta.cu's plan and layout arithmetic): no re-derivation on either side."""
    from macer_kernels.cuda._ext import ext

    c = ext()
    constants = c.SELECT_CTA_CONSTANTS
    mine = {"threads": R.THREADS, "warps": R.WARPS, "select_bits": R.SELECT_BITS, "sort_bits": R.SORT_BITS,
            "small": R.SMALL, "max_table": R.MAX_TABLE, "max_cluster": R.MAX_CLUSTER,
            "composite_bits": R.COMPOSITE_BITS, "code_kept": R.CODE_KEPT, "code_pad": R.CODE_PAD,
            "chunk_overflow": R.CHUNK_OVERFLOW, "single_topk_max": R.SINGLE_TOPK_MAX,
            "cluster_topk_tokens": R.CLUSTER_TOPK_TOKENS, "single_coverage_max": R.SINGLE_COVERAGE_MAX,
            "cluster_coverage_tokens": R.CLUSTER_COVERAGE_TOKENS,
            "max_cluster_coverage_n": R.MAX_CLUSTER_COVERAGE_N, "max_stage_modalities": R.MAX_STAGE_MODALITIES,
            "static_smem_bytes": STATIC_SMEM_BYTES}
    assert constants == mine
    rng = np.random.default_rng(seed)
    for coverage, wide in ((False, False), (True, False), (False, True), (True, True)):
        for avail, clusters in ((SM90_AVAIL, 8), (SM90_AVAIL, 1), (SM89_AVAIL, 1), (0, 1), (5000, 3)):
            assert c.select_cta_max_n_for(avail, coverage, wide, clusters) == R.max_n(coverage, wide, avail,
                                                                                     clusters)
            for n in [1, 2, 4096, 4097, 20000, 65536, 65537, *rng.integers(1, 400000, 40).tolist()]:
                assert c.select_cta_plan(n, coverage, wide, avail, clusters) == R.plan(n, coverage, wide, avail,
                                                                                       clusters), (n, avail)
    bits32, bits64 = _bit_patterns(rng, 32), _bit_patterns(rng, 64)
    assert [c.select_descending_key32(int(b)) for b in bits32] == descending_key32(bits32.view(np.float32)).tolist()
    assert [c.select_descending_key64(int(b)) for b in bits64] == descending_key64(bits64.view(np.float64)).tolist()


def test_topk_nan_member_ranks_last_and_never_picks_padding_or_other_labels():
    # a NaN member with every bit set, next to a PAD token: the member is picked, not the PAD
    scores, labels = np.array([0.0, NAN64]), np.array([PAD, 0])
    assert descending_key64(scores)[1] == NAN_KEY64
    assert np.array_equal(select_row(scores, labels, None, [(0, 1, None)], 1), [1])
    sorts = stage_select_sorts(torch.from_numpy(scores)[None], torch.from_numpy(labels)[None], None,
                               ((0, 1, None, 0),), 1)
    assert sorts.tolist() == [[1]]
    # a label-1 token (kept anyway) and a PAD token: the NaN member is taken after the numbers of its label
    scores, labels = np.array([1.0, NAN64, 2.0, 0.5]), np.array([1, 0, 0, PAD])
    assert np.array_equal(select_row(scores, labels, None, [(0, 2, None)], 3), [0, 1, 2])
    assert np.array_equal(select_row(scores, labels, None, [(0, 1, None)], 2), [0, 2])
    # a standalone top-K: the numbers, then the NaNs by index
    assert np.array_equal(select_row(np.array([NAN64, 3.0, NAN64]), None, None, [(0, 2, None)], 2), [0, 1])


def test_coverage_nan_member_ranks_after_every_number_of_its_label():
    # an fp32 NaN with every bit set in the last chunk byte (254) at the last index: its score key is kNanKey32
    # (the largest), so it is ranked last in its chunk and its value, a NaN, last of all: picked only with k = m
    labels = np.array([PAD, 0, 1, 0, 0, PAD, 0, 0])
    scores = np.array([5.0, 0.5, 1.0, 0.25, 0.5, 9.0, 0.75, NAN32], dtype=np.float32)
    chunks = np.array([0, 3, 0, 3, 1, 0, 1, 254])
    assert descending_key32(scores[7:])[0] == NAN_KEY32
    members = np.flatnonzero(labels == 0)
    t = tuple(torch.from_numpy(x)[None] for x in (scores, labels, chunks))
    for k in range(1, len(members) + 1):
        want = padded_oracle(*t, ((0, k, 0.5, None),), k + 1, None)[0]
        assert (7 in want.tolist()) == (k == len(members)), k
        for cluster in (1, 2, 3):
            assert np.array_equal(select_row(scores, labels, chunks, [(0, k, 0.5)], k + 1, cluster=cluster),
                                  want.numpy()), k
        assert torch.equal(stage_select_sorts(*t, ((0, k, 0.5, None),), k + 1)[0], want), k


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy casting a signalling NaN
@pytest.mark.parametrize("out_stride", [None, 50])
def test_emulated_launch_with_nan_rows_matches_the_reference_and_flags(out_stride, seed):
    """B rows through the replayed launch (per-row budget table, output stride, the non-finite flags): a finite row,
    a row with NaNs of several bit patterns and -inf, an all-NaN row (its first K tokens), against the reference."""
    from macer_kernels.reference import stage_flags_ref

    counts = [{1: 12, 2: 15}] * 3
    scores, labels, chunks = padded_case(seed, 40, [40, 36, 40], counts, ties=True)
    members = np.flatnonzero(labels[1].numpy() > 0)
    scores[1, members[::4]] = torch.from_numpy(np.resize(NAN32_BITS, len(members[::4])).view(np.float32))
    scores[1, members[1]] = -np.inf
    scores[2] = torch.where(labels[2] > 0, float("nan"), scores[2])
    modalities = ((1, 6, None, 0), (2, 7, 0.4, 8))
    keeps = torch.tensor([[6, 7], [3, 7], [6, 2]], dtype=torch.int32)
    out_len = 40 - 6 - 8
    want = padded_oracle(scores, labels, chunks, modalities, out_len, keeps)
    assert (want[2] >= 0).sum() == 40 - 6 - 13 and (want[1] >= 0).sum() == 36 - 9 - 8
    stride = out_len if out_stride is None else out_stride
    mods = [(label, keep, weight) for label, keep, weight, _ in modalities]
    out, flags = select_cta(scores.numpy(), labels.numpy(), chunks.numpy(), mods, out_len, stride, keeps.numpy(),
                            flags=True)
    for b in range(3):
        assert np.array_equal(out[b * stride:b * stride + out_len], want[b].numpy()), f"seed={seed} row={b}"
        if b < 2:
            assert (out[b * stride + out_len:(b + 1) * stride] == -7).all(), "a row wrote past out_len"
    stage = [SimpleNamespace(label=label) for label, _, _, _ in modalities]
    assert flags.tolist() == stage_flags_ref(scores, labels, stage).tolist() == [False, True, True]
    got_flags = torch.empty(3, dtype=torch.bool)
    assert torch.equal(stage_select_sorts(scores, labels, chunks, modalities, out_len, keeps, got_flags), want)
    assert got_flags.tolist() == [False, True, True]
