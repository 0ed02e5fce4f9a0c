"""The one-CTA selection kernel's algorithm (csrc/kernels/select_cta.cuh), replayed step by step in numpy on CPU and
compared with the float64 references; plus the multi-CTA stage path (batched torch sorts), which runs on CPU as is.

No GPU is needed: the emulation mirrors the kernel's integer key packing, its bitonic network, the chunk-rank binary
search, the IEEE float64 value, the 8-pass radix select with its bin search, the tie scans and the row assembly. What
it cannot show is that the CUDA code matches it (races, barriers): tests/test_cuda_kernels.py does that on a GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from macer_kernels.cuda.stage import stage_select_sorts
from macer_kernels.reference import coverage_select_ref, topk_indices_ref
from macer_kernels.select import _coverage_select_torch, _topk_indices_torch

NEVER = np.uint64(2**64 - 1)
MAX_SORT = 1024 * 28  # kThreads * kMaxSortItems


def descending_key32(x: np.ndarray) -> np.ndarray:
    x = np.where(x == 0, np.float32(0), x.astype(np.float32))
    bits = x.view(np.uint32)
    asc = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))
    return ~asc


def descending_key64(x: np.ndarray) -> np.ndarray:
    x = np.where(x == 0, 0.0, x.astype(np.float64))
    bits = x.view(np.uint64)
    asc = np.where(bits >> np.uint64(63) == 1, ~bits, bits | np.uint64(1 << 63))
    return ~asc


def radix_select(keys: np.ndarray, k: int) -> tuple[int, int, int]:
    """(T, need, count) as the kernel's radix_select: 8 passes of 8-bit digits, the bin holding the need-th best."""
    prefix, need = 0, k
    count = 0
    for shift in range(56, -1, -8):
        if shift == 56:
            live = keys
        else:
            live = keys[((keys ^ np.uint64(prefix)) >> np.uint64(shift + 8)) == 0]
        digits = ((live >> np.uint64(shift)) & np.uint64(255)).astype(np.int64)
        hist = np.bincount(digits, minlength=256)
        cum = np.cumsum(hist)
        b = int(np.argmax(cum >= need))  # first bin whose inclusive count reaches need
        need -= int(cum[b] - hist[b])
        count = int(hist[b])
        prefix |= b << shift
    return prefix, need, count


def select_k(key: np.ndarray, score_key: np.ndarray, by_score: bool, k: int) -> np.ndarray:
    """The kernel's select_k: a bool mask of the k best by (key, then score key if by_score, then index)."""
    t1, need1, count1 = radix_select(key, k)
    split = by_score and need1 < count1
    t2, need2 = 0, need1
    if split:
        t2, need2, _ = radix_select(np.where(key == np.uint64(t1), score_key, NEVER), need1)
    tied = (key == np.uint64(t1)) & ((score_key == np.uint64(t2)) if split else True)
    rank = np.cumsum(tied) - tied  # the block scan's exclusive ranks in index order
    take = key < np.uint64(t1)
    if split:
        take |= (key == np.uint64(t1)) & (score_key < np.uint64(t2))
    return take | (tied & (rank < need2))


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


def coverage_keys(scores: np.ndarray, chunks: np.ndarray, member: np.ndarray, weight: float) -> np.ndarray:
    n = len(scores)
    assert n <= MAX_SORT
    ib = max(1, (n - 1).bit_length())
    cb = 32 - ib
    overflow = bool(((chunks[member] < 0) | (chunks[member] >= (1 << cb))).any())
    s32 = scores.astype(np.float32)
    value_keys = np.full(n, NEVER, dtype=np.uint64)
    t = np.zeros(n, dtype=np.int64)
    if not overflow:
        idx = np.arange(n, dtype=np.uint64)
        packed = np.where(member, (chunks.astype(np.uint64) << np.uint64(32 + ib))
                          | (descending_key32(s32).astype(np.uint64) << np.uint64(ib)) | idx, NEVER)
        packed = bitonic_sort(packed)
        assert np.all(packed[:-1] <= packed[1:])
        real = packed[packed != NEVER]
        tokens = (real & np.uint64((1 << ib) - 1)).astype(np.int64)
        field = real >> np.uint64(32 + ib)
        starts = np.searchsorted(field, field, side="left")  # the binary search for the chunk's first position
        ranks = np.arange(len(real)) - starts
        assert ranks.max(initial=0) < 2**16 and tokens.max(initial=0) < 2**16  # the (rank << 16 | token) packing
        t[tokens] = ranks
    else:  # the kernel's direct count of the chunk's tokens ahead
        for p in np.flatnonzero(member):
            same = member & (chunks == chunks[p])
            same[p] = False
            t[p] = int(np.sum(same & ((s32 > s32[p]) | ((s32 == s32[p]) & (np.arange(n) < p)))))
    v = scores.astype(np.float64) + np.sqrt(weight / (1.0 + t.astype(np.float64)))
    value_keys[member] = descending_key64(v[member])
    return value_keys


def select_row(scores, labels, chunks, modalities, out_len, keeps=None) -> np.ndarray:
    """The kernel's select_row for one row; labels None = every token a candidate of the single modality. ``keeps``:
    the row's budgets (its row of the [B, M] table), None = each modality's spec keep."""
    n = len(scores)
    picked = np.zeros(n, dtype=bool)
    listed = np.zeros(n, dtype=bool)
    score_key = descending_key64(scores.astype(np.float64))
    for m, (label, keep, weight) in enumerate(modalities):
        budget = keep if keeps is None else int(keeps[m])
        if budget < 0 or budget > keep:
            return np.full(out_len, -1)
        member = np.ones(n, dtype=bool) if labels is None else labels == label
        listed |= member
        if member.sum() < budget:
            return np.full(out_len, -1)
        if budget == 0:
            continue
        if weight is not None:
            key = coverage_keys(scores, chunks, member, weight)
        else:
            key = np.where(member, score_key, NEVER)
        picked |= select_k(key, score_key, weight is not None, budget)
    kept = picked if labels is None else picked | (~listed & (labels >= 0))
    total = int(kept.sum())
    if total > out_len:
        return np.full(out_len, -1)
    out = np.full(out_len, -1)
    out[out_len - total:] = np.flatnonzero(kept)  # right-aligned after the -1 fill
    return out


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
    return sorted({1, 2, 3, MAX_SORT - 1, MAX_SORT, *rng.integers(1, 3001, 300).tolist(), *powers} - {0})


def test_bitonic_schedule_with_skipped_comparators_sorts_every_size(seed):
    rng = np.random.default_rng(seed)
    for n in _schedule_sizes(rng):
        # few distinct values (kNever included) as well as distinct ones: the sort must not need distinct keys
        keys = rng.integers(0, 2**62, n, dtype=np.uint64)
        few = rng.choice(np.array([0, 5, 2**40, NEVER], dtype=np.uint64), n)
        for x in (keys, few):
            assert np.array_equal(bitonic_sort(x), np.sort(x)), f"seed={seed} n={n}"


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


@pytest.mark.parametrize("n", [16385, 20000, MAX_SORT])
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
