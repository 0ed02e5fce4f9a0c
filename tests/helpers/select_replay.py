"""The radix selection kernel (``csrc/kernels/select_cta.cuh``) replayed step by step in numpy, for CPU tests.

The replay follows the kernel's data and arithmetic rather than only its result: the row split over the CTAs of a
cluster (CTA r owns tokens ``[r * cap, (r + 1) * cap)``), the one-byte token codes and chunk bytes, the per-slot
counts and key OR / AND, the budgets, and per modality the take-all / select branch; for coverage the stable counting
passes of the rank sort (warp segments, the places from the exclusive scan over (digit, CTA, warp), the digits that
are skipped, the balanced placement of sorted positions over the CTAs, the rank pass) or the direct count for chunk
ids outside a byte, the float64 bonus table; the radix select's passes over the 96-bit composite (the pass geometry,
the cluster's summed histograms, the bin search of thread pairs, the four ways a pass ends, the candidate bitmap, the
small list ranked pairwise, the tie scan in index order across CTAs); and the row's output. Its constants are read
from the headers, its launch plan is checked against ``_C.select_cta_plan`` where the module is built, and every
sort pass checks itself against a stable sort. What it cannot show is that the CUDA code matches it (races,
barriers, the device's float conversions and shared-memory traffic): that is what ``pytest -m cuda`` is for.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

_CSRC = Path(__file__).resolve().parents[2] / "csrc"
_HEADER = (_CSRC / "kernels" / "select_cta.cuh").read_text()
_COMMON = (_CSRC / "kernels" / "common.cuh").read_text()
_LAUNCHERS = (_CSRC / "launchers.h").read_text()


def _constants(text: str, known: dict[str, int]) -> dict[str, int]:
    """Every ``constexpr <type> kName = <expr>;`` of a header whose expression is integer arithmetic on literals and
    earlier constants (``~0ull`` and ``~0ull - 1`` included)."""
    out = dict(known)
    for name, expr in re.findall(r"constexpr\s+(?:const\s+)?\w+\s+(k\w+)\s*=\s*([^;]+);", text):
        expr = re.sub(r"int64_t\{(\d+)\}", r"\1", expr.strip())
        expr = expr.replace("~0ull", str(2**64 - 1))
        expr = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)
        for other, value in out.items():
            expr = re.sub(rf"\b{other}\b", str(value), expr)
        if re.fullmatch(r"[0-9xXa-fA-F\s()+\-*/<>]+", expr):
            out[name] = int(eval(expr.replace("/", "//")))  # digits and operators only (checked above)
    return out


K = _constants(_HEADER, _constants(_LAUNCHERS, _constants(_COMMON, {})))
THREADS, WARPS = K["kThreads"], K["kWarps"]
SELECT_BITS, SELECT_BINS = K["kSelectBits"], K["kSelectBins"]
SORT_BITS, SORT_BINS = K["kSortBits"], K["kSortBins"]
SMALL, MAX_TABLE, MAX_CLUSTER, COMPOSITE_BITS = K["kSmall"], K["kMaxTable"], K["kMaxCluster"], K["kCompositeBits"]
CODE_KEPT, CODE_PAD, CHUNK_OVERFLOW = K["kCodeKept"], K["kCodePad"], K["kChunkOverflow"]
SINGLE_TOPK_MAX, CLUSTER_TOPK_TOKENS = K["kSingleTopKMax"], K["kClusterTopKTokens"]
SINGLE_COVERAGE_MAX, CLUSTER_COVERAGE_TOKENS = K["kSingleCoverageMax"], K["kClusterCoverageTokens"]
MAX_CLUSTER_COVERAGE_N, MAX_STAGE_MODALITIES = K["kMaxClusterCoverageN"], K["kMaxStageModalities"]
NAN_KEY32, NAN_KEY64 = np.uint32(K["kNanKey32"]), np.uint64(K["kNanKey64"])
LAYOUT_TOPK, LAYOUT_COVERAGE_SINGLE, LAYOUT_COVERAGE_CLUSTER = 0, 1, 2

# Shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin) on the two compiled architectures, and
# the kernels' static shared memory there (ptxas -v, nvcc 13.0; recorded in benchmarks/results/select_resources.json).
OPTIN_BYTES = {89: 99 * 1024, 90: 227 * 1024}
STATIC_SMEM = {89: 19920, 90: 19920}


# --- order keys (common.cuh) -----------------------------------------------------------------------------------------

def descending_key32(x: np.ndarray) -> np.ndarray:
    """The kernel's descending_key32: NaN by value (x != x) -> kNanKey32 whatever its bits, -0.0 as +0.0."""
    x = np.asarray(x).astype(np.float32)
    nan = np.isnan(x)
    bits = np.where((x == 0) | nan, np.float32(0), x).view(np.uint32)
    asc = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))
    return np.where(nan, NAN_KEY32, ~asc).astype(np.uint32)


