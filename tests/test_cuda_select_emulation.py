"""The one-CTA selection kernel's algorithm (csrc/kernels/select_cta.cuh), replayed step by step in numpy on CPU and
compared with the float64 references; plus the multi-CTA stage path (batched torch sorts), which runs on CPU as is.

No GPU is needed: the emulation mirrors the kernel's integer key packing, its bitonic network, the chunk-rank binary
search, the IEEE float64 value, the 8-pass radix select with its bin search, the tie scans, the non-finite flags and
the row assembly at its output stride. Its constants are read from the headers (``csrc/kernels/select_cta.cuh``,
``common.cuh``); where ``_C`` is built, the replay's keys (from raw bits), constants and launch limit are checked
against the module's host helpers, which run the kernels' own code (``test_replay_matches_the_built_module``). What
it cannot show is that the CUDA code matches it (races, barriers, the device's float conversions):
tests/test_cuda_kernels.py and tests/test_nonfinite_select.py do that on a GPU (docs/cuda.md lists the rest).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from macer_kernels.cuda.stage import stage_select_sorts
from macer_kernels.reference import coverage_select_ref, topk_indices_ref
from macer_kernels.select import _coverage_select_torch, _topk_indices_torch


def _cuda_module_built() -> bool:
    return importlib.util.find_spec("macer_kernels._C") is not None


_KERNELS = Path(__file__).resolve().parents[1] / "csrc" / "kernels"
_CTA_HEADER = (_KERNELS / "select_cta.cuh").read_text()
_COMMON_HEADER = (_KERNELS / "common.cuh").read_text()


def _constant(header: str, name: str) -> int:
    """``constexpr <type> name = <value>;`` of a header: a decimal or hex literal, or ``~0ull`` (- 1)."""
    match = re.search(rf"constexpr \w+ {name} = ([^;]+);", header)
    assert match, f"{name} not found in the header"
    text = match.group(1).strip()
    if text == "~0ull":
        return 2**64 - 1
    if text == "~0ull - 1":
        return 2**64 - 2
    return int(text.rstrip("uUlL"), 0)


THREADS = _constant(_CTA_HEADER, "kThreads")
MAX_SORT_ITEMS = _constant(_CTA_HEADER, "kMaxSortItems")
MAX_SORT = THREADS * MAX_SORT_ITEMS  # coverage's register bound; the launcher also bounds n by shared memory
NEVER = np.uint64(_constant(_CTA_HEADER, "kNever"))
NAN_KEY32 = np.uint32(_constant(_COMMON_HEADER, "kNanKey32"))
NAN_KEY64 = np.uint64(_constant(_COMMON_HEADER, "kNanKey64"))

# The launcher's n limit (csrc/select_cta.cu): n 64-bit keys and a bitmap of ceil(n / 32) words in dynamic shared
# memory, capped by MAX_SORT for coverage. The kernel's static shared memory (its Shared struct, CUB's scan storage
# included) is a recorded fact of the build, checked against _C where it is built.
STATIC_SMEM_BYTES = 1248
SM90_OPTIN_BYTES = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100


def dynamic_bytes(n: int) -> int:
    return n * 8 + -(-n // 32) * 4


def launcher_max_n(avail: int, coverage: bool) -> int:
    n = avail // 8
    while n > 0 and dynamic_bytes(n) > avail:
        n -= 1
    return min(n, MAX_SORT) if coverage else n


SM90_MAX_N = launcher_max_n(SM90_OPTIN_BYTES - STATIC_SMEM_BYTES, True)  # 28455: the largest one-CTA n on an H100


def descending_key32(x: np.ndarray) -> np.ndarray:
    """The kernel's descending_key32 (common.cuh): NaN by value (x != x) -> kNanKey32, whatever its bits."""
    x = np.asarray(x).astype(np.float32)
    nan = np.isnan(x)
    bits = np.where(x == 0, np.float32(0), np.where(nan, np.float32(0), x)).view(np.uint32)
    asc = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))
    return np.where(nan, NAN_KEY32, ~asc)


def descending_key64(x: np.ndarray) -> np.ndarray:
    """The kernel's descending_key64 (common.cuh): NaN by value -> kNanKey64 (after -inf, before kNever)."""
    x = np.asarray(x).astype(np.float64)
    nan = np.isnan(x)
    bits = np.where(x == 0, 0.0, np.where(nan, 0.0, x)).view(np.uint64)
    asc = np.where(bits >> np.uint64(63) == 1, ~bits, bits | np.uint64(1 << 63))
    return np.where(nan, NAN_KEY64, ~asc)


