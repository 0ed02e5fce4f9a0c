"""The CUDA scoring kernels (csrc/kernels/modality_scores.cuh), replayed step by step in numpy on CPU and compared
with the float64 reference ``modality_scores_ref``.

No GPU is needed: the replay follows the kernels' loop structure and fp32 arithmetic -- the host's split count and
tile ranges, the row tiles of 32 query rows, per K tile the visibility test (causal limit, N tail, PAD keys), the
tile's (max, sum of exp2) per label merged into a running pair in the kernel's order (4 threads per row, then two
shuffles), one partial per (row, label, split) at the flat index the kernel writes (inside the workspace bound of
``modality_scores_workspace_bytes``), the combine's per-lane merge over splits and its butterfly reductions, and the
reduce (8 warps splitting the rows, summed in warp order). It shares its arithmetic helpers with the kernels rather
than re-deriving them: the split plan, ``split_begin`` and ``key_visible`` are the header's own functions called
through ``_C`` (so an off-by-one planted in the causal limit or in ``split_begin`` fails here), and every constant
comes from ``_C.MODALITY_SCORES_CONSTANTS``, compiled from the header. Dot products are numpy's fp32 matmul rather
than WMMA's order of accumulation (both fp32, rounding-level apart). What the replay cannot show is that the CUDA
code matches it (barriers, races, the K staging, see docs/cuda.md): the ``cuda``-marked tests at the end, and
tests/test_cuda_kernels.py, do that on a GPU.

PAD keys (label -1, a batch's padding: excluded from every row's softmax): the oracle is the contract's own, each
sample's scores on its non-PAD keys equal the reference run on that sample alone with the PAD keys removed and the
positions shifted, PAD keys score exactly 0; the reference run on the padded batch is checked to agree with it.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from macer_kernels.reference import modality_scores_ref

# The replay calls the kernels' own host helpers and reads their constants from the compiled module (built from
# csrc/kernels/modality_scores.cuh): without the extension there is nothing to replay.
_C = pytest.importorskip("macer_kernels._C")
K = dict(_C.MODALITY_SCORES_CONSTANTS)

ROW_TILE = K["row_tile"]
WARPS = K["warps"]
ROWS_PER_WARP = K["rows_per_warp"]
THREADS_PER_ROW = K["threads_per_row"]
NUM_LABELS = K["num_labels"]
MIN_KEYS_PER_TILE = K["min_keys_per_tile"]
MAX_SPLITS = K["max_splits"]
REDUCE_WARPS = K["reduce_warps"]
REDUCE_KEYS = K["reduce_keys"]
REDUCE_UNROLL = K["reduce_unroll"]
KEYS_CODE = {K["keys_fp32"]: 0, K["keys_bf16"]: 2}  # keys per tile -> a dtype code with that tile (fp32, bf16)
LOG2E = 1.4426950408889634
F32 = np.float32
NEG_INF = F32(-np.inf)


def test_the_module_reports_the_kernels_layout():
    """The constants the replay runs on are those the kernels were compiled with; the mappings they imply hold."""
    assert K["threads"] == 32 * WARPS and ROWS_PER_WARP * WARPS == ROW_TILE and THREADS_PER_ROW * ROWS_PER_WARP == 32
    assert K["keys_fp32"] == K["keys_fp64"] == 32 and K["keys_fp16"] == K["keys_bf16"] == 64
    assert K["combine_threads"] == 32 * NUM_LABELS and REDUCE_KEYS == 32
    assert _C.MAX_MODALITIES + 1 == NUM_LABELS


# ---- host side: splits, tile ranges, workspace ---------------------------------------------------------------------

def max_splits(n: int) -> int:
    return min(-(-n // MIN_KEYS_PER_TILE), MAX_SPLITS)


def split_plan(keys: int, n: int, kv_heads: int, batch: int, wave: int) -> tuple[int, int, int, int]:
    """The launcher's (tiles, splits, split_tiles, split_extra) for a wave of `wave` CTAs: _C's own arithmetic."""
    return tuple(_C.modality_scores_split_plan(KEYS_CODE[keys], batch, kv_heads, n, wave))


def host_splits(keys: int, n: int, kv_heads: int, batch: int, wave: int) -> int:
    return split_plan(keys, n, kv_heads, batch, wave)[1]


def split_begin(split: int, split_tiles: int, split_extra: int) -> int:
    return _C.modality_scores_split_begin(split, split_tiles, split_extra)


def _align(x: int) -> int:
    return (x + 255) // 256 * 256


def workspace_layout(b: int, hq: int, lq: int, n: int) -> tuple[int, int, int, int]:
    """carve(): byte offsets of (logits, partial, stats) and the total (modality_scores_workspace_bytes)."""
    rows = hq * lq
    logits = _align(4 * b * rows * n)
    partial = _align(8 * b * rows * NUM_LABELS * max_splits(n))
    return 0, logits, logits + partial, logits + partial + _align(8 * b * rows * NUM_LABELS)


@pytest.mark.parametrize("tiles", [1, 2, 3, 7, 64, 313, 1563, 5000])
def test_splits_cover_every_tile_once_with_lengths_differing_by_at_most_one(tiles):
    """_C.modality_scores_split_begin is the kernel's split_begin (an off-by-one planted there fails here)."""
    for splits in sorted({1, 2, 3, 5, 31, 32, 33, 132, 792, tiles} & set(range(1, tiles + 1))):
        q, extra = divmod(tiles, splits)
        bounds = [split_begin(s, q, extra) for s in range(splits + 1)]
        lengths = np.diff(bounds)
        assert bounds[0] == 0 and bounds[-1] == tiles, (tiles, splits)
        assert lengths.min() >= 1 and lengths.max() - lengths.min() <= 1, (tiles, splits)