def descending_key64(x: np.ndarray) -> np.ndarray:
    """The kernel's descending_key64: NaN by value -> kNanKey64, -0.0 as +0.0."""
    x = np.asarray(x).astype(np.float64)
    nan = np.isnan(x)
    bits = np.where((x == 0) | nan, 0.0, x).view(np.uint64)
    asc = np.where(bits >> np.uint64(63) == 1, ~bits, bits | np.uint64(1 << 63))
    return np.where(nan, NAN_KEY64, ~asc).astype(np.uint64)


def score_of_key(key: np.ndarray) -> np.ndarray:
    """The kernel's score_of_key: the float score of a 32-bit key, as float64 (-0.0 back as +0.0, NaN as a NaN)."""
    asc = ~np.asarray(key, dtype=np.uint32)
    bits = np.where(asc >> 31 == 1, asc & np.uint32(0x7FFFFFFF), ~asc).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def bonus(weight: float, t: np.ndarray) -> np.ndarray:
    """sqrt(lambda_c / (1 + t)) with the reference's float64 operations (each IEEE-rounded once)."""
    with np.errstate(invalid="ignore"):
        return np.sqrt(np.float64(weight) / (1.0 + np.asarray(t, dtype=np.float64)))


# --- the launch plan (csrc/select_cta.cu) ----------------------------------------------------------------------------

def align16(x: int) -> int:
    return (x + 15) // 16 * 16