def radix_select(keys: np.ndarray, k: int) -> tuple[int, int, int]:
    """(T, need, count) as the kernel's radix_select: 8 passes of 8-bit digits, the bin holding the need-th best,
    found as warp 0 finds it (lane l owns bins 8l..8l+7; the lane whose range holds the need-th key writes). When no
    bin holds it (k above the live keys), no lane writes and the previous pass's values stay, as in the kernel (its
    thread 0 starts them at prefix 0, need k, count 0)."""
    prefix, need = 0, k
    count = 0
    for shift in range(56, -1, -8):
        if shift == 56:
            live = keys
        else:
            live = keys[((keys ^ np.uint64(prefix)) >> np.uint64(shift + 8)) == 0]
        digits = ((live >> np.uint64(shift)) & np.uint64(255)).astype(np.int64)
        hist = np.bincount(digits, minlength=256)
        lane_sum = hist.reshape(32, 8).sum(axis=1)
        incl = np.cumsum(lane_sum)
        excl = incl - lane_sum
        hit = np.flatnonzero((excl < need) & (need <= incl))
        if not len(hit):
            continue  # no lane's bins hold it: sh.prefix / need / count keep their values
        lane = int(hit[0])
        run = int(excl[lane])
        for j in range(8):
            c = int(hist[lane * 8 + j])
            if run + c >= need:
                prefix |= (lane * 8 + j) << shift
                need -= run
                count = c
                break
            run += c
    return prefix, need, count


def select_k(key: np.ndarray, score_key: np.ndarray, by_score: bool, k: int) -> tuple[np.ndarray, bool]:
    """The kernel's select_k: a bool mask of the k best by (key, then score key if by_score, then index), and whether
    k were picked. A threshold of NEVER (k above the keys below NEVER) takes only the keys below it, never the NEVER
    group (other labels, padding, or a member whose NaN score has every bit set)."""
    t1, need1, count1 = radix_select(key, k)
    complete = t1 != int(NEVER)
    split = complete and by_score and need1 < count1
    t2, need2 = 0, need1
    if split:
        t2, need2, _ = radix_select(np.where(key == np.uint64(t1), score_key, NEVER), need1)
    tied = complete & (key == np.uint64(t1)) & ((score_key == np.uint64(t2)) if split else True)
    rank = np.cumsum(tied) - tied  # the block scan's exclusive ranks in index order
    take = key < np.uint64(t1)
    if split:
        take |= (key == np.uint64(t1)) & (score_key < np.uint64(t2))
    return take | (tied & (rank < need2)), complete