def _wave_cost(splits: int, tiles: int, ctas: int, wave: int) -> int:
    """The plan's time model: waves of CTAs x (tiles per split + about one tile of fixed work per CTA)."""
    return math.ceil(splits * ctas / wave) * (math.ceil(tiles / splits) + 1)


@pytest.mark.parametrize(("n", "hkv", "b", "wave"), [(2400, 4, 1, 660), (20000, 4, 1, 660), (100000, 4, 1, 660),
                                                     (100000, 1, 1, 2368), (5, 2, 3, 100), (40, 8, 64, 792),
                                                     (2400, 4, 100, 660), (20000, 4, 100, 660), (100000, 4, 37, 660),
                                                     (20000, 4, 160, 660), (777, 3, 2, 1), (10 ** 6, 1, 1, 5000)])
def test_split_count_fills_whole_waves_within_the_workspace(n, hkv, b, wave):
    """Item 5 of issue 20: the split count keeps the grid close to whole waves. Against a brute force over every
    split count, the plan's modelled time (waves x tiles per split) is within 2 % of the best; the old rule (at most
    one wave, rounded down) ran B = 100, Hkv = 4 on a 660-CTA wave as one 61 % full wave of whole-row CTAs."""
    for keys in (32, 64):
        tiles, splits, split_tiles, split_extra = split_plan(keys, n, hkv, b, wave)
        assert tiles == -(-n // keys) and (split_tiles, split_extra) == divmod(tiles, splits)
        limit = min(tiles, max_splits(n))
        assert 1 <= splits <= limit
        best = min(_wave_cost(s, tiles, hkv * b, wave) for s in range(1, limit + 1))
        assert _wave_cost(splits, tiles, hkv * b, wave) <= 1.02 * best, (keys, n, hkv, b, wave, splits)
        if splits * hkv * b <= wave:  # within one wave: as many splits as fit (the shortest splits)
            assert splits == limit or (splits + 1) * hkv * b > wave, (keys, n, hkv, b, wave, splits)
    assert host_splits(64, 2400, 4, 100, 660) > 1


def test_split_plan_rejects_empty_shapes():
    with pytest.raises(ValueError, match="split plan: B, Hkv, N and wave must be >= 1"):
        _C.modality_scores_split_plan(2, 1, 1, 0, 1)


def test_module_rejects_more_rows_than_the_combine_grid_takes():
    """The combine runs one block per query row (grid.x < 2^31) and the tile kernel's row math is 32-bit."""
    with pytest.raises(ValueError, match=re.escape("B * Hq * Lq must be at most 2^31 - 1 (CUDA grid limit)")):
        _C.modality_scores(0, 0, 0, 0, 0, 0, 2, 8, 8, (65535, 65535, 1, 64, 1, 16), (1, 1, 1, 1), (1, 1, 1),
                           (1, 1), (1, 1), 0.1, 1e-6, 0, 0)


def test_workspace_bytes_match_the_replayed_layout():
    for b, hq, lq, n in [(1, 28, 4, 2400), (1, 28, 4, 100000), (3, 8, 5, 1), (2, 4, 17, 33), (1, 1, 1, 32769 * 32)]:
        assert _C.modality_scores_workspace_bytes(b, hq, lq, n) == workspace_layout(b, hq, lq, n)[3]


def test_key_visibility_is_the_causal_limit_the_tail_and_pad():
    """_C.modality_scores_visible is the kernel's key_visible (an off-by-one planted in the causal limit fails here
    and in every replay below): key n is visible to a row at position pos iff n < N, n <= pos and its label >= 0."""
    keys = list(range(12))
    labels = [0, 1, -1, 2, 8, 0, -1, 3, 1, 1, 0, 2]
    positions = [0, 3, 5, 9, 11, 20]
    got = np.array(_C.modality_scores_visible(keys, labels, 10, positions)).reshape(len(positions), len(keys))
    n, lab, pos = np.array(keys)[None], np.array(labels)[None], np.array(positions)[:, None]
    assert np.array_equal(got, (n < 10) & (n <= pos) & (lab >= 0))


# ---- the kernels ---------------------------------------------------------------------------------------------------

def butterfly_sum(v: np.ndarray) -> np.ndarray:
    """An xor-shuffle sum over the last axis (its lanes: 32 for warp_sum, THREADS_PER_ROW for the tile epilogue's
    row groups), offsets from the largest down as warp_sum does, in fp32; returns lane 0's value (every lane ends
    with the same one: fp32 addition is commutative)."""
    v = v.astype(F32)
    lanes = np.arange(v.shape[-1])
    off = v.shape[-1] // 2
    while off:
        v = (v + v[..., lanes ^ off]).astype(F32)
        off //= 2
    return v[..., 0]


def row_group_sum(v: np.ndarray) -> np.ndarray:
    """The epilogue's per-row sum: offsets 1, 2 (ascending, as the kernel's loop runs) over the row's threads."""
    v = v.astype(F32)
    lanes = np.arange(v.shape[-1])
    off = 1
    while off < v.shape[-1]:
        v = (v + v[..., lanes ^ off]).astype(F32)
        off *= 2
    return v[..., 0]


def warp_sum(v: np.ndarray) -> np.ndarray:
    """warp_sum: the xor butterfly over 32 lanes (offsets 16 .. 1)."""
    return butterfly_sum(v)


def tile_kernel(q, k, labels, positions, scale_log2, keys, splits, logits, partial):
    """scores_tile_kernel over the whole grid (splits, Hkv, B). q [B,Hq,Lq,D], k [B,Hkv,N,D] fp32 values; writes the
    flat logits and partial arrays at the kernel's indices. Split ranges and visibility come from the kernel's own
    helpers (_C.modality_scores_split_begin, _C.modality_scores_visible); the epilogue's sums follow its order
    (THREADS_PER_ROW threads per row, each over keys g + THREADS_PER_ROW u, then two xor shuffles)."""
    b_n, hq, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    tiles = -(-n // keys)
    split_tiles, split_extra = divmod(tiles, splits)
    group, rows_per_batch = hq // hkv, hq * lq
    rows = group * lq
    for b in range(b_n):
        for kvh in range(hkv):
            for split in range(splits):
                t_first = split_begin(split, split_tiles, split_extra)
                t_end = split_begin(split + 1, split_tiles, split_extra)
                for r0 in range(0, rows, ROW_TILE):
                    rr = np.arange(r0, min(rows, r0 + ROW_TILE))
                    h, qi = kvh * group + rr // lq, rr % lq
                    qtile, pos = q[b, h, qi], positions[b, qi]
                    row_index = b * rows_per_batch + kvh * rows + rr
                    run_max = np.full((len(rr), NUM_LABELS), NEG_INF)
                    run_sum = np.zeros((len(rr), NUM_LABELS), F32)
                    broken = np.zeros(len(rr), bool)
                    for t in range(t_first, t_end):
                        keys_n = t * keys + np.arange(keys)
                        exists = keys_n < n
                        lab = np.full(keys, -1)
                        lab[exists] = labels[b, keys_n[exists]]
                        present = sorted({int(x) for x in lab if 0 <= x < NUM_LABELS})
                        ktile = np.zeros((keys, q.shape[-1]), F32)
                        ktile[exists] = k[b, kvh, keys_n[exists]]
                        s = (qtile @ ktile.T).astype(F32)
                        logit = (s * scale_log2).astype(F32)
                        # The kernel's own visibility test (key_visible: the causal limit, the N tail, PAD).
                        visible = np.array(_C.modality_scores_visible(keys_n.tolist(), lab.tolist(), n,
                                                                      pos.tolist()), bool).reshape(len(rr), keys)
                        v = np.where(visible, logit, NEG_INF)
                        broken |= (visible & ~np.isfinite(logit)).any(axis=1)
                        logits[row_index[:, None] * n + keys_n[exists][None]] = v[:, exists]
                        for m in present:
                            in_m = np.broadcast_to(lab[None] == m, v.shape)
                            mx = np.where(in_m, v, NEG_INF).max(axis=1)  # the row group's max: exact
                            merge = mx != NEG_INF  # rows without a visible key of m here keep their pair
                            ref = np.maximum(run_max[:, m], mx)
                            terms = np.where(in_m & (v != NEG_INF), np.exp2(v - ref[:, None]), F32(0))
                            # Thread g of the row's group sums keys g, g + THREADS_PER_ROW, ... in that order.
                            part = np.zeros((len(rr), THREADS_PER_ROW), F32)
                            for u in range(keys // THREADS_PER_ROW):
                                part = (part + terms[:, THREADS_PER_ROW * u:THREADS_PER_ROW * (u + 1)]).astype(F32)
                            total = row_group_sum(part)
                            scaled = (run_sum[:, m] * np.exp2(run_max[:, m] - ref)).astype(F32)
                            run_sum[:, m] = np.where(merge, (scaled + total).astype(F32), run_sum[:, m])
                            run_max[:, m] = np.where(merge, ref, run_max[:, m])
                    for m in range(NUM_LABELS):
                        at = (row_index * NUM_LABELS + m) * splits + split
                        partial[at, 0] = np.where(broken, NEG_INF, run_max[:, m])
                        partial[at, 1] = np.where(broken, F32(np.nan), run_sum[:, m])


def combine_kernel(partial, stats, total_rows, splits, eps):
    """scores_combine_kernel: block per row, warp m per label; lane l merges splits l, l + 32, ... in that order."""
    eps = F32(eps)
    for row in range(total_rows):
        at = (row * NUM_LABELS + np.arange(NUM_LABELS)[:, None]) * splits + np.arange(splits)[None]  # [9, splits]
        pm = partial[at]
        mx = np.full((NUM_LABELS, 32), NEG_INF)
        sm = np.zeros((NUM_LABELS, 32), F32)
        broken = bool(np.isnan(pm[..., 1]).any())
        for i in range(splits):
            lane, px, py = i % 32, pm[:, i, 0], pm[:, i, 1]
            seen = px != NEG_INF
            up = seen & (px > mx[:, lane])
            keep = seen & ~up
            up_sum = (sm[:, lane] * np.exp2(mx[:, lane] - px) + py).astype(F32)
            keep_sum = (sm[:, lane] + py * np.exp2(px - mx[:, lane])).astype(F32)
            sm[:, lane] = np.where(up, up_sum, np.where(keep, keep_sum, sm[:, lane]))
            mx[:, lane] = np.where(up, px, mx[:, lane])
        label_max = mx.max(axis=1)
        label_sum = warp_sum(np.where(mx == NEG_INF, F32(0), sm * np.exp2(mx - label_max[:, None])))
        row_max = label_max.max()
        z = F32(0)
        for m in range(NUM_LABELS):
            if label_max[m] != NEG_INF:
                z = F32(z + label_sum[m] * np.exp2(label_max[m] - row_max))
        for m in range(NUM_LABELS):
            if broken:
                inv = F32(np.nan)
            elif label_max[m] == NEG_INF:
                inv = F32(0)
            else:
                eps_term = F32(eps * z * np.exp2(row_max - label_max[m])) if eps > 0 else F32(0)
                inv = F32(1) / F32(label_sum[m] + eps_term)
            stats[row * NUM_LABELS + m] = (label_max[m], inv)


def reduce_kernel(logits, stats, labels, rows_per_batch, out):
    """scores_reduce_kernel: per key, warp w sums rows w, w + REDUCE_WARPS, ... in order (its unrolled loads keep
    that order), then the warps' sums are added in warp order, / rows."""
    b_n, n = labels.shape
    for b in range(b_n):
        m = labels[b]
        scored = (m > 0) & (m < NUM_LABELS)  # -1 (PAD) and 0 never index stats
        keys_n = np.nonzero(scored)[0]
        total = np.zeros(len(keys_n), F32)
        for w in range(REDUCE_WARPS):
            acc = np.zeros(len(keys_n), F32)
            for r in range(w, rows_per_batch, REDUCE_WARPS):
                row = b * rows_per_batch + r
                lg = logits[row * n + keys_n]
                st = stats[row * NUM_LABELS + m[scored]]
                p = np.where(lg == NEG_INF, F32(0), np.exp2(lg - st[:, 0]))
                acc = (acc + (p * st[:, 1]).astype(F32)).astype(F32)
            total = (total + acc).astype(F32)
        out[b] = 0
        out[b, keys_n] = (total / F32(rows_per_batch)).astype(F32)


def replay(q, k, labels, positions, scale, eps, *, keys, splits=None, wave=792):
    """The three launches on fp32 numpy arrays, in flat buffers laid out as the workspace (an index past the bound
    raises IndexError). Returns the [B, N] float32 scores."""
    b_n, hq, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    tiles = -(-n // keys)
    splits = host_splits(keys, n, hkv, b_n, wave) if splits is None else splits
    assert 1 <= splits <= min(tiles, max_splits(n))
    off = workspace_layout(b_n, hq, lq, n)
    logits = np.full((off[1] - off[0]) // 4, F32(np.nan))  # NaN: a logit the reduce reads but nobody wrote shows
    partial = np.full(((off[2] - off[1]) // 8, 2), F32(np.nan))
    stats = np.full(((off[3] - off[2]) // 8, 2), F32(np.nan))
    scale_log2 = F32(np.float64(scale) * LOG2E)
    with np.errstate(invalid="ignore", over="ignore"):
        tile_kernel(q, k, labels, positions, scale_log2, keys, splits, logits, partial)
        combine_kernel(partial, stats, b_n * hq * lq, splits, eps)
        out = np.empty((b_n, n), F32)
        reduce_kernel(logits, stats, labels, hq * lq, out)
    return out


# ---- oracle and inputs ---------------------------------------------------------------------------------------------

def pad_oracle(q, k, labels, positions, scale, eps) -> torch.Tensor:
    """Each sample alone on its non-PAD keys (positions shifted), through modality_scores_ref; PAD keys score 0."""
    q, k = torch.from_numpy(q).double(), torch.from_numpy(k).double()
    labels, positions = torch.from_numpy(labels), torch.from_numpy(positions)
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for b in range(labels.shape[0]):
        real = labels[b] != -1
        idx = real.nonzero().flatten()
        assert bool(real[positions[b]].all()), "query positions must point at real keys"
        shifted = torch.cumsum(real.long(), 0)[positions[b]] - 1
        out[b, idx] = modality_scores_ref(q[b:b + 1], k[b:b + 1][:, :, idx], labels[b:b + 1, idx], shifted[None],
                                          scale=scale, eps=eps)[0]
    return out


def make_case(seed, b, hq, hkv, lq, n, d, *, labels=4, pad=0, scattered_pad=0, bf16=False):
    """Random q/k (k sharper than unit logits), labels in 0..labels-1, left padding of up to `pad` keys per sample
    (sample 0 unpadded) plus `scattered_pad` PAD keys anywhere, positions on real keys at or after N/3."""
    g = np.random.default_rng(seed)
    q = g.standard_normal((b, hq, lq, d)).astype(F32)
    k = (2.0 * g.standard_normal((b, hkv, n, d))).astype(F32)
    if bf16:  # the values a bf16 tensor holds, exactly representable in fp32 (WMMA multiplies them exactly)
        q = torch.from_numpy(q).bfloat16().float().numpy()
        k = torch.from_numpy(k).bfloat16().float().numpy()
    lab = g.integers(0, labels, (b, n))
    for i in range(1, b):
        lab[i, :int(g.integers(0, pad + 1))] = -1
    if scattered_pad:
        lab[g.integers(0, b, scattered_pad), g.integers(0, n, scattered_pad)] = -1
    positions = np.zeros((b, lq), np.int64)
    for i in range(b):
        real = np.nonzero(lab[i] != -1)[0]
        if len(real) == 0:
            lab[i, -1] = 1
            real = np.array([n - 1])
        late = real[real >= n // 3]
        positions[i] = g.choice(late if len(late) else real, lq)
    return q, k, lab, positions


def check(seed, case, out, ref, labels, tol=2e-6):
    msg = f"seed={seed} {case}"
    assert out.shape == tuple(ref.shape), msg
    out64 = torch.from_numpy(out).double()
    assert not torch.isnan(out64).any(), msg
    assert torch.all(out64[torch.from_numpy(labels) <= 0] == 0), f"{msg}: text and PAD keys must score exactly 0"
    err = (out64 - ref).abs().max().item()
    assert err <= tol * max(ref.abs().max().item(), 1e-30), f"{msg}: max error {err} vs max {ref.abs().max()}"


CASES = {  # (b, hq, hkv, lq, n, d, case options)
    "gqa 8/2, Lq 3, N 200": (2, 8, 2, 3, 200, 16, {}),
    "MHA, one row": (1, 2, 2, 1, 97, 8, {}),
    "7B group 7 x 4 = 28 rows": (1, 7, 1, 4, 300, 32, {}),
    "36 rows: two row tiles": (2, 12, 1, 3, 150, 8, {}),
    "34 rows, Lq 17": (1, 4, 2, 17, 130, 12, {}),
    "left padding": (3, 4, 2, 2, 180, 16, {"pad": 120}),
    "left and scattered padding, 2 row tiles": (3, 12, 1, 3, 140, 8, {"pad": 90, "scattered_pad": 25}),
    "N = 1": (1, 2, 1, 1, 1, 8, {}),
    "bf16 values": (2, 4, 1, 5, 257, 64, {"bf16": True, "pad": 60}),
}


@pytest.mark.parametrize("keys", [64, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_the_reference(seed, case, keys):
    b, hq, hkv, lq, n, d, opts = CASES[case]
    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, **opts)
    scale = d ** -0.5
    ref = pad_oracle(q, k, lab, positions, scale, 1e-6)
    # The reference itself takes PAD keys (label -1) too: both oracles agree, and the replay is checked against both.
    direct = modality_scores_ref(torch.from_numpy(q).double(), torch.from_numpy(k).double(), torch.from_numpy(lab),
                                 torch.from_numpy(positions), scale=scale, eps=1e-6)
    assert torch.allclose(direct, ref, rtol=1e-12, atol=1e-300), f"seed={seed} {case}: reference vs PAD oracle"
    tiles = -(-n // keys)
    # The host's split count for a small wave (several tiles per split) and for an H100-sized one (one tile per
    # split here), plus an explicit count that splits the tiles unevenly.
    for splits in sorted({host_splits(keys, n, hkv, b, 3 * hkv * b), host_splits(keys, n, hkv, b, 792),
                          max(1, min(tiles, tiles // 2 + 1))}):
        out = replay(q, k, lab, positions, scale, 1e-6, keys=keys, splits=splits)
        check(seed, f"{case}, keys/tile {keys}, splits {splits}", out, ref, lab)


def test_replay_many_splits_per_combine_lane(seed):
    """More splits than lanes (each combine lane merges 2-3 splits, in both branches of its merge) and a split count
    from an H100-sized wave at B = 1, Hkv = 1 (one tile per split)."""
    b, hq, hkv, lq, n, d = 1, 3, 1, 2, 2300, 8
    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, labels=3)
    ref = pad_oracle(q, k, lab, positions, 0.4, 1e-6)
    for keys in (64, 32):
        tiles = -(-n // keys)
        for splits in (33, tiles):
            out = replay(q, k, lab, positions, 0.4, 1e-6, keys=keys, splits=splits)
            check(seed, f"keys/tile {keys}, splits {splits}", out, ref, lab)


def test_replay_edge_labels_and_eps_zero(seed):
    """A label absent everywhere (3), a label whose only key some rows cannot see (4), a label with one visible key
    (5), label 8, a sample whose first 60 keys are PAD, eps = 0 and eps > 0, one split, several, one per tile."""
    b, hq, hkv, lq, n, d = 3, 6, 2, 3, 230, 16
    q, k, lab, _ = make_case(seed, b, hq, hkv, lq, n, d, labels=3, pad=100)
    g = np.random.default_rng(seed + 1)
    lab[:, 200] = 4  # seen only by rows at position >= 200
    lab[:, 17] = 5   # one key
    lab[:, 150:160] = 8
    lab[2, :] = -1
    lab[2, 60:] = g.integers(0, 3, n - 60)
    positions = np.array([[199, 229, 210], [150, 200, 120], [60, 61, 229]])
    for eps in (0.0, 1e-6, 0.5):
        ref = pad_oracle(q, k, lab, positions, d ** -0.5, eps)
        for keys in (64, 32):
            tiles = -(-n // keys)
            for splits in (1, 3, tiles):
                out = replay(q, k, lab, positions, d ** -0.5, eps, keys=keys, splits=splits)
                check(seed, f"eps {eps}, keys/tile {keys}, splits {splits}", out, ref, lab)


def test_replay_pad_keys_equal_the_sample_without_them(seed):
    """The contract's statement directly, replay against replay: sample 1 left-padded with 70 PAD keys (random K
    values) scores on its real keys as it does alone without them, its PAD keys score exactly 0, and sample 0 of the
    same batch (unpadded) is bit for bit what it is alone at the same split count."""
    q, k, lab, positions = make_case(seed, 2, 8, 2, 3, 90, 16)
    pad = 70
    g = np.random.default_rng(seed + 1)
    kp = np.concatenate([g.standard_normal((2, 2, pad, 16)).astype(F32), k], axis=2)
    labp = np.concatenate([np.full((2, pad), -1), lab], axis=1)
    labp[0, :pad] = g.integers(0, 4, pad)  # sample 0: 160 real keys
    posp = positions + pad
    for keys in (64, 32):
        both = replay(q, kp, labp, posp, 0.25, 1e-6, keys=keys, splits=2)
        alone0 = replay(q[:1], kp[:1], labp[:1], posp[:1], 0.25, 1e-6, keys=keys, splits=2)
        alone1 = replay(q[1:], k[1:], lab[1:], positions[1:], 0.25, 1e-6, keys=keys)
        assert np.all(both[1, :pad] == 0), f"seed={seed}: PAD keys must score exactly 0"
        err = np.abs(both[1, pad:] - alone1[0]).max()
        assert err <= 2e-6 * np.abs(alone1).max(), f"seed={seed} keys={keys}: padded vs alone differ by {err}"
        assert np.array_equal(both[0], alone0[0]), f"seed={seed} keys={keys}: the other sample must not change"


def test_replay_follows_the_non_finite_rule(seed):
    """A NaN in a key some row sees breaks its batch element (scored tokens NaN, text 0); the other sample is
    unchanged and a NaN in a key no row sees (past every position, or PAD) does nothing."""
    q, k, lab, _ = make_case(seed, 2, 4, 2, 2, 140, 8)
    positions = np.array([[100, 120], [90, 110]])
    lab[:, :3] = 0
    k[0, 1, 50, 3] = np.nan  # seen by sample 0's rows of KV head 1
    k[1, 0, 130, :] = np.nan  # after every position of sample 1
    lab[1, 40] = -1
    k[1, 1, 40, 0] = np.inf  # a PAD key
    for keys in (64, 32):
        out = replay(q, k, lab, positions, 0.3, 1e-6, keys=keys, splits=2)
        assert np.isnan(out[0][lab[0] > 0]).all() and np.all(out[0][lab[0] == 0] == 0), f"seed={seed}"
        clean_k = k.copy()
        clean_k[1, 0, 130] = 0.0
        clean_k[1, 1, 40] = 0.0
        ref = pad_oracle(q[1:], clean_k[1:], lab[1:], positions[1:], 0.3, 1e-6)
        check(seed, f"non-finite, keys/tile {keys}", out[1:], ref, lab[1:])


# ---- on a GPU: the kernels themselves on PAD keys, splits of several tiles and two row tiles --------------------
# The split count fills whole waves of CTAs over (splits, Hkv, B) (an H100 wave at D = 64: 132 SMs x 8 CTAs for bf16,
# x 4 for fp32 by registers), so a split holds several tiles when the tiles outnumber a wave's CTAs per (Hkv, B): by
# _C.modality_scores_split_plan the shapes below have 2-4 tiles per split for bf16 and 9-15 for fp32 on an H100. The
# small case is the one benchmarks/gpu_check.sh runs under compute-sanitizer.

def _run_cuda(seed, dtype, b, hq, hkv, lq, n, d=64, tol=1e-5):
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, pad=n // 2, scattered_pad=n // 50)
    q = torch.from_numpy(q).to(dtype)
    k = torch.from_numpy(k).to(dtype)
    ref = pad_oracle(q.float().numpy(), k.float().numpy(), lab, positions, 0.125, 1e-6)
    out = modality_scores_cuda(q.cuda(), k.cuda(), torch.from_numpy(lab).cuda(), torch.from_numpy(positions).cuda(),
                               0.125, 1e-6).cpu()
    # tol: tests/test_cuda_kernels.py's fixed ceiling (the H100 run gave 1e-7 to 2e-6 of the max)
    check(seed, f"cuda {dtype} {(b, hq, hkv, lq, n)}", out.numpy(), ref, lab, tol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(("b", "hq", "hkv", "lq", "n"), [(3, 28, 4, 4, 20000), (4, 24, 2, 3, 20000),
                                                         (1, 4, 4, 1, 33)])
def test_cuda_kernels_match_the_pad_oracle(seed, dtype, b, hq, hkv, lq, n):
    _run_cuda(seed, dtype, b, hq, hkv, lq, n)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_split_kernels_small_case_for_the_sanitizer(seed, dtype):
    """B * Hkv = 64 CTAs per split index (on an H100 16 splits of 2-3 tiles for bf16, 8 of 10-11 for fp32 at
    N = 2600), 34 rows per KV head (two row tiles), PAD keys: every barrier, buffer swap and partial of the split
    kernel, small enough for racecheck."""
    _run_cuda(seed, dtype, 8, 16, 8, 17, 2600)


_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cuda_unsplit_grid_of_many_tiles(seed, dtype):
    """The other side of the split plan: B * Hkv = 68800 CTAs, at least 16 waves on any GPU (an SM holds at most 32
    CTAs), so each CTA runs all 3-5 tiles of its (batch, KV head) as one split; vs the float64 reference."""
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    b, hq, hkv, lq, n, d = 4300, 16, 16, 1, 130, 16
    wave_bound = torch.cuda.get_device_properties(0).multi_processor_count * 32
    assert _C.modality_scores_split_plan(_CODES[dtype], b, hkv, n, wave_bound)[1] == 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, device="cuda").to(dtype)
    k = (2 * torch.randn(b, hkv, n, d, generator=g, device="cuda")).to(dtype)
    lab = torch.randint(0, 4, (b, n), generator=g, device="cuda")
    pos = torch.randint(n // 3, n, (b, lq), generator=g, device="cuda")
    out = modality_scores_cuda(q, k, lab, pos, 0.25, 1e-6)
    ref = modality_scores_ref(q.double(), k.double(), lab, pos, scale=0.25, eps=1e-6)
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"seed={seed} {dtype}: max error {err}"
    assert bool((out[lab == 0] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cuda_non_finite_rule_across_splits(seed, dtype):
    """The non-finite rule through splits of several tiles: a NaN in a key that sample 0's rows see (in one split)
    makes its scored keys NaN and its text 0; sample 1, with a NaN only after its rows' positions and an inf in a PAD
    key, is the PAD oracle's."""
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    q, k, lab, positions = make_case(seed, 2, 8, 2, 3, 2600, 64, pad=0)
    positions[1] = [1500, 1800, 2000]
    k[0, 1, 700, 5] = np.nan
    k[1, 0, 2300, :] = np.nan
    lab[1, 900] = -1
    k[1, 1, 900, 0] = np.inf
    qt, kt = torch.from_numpy(q).to(dtype), torch.from_numpy(k).to(dtype)
    out = modality_scores_cuda(qt.cuda(), kt.cuda(), torch.from_numpy(lab).cuda(), torch.from_numpy(positions).cuda(),
                               0.125, 1e-6).cpu().numpy()
    assert np.isnan(out[0][lab[0] > 0]).all() and np.all(out[0][lab[0] == 0] == 0), f"seed={seed} {dtype}"
    clean = kt.float().numpy()[1:].copy()
    clean[0, 0, 2300] = 0.0
    clean[0, 1, 900] = 0.0
    ref = pad_oracle(qt.float().numpy()[1:], clean, lab[1:], positions[1:], 0.125, 1e-6)
    check(seed, f"cuda non-finite {dtype}", out[1:], ref, lab[1:], tol=1e-5)