def layout_bytes(cap: int, kind: int, wide: bool, table: int) -> int:
    """make_layout(cap, kind, wide, table).bytes: per CTA, each array 16-byte aligned."""
    words = -(-cap // 32)
    sizes = [cap * (8 if wide else 4), 4 * words, 4 * words, cap]
    if kind != LAYOUT_TOPK:
        item = 2 if kind == LAYOUT_COVERAGE_SINGLE else 8
        sizes += [cap, cap * item, cap * item]
        if kind == LAYOUT_COVERAGE_CLUSTER:
            sizes.append(2 * cap)
        sizes.append(8 * table)
    return sum(align16(s) for s in sizes)


def plan(n: int, coverage: bool, wide: bool, dynamic_bytes: int, max_cluster: int) -> tuple[int, int, int, int, int]:
    """select_cta_plan: (cluster, cap, layout, table, bytes); cluster 0 when n does not fit."""
    none = (0, 0, 0, 0, 0)
    if n < 1 or dynamic_bytes < 0 or (coverage and wide):
        return none
    max_cluster = max(1, min(max_cluster, MAX_CLUSTER))
    table = min(MAX_TABLE, n) if coverage else 0

    def fit(c: int, kind: int):
        cap = -(-n // c)
        if c > n or (kind == LAYOUT_COVERAGE_SINGLE and cap > 65535):
            return none
        nbytes = layout_bytes(cap, kind, wide, table)
        return (c, cap, kind, table, nbytes) if nbytes <= dynamic_bytes else none

    if not coverage:
        want = -(-n // CLUSTER_TOPK_TOKENS) if n > SINGLE_TOPK_MAX else 1
        order = [*range(min(want, max_cluster), max_cluster + 1), *range(1, min(want, max_cluster))]
        return next((p for c in order if (p := fit(c, LAYOUT_TOPK))[0]), none)
    clusters = max_cluster >= 2 and n <= MAX_CLUSTER_COVERAGE_N
    if clusters and n > SINGLE_COVERAGE_MAX:
        want = max(2, -(-n // CLUSTER_COVERAGE_TOKENS))
        for c in range(min(want, max_cluster), max_cluster + 1):
            if (p := fit(c, LAYOUT_COVERAGE_CLUSTER))[0]:
                return p
    if (p := fit(1, LAYOUT_COVERAGE_SINGLE))[0]:
        return p
    if clusters:
        for c in range(2, max_cluster + 1):
            if (p := fit(c, LAYOUT_COVERAGE_CLUSTER))[0]:
                return p
    return none


def max_n(coverage: bool, wide: bool, dynamic_bytes: int, max_cluster: int) -> int:
    """select_cta_max_n_for: the largest n the plan takes (its feasible n are 1..max_n)."""
    def fits(n: int) -> bool:
        return plan(n, coverage, wide, dynamic_bytes, max_cluster)[0] > 0

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < 2**40 and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- the radix select ------------------------------------------------------------------------------------------------

def pass_low(p: int, bits: int) -> int:
    return max(COMPOSITE_BITS - bits, COMPOSITE_BITS - SELECT_BITS * (p + 1))


def pass_width(p: int, bits: int) -> int:
    return COMPOSITE_BITS - SELECT_BITS * p - pass_low(p, bits)


def digit_of(hi: np.ndarray, lo: np.ndarray, p: int, bits: int) -> np.ndarray:
    """The kernel's digit_of on composites X = hi * 2^32 + lo (uint64 / uint32 arrays): bits [low, low + width)."""
    low, width = pass_low(p, bits), pass_width(p, bits)
    hi, lo = np.asarray(hi, dtype=np.uint64), np.asarray(lo, dtype=np.uint64)
    if low >= 32:
        v = hi >> np.uint64(low - 32)
    else:  # uint64 shifts wrap as the kernel's do
        v = (hi << np.uint64(32 - low)) | (lo >> np.uint64(low))
    return (v & np.uint64((1 << width) - 1)).astype(np.int64)


def find_bin(hist: np.ndarray, need: int) -> tuple[int, int, int]:
    """find_bin: thread t owns bins 2t and 2t + 1; its exclusive prefix over the pair sums; the thread whose pair
    holds the need-th candidate names the bin, the candidates below it and in it."""
    pairs = hist.reshape(-1, 2).sum(axis=1)
    excl = np.cumsum(pairs) - pairs
    (t,) = np.flatnonzero((excl < need) & (need <= excl + pairs))  # exactly one thread writes
    first = need <= excl[t] + hist[2 * t]
    b = 2 * t if first else 2 * t + 1
    return int(b), int(excl[t] if first else excl[t] + hist[2 * t]), int(hist[b])


NEXT, ALL, SMALL_SET, TIE = "next", "all", "small", "tie"


def select_best(ctas: list[np.ndarray], hi: np.ndarray, lo: np.ndarray, need: int, bits: int,
                trace: list | None = None) -> list:
    """select_best over the members of each CTA (``ctas[r]``: the members' global token indices, ascending; X of
    token i is hi[i] * 2^32 + lo[i]): the members taken, the ``need`` smallest X with ties to the lower index, as the
    kernel finds them. ``trace`` gets one (pass, bin, below, count, kind) per pass."""
    last = -(-bits // SELECT_BITS) - 1
    taken = [np.zeros(len(t), dtype=bool) for t in ctas]
    cand = [np.ones(len(t), dtype=bool) for t in ctas]  # pass 0: every member
    hist = sum(np.bincount(digit_of(hi[t], lo[t], 0, bits), minlength=SELECT_BINS) for t in ctas)
    p = 0
    while True:
        b, below, cnt = find_bin(hist, need)
        need -= below
        kind = ALL if cnt == need else TIE if p == last else SMALL_SET if cnt <= SMALL else NEXT
        if trace is not None:
            trace.append((p, b, below, cnt, kind))
        nxt = np.zeros(SELECT_BINS, dtype=np.int64)
        for r, tokens in enumerate(ctas):
            d = digit_of(hi[tokens], lo[tokens], p, bits)
            taken[r] |= cand[r] & ((d < b) | ((kind == ALL) & (d == b)))
            cand[r] &= (kind != ALL) & (d == b)
            if kind == NEXT and cand[r].any():
                t = tokens[cand[r]]
                nxt += np.bincount(digit_of(hi[t], lo[t], p + 1, bits), minlength=SELECT_BINS)
        if kind == NEXT:
            hist, p = nxt, p + 1
            continue
        if kind == SMALL_SET:  # every CTA's small list, each entry ranked by (X, token) against all of them
            entries = [(int(hi[i]), int(lo[i]), int(i)) for r, tokens in enumerate(ctas) for i in tokens[cand[r]]]
            assert len(entries) == cnt <= SMALL
            for r, tokens in enumerate(ctas):
                for j in np.flatnonzero(cand[r]):
                    mine = (int(hi[tokens[j]]), int(lo[tokens[j]]), int(tokens[j]))
                    taken[r][j] |= sum(e < mine for e in entries) < need
        if kind == TIE:  # the tie group in index order across the CTAs
            group = np.concatenate([tokens[cand[r]] for r, tokens in enumerate(ctas)])
            assert len(set(zip(hi[group].tolist(), lo[group].tolist(), strict=True))) == 1 and cnt > need
            before = 0
            for r in range(len(ctas)):
                for j in np.flatnonzero(cand[r]):
                    taken[r][j] |= before < need
                    before += 1
        break
    return [tokens[t] for tokens, t in zip(ctas, taken, strict=True)]


# --- coverage ranks --------------------------------------------------------------------------------------------------

def counting_pass(seqs: list[np.ndarray], digit, rank_only: bool, members: int) -> tuple[list, np.ndarray | None]:
    """One stable counting pass over the row's items (``seqs[r]``: CTA r's items in order, each a global token
    index): per CTA, warp w owns items [w * seg, (w + 1) * seg), seg = ceil(len / warps); the place of an item is
    base[d] (the items of smaller digits in every CTA, and of digit d in lower CTAs) + the items of digit d in the
    CTA's lower warps + those earlier in its own warp. Returns the next per-CTA sequences (sorted position q in CTA
    q // per at q % per, per = ceil(members / C)) or, with ``rank_only``, each item's rank among the earlier items of
    its digit (as {token: rank})."""
    c = len(seqs)
    digits = [np.asarray(digit(np.asarray(s, dtype=np.int64)), dtype=np.int64) for s in seqs]
    counts = np.zeros((c, WARPS, SORT_BINS), dtype=np.int64)
    within = []
    for r, (s, d) in enumerate(zip(seqs, digits, strict=True)):
        seg = max(1, -(-len(s) // WARPS))
        warp = np.arange(len(s)) // seg
        group = warp * SORT_BINS + d
        order = np.argsort(group, kind="stable")  # by (warp, digit), positions ascending inside
        starts = np.searchsorted(group[order], group[order], side="left")
        earlier = np.empty(len(s), dtype=np.int64)
        earlier[order] = np.arange(len(s)) - starts  # items of the same digit earlier in the same warp
        counts[r] = np.bincount(group, minlength=WARPS * SORT_BINS).reshape(WARPS, SORT_BINS)
        within.append((warp, earlier))
    assert counts.max(initial=0) < 2**16  # the kernel's 16-bit per-warp counters
    lower_warps = np.cumsum(counts, axis=1) - counts  # [C, W, D]
    totals = counts.sum(axis=1)  # [C, D]
    all_digits = totals.sum(axis=0)
    digits_before = np.cumsum(all_digits) - all_digits
    lower_ctas = np.cumsum(totals, axis=0) - totals  # [C, D]
    places = []
    for r, (d, (warp, earlier)) in enumerate(zip(digits, within, strict=True)):
        base = lower_ctas[r] + (0 if rank_only else digits_before)
        places.append(base[d] + lower_warps[r, warp, d] + earlier)
    flat_items = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    flat_digits = np.concatenate(digits)
    flat_places = np.concatenate(places)
    if rank_only:
        want = np.zeros(len(flat_items), dtype=np.int64)  # rank among equal digits, in sequence order
        for dig in np.unique(flat_digits):
            same = np.flatnonzero(flat_digits == dig)
            want[same] = np.arange(len(same))
        assert np.array_equal(flat_places, want)
        return [], dict(zip(flat_items.tolist(), flat_places.tolist(), strict=True))
    assert np.array_equal(np.sort(flat_places), np.arange(members))  # a permutation of the positions
    order = np.empty(members, dtype=np.int64)
    order[flat_places] = flat_items
    assert np.array_equal(order, flat_items[np.argsort(flat_digits, kind="stable")])  # a stable sort by digit
    per = -(-members // c)
    return [order[r * per:(r + 1) * per] for r in range(c)], None


def coverage_ranks(ctas: list[np.ndarray], key32: np.ndarray, chunk8: np.ndarray, row_or: int, row_and: int,
                   trace: dict | None = None) -> dict:
    """ranks_single / ranks_cluster: each member's rank in its chunk by (score key asc, index asc), from the members
    in index order through the score passes whose digit varies, then the rank pass over the chunk byte."""
    m = sum(len(s) for s in ctas)
    seqs = [np.asarray(s, dtype=np.int64) for s in ctas]
    varies = row_or ^ row_and
    ran = []
    for p in range(4):
        shift = 8 * p
        if (varies >> shift) & 255 == 0:
            continue
        ran.append(p)
        seqs, _ = counting_pass(seqs, lambda t, s=shift: (key32[t].astype(np.int64) >> s) & 255, False, m)
    _, ranks = counting_pass(seqs, lambda t: chunk8[t], True, m)
    if trace is not None:
        trace["sort_passes"] = ran
    return ranks


def direct_ranks(members: np.ndarray, key32: np.ndarray, chunk_ids: np.ndarray) -> dict:
    """ranks_direct: for chunk ids outside a byte, each member counts the members of its chunk ahead of it."""
    ranks = {}
    for i in members:
        same = members[(chunk_ids[members] == chunk_ids[i]) & (members != i)]
        ranks[int(i)] = int(np.sum((key32[same] < key32[i]) | ((key32[same] == key32[i]) & (same < i))))
    return ranks


# --- the row ---------------------------------------------------------------------------------------------------------

def _is_finite_key(key: np.ndarray, wide: bool) -> np.ndarray:
    if wide:
        special = descending_key64(np.array([np.inf, -np.inf]))
        return (key != NAN_KEY64) & (key != special[0]) & (key != special[1])
    special = descending_key32(np.array([np.inf, -np.inf], dtype=np.float32))
    return (key != NAN_KEY32) & (key != special[0]) & (key != special[1])


def replay_row(scores, labels, chunk_ids, modalities, out_len, keeps=None, cluster=1, trace=None):
    """One row through the kernel: ``modalities`` a list of (label, keep, coverage_weight or None), ``keeps`` the
    row's budgets (its row of the [B, M] table) or None, ``cluster`` the CTAs of the row. Returns (out [out_len], the
    row's non-finite flag). ``trace`` (a dict) gets, per modality slot, the path taken and the select's passes."""
    scores = np.asarray(scores)
    n = len(scores)
    wide = scores.dtype == np.float64
    if wide:
        assert not any(w is not None for _, _, w in modalities), "coverage takes 32-bit keys: float64 goes elsewhere"
    key = descending_key64(scores) if wide else descending_key32(scores.astype(np.float32))
    m_count = len(modalities)
    # codes: the modality slot of the label (the first that matches), else kept as is (>= 0) or padding (< 0)
    if labels is None:
        code = np.zeros(n, dtype=np.int64)
    else:
        labels = np.asarray(labels).astype(np.int64)
        code = np.where(labels < 0, CODE_PAD, CODE_KEPT)
        for s in reversed(range(m_count)):
            code = np.where(labels == modalities[s][0], s, code)
    coverage_slots = {s for s, (_, _, w) in enumerate(modalities) if w is not None}
    chunk8 = np.zeros(n, dtype=np.int64)
    if coverage_slots:
        cov = np.isin(code, list(coverage_slots))
        c = np.asarray(chunk_ids).astype(np.int64)
        chunk8 = np.where(cov, np.where((c >= 0) & (c < CHUNK_OVERFLOW), c, CHUNK_OVERFLOW), 0)
    cap = -(-n // cluster)
    cta_of = np.arange(n) // cap
    counts = [int((code == s).sum()) for s in range(m_count)]
    nonfinite = bool(((code < m_count) & ~_is_finite_key(key, wide)).any())
    budgets = [int(k) if keeps is None else int(keeps[s]) for s, (_, k, _) in enumerate(modalities)]
    valid = all(0 <= b <= spec[1] and b <= c for b, spec, c in zip(budgets, modalities, counts, strict=True))
    kept = code == CODE_KEPT
    for s, (_, _, weight) in enumerate(modalities):
        if not valid:
            break
        k, record = budgets[s], ({} if trace is None else trace.setdefault(s, {}))
        members = np.flatnonzero(code == s)
        if k == 0:
            record["path"] = "none"
            continue
        if k == counts[s]:
            record["path"] = "all"
            kept[members] = True
            continue
        ctas = [members[cta_of[members] == r] for r in range(cluster)]
        hi = np.zeros(n, dtype=np.uint64)
        lo = np.zeros(n, dtype=np.uint32)
        if weight is None:  # X: the key in the composite's top bits
            bits = 64 if wide else 32
            hi[members] = key[members] if wide else key[members].astype(np.uint64) << np.uint64(32)
        else:  # X: (key of v, score key)
            bits = COMPOSITE_BITS
            key32 = key.astype(np.uint32)
            if (chunk8[members] == CHUNK_OVERFLOW).any():
                ranks = direct_ranks(members, key32, np.asarray(chunk_ids).astype(np.int64))
                record["ranks"] = "direct"
            else:
                member_keys = key32[members].astype(np.int64)
                row_or = int(np.bitwise_or.reduce(member_keys))
                row_and = int(np.bitwise_and.reduce(member_keys))
                ranks = coverage_ranks(ctas, key32, chunk8, row_or, row_and, record)
                record["ranks"] = "sort"
            t = np.array([ranks[int(i)] for i in members], dtype=np.int64)
            assert t.max(initial=0) < 2**16  # the kernel's 16-bit rank slots
            record["table_misses"] = int((t >= min(MAX_TABLE, n)).sum())
            hi[members] = descending_key64(score_of_key(key32[members]) + bonus(weight, t))
            lo[members] = key32[members]
        passes = record.setdefault("passes", [])
        for picked in select_best(ctas, hi, lo, k, bits, passes):
            kept[picked] = True
        record["path"] = "select"
    out = np.full(out_len, -1, dtype=np.int64)
    total = int(kept.sum())
    if valid and total <= out_len:
        out[out_len - total:] = np.flatnonzero(kept)  # each CTA after the kept tokens of the lower ones
    return out, nonfinite


def replay_launch(scores, labels, chunk_ids, modalities, out_len, out_stride, keeps=None, cluster=1, flags=False):
    """select_cta_kernel over B rows: row b writes out[b * out_stride:][:out_len] of one flat buffer (entries between
    rows untouched, here -7) and, with ``flags``, nonfinite[b]. Returns (out, nonfinite)."""
    b = scores.shape[0]
    out = np.full(max(0, (b - 1) * out_stride) + out_len, -7)
    nonfinite = np.zeros(b, dtype=bool)
    table = None if keeps is None else np.asarray(keeps, dtype=np.int32).reshape(-1)
    m = len(modalities)
    for row in range(b):
        budgets = None if table is None else table[row * m:(row + 1) * m]
        got, bad = replay_row(scores[row], None if labels is None else labels[row],
                              None if chunk_ids is None else chunk_ids[row], modalities, out_len, budgets, cluster)
        out[row * out_stride:row * out_stride + out_len] = got
        nonfinite[row] = bad and flags
    return out, nonfinite


def cluster_for(n: int, coverage: bool, wide: bool = False, arch: int = 90) -> int:
    """The cluster size the launcher picks for a row of n tokens on sm_90 (clusters of up to MAX_CLUSTER) or sm_89
    (none)."""
    c = plan(n, coverage, wide, OPTIN_BYTES[arch] - STATIC_SMEM[arch], MAX_CLUSTER if arch >= 90 else 1)[0]
    assert c > 0, f"n = {n} does not fit on sm_{arch}"
    return c


def bonus_reference(weight: float, t: int) -> float:
    """The bonus as the float64 reference writes it (Python floats: IEEE double, one rounding per operation)."""
    return math.sqrt(weight / (1.0 + t))