def bitonic_schedule(n: int):
    """The kernel's comparator steps for n keys: per step the (i, j) pairs (i < j) it compares, the comparators with
    j >= n skipped. Block sizes 2, 4, ..., n_pad (the power of two >= n): first i against its mirror in the block,
    then half-cleaners i against i + stride; the index arithmetic is the kernel's, over q in [0, n_pad / 2)."""
    n_pad = 1 << max(0, (n - 1).bit_length())
    q = np.arange(n_pad // 2)
    size = 2
    while size <= n_pad:
        half = size // 2
        r = q & (half - 1)
        i = 2 * (q - r) + r
        j = i + size - 1 - 2 * r
        yield i[j < n], j[j < n]
        stride = half // 2
        while stride > 0:
            i = 2 * q - (q & (stride - 1))
            j = i + stride
            yield i[j < n], j[j < n]
            stride //= 2
        size *= 2


def bitonic_sort(keys: np.ndarray) -> np.ndarray:
    """The kernel's sort of the n stored keys: every comparator puts the smaller key at its lower position."""
    keys = keys.copy()
    for i, j in bitonic_schedule(len(keys)):
        a, b = keys[i], keys[j]
        keys[i], keys[j] = np.minimum(a, b), np.maximum(a, b)
    return keys


def _register_pass(keys: np.ndarray, m: int, full_top: int, stride_top: int) -> None:
    """select_cta.cuh's sort64_in_registers on the shared key array: a warp per aligned block of 64 positions, lane l
    holding x0 = position 64 b + l and x1 = 64 b + 32 + l (NEVER at positions >= m, never stored), partners by the
    kernel's xor shuffles. full_top > 0: every step of the sizes 2 .. full_top; else half-cleaners stride_top .. 1."""
    lanes = np.arange(32)

    def shfl(x, mask):
        return x[..., lanes ^ mask]

    def half_cleaners(x0, x1, top):
        s = top
        while s > 0:
            if s == 32:
                x0, x1 = np.minimum(x0, x1), np.maximum(x0, x1)
            else:
                lower = (lanes & s) == 0
                y0, y1 = shfl(x0, s), shfl(x1, s)
                x0 = np.where(lower, np.minimum(x0, y0), np.maximum(x0, y0))
                x1 = np.where(lower, np.minimum(x1, y1), np.maximum(x1, y1))
            s //= 2
        return x0, x1

    blocks = np.arange(-(-m // 64))[:, None]  # every warp's blocks at once: [blocks, 32 lanes]
    p0, p1 = blocks * 64 + lanes, blocks * 64 + 32 + lanes
    x0 = np.full(p0.shape, NEVER, dtype=np.uint64)
    x1 = np.full(p1.shape, NEVER, dtype=np.uint64)
    x0[p0 < m], x1[p1 < m] = keys[p0[p0 < m]], keys[p1[p1 < m]]
    if full_top > 0:
        size = 2
        while size <= full_top:
            if size == 64:
                x0, x1 = np.minimum(x0, shfl(x1, 31)), np.maximum(x1, shfl(x0, 31))
            else:
                lower = (lanes & (size // 2)) == 0
                y0, y1 = shfl(x0, size - 1), shfl(x1, size - 1)
                x0 = np.where(lower, np.minimum(x0, y0), np.maximum(x0, y0))
                x1 = np.where(lower, np.minimum(x1, y1), np.maximum(x1, y1))
            x0, x1 = half_cleaners(x0, x1, size // 4)
            size *= 2
    else:
        x0, x1 = half_cleaners(x0, x1, stride_top)
    keys[p0[p0 < m]], keys[p1[p1 < m]] = x0[p0 < m], x1[p1 < m]


def kernel_sort_phases(m: int) -> list:
    """coverage_keys' sort as the kernel runs it, one entry per barrier: ("registers", full_top, stride_top) for a
    pass of sort64_in_registers, ("shared", i, j) for a step in shared memory (comparators with j >= m skipped)."""
    m_pad = 1 << max(0, (m - 1).bit_length())
    phases = [("registers", min(m_pad, 64), 0)]
    q = np.arange(m_pad // 2)
    size = 128
    while size <= m_pad:
        half = size // 2
        r = q & (half - 1)
        i = 2 * (q - r) + r
        j = i + size - 1 - 2 * r
        phases.append(("shared", i[j < m], j[j < m]))
        stride = half // 2
        while stride >= 64:
            i = 2 * q - (q & (stride - 1))
            j = i + stride
            phases.append(("shared", i[j < m], j[j < m]))
            stride //= 2
        phases.append(("registers", 0, 32))
        size *= 2
    return phases


def run_sort_phases(keys: np.ndarray, m: int, phases: list) -> None:
    for kind, a, b in phases:
        if kind == "registers":
            _register_pass(keys, m, a, b)
        else:
            assert np.all(a < b) and b.max(initial=-1) < m
            x, y = keys[a], keys[b]
            keys[a], keys[b] = np.minimum(x, y), np.maximum(x, y)


def owned(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's blocked ownership: thread t owns tokens [lo[t], hi[t]), ceil(n / kThreads) each, in index order."""
    per = -(-n // THREADS)
    lo = np.minimum(n, np.arange(THREADS) * per)
    return lo, np.minimum(n, lo + per)


def member_scan(member: np.ndarray) -> tuple[np.ndarray, int]:
    """select_row's block scan of the modality's members over owned(): per thread the members below its first token
    (where coverage_keys writes its first member key), and the block's count m."""
    lo, hi = owned(len(member))
    local = np.array([int(member[a:b].sum()) for a, b in zip(lo, hi)])
    return np.cumsum(local) - local, int(local.sum())


def coverage_keys(scores: np.ndarray, chunks: np.ndarray, member: np.ndarray, weight: float, before: np.ndarray,
                  m: int, keys: np.ndarray, trace: dict | None = None) -> np.ndarray:
    """The kernel's coverage_keys on the shared key array ``keys`` (n entries, stale contents from earlier work):
    member sort keys written compactly at keys[before + j], a bitonic sort of keys[0, m) only, each position's rank in
    its chunk by binary search, then the value keys by token index. ``trace`` records the path and the sort's width
    and steps."""
    n = len(scores)
    assert n <= MAX_SORT and 1 <= m <= n
    ib = max(1, (n - 1).bit_length())
    cb = 32 - ib
    s32 = scores.astype(np.float32)
    written = np.zeros(n, dtype=np.int64)
    overflow = False
    lo, hi = owned(n)
    for t in range(THREADS):
        where = lo[t] + np.flatnonzero(member[lo[t]:hi[t]])  # this thread's members, ascending
        c = chunks[where].astype(np.int64)
        overflow |= bool(((c < 0) | (c >= (1 << cb))).any())
        slots = before[t] + np.arange(len(where))
        # uint64(c) << (32 + ib) wraps like the kernel's shift; its low 32 + ib bits are zero whatever c is
        keys[slots] = ((c.astype(np.uint64) << np.uint64(32 + ib))
                       | (descending_key32(s32[where]).astype(np.uint64) << np.uint64(ib))
                       | where.astype(np.uint64))
        written[slots] += 1
    assert np.array_equal(written, np.arange(n) < m), "member keys must fill keys[0, m) once each"
    if trace is not None:
        trace["overflow"] = overflow
    if not overflow:
        steps = list(bitonic_schedule(m))
        phases = kernel_sort_phases(m)  # the network's steps as the kernel groups them, a barrier after each
        if trace is not None:
            trace.update(width=m, steps=len(steps), barriers=len(phases))
        run_sort_phases(keys, m, phases)
        assert np.all(keys[:m - 1] <= keys[1:m])
    real = keys[:m].copy()  # positions p < m; a real key may equal NEVER and is still a member
    tokens = (real & np.uint64((1 << ib) - 1)).astype(np.int64)
    t = np.zeros(m, dtype=np.int64)
    if not overflow:
        field = real >> np.uint64(32 + ib)
        t = np.arange(m) - np.searchsorted(field, field, side="left")  # the binary search for the chunk's start
    else:  # the kernel's direct count of the chunk's members ahead
        for r, p in enumerate(tokens):
            same = member & (chunks == chunks[p])
            same[p] = False
            t[r] = int(np.sum(same & ((s32 > s32[p]) | ((s32 == s32[p]) & (np.arange(n) < p)))))
    assert t.max(initial=0) < 2**16 and tokens.max(initial=0) < 2**15  # the (rank << 16 | token) packing
    assert np.array_equal(np.sort(tokens), np.flatnonzero(member))
    keys[:] = NEVER
    v = scores[tokens].astype(np.float64) + np.sqrt(weight / (1.0 + t.astype(np.float64)))
    keys[tokens] = descending_key64(v)
    return keys


def select_row(scores, labels, chunks, modalities, out_len, keeps=None, trace=None, seed=0) -> np.ndarray:
    """The kernel's select_row for one row; labels None = every token a candidate of the single modality. ``keeps``:
    the row's budgets (its row of the [B, M] table), None = each modality's spec keep. The shared key array starts
    with garbage (``seed``): nothing may read a key it did not write. ``trace``: coverage_keys' record, per label."""
    n = len(scores)
    picked = np.zeros(n, dtype=bool)
    listed = np.zeros(n, dtype=bool)
    score_key = descending_key64(scores.astype(np.float64))
    keys = np.random.default_rng(seed).integers(0, 2**64, n, dtype=np.uint64)
    for m, (label, keep, weight) in enumerate(modalities):
        budget = keep if keeps is None else int(keeps[m])
        if budget < 0 or budget > keep:
            return np.full(out_len, -1)
        member = np.ones(n, dtype=bool) if labels is None else labels == label
        listed |= member
        before, count = member_scan(member)
        if count < budget:
            return np.full(out_len, -1)
        if budget == 0:
            continue
        if weight is not None:
            record = {} if trace is None else trace.setdefault(label, {})
            coverage_keys(scores, chunks, member, weight, before, count, keys, record)
        else:
            keys[:] = np.where(member, score_key, NEVER)
        take, complete = select_k(keys, score_key, weight is not None, budget)
        if not complete:  # fewer than budget picks: the row is flagged
            return np.full(out_len, -1)
        picked |= take
    kept = picked if labels is None else picked | (~listed & (labels >= 0))
    total = int(kept.sum())
    if total > out_len:
        return np.full(out_len, -1)
    out = np.full(out_len, -1)
    out[out_len - total:] = np.flatnonzero(kept)  # right-aligned after the -1 fill
    return out


def select_cta(scores, labels, chunks, modalities, out_len, out_stride, keeps=None, flags=False):
    """The kernel's launch over B rows (select_cta_kernel): row b reads its scores, labels and chunk ids, its budgets
    at ``keeps[b * M:]`` of the flat int32 table, and writes ``out[b * out_stride:][:out_len]`` of one flat buffer
    (entries between rows untouched, here -7); with ``flags`` also ``nonfinite[b]``: a non-finite score at a token of
    a selected label (every token without labels), found before any modality is selected. Returns (out, nonfinite)."""
    b = scores.shape[0]
    out = np.full(max(0, (b - 1) * out_stride) + out_len, -7)
    nonfinite = np.zeros(b, dtype=bool)
    table = None if keeps is None else np.asarray(keeps, dtype=np.int32).reshape(-1)
    m = len(modalities)
    for row in range(b):
        lab = None if labels is None else labels[row]
        if flags:
            staged = np.ones(scores.shape[1], dtype=bool) if lab is None else np.isin(lab, [x[0] for x in modalities])
            nonfinite[row] = bool((staged & ~np.isfinite(scores[row].astype(np.float64))).any())
        budgets = None if table is None else table[row * m:(row + 1) * m]
        got = select_row(scores[row], lab, None if chunks is None else chunks[row], modalities, out_len, budgets)
        out[row * out_stride:row * out_stride + out_len] = got
    return out, nonfinite


def _scores(rng, n, ties, dtype=np.float32):
    if ties:
        return (rng.integers(0, 7, n) / 4).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 31, 100, 864, 1025, 3001])
@pytest.mark.parametrize("ties", [False, True])
def test_emulated_topk_matches_reference(n, ties):
    seed = n * 2 + ties
    rng = np.random.default_rng(seed)
    for dtype in (np.float32, np.float64, np.float16):
        scores = _scores(rng, n, ties, dtype)
        if n > 5:
            scores[:3] = np.array([0.0, -0.0, -np.inf], dtype=dtype)
        for k in sorted({1, n // 3, n - 1, n} - {0}):
            got = select_row(scores, None, None, [(0, k, None)], k)
            want = topk_indices_ref(torch.from_numpy(scores.astype(np.float64)), k).numpy()
            assert np.array_equal(got, want), f"seed={seed} dtype={dtype} k={k}"


@pytest.mark.parametrize("n", [1, 2, 33, 300, 864, 2049])
@pytest.mark.parametrize("weight", [0.0, 0.05, 1.0, 3e32])
def test_emulated_coverage_matches_reference(n, weight):
    seed = n + int(weight * 100) % 97
    rng = np.random.default_rng(seed)
    for ties in (False, True):
        scores = _scores(rng, n, ties)
        chunks = rng.integers(0, max(1, min(24, n)), n)
        for k in sorted({1, n // 4, n} - {0}):
            got = select_row(scores, None, chunks, [(0, k, weight)], k)
            s, c = torch.from_numpy(scores), torch.from_numpy(chunks)
            want = coverage_select_ref(s, c, k, weight) if n <= 300 else _coverage_select_torch(s, c, k, weight)
            assert np.array_equal(got, want.numpy()), f"seed={seed} ties={ties} k={k}"


def test_emulated_coverage_large_chunk_ids_take_the_direct_count():
    rng = np.random.default_rng(7)
    scores = _scores(rng, 200, True)
    chunks = rng.integers(0, 3, 200) * (2**40)  # do not fit the key's chunk field
    for k in (1, 50, 200):
        got = select_row(scores, None, chunks, [(0, k, 0.3)], k)
        want = coverage_select_ref(torch.from_numpy(scores), torch.from_numpy(chunks), k, 0.3)
        assert np.array_equal(got, want.numpy()), f"seed=7 k={k}"


def test_emulated_radix_select_splits_a_tie_group_by_score():
    # Equal float64 values with different scores (1 + 1e-20 == 1 + 0): the tie rule takes the higher score first,
    # then the lower index -- here token 2 before tokens 0 and 3, though its index is higher.
    scores = np.array([0.0, -5.0, 1e-20, 0.0], dtype=np.float32)
    chunks = np.array([0, 1, 2, 3])
    for k in range(1, 5):
        got = select_row(scores, None, chunks, [(0, k, 1.0)], k)
        want = coverage_select_ref(torch.from_numpy(scores), torch.from_numpy(chunks), k, 1.0)
        assert np.array_equal(got, want.numpy()), k
    assert np.array_equal(select_row(scores, None, chunks, [(0, 1, 1.0)], 1), [2])


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
            got = select_row(scores[row].numpy(), labels[row].numpy(), chunk_ids[row].numpy(), mods, out_len)
            assert np.array_equal(got, want[row].numpy()), f"seed={seed} row={row}"


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


# --- the coverage sort: n stored keys, virtual +inf padding, comparators with j >= n skipped ------------------------

def _schedule_sizes(rng) -> list[int]:
    powers = [p + d for e in range(1, 16) for p in (2**e,) for d in (-1, 0, 1)]
    return sorted({1, 2, 3, SM90_MAX_N, MAX_SORT - 1, MAX_SORT, *rng.integers(1, 3001, 300).tolist(), *powers} - {0})


def test_bitonic_schedule_with_skipped_comparators_sorts_every_size(seed):
    rng = np.random.default_rng(seed)
    for n in _schedule_sizes(rng):
        # few distinct values (kNever included) as well as distinct ones: the sort must not need distinct keys
        keys = rng.integers(0, 2**62, n, dtype=np.uint64)
        few = rng.choice(np.array([0, 5, 2**40, NEVER], dtype=np.uint64), n)
        for x in (keys, few):
            assert np.array_equal(bitonic_sort(x), np.sort(x)), f"seed={seed} n={n}"


def test_kernel_sort_phases_are_the_network(seed):
    """Issue 20 item 6: the kernel runs the steps inside aligned 64-position blocks in registers (xor shuffles, one
    barrier per run of steps). Replaying its lane arithmetic must give exactly the keys the network's comparator list
    gives (distinct keys, few distinct values with NEVER, reversed input), for ~110 widths; and the barriers drop
    from one per step to 15 at m = 864 (55 steps) and 55 at m = 28672 (120 steps)."""
    rng = np.random.default_rng(seed)
    powers = [p + d for e in range(1, 16) for p in (2**e,) for d in (-1, 0, 1)]
    for n in sorted({1, 2, 3, 864, MAX_SORT - 1, MAX_SORT, *rng.integers(1, 3001, 60).tolist(), *powers} - {0}):
        distinct = rng.integers(0, 2**62, n, dtype=np.uint64)
        few = rng.choice(np.array([0, 5, 2**40, NEVER], dtype=np.uint64), n)
        for x in (distinct, few, np.sort(distinct)[::-1].copy()):
            got = x.copy()
            run_sort_phases(got, n, kernel_sort_phases(n))
            assert np.array_equal(got, bitonic_sort(x)), f"seed={seed} n={n}"
    assert len(kernel_sort_phases(864)) == 15 and len(list(bitonic_schedule(864))) == 55
    assert len(kernel_sort_phases(MAX_SORT)) == 55 and len(list(bitonic_schedule(MAX_SORT))) == 120
    assert len(kernel_sort_phases(64)) == 1 and len(kernel_sort_phases(1)) == 1


def test_skipped_comparators_are_no_ops_of_the_padded_network(seed):
    """The skip rule itself: the full network over n_pad keys with +inf (kNever) at positions >= n never moves a
    padding key below n, so every comparator the kernel skips (j >= n) compares and keeps kNever at j."""
    rng = np.random.default_rng(seed)
    for n in sorted({*rng.integers(1, 700, 40).tolist(), 1, 2, 127, 129, 511, 512, 513}):
        n_pad = 1 << max(0, (n - 1).bit_length())
        keys = np.full(n_pad, NEVER, dtype=np.uint64)
        keys[:n] = rng.integers(0, 2**63, n, dtype=np.uint64)
        q = np.arange(n_pad // 2)
        size = 2
        while size <= n_pad:
            half = size // 2
            r = q & (half - 1)
            steps = [(2 * (q - r) + r, 2 * (q - r) + size - 1 - r)]
            stride = half // 2
            while stride > 0:
                i = 2 * q - (q & (stride - 1))
                steps.append((i, i + stride))
                stride //= 2
            for i, j in steps:
                assert np.all(i < j)
                a, b = keys[i], keys[j]
                keys[i], keys[j] = np.minimum(a, b), np.maximum(a, b)
                assert np.all(keys[n:] == NEVER), f"seed={seed} n={n} size={size}"
            size *= 2
        assert np.array_equal(keys[:n], bitonic_sort(keys[:n])), f"seed={seed} n={n}"


@pytest.mark.parametrize("n", [16385, 20000, SM90_MAX_N])
def test_emulated_coverage_above_16k_matches_the_references(n):
    """Coverage at sizes the power-of-two sort could not hold (n_pad = 32768 keys): keys, ranks and selection
    against coverage_select_ref (small k) and the step-by-step greedy oracle (large k)."""
    from greedy_oracle import coverage_greedy_order

    seed = n
    rng = np.random.default_rng(seed)
    scores = _scores(rng, n, ties=n % 2 == 0)
    chunks = rng.integers(0, 24, n)
    s, c = torch.from_numpy(scores), torch.from_numpy(chunks)
    order = coverage_greedy_order(s, c, 0.2)
    for k in (1, 37, n // 3):
        got = select_row(scores, None, chunks, [(0, k, 0.2)], k)
        want = coverage_select_ref(s, c, k, 0.2).numpy() if k < 100 else np.sort(order[:k])
        assert np.array_equal(got, want), f"seed={seed} n={n} k={k}"
    assert n > 16384 and (n - 1).bit_length() == 15  # the index field's widest case; chunk field 17 bits


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
        got = select_row(scores[b].numpy(), labels[b].numpy(), chunk_ids[b].numpy(), mods, out_len,
                         None if keeps is None else keeps[b].numpy())
        assert np.array_equal(got, want[b].numpy()), f"{what} (emulated kernel) row={b}"
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


# --- coverage sorts only the modality's m members (keys written compactly, network width from m) ------------------

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


@pytest.mark.parametrize(("n", "m"), [(3000, 37), (3000, 3000), (500, 1), (1, 1), (1025, 1024), (20000, 864),
                                      (20000, 19000), (SM90_MAX_N, 900)])
def test_emulated_coverage_sorts_only_the_members(n, m):
    """The new schedule: member keys compacted into keys[0, m), a network of width m (log2(m_pad)(log2(m_pad)+1)/2
    steps), ranks over p < m, value keys by token index; the shared key array starts with garbage. Against the
    literal greedy (small k) and the step-by-step greedy oracle (large k)."""
    from greedy_oracle import coverage_greedy_order

    seed = n + 7 * m
    scores, labels, chunks = _labelled_row(seed, n, m)
    where = np.flatnonzero(labels == 2)
    order = None
    if m > 300:
        order = coverage_greedy_order(torch.from_numpy(scores[where]), torch.from_numpy(chunks[where]), 0.3)
    for k in sorted({1, m // 4, m} - {0}):
        want = _row_oracle(scores, labels, chunks, 2, k, 0.3, order if k > 250 else None)
        trace = {}
        got = select_row(scores, labels, chunks, [(2, k, 0.3)], len(want), trace=trace, seed=seed)
        assert np.array_equal(got, want), f"seed={seed} n={n} m={m} k={k}"
        m_pad = 1 << max(0, (m - 1).bit_length())
        log = m_pad.bit_length() - 1
        barriers = 1 + sum(e - 5 for e in range(7, log + 1))  # a register pass, then per size >= 128 its wide steps
        assert trace[2] == {"overflow": False, "width": m, "steps": log * (log + 1) // 2, "barriers": barriers}, \
            f"seed={seed}"
    if n == 20000 and m == 864:
        # not the 120 steps of a 32768-wide network over the whole row; 15 barriers, not one per step
        assert trace[2]["steps"] == 55 and trace[2]["barriers"] == 15


@pytest.mark.parametrize(("n", "m"), [(300, 40), (1200, 1200), (257, 1)])
def test_emulated_stage_coverage_after_topk_matches_stage_select_ref(n, m):
    """A top-K modality first (its keys fill the whole array), then coverage over m members: the coverage step
    must not read the top-K keys it did not overwrite. Against reference.stage_select_ref per sample."""
    seed = 3 * n + m
    scores, labels, chunks = _labelled_row(seed, n, m)
    labels = np.where(labels == PAD, 0, labels)  # stage_select_ref has no padding; padded cases are tested above
    a = int((labels == 1).sum())
    for k_a, k_v in ((a // 2, max(1, m // 3)), (a, m), (0, 1)):
        modalities = ((1, k_a, None, 0), (2, k_v, 0.25, None))
        t = (torch.from_numpy(scores)[None], torch.from_numpy(labels)[None], torch.from_numpy(chunks)[None])
        out_len = n - (a - k_a) - (m - k_v)
        want = padded_oracle(*t, modalities, out_len, None)
        assert torch.equal(stage_select_sorts(*t, modalities, out_len), want), f"seed={seed}"
        got = select_row(scores, labels, chunks, [(1, k_a, None), (2, k_v, 0.25)], out_len, seed=seed)
        assert np.array_equal(got, want[0].numpy()), f"seed={seed} n={n} m={m} k={k_a, k_v}"


def test_emulated_coverage_absent_or_zero_budget_costs_no_sort():
    """m = 0 (keep 0) and keep = 0 with members: coverage_keys is not reached (no sort, no trace); standalone
    coverage (no labels) sorts all n."""
    scores, labels, chunks = _labelled_row(11, 400, 50)
    trace = {}
    kept = np.flatnonzero((labels >= 0) & (labels != 2))
    out = select_row(scores, labels, chunks, [(2, 0, 0.3), (5, 0, 0.3)], len(kept), trace=trace)
    assert np.array_equal(out, kept) and trace == {}
    trace = {}
    select_row(scores, None, chunks % 2**20, [(0, 3, 0.3)], 3, trace=trace)
    assert trace[0] == {"overflow": False, "width": 400, "steps": 45, "barriers": 1 + 2 + 3 + 4}


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
    """Issue 20 item 2: every NaN (sign, payload, signalling) has one key, after -inf's and before kNever; the old
    keys came from the bits, so a positive NaN ranked best. -0.0 and +0.0 share a key."""
    k32 = descending_key32(NAN32_BITS.view(np.float32))
    k64 = descending_key64(NAN64_BITS.view(np.float64))
    assert (k32 == NAN_KEY32).all() and (k64 == NAN_KEY64).all()
    assert descending_key32(np.float32(-np.inf)) < NAN_KEY32 and descending_key64(-np.inf) < NAN_KEY64 < NEVER
    assert descending_key32(np.float32(-0.0)) == descending_key32(np.float32(0.0))
    assert descending_key64(-0.0) == descending_key64(0.0)
    rng = np.random.default_rng(seed)
    x = _bit_patterns(rng, 64).view(np.float64)
    nan = np.isnan(x)
    order = np.lexsort((np.arange(len(x)), np.where(nan, 0.0, -x), nan))  # NaN last, then score desc, index asc
    ranked = np.argsort(descending_key64(x), kind="stable")
    assert np.array_equal(ranked, order), f"seed={seed}"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.skipif(not _cuda_module_built(), reason="macer_kernels._C is not built")
def test_replay_matches_the_built_module(seed):
    """The replay's keys, constants and launch limit against ``_C``'s host helpers, which run the kernels' own code
    (common.cuh's key functions, select_cta.cu's limit arithmetic): no re-derivation on either side of the check."""
    from macer_kernels.cuda._ext import ext

    c = ext()
    facts = c.select_cta_facts()
    assert (facts["threads"], facts["max_sort_items"]) == (THREADS, MAX_SORT_ITEMS)
    assert (facts["never_key"], facts["nan_key64"], facts["nan_key32"]) == (int(NEVER), int(NAN_KEY64),
                                                                             int(NAN_KEY32))
    assert facts["static_smem_bytes"] == STATIC_SMEM_BYTES
    for avail in (0, 7, 8, 33, 4096, 48 * 1024, 99 * 1024 - STATIC_SMEM_BYTES, SM90_OPTIN_BYTES - STATIC_SMEM_BYTES,
                  300 * 1024):
        for coverage in (False, True):
            assert c.select_cta_max_n_for(avail, coverage) == launcher_max_n(avail, coverage), (avail, coverage)
    assert SM90_MAX_N == c.select_cta_max_n_for(SM90_OPTIN_BYTES - STATIC_SMEM_BYTES, True) == 28455
    rng = np.random.default_rng(seed)
    bits32, bits64 = _bit_patterns(rng, 32), _bit_patterns(rng, 64)
    assert [c.select_descending_key32(int(b)) for b in bits32] == descending_key32(bits32.view(np.float32)).tolist()
    assert [c.select_descending_key64(int(b)) for b in bits64] == descending_key64(bits64.view(np.float64)).tolist()


def test_radix_select_keeps_previous_values_when_no_bin_holds_k():
    """The kernel's bin search writes nothing when no lane's bins hold the need-th key (k above the live keys); the
    replay used to take bin 0 and report its count."""
    keys = np.array([1, 2, 3], dtype=np.uint64)
    assert radix_select(keys, 5) == (0, 5, 0)
    assert radix_select(keys, 3) == (3, 1, 1)


def test_topk_nan_member_ranks_last_and_never_picks_padding_or_other_labels():
    # the review's trigger: a NaN member with every bit set, next to a PAD token: the member is picked, not the PAD
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


def test_coverage_nan_member_whose_sort_key_is_all_ones_is_still_a_member():
    # n = 8: index field 3 bits, chunk field 29 bits; token 7 with chunk 2^29 - 1 and an fp32 NaN packs to ~0 (the
    # coverage sort key, not a selection key): it stays a member, and ranks after every number of its label
    labels = np.array([PAD, 0, 1, 0, 0, PAD, 0, 0])
    ib = (len(labels) - 1).bit_length()
    scores = np.array([5.0, 0.5, 1.0, 0.25, 0.5, 9.0, 0.75, NAN32], dtype=np.float32)
    chunks = np.array([0, 3, 0, 3, 1, 0, 1, 2**29 - 1])
    key7 = (int(chunks[7]) << (32 + ib)) | (int(descending_key32(scores[7:])[0]) << ib) | 7
    assert key7 == int(NEVER)
    members = np.flatnonzero(labels == 0)
    t = tuple(torch.from_numpy(x)[None] for x in (scores, labels, chunks))
    for k in range(1, len(members) + 1):
        want = padded_oracle(*t, ((0, k, 0.5, None),), k + 1, None)[0]
        assert (7 in want.tolist()) == (k == len(members)), k
        assert np.array_equal(select_row(scores, labels, chunks, [(0, k, 0.5)], k + 1), want.numpy()), k
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
