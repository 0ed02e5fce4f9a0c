"""The S-A scoring kernels (csrc/kernels/modality_scores.cuh, csrc/kernels/scores_fragment.cuh), replayed step by step
in numpy on CPU and compared with the float64 reference ``modality_scores_ref``.

No GPU is needed: the replay follows the kernels' algorithm and fp32 arithmetic -- the host's split plan and tile
ranges, row tiles of 32 query rows, the accumulator fragment's thread -> (key, row) map (warps of 16 keys, lanes of
2 keys x 8 rows), per warp and tile the visibility decision (the whole warp visible to every real row, else the
per-element test: causal limit, N tail, PAD keys), the non-finite check, the stored values at the workspace index the
kernel writes them to, each thread's running (reference, sum) per row in its most-recently-used label slots with the
lazy rescale (threshold 8 in log2 units) and LRU eviction (flushed over the warp by xor 4, 8, 16 into per-warp
accumulators), the end-of-split merge of the 4 warps, the partials at their flat index, the last CTA's combine
(batches of 16 splits, pairwise trees, in order), and the reduce (units in order, rows in slot order, then xor 1, 2).
It shares the kernels' host/device helpers rather than re-deriving them: the split plan, ``split_begin``,
``key_visible`` and the fragment map are the header's functions called through ``_C`` (an off-by-one planted in the
causal limit, in ``split_begin`` or in the fragment map fails here), and every constant comes from
``_C.MODALITY_SCORES_CONSTANTS``. Dot products are numpy's fp32 matmul rather than mma.sync's order of accumulation,
and exp2 is numpy's rather than MUFU.EX2 (both fp32, rounding-level apart). What the replay cannot show is that the
CUDA code matches it (barriers, races, the cp.async ring, ldmatrix addressing): the ``cuda``-marked tests at the end,
tests/kernels/test_cuda_kernels.py, and the SASS tests (tests/kernels/test_cuda_scores_sass.py) do that.

PAD keys (label -1, a batch's padding: excluded from every row's softmax): the oracle is the contract's own, each
sample's scores on its non-PAD keys equal the reference run on that sample alone with the PAD keys removed and the
positions shifted, PAD keys score exactly 0; the reference run on the padded batch is checked to agree with it.
"""

from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest
import torch

from macer_kernels.reference import modality_scores_ref

# The replay calls the kernels' own host helpers and reads their constants from the compiled module (built from
# csrc/kernels/modality_scores.cuh): without the extension there is nothing to replay.
_C = pytest.importorskip("macer_kernels._C")
K = dict(_C.MODALITY_SCORES_CONSTANTS)

THREADS, WARPS, TILE_KEYS, WARP_KEYS = K["threads"], K["warps"], K["tile_keys"], K["warp_keys"]
ROW_TILE, ROWS_PER_THREAD, FRAG = K["row_tile"], K["rows_per_thread"], K["frag_elems"]
LABEL_SLOTS, THRESHOLD = K["label_slots"], K["rescale_threshold"]
NUM_LABELS, MAX_SPLITS, COMBINE_BATCH = K["num_labels"], K["max_splits"], K["combine_batch"]
SB_CONSUMERS, SB_GROUP = K["sb_consumers"], K["sb_group"]
LOG2E = 1.4426950408889634
F32 = np.float32
NEG_INF = F32(-np.inf)
EMPTY = F32(np.finfo(np.float32).max)  # kEmptyNegRef: the negated reference of an empty pair
LANES = np.arange(32)

# The fragment map, from the kernels' own helper: KEY[w, lane, e] (in the tile), ROW[lane, e] (in the row tile).
KEY = np.array([[[_C.modality_scores_fragment(w, lane, e)[0] for e in range(FRAG)] for lane in range(32)]
                for w in range(WARPS)])
ROW = np.array([[_C.modality_scores_fragment(0, lane, e)[1] for e in range(FRAG)] for lane in range(32)])
# Element of row slot i (0..7) for key slot k (0: key g, 1: key g + 8): frag_elem(i, k) = 4 (i // 2) + 2 k + i % 2.
ELEM = np.array([[4 * (i // 2) + 2 * k + i % 2 for k in range(2)] for i in range(ROWS_PER_THREAD)])


def test_the_module_reports_the_kernels_layout():
    """The constants the replay runs on are those the kernels were compiled with; the fragment map is a bijection of
    (warp, lane, element) onto (key of the 64-key tile, row of the 32-row tile) with each thread holding 2 keys x 8
    rows, and row slot i / key slot k address the elements the kernels' update reads."""
    assert THREADS == 32 * WARPS and TILE_KEYS == WARPS * WARP_KEYS == 64 and ROW_TILE == 32 and FRAG == 16
    assert _C.MAX_MODALITIES + 1 == NUM_LABELS and COMBINE_BATCH % 2 == 0 and MAX_SPLITS % COMBINE_BATCH == 0
    pairs = {(int(KEY[w, lane, e]), int(ROW[lane, e])) for w in range(WARPS) for lane in range(32) for e in range(FRAG)}
    assert pairs == {(k, r) for k in range(TILE_KEYS) for r in range(ROW_TILE)}
    for lane in range(32):
        assert set(KEY[1, lane]) == {16 + lane // 4, 16 + lane // 4 + 8}
        assert sorted(set(ROW[lane])) == sorted({8 * j + 2 * (lane % 4) + c for j in range(4) for c in range(2)})
        for i in range(ROWS_PER_THREAD):
            assert ROW[lane, ELEM[i, 0]] == ROW[lane, ELEM[i, 1]] == 8 * (i // 2) + 2 * (lane % 4) + i % 2
            assert KEY[0, lane, ELEM[i, 0]] + 8 == KEY[0, lane, ELEM[i, 1]]


# ---- host side: split plan, tile ranges, workspace -----------------------------------------------------------------

def split_begin(split: int, split_tiles: int, split_extra: int) -> int:
    return _C.modality_scores_split_begin(split, split_tiles, split_extra)


def split_plan(b: int, hkv: int, row_tiles: int, n: int, wave: int) -> tuple[int, int, int, int]:
    return tuple(_C.modality_scores_split_plan(b, hkv, row_tiles, n, wave))


def _align(x: int) -> int:
    return (x + 255) // 256 * 256


def split_stride(n: int) -> int:
    s = min(-(-n // TILE_KEYS), MAX_SPLITS)
    return s + s % 2


def workspace_layout(b: int, hq: int, lq: int, hkv: int, n: int) -> tuple[int, int, int, int]:
    """carve(): byte offsets of (logits, partial, stats) and the end of the S-A part."""
    units = b * hkv * -(-(hq // hkv * lq) // ROW_TILE)
    tiles = -(-n // TILE_KEYS)
    logits = _align(4 * units * tiles * TILE_KEYS * ROW_TILE)
    partial = _align(8 * units * NUM_LABELS * ROW_TILE * split_stride(n))
    return 0, logits, logits + partial, logits + partial + _align(8 * units * NUM_LABELS * ROW_TILE)


@pytest.mark.parametrize("tiles", [1, 2, 3, 7, 64, 313, 1563, 5000])
def test_splits_cover_every_tile_once_with_lengths_differing_by_at_most_one(tiles):
    """_C.modality_scores_split_begin is the kernel's split_begin (an off-by-one planted there fails here)."""
    for splits in sorted({1, 2, 3, 5, 31, 32, 33, 127, 128, tiles} & set(range(1, min(tiles, MAX_SPLITS) + 1))):
        q, extra = divmod(tiles, splits)
        bounds = [split_begin(s, q, extra) for s in range(splits + 1)]
        lengths = np.diff(bounds)
        assert bounds[0] == 0 and bounds[-1] == tiles, (tiles, splits)
        assert lengths.min() >= 1 and lengths.max() - lengths.min() <= 1, (tiles, splits)


def _plan_cost(s: int, tiles: int, ctas: int, wave: int, row_tiles: int) -> int:
    """The plan's time model (csrc/modality_scores.cu): waves x row tiles x (tiles per split + one tile of fixed
    work), plus the last CTA's merge of s partials per (label, row), one tile per 32 splits."""
    return -(-s * ctas // wave) * row_tiles * (-(-tiles // s) + 1) + row_tiles * -(-s // 32)


@pytest.mark.parametrize(("n", "hkv", "b", "rt", "wave"), [(2400, 4, 1, 1, 660), (20000, 4, 1, 1, 660),
                                                           (100000, 4, 1, 1, 396), (100000, 1, 1, 1, 2368),
                                                           (5, 2, 3, 1, 100), (40, 8, 64, 2, 792),
                                                           (2400, 4, 100, 1, 660), (20000, 4, 160, 3, 660),
                                                           (777, 3, 2, 1, 1), (10 ** 6, 1, 1, 4, 5000)])
def test_split_plan_is_the_least_modelled_time(n, hkv, b, rt, wave):
    """The split count is the argmin of the documented model over every count in [1, min(tiles, 128)], the fewest
    splits among equals; the workspace's partial stride holds it."""
    tiles, splits, split_tiles, split_extra = split_plan(b, hkv, rt, n, wave)
    assert tiles == -(-n // TILE_KEYS) and (split_tiles, split_extra) == divmod(tiles, splits)
    limit = min(tiles, MAX_SPLITS)
    costs = [_plan_cost(s, tiles, hkv * b, wave, rt) for s in range(1, limit + 1)]
    assert splits == 1 + int(np.argmin(costs)), (n, hkv, b, rt, wave, splits)
    assert splits <= split_stride(n)


def test_split_plan_fills_an_h100_at_the_7b_shapes():
    """B = 1, Hkv = 4 on 132 SMs x 3 resident CTAs: the plan uses most of the wave at N = 20k and 100k."""
    for n in (20_000, 100_000):
        _, splits, _, _ = split_plan(1, 4, 1, n, 396)
        assert 4 * splits >= 0.6 * 396, (n, splits)


def test_split_plan_rejects_empty_shapes():
    with pytest.raises(ValueError, match="split plan: B, Hkv, row tiles, N and wave must be >= 1"):
        _C.modality_scores_split_plan(1, 1, 1, 0, 1)


def test_module_rejects_more_rows_than_the_grid_takes():
    with pytest.raises(ValueError, match=re.escape("B * Hq * Lq must be at most 2^31 - 1 (CUDA grid limit)")):
        _C.modality_scores(0, 0, 0, 0, 0, 0, 0, 2, 8, 8, (65535, 65535, 1, 64, 1, 16), (1, 1, 1, 1), (1, 1, 1),
                           (1, 1), (1, 1), 0.1, 1e-6, 0, 0)


@pytest.mark.parametrize(("b", "hq", "lq", "hkv", "n"), [(1, 28, 4, 4, 2400), (1, 28, 4, 4, 100000), (3, 8, 5, 2, 1),
                                                         (2, 4, 17, 2, 33), (1, 1, 1, 1, 32769 * 32),
                                                         (2, 16, 17, 8, 2600)])
def test_workspace_bytes_hold_the_replayed_layout(b, hq, lq, hkv, n):
    """The S-A layout is inside the workspace (with 90a built, S-B's may be larger: the bound is the larger)."""
    total = _C.modality_scores_workspace_bytes(b, hq, lq, hkv, n)
    assert total >= workspace_layout(b, hq, lq, hkv, n)[3]
    units = b * hkv * -(-(hq // hkv * lq) // ROW_TILE)
    assert _C.modality_scores_counter_count(b, hq, lq, hkv) == 64 + 2 * units  # S-B's words, then S-A's


def test_key_visibility_is_the_causal_limit_the_tail_and_pad():
    """_C.modality_scores_visible is the kernel's key_visible (an off-by-one planted in the causal limit fails here
    and in every replay below): key n is visible to a row at position pos iff n < N, n <= pos and its label is in
    0..8."""
    keys = list(range(12))
    labels = [0, 1, -1, 2, 8, 0, -1, 3, 1, 9, 0, 2]
    positions = [0, 3, 5, 9, 11, 20]
    got = np.array(_C.modality_scores_visible(keys, labels, 10, positions)).reshape(len(positions), len(keys))
    n, lab, pos = np.array(keys)[None], np.array(labels)[None], np.array(positions)[:, None]
    assert np.array_equal(got, (n < 10) & (n <= pos) & (lab >= 0) & (lab < NUM_LABELS))


# ---- the vectorised K loads: their address arithmetic, on both cache layouts -----------------------------------------

def _replay_issue_chunk(key: torch.Tensor, b: int, kvh: int, tile: int, chunk: int) -> torch.Tensor:
    """The 64 x 128-byte stage issue_chunk fills for (tile, chunk) of KV head kvh: thread tid copies, for i = 0..3,
    16 bytes from chunk_src + (tid >> 3) k_row_bytes + 16 (tid & 7) + i 16 k_row_bytes (chunk_src = the tile's first
    key row + 128 chunk, walked by the kernel as tile x 64 k_row_bytes + chunk x 128) into row (tid >> 3) + 16 i,
    piece tid & 7; zero where the key is past N or the piece past D. Returns the stage as [64, 128] bytes."""
    es = key.element_size()
    storage = torch.empty(0, dtype=torch.uint8).set_(key.untyped_storage())
    base = key.storage_offset() * es + (b * key.stride(0) + kvh * key.stride(1)) * es
    k_row_bytes = key.stride(2) * es
    n, d_bytes = key.shape[2], key.shape[3] * es
    chunk_src = base + tile * 64 * k_row_bytes + chunk * 128
    stage = torch.zeros(64, 128, dtype=torch.uint8)
    for tid in range(THREADS):
        key0, piece = tid >> 3, tid & 7
        in_d = piece * 16 + chunk * 128 < d_bytes
        for i in range(4):
            if in_d and key0 + 16 * i < n - tile * 64:
                src = chunk_src + key0 * k_row_bytes + piece * 16 + i * 16 * k_row_bytes
                stage[key0 + 16 * i, piece * 16:piece * 16 + 16] = storage[src:src + 16]
    return stage


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize(("dtype", "d"), [(torch.bfloat16, 128), (torch.float16, 72), (torch.float32, 40)])
def test_vector_loads_read_each_key_row_on_both_cache_layouts(layout, dtype, d, seed):
    """The vectorised loader's address arithmetic reads K[b, kvh, key, chunk's d range] into row key of the stage,
    zero past N (an odd N = 101: a tail tile) and past D, for a transformers cache [B, H, N, D] and a FlashAttention /
    vLLM cache [B, N, H, D] seen through strides."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, n = 2, 3, 101
    if layout == "bhnd":
        key = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    else:
        key = torch.randn(b, n, hkv, d, generator=g).to(dtype).transpose(1, 2)
    es = key.element_size()
    chunks = -(-d * es // 128)
    for bb, kvh in [(0, 0), (1, 2)]:
        for tile in range(-(-n // 64)):
            for chunk in range(chunks):
                got = _replay_issue_chunk(key, bb, kvh, tile, chunk)
                want = torch.zeros(64, 128, dtype=torch.uint8)
                rows = key[bb, kvh, tile * 64:(tile + 1) * 64].contiguous().view(torch.uint8)
                part = rows[:, chunk * 128:(chunk + 1) * 128]
                want[:part.shape[0], :part.shape[1]] = part
                assert torch.equal(got, want), f"seed={seed} {layout} tile={tile} chunk={chunk}"


# ---- the kernels ---------------------------------------------------------------------------------------------------

def ex2(x) -> np.ndarray:
    """MUFU.EX2 (ex2.approx.ftz.f32) up to its approximation: fp32 exp2 with subnormal results flushed to 0."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.exp2(np.asarray(x, F32)).astype(F32)
    return np.where(np.abs(y) < F32(2.0 ** -126), F32(0), y).astype(F32)


def fma(a, b, c) -> np.ndarray:
    """fp32 fma: the product in float64 is exact, then one rounding of the sum (to float64, then float32)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def merge_pair(nr, s, nr2, s2):
    """scores_fragment.cuh's merge_pair on arrays: n = min(nr, nr2), s * exp2(n - nr) + s2 * exp2(n - nr2)."""
    with np.errstate(invalid="ignore", over="ignore"):
        n = np.fmin(nr, nr2).astype(F32)
        out = (np.asarray(s, F32) * ex2(n - nr) + np.asarray(s2, F32) * ex2(n - nr2)).astype(F32)
    return n, out


class Warp:
    """One warp's per-thread state of ThreadStats: nref/sum [slot, lane, row slot], the warp-uniform label table
    (most recently used first), and the warp's accumulators acc[label, row] (nref, sum) in shared memory."""

    def __init__(self):
        self.nref = np.full((LABEL_SLOTS, 32, ROWS_PER_THREAD), EMPTY)
        self.sum = np.zeros((LABEL_SLOTS, 32, ROWS_PER_THREAD), F32)
        self.label = [-1] * LABEL_SLOTS
        self.acc = np.stack([np.full((NUM_LABELS, ROW_TILE), EMPTY), np.zeros((NUM_LABELS, ROW_TILE), F32)])
        self.seen = 0
        self.z = np.zeros(32, F32)

    def to_front(self, s: int) -> None:
        order = [s] + [k for k in range(LABEL_SLOTS) if k != s]
        self.nref, self.sum = self.nref[order], self.sum[order]
        self.label = [self.label[k] for k in order]

    def flush_front(self) -> None:
        label = self.label[0]
        for i in range(ROWS_PER_THREAD):
            nr, s = self.nref[0, :, i].copy(), self.sum[0, :, i].copy()
            for off in (4, 8, 16):
                nr, s = merge_pair(nr, s, nr[LANES ^ off], s[LANES ^ off])
            for lane in range(4):
                row = 8 * (i // 2) + 2 * lane + i % 2
                a_nr, a_s = merge_pair(self.acc[0, label, row], self.acc[1, label, row], nr[lane], s[lane])
                self.acc[0, label, row], self.acc[1, label, row] = a_nr, a_s
        self.nref[0], self.sum[0], self.label[0] = EMPTY, 0, -1

    def bring_to_front(self, m: int) -> None:
        if self.label[0] == m:
            return
        if self.label[1] == m:
            self.to_front(1)
            return
        present = self.label[2] == m
        self.to_front(2)
        if present:
            return
        if self.label[0] >= 0:
            self.flush_front()
        self.label[0] = m

    def update(self, v: np.ndarray, select: bool, in_a: np.ndarray, in_b: np.ndarray, scale: F32) -> None:
        """update_slot on slot 0: v [32 lanes, 16] raw values (-inf where not visible)."""
        nref, sm = self.nref[0], self.sum[0]
        for i in range(ROWS_PER_THREAD):
            xa, xb = v[:, ELEM[i, 0]], v[:, ELEM[i, 1]]
            if select:
                xa, xb = np.where(in_a, xa, NEG_INF), np.where(in_b, xb, NEG_INF)
            mx = np.fmax(xa, xb)
            with np.errstate(invalid="ignore", over="ignore"):
                rescale = fma(mx, scale, nref[:, i]) > F32(THRESHOLD)
                nr = (-(mx * scale)).astype(F32)
                sm[:, i] = np.where(rescale, (sm[:, i] * ex2(nr - nref[:, i])).astype(F32), sm[:, i])
                nref[:, i] = np.where(rescale, nr, nref[:, i])
                sm[:, i] = (sm[:, i] + (ex2(fma(xa, scale, nref[:, i])) + ex2(fma(xb, scale, nref[:, i])))).astype(F32)

    def flush_all(self) -> None:
        for _ in range(LABEL_SLOTS):
            if self.label[0] >= 0:
                self.flush_front()
            self.to_front(LABEL_SLOTS - 1)


def tile_kernel(q, k, labels, positions, scale_log2, plan, logits, partial, masks, split_stride_):
    """scores_tile_kernel over the grid (splits, Hkv, B), every row tile: writes the stored values, the partials and
    the units' label masks (| broken) at the kernel's indices."""
    b_n, hq, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    tiles, splits, split_tiles, split_extra = plan
    group = hq // hkv
    rows = group * lq
    row_tiles = -(-rows // ROW_TILE)
    for b in range(b_n):
        for kvh in range(hkv):
            for rt in range(row_tiles):
                unit = (b * hkv + kvh) * row_tiles + rt
                rr = rt * ROW_TILE + np.arange(ROW_TILE)
                real = rr < rows
                h, qi = kvh * group + rr // lq, rr % lq
                qtile = np.where(real[:, None], q[b, np.minimum(h, hq - 1), qi], F32(0)).astype(F32)
                pos = np.where(real, positions[b, qi], -1)
                min_pos = int(pos[real].min())
                for split in range(splits):
                    t_first = split_begin(split, split_tiles, split_extra)
                    t_end = split_begin(split + 1, split_tiles, split_extra)
                    warps = [Warp() for _ in range(WARPS)]
                    for t in range(t_first, t_end):
                        keys_n = t * TILE_KEYS + np.arange(TILE_KEYS)
                        exists = keys_n < n
                        ktile = np.zeros((TILE_KEYS, q.shape[-1]), F32)
                        ktile[exists] = k[b, kvh, keys_n[exists]]
                        with np.errstate(invalid="ignore", over="ignore"):
                            dots = (ktile @ qtile.T).astype(F32)  # [key, row]
                        lab_all = np.full(TILE_KEYS, -1)
                        lab_all[exists] = labels[b, keys_n[exists]]
                        for w, warp in enumerate(warps):
                            _warp_epilogue(warp, w, t, dots, lab_all, keys_n, n, pos, min_pos, scale_log2, logits,
                                           unit, tiles, min(ROW_TILE, rows - rt * ROW_TILE))
                    for warp in warps:
                        warp.flush_all()
                    bad = any(np.isnan(warp.z).any() for warp in warps)
                    mask = int(np.bitwise_or.reduce([warp.seen for warp in warps])) | (K["mask_broken"] if bad else 0)
                    masks[unit] |= mask
                    for p in range(NUM_LABELS * ROW_TILE):
                        m, r = divmod(p, ROW_TILE)
                        nr, s = warps[0].acc[0, m, r], warps[0].acc[1, m, r]
                        for w in range(1, WARPS):
                            nr, s = merge_pair(nr, s, warps[w].acc[0, m, r], warps[w].acc[1, m, r])
                        at = ((unit * NUM_LABELS + m) * ROW_TILE + r) * split_stride_
                        partial[at + split] = (nr, s)
                        if split + 1 == splits and split_stride_ > splits:
                            partial[at + splits] = (EMPTY, 0)


def _warp_epilogue(warp, w, t, dots, lab_all, keys_n, n, pos, min_pos, scale_log2, logits, unit, tiles, rows_here):
    """The epilogue of tile t for warp w: visibility, the non-finite check, the stores, the label updates."""
    acc = dots[KEY[w], ROW]  # [32 lanes, 16]: the fragment
    lab = lab_all[WARP_KEYS * w:WARP_KEYS * (w + 1)]
    n_w = t * TILE_KEYS + WARP_KEYS * w
    lane_ok = (n_w + np.arange(WARP_KEYS) < n) & (lab >= 0) & (lab < NUM_LABELS)
    mask = 0
    for x in lab[lane_ok]:
        mask |= 1 << int(x)
    all_ok = bool(lane_ok.all())
    g = LANES // 4
    lab_a, lab_b = lab[g], lab[g + 8]
    with np.errstate(invalid="ignore", over="ignore"):
        if all_ok and n_w + WARP_KEYS - 1 <= min_pos:
            for e in range(FRAG):
                warp.z = fma(acc[:, e], F32(0), warp.z)
            v = acc
        else:
            keys = keys_n[KEY[w]]  # [32, 16] key indices
            key_labels = lab_all[KEY[w]]
            rows_pos = pos[ROW]
            vis = _visible(keys, key_labels, n, rows_pos)
            for e in range(FRAG):
                warp.z = np.where(vis[:, e], fma(acc[:, e], F32(0), warp.z), warp.z)
            v = np.where(vis, acc, NEG_INF).astype(F32)
    at = ((unit * tiles + t) * WARPS + w) * 32 * FRAG
    stored = _group_stored(rows_here)  # [q, lane]: groups of padding rows are never stored
    block = logits[at:at + 32 * FRAG].reshape(4, 32, 4)  # [q][lane][4]: coalesced stores
    block[stored] = v.reshape(32, 4, 4).transpose(1, 0, 2)[stored]
    warp.seen |= mask
    select = (not all_ok) or bin(mask).count("1") > 1
    if not select and warp.label[0] >= 0 and mask == 1 << warp.label[0]:
        warp.update(v, False, None, None, scale_log2)
        return
    for m in range(NUM_LABELS):
        if mask >> m & 1:
            warp.bring_to_front(m)
            warp.update(v, select, lab_a == m, lab_b == m, scale_log2)


def _group_stored(rows_here: int) -> np.ndarray:
    """group_stored(q, lane, rows_here) (scores_fragment.cuh): [4, 32] bool, whether group q of a lane holds a real
    row (8 q + 2 (lane % 4) < rows_here)."""
    return 8 * np.arange(4)[:, None] + 2 * (LANES % 4)[None] < rows_here


def _visible(keys: np.ndarray, key_labels: np.ndarray, n: int, rows_pos: np.ndarray) -> np.ndarray:
    """The kernel's key_visible for each (lane, element), through _C (one call per distinct row position)."""
    out = np.zeros(keys.shape, bool)
    for p in np.unique(rows_pos):
        sel = rows_pos == p
        out[sel] = np.array(_C.modality_scores_visible(keys[sel].tolist(), key_labels[sel].tolist(), n, [int(p)]),
                            bool)
    return out


def combine_kernel(partial, stats, masks, units, splits, split_stride_, rows, row_tiles, eps):
    """The last CTA of each unit (combine_unit): present labels ascending x 32 rows; splits in batches of
    COMBINE_BATCH (pairs of splits, then a pairwise tree), the batches in order; then per row M_r, Z_r and
    (-M_r,m, W_r,m)."""
    half = COMBINE_BATCH // 2
    for unit in range(units):
        rt = unit % row_tiles
        mask = int(masks[unit])
        present = [m for m in range(NUM_LABELS) if mask >> m & 1]
        broken = bool(mask & K["mask_broken"])
        tot = {}
        for m in present:
            base = ((unit * NUM_LABELS + m) * ROW_TILE + np.arange(ROW_TILE)) * split_stride_  # [32 rows]
            nr, s = np.full(ROW_TILE, EMPTY), np.zeros(ROW_TILE, F32)
            for s0 in range(0, splits, COMBINE_BATCH):
                bn, bs = [], []
                for kk in range(half):
                    if s0 + 2 * kk < splits:
                        x0, x1 = partial[base + s0 + 2 * kk], partial[base + s0 + 2 * kk + 1]
                    else:
                        x0 = x1 = np.tile(np.array([EMPTY, 0], F32), (ROW_TILE, 1))
                    n_, s_ = merge_pair(x0[:, 0], x0[:, 1], x1[:, 0], x1[:, 1])
                    bn.append(n_)
                    bs.append(s_)
                width = 1
                while width < half:
                    for kk in range(0, half, 2 * width):
                        bn[kk], bs[kk] = merge_pair(bn[kk], bs[kk], bn[kk + width], bs[kk + width])
                    width *= 2
                nr, s = merge_pair(nr, s, bn[0], bs[0])
            tot[m] = (nr, s)
        row_stats(tot, present, rt, rows, broken, eps, stats, unit)


def row_stats(tot, present, rt, rows, broken, eps, stats, unit):
    """row_stats (scores_fragment.cuh): per row, M_r = max over present labels, Z_r, then (-M_r,m, W_r,m) into
    stats[(unit * 9 + m) * 32 + r]. tot[m] = the merged (nref[32], sum[32]) of label m."""
    eps = F32(eps)
    for r in range(ROW_TILE):
        real = rt * ROW_TILE + r < rows
        seen = [m for m in present if tot[m][0][r] != EMPTY]
        row_max = max((F32(-tot[m][0][r]) for m in seen), default=NEG_INF)
        z = F32(0)
        for m in seen:
            z = F32(z + tot[m][1][r] * np.exp2(F32(-tot[m][0][r] - row_max)))
        for m in present:
            nr, s = tot[m][0][r], tot[m][1][r]
            if not real:
                out = (0, 0)
            elif broken:
                out = (0 if nr == EMPTY else nr, np.nan)
            elif nr == EMPTY:
                out = (0, 0)
            else:
                with np.errstate(over="ignore"):
                    eps_term = F32(eps * z * np.exp2(F32(row_max + nr))) if eps > 0 else F32(0)
                out = (nr, F32(1) / F32(s + eps_term))
            stats[(unit * NUM_LABELS + m) * ROW_TILE + r] = out


def reduce_kernel(logits, stats, labels, units_per_batch, tiles, scale_log2, inv_rows, out, rows, row_tiles):
    """scores_reduce_kernel: per (tile, warp, lane) its two keys; units in order, row slots in order (fma into the
    key's running sum), then xor 1, 2 over the lanes sharing the keys; lane l < 16 writes key 16 w + l."""
    b_n, n = labels.shape
    t_lane = LANES % 4
    for b in range(b_n):
        for tile in range(tiles):
            for w in range(WARPS):
                n_w = tile * TILE_KEYS + WARP_KEYS * w
                keys = n_w + np.arange(WARP_KEYS)
                lab = np.where(keys < n, labels[b, np.minimum(keys, n - 1)], -1)
                lab_a, lab_b = lab[LANES // 4], lab[LANES // 4 + 8]
                acc = [np.zeros(32, F32), np.zeros(32, F32)]
                for kk in range(units_per_batch):
                    unit = b * units_per_batch + kk
                    at = ((unit * tiles + tile) * WARPS + w) * 32 * FRAG
                    stored = _group_stored(min(ROW_TILE, rows - (kk % row_tiles) * ROW_TILE))
                    block = np.where(stored[..., None], logits[at:at + 32 * FRAG].reshape(4, 32, 4), NEG_INF)
                    v = block.transpose(1, 0, 2).reshape(32, FRAG)
                    for ks, lab_k in ((0, lab_a), (1, lab_b)):
                        scored = (lab_k >= 1) & (lab_k < NUM_LABELS)
                        lab_c = np.clip(lab_k, 0, NUM_LABELS - 1)
                        for i in range(ROWS_PER_THREAD):
                            row = 8 * (i // 2) + 2 * t_lane + i % 2
                            st = stats[(unit * NUM_LABELS + lab_c) * ROW_TILE + row]  # [32, 2]
                            with np.errstate(invalid="ignore", over="ignore"):
                                term = fma(ex2(fma(v[:, ELEM[i, ks]], scale_log2, st[:, 0])), st[:, 1], acc[ks])
                            acc[ks] = np.where(scored, term, acc[ks])
                for ks in range(2):
                    for off in (1, 2):
                        acc[ks] = (acc[ks] + acc[ks][LANES ^ off]).astype(F32)
                for lane in range(WARP_KEYS):
                    key = n_w + lane
                    if key >= n:
                        continue
                    total = acc[0 if lane < 8 else 1][4 * (lane & 7)]
                    scored = 1 <= lab[lane] < NUM_LABELS
                    out[b, key] = F32(total * inv_rows) if scored else F32(0)


def replay(q, k, labels, positions, scale, eps, *, splits=None, wave=396):
    """The S-A launches on fp32 numpy arrays, in flat buffers laid out as the workspace (an index past the bound
    raises IndexError). Returns the [B, N] float32 scores."""
    b_n, hq, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    rows = hq // hkv * lq
    row_tiles = -(-rows // ROW_TILE)
    tiles = -(-n // TILE_KEYS)
    plan = split_plan(b_n, hkv, row_tiles, n, wave)
    if splits is not None:
        plan = (tiles, splits, *divmod(tiles, splits))
    assert 1 <= plan[1] <= min(tiles, MAX_SPLITS)
    stride = split_stride(n)
    off = workspace_layout(b_n, hq, lq, hkv, n)
    units = b_n * hkv * row_tiles
    logits = np.full((off[1] - off[0]) // 4, F32(np.nan))  # NaN: a value the reduce reads but nobody wrote shows
    partial = np.full(((off[2] - off[1]) // 8, 2), F32(np.nan))
    stats = np.full(((off[3] - off[2]) // 8, 2), F32(np.nan))
    masks = np.zeros(units, np.int64)
    scale_log2 = F32(np.float64(scale) * LOG2E)
    with np.errstate(invalid="ignore", over="ignore"):
        tile_kernel(q, k, labels, positions, scale_log2, plan, logits, partial, masks, stride)
        combine_kernel(partial, stats, masks, units, plan[1], stride, rows, row_tiles, eps)
        out = np.full((b_n, n), F32(np.nan))
        reduce_kernel(logits, stats, labels, hkv * row_tiles, tiles, scale_log2, F32(1.0 / (hq * lq)), out, rows,
                      row_tiles)
    return out


def replay_sb(q, k, labels, positions, scale, eps, *, ctas):
    """S-B (modality_scores_sm90a.cuh) on fp32 numpy arrays, B = 1: CTA c owns tiles split_begin(c, T // ctas, T % ctas)
    .. of every KV head; its consumer warpgroup w takes the tiles j = w, w + 2, ... of its range, heads in order, with
    S-A's epilogue per warp (warp of the warpgroup = the fragment's warp); at each head's end the 8 consumer warps'
    accumulators merge in warp order into the CTA's partial of that head. Then the last CTA of each group of
    SB_GROUP merges the group's partials (all 9 labels, CTAs in order), the last group merger merges the groups (in
    group order) for the present labels and writes the statistics; phase 2 is S-A's reduce over units = heads
    (the values a unit keeps on chip or spills are the same numbers)."""
    b_n, hq, lq, _ = q.shape
    assert b_n == 1
    hkv, n = k.shape[1], k.shape[2]
    rows = hq // hkv * lq
    assert rows <= ROW_TILE
    tiles = -(-n // TILE_KEYS)
    ctas = min(ctas, tiles)
    scale_log2 = F32(np.float64(scale) * LOG2E)
    logits = np.full(hkv * tiles * TILE_KEYS * ROW_TILE, F32(np.nan))
    stats = np.full((hkv * NUM_LABELS * ROW_TILE, 2), F32(np.nan))
    partial = np.full((hkv, NUM_LABELS * ROW_TILE, ctas, 2), F32(np.nan))
    masks = np.zeros(ctas, np.int64)
    rr = np.arange(ROW_TILE)
    real = rr < rows
    group = hq // hkv
    pos = np.where(real, positions[0, rr % lq], -1)
    min_pos = int(pos[real].min())
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(ctas):
            t0 = split_begin(c, tiles // ctas, tiles % ctas)
            nt = split_begin(c + 1, tiles // ctas, tiles % ctas) - t0
            warps = [Warp() for _ in range(SB_CONSUMERS * WARPS)]
            for h in range(hkv):
                hh = np.minimum(h * group + rr // lq, hq - 1)
                qtile = np.where(real[:, None], q[0, hh, rr % lq], F32(0)).astype(F32)
                for cw in range(SB_CONSUMERS):
                    for j in range(cw, nt, SB_CONSUMERS):
                        tile = t0 + j
                        keys_n = tile * TILE_KEYS + np.arange(TILE_KEYS)
                        exists = keys_n < n
                        ktile = np.zeros((TILE_KEYS, q.shape[-1]), F32)
                        ktile[exists] = k[0, h, keys_n[exists]]
                        dots = (ktile @ qtile.T).astype(F32)
                        lab_all = np.full(TILE_KEYS, -1)
                        lab_all[exists] = labels[0, keys_n[exists]]
                        for wq in range(WARPS):
                            _warp_epilogue(warps[cw * WARPS + wq], wq, tile, dots, lab_all, keys_n, n, pos, min_pos,
                                           scale_log2, logits, h, tiles, rows)
                for warp in warps:
                    warp.flush_all()
                for p in range(NUM_LABELS * ROW_TILE):
                    m, r = divmod(p, ROW_TILE)
                    nr, s = warps[0].acc[0, m, r], warps[0].acc[1, m, r]
                    for w in range(1, len(warps)):
                        nr, s = merge_pair(nr, s, warps[w].acc[0, m, r], warps[w].acc[1, m, r])
                    partial[h, p, c] = (nr, s)
                for warp in warps:
                    warp.acc[0], warp.acc[1] = EMPTY, 0
            bad = any(np.isnan(warp.z).any() for warp in warps)
            masks[c] = int(np.bitwise_or.reduce([warp.seen for warp in warps])) | (K["mask_broken"] if bad else 0)
        groups = -(-ctas // SB_GROUP)
        gpart = np.full((groups, hkv, NUM_LABELS * ROW_TILE, 2), F32(np.nan))
        for g in range(groups):
            members = range(g * SB_GROUP, min(ctas, (g + 1) * SB_GROUP))
            nr, s = np.full((hkv, NUM_LABELS * ROW_TILE), EMPTY), np.zeros((hkv, NUM_LABELS * ROW_TILE), F32)
            for c in members:
                nr, s = merge_pair(nr, s, partial[:, :, c, 0], partial[:, :, c, 1])
            gpart[g, ..., 0], gpart[g, ..., 1] = nr, s
        mask = int(np.bitwise_or.reduce(masks))
        present = [m for m in range(NUM_LABELS) if mask >> m & 1]
        for h in range(hkv):
            tot = {}
            for m in present:
                nr, s = np.full(ROW_TILE, EMPTY), np.zeros(ROW_TILE, F32)
                for g in range(groups):
                    sl = slice(m * ROW_TILE, (m + 1) * ROW_TILE)
                    nr, s = merge_pair(nr, s, gpart[g, h, sl, 0], gpart[g, h, sl, 1])
                tot[m] = (nr, s)
            row_stats(tot, present, 0, rows, bool(mask & K["mask_broken"]), eps, stats, h)
        out = np.full((1, n), F32(np.nan))
        reduce_kernel(logits, stats, labels, hkv, tiles, scale_log2, F32(1.0 / (hq * lq)), out, rows, 1)
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


def make_case(seed, b, hq, hkv, lq, n, d, *, labels=4, pad=0, scattered_pad=0, bf16=False, runs=0):
    """Random q/k (k sharper than unit logits), labels in 0..labels-1 (i.i.d., or in runs of about `runs` keys, as an
    omni prompt's), left padding of up to `pad` keys per sample (sample 0 unpadded) plus `scattered_pad` PAD keys
    anywhere, positions on real keys at or after N/3."""
    g = np.random.default_rng(seed)
    q = g.standard_normal((b, hq, lq, d)).astype(F32)
    k = (2.0 * g.standard_normal((b, hkv, n, d))).astype(F32)
    if bf16:  # the values a bf16 tensor holds, exactly representable in fp32 (the MMA multiplies them exactly)
        q = torch.from_numpy(q).bfloat16().float().numpy()
        k = torch.from_numpy(k).bfloat16().float().numpy()
    if runs:
        lab = np.repeat(g.integers(0, labels, (b, -(-n // runs))), runs, axis=1)[:, :n]
    else:
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
    "MHA, one row, odd N": (1, 2, 2, 1, 97, 8, {}),
    "7B group 7 x 4 = 28 rows": (1, 7, 1, 4, 300, 32, {}),
    "7B rows, label runs": (1, 7, 1, 4, 700, 16, {"runs": 90, "labels": 3}),
    "36 rows: two row tiles": (2, 12, 1, 3, 150, 8, {}),
    "34 rows, Lq 17": (1, 4, 2, 17, 130, 12, {}),
    "left padding": (3, 4, 2, 2, 180, 16, {"pad": 120}),
    "left and scattered padding, 2 row tiles": (3, 12, 1, 3, 140, 8, {"pad": 90, "scattered_pad": 25}),
    "N = 1": (1, 2, 1, 1, 1, 8, {}),
    "bf16 values": (2, 4, 1, 5, 257, 64, {"bf16": True, "pad": 60}),
    "all 9 labels: LRU eviction": (1, 8, 2, 2, 400, 16, {"labels": 9}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_matches_the_reference(seed, case):
    b, hq, hkv, lq, n, d, opts = CASES[case]
    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, **opts)
    for i in range(b):  # one row per sample sees every key: every split's partial counts
        positions[i, 0] = np.nonzero(lab[i] != -1)[0].max()
    scale = d ** -0.5
    ref = pad_oracle(q, k, lab, positions, scale, 1e-6)
    # The reference itself takes PAD keys (label -1) too: both oracles agree, and the replay is checked against both.
    direct = modality_scores_ref(torch.from_numpy(q).double(), torch.from_numpy(k).double(), torch.from_numpy(lab),
                                 torch.from_numpy(positions), scale=scale, eps=1e-6)
    assert torch.allclose(direct, ref, rtol=1e-12, atol=1e-300), f"seed={seed} {case}: reference vs PAD oracle"
    tiles = -(-n // TILE_KEYS)
    # The host's split count for a small wave (several tiles per split) and for an H100-sized one, plus an explicit
    # count that splits the tiles unevenly.
    counts = {split_plan(b, hkv, -(-(hq // hkv * lq) // ROW_TILE), n, w)[1] for w in (3 * hkv * b, 396)}
    for splits in sorted(counts | {max(1, min(tiles, tiles // 2 + 1))}):
        out = replay(q, k, lab, positions, scale, 1e-6, splits=splits)
        check(seed, f"{case}, splits {splits}", out, ref, lab)


def _two_x_rule(out: torch.Tensor, q, k, lab, positions, scale, eps, ref) -> tuple[float, float]:
    """FlashAttention's rule for a fast path, in norms (stable for fp32 errors of ~1e-8): (its error, the bound
    2 x the error PyTorch's own fp32 path makes on the same inputs + 2 fp32 ulp of the norm, the slack of the
    approximate exp2 (MUFU.EX2, <= 2 ulp, as CUDA's exp2f))."""
    from macer_kernels.modality_scores import _modality_scores_torch

    inputs = [torch.as_tensor(x) for x in (q, k, lab, positions)]
    pt = _modality_scores_torch(*inputs, scale, eps).double().cpu()
    err = (out.double().cpu() - ref).norm().item()
    return err, 2 * (pt - ref).norm().item() + 2 * 2.0 ** -23 * ref.norm().item()


@pytest.mark.parametrize("case", ["gqa 8/2, Lq 3, N 200", "7B group 7 x 4 = 28 rows", "7B rows, label runs",
                                  "36 rows: two row tiles", "bf16 values"])
def test_replay_error_is_within_twice_pytorchs_fp32_error(seed, case):
    """The per-(row, label) numerics in fp32: the replayed S-A error against the float64 reference is at most 2x the
    error of PyTorch's own fp32 path on the same inputs (plus the exp2 slack)."""
    b, hq, hkv, lq, n, d, opts = CASES[case]
    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, **opts)
    ref = pad_oracle(q, k, lab, positions, d ** -0.5, 1e-6)
    err, bound = _two_x_rule(torch.from_numpy(replay(q, k, lab, positions, d ** -0.5, 1e-6)), q, k, lab, positions,
                             d ** -0.5, 1e-6, ref)
    assert err <= bound, f"seed={seed} {case}: error {err:.3g} > 2x PyTorch fp32 + slack = {bound:.3g}"


def test_replay_many_splits_per_combine_batch(seed):
    """More splits than one combine batch (17, 33: a partial last batch; 36 = every tile its own split, an even
    count), one row tile at the 7B group of 28 rows."""
    b, hq, hkv, lq, n, d = 1, 7, 1, 4, 2300, 8
    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, labels=3)
    ref = pad_oracle(q, k, lab, positions, 0.4, 1e-6)
    for splits in (17, 33, 36):
        out = replay(q, k, lab, positions, 0.4, 1e-6, splits=splits)
        check(seed, f"splits {splits}", out, ref, lab)


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
        for splits in (1, 3, -(-n // TILE_KEYS)):
            out = replay(q, k, lab, positions, d ** -0.5, eps, splits=splits)
            check(seed, f"eps {eps}, splits {splits}", out, ref, lab)


def test_replay_keeps_a_modality_far_below_the_row_maximum_exact(seed):
    """Per-(row, label) references: audio keys 140 log2 units below the video keys of the same rows (their mass
    underflows fp32 against the row maximum, so one maximum per row would give audio 0 or NaN) still score as the
    float64 reference says, and the lazy rescale moves each thread's reference as the keys grow by more than 8."""
    b, hq, hkv, lq, n, d = 1, 4, 1, 2, 256, 16
    g = np.random.default_rng(seed)
    q = np.zeros((b, hq, lq, d), F32)
    q[..., 0] = 1.0
    k = g.standard_normal((b, hkv, n, d)).astype(F32) * F32(0.5)
    lab = np.where(np.arange(n) % 64 < 32, 1, 2)[None]  # audio and video runs of 32 keys
    lab[0, :8] = 0
    # logits in log2 units: video around +60, audio around -80 (scale 1, ln-units x log2 e)
    k[0, 0, lab[0] == 2, 0] += F32(60 / LOG2E)
    k[0, 0, lab[0] == 1, 0] += F32(-80 / LOG2E)
    k[0, 0, :, 0] += np.linspace(0, 30, n).astype(F32)  # a growing maximum: several rescales per thread
    positions = np.array([[n - 1, n - 5]])
    ref = pad_oracle(q, k, lab, positions, 1.0, 0.0)
    assert ref[0, lab[0] == 1].sum() > 0.99  # audio sums to ~1 per row on its own
    for splits in (1, 4):
        out = replay(q, k, lab, positions, 1.0, 0.0, splits=splits)
        check(seed, f"splits {splits}", out, ref, lab)


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
    both = replay(q, kp, labp, posp, 0.25, 1e-6, splits=2)
    alone0 = replay(q[:1], kp[:1], labp[:1], posp[:1], 0.25, 1e-6, splits=2)
    alone1 = replay(q[1:], k[1:], lab[1:], positions[1:], 0.25, 1e-6)
    assert np.all(both[1, :pad] == 0), f"seed={seed}: PAD keys must score exactly 0"
    err = np.abs(both[1, pad:] - alone1[0]).max()
    assert err <= 2e-6 * np.abs(alone1).max(), f"seed={seed}: padded vs alone differ by {err}"
    assert np.array_equal(both[0], alone0[0]), f"seed={seed}: the other sample must not change"


def test_replay_follows_the_non_finite_rule(seed):
    """A NaN in a key some row sees breaks its batch element (scored tokens NaN, text 0), a -inf logit too (IEEE
    would give it weight 0); the other sample is unchanged and a NaN in a key no row sees (past every position, or
    PAD) does nothing."""
    q, k, lab, _ = make_case(seed, 2, 4, 2, 2, 140, 8)
    positions = np.array([[100, 120], [90, 110]])
    lab[:, :3] = 0
    k[1, 0, 130, :] = np.nan  # after every position of sample 1
    lab[1, 40] = -1
    k[1, 1, 40, 0] = np.inf  # a PAD key
    clean_k = k.copy()
    clean_k[1, 0, 130] = 0.0
    clean_k[1, 1, 40] = 0.0
    for poison in ("nan", "-inf"):
        kk, qq = k.copy(), q.copy()
        if poison == "nan":
            kk[0, 1, 50, 3] = np.nan  # seen by sample 0's rows of KV head 1
        else:
            # Every row of KV head 1 (query heads 2, 3) sees logit -inf at key 50 and nothing else non-finite: IEEE
            # would give that key weight 0, the rule breaks the sample.
            qq[0, 2:4, :, 3] = np.abs(qq[0, 2:4, :, 3]) + F32(0.1)
            kk[0, 1, 50, :] = 0.0
            kk[0, 1, 50, 3] = -np.inf
        out = replay(qq, kk, lab, positions, 0.3, 1e-6, splits=2)
        assert np.isnan(out[0][lab[0] > 0]).all() and np.all(out[0][lab[0] == 0] == 0), f"seed={seed} {poison}"
        ref1 = pad_oracle(qq[1:], clean_k[1:], lab[1:], positions[1:], 0.3, 1e-6)
        check(seed, f"non-finite {poison}", out[1:], ref1, lab[1:])


SB_CASES = {  # (hq, hkv, lq, n, d, ctas, case options)
    "7B group 28 rows, 13 CTAs: two combine groups": (7, 1, 4, 1000, 16, 13, {"runs": 90, "labels": 3}),
    "4 KV heads, odd tiles per CTA": (8, 4, 3, 700, 8, 4, {}),
    "one tile per CTA, 25 CTAs (3 groups)": (4, 2, 2, 1600, 8, 25, {"labels": 9}),
    "more CTAs asked than tiles, N = 100": (4, 1, 1, 100, 8, 132, {}),
}


@pytest.mark.parametrize("case", list(SB_CASES))
def test_sb_replay_matches_the_reference(seed, case):
    """S-B's partition (CTA tile ranges, alternating consumer warpgroups, heads in order), its per-head merge of the 8
    consumer warps, the two-level combine and phase 2, against the float64 reference; and against S-A's replay on the
    same inputs (both within fp32 rounding of the reference)."""
    hq, hkv, lq, n, d, ctas, opts = SB_CASES[case]
    q, k, lab, positions = make_case(seed, 1, hq, hkv, lq, n, d, **opts)
    positions[0, 0] = n - 1  # one row sees every key (the question ends the prompt), so every CTA's keys count
    scale = d ** -0.5
    ref = pad_oracle(q, k, lab, positions, scale, 1e-6)
    out = replay_sb(q, k, lab, positions, scale, 1e-6, ctas=ctas)
    check(seed, f"S-B {case}", out, ref, lab)


def test_sb_replay_follows_the_non_finite_rule_and_eps(seed):
    """A NaN key seen by the rows breaks the sample (scored keys NaN, text 0); eps = 0 and 0.5 on an unseen label."""
    q, k, lab, _ = make_case(seed, 1, 4, 2, 2, 400, 8, labels=4)
    positions = np.array([[300, 350]])
    lab[0, 390:] = 3  # past every position: label 3 unseen
    for eps in (0.0, 0.5):
        ref = pad_oracle(q, k, lab, positions, 0.3, eps)
        check(seed, f"S-B eps {eps}", replay_sb(q, k, lab, positions, 0.3, eps, ctas=5), ref, lab)
    k[0, 1, 100, 2] = np.nan
    out = replay_sb(q, k, lab, positions, 0.3, 1e-6, ctas=5)
    assert np.isnan(out[0][lab[0] > 0]).all() and np.all(out[0][lab[0] == 0] == 0), f"seed={seed}"


def test_planted_fragment_map_bug_fails_the_replay(seed, monkeypatch):
    """The replay's fragment map is the kernel's: with the key of element e off by one key slot (the bug a wrong
    `8 (c / 2)` term in frag_key would be), the replay no longer matches the reference."""
    q, k, lab, positions = make_case(seed, 1, 4, 1, 2, 128, 8)
    ref = pad_oracle(q, k, lab, positions, 0.3, 1e-6)
    wrong = KEY.copy()
    wrong[:, :, [2, 3]], wrong[:, :, [0, 1]] = KEY[:, :, [0, 1]], KEY[:, :, [2, 3]]
    monkeypatch.setattr(sys.modules[__name__], "KEY", wrong)
    out = replay(q, k, lab, positions, 0.3, 1e-6, splits=1)
    err = (torch.from_numpy(out).double() - ref).abs().max().item()
    assert err > 1e-3 * ref.abs().max().item(), f"seed={seed}: a wrong fragment map went unnoticed"


# ---- on a GPU: the kernels themselves on PAD keys, splits of several tiles and two row tiles --------------------
# The split count fills the device's waves of CTAs over (splits, Hkv, B), so a split holds several tiles when the tiles
# outnumber a wave's CTAs per (Hkv, B). The small case is the one benchmarks/gpu_check.sh runs under
# compute-sanitizer.

def _run_cuda(seed, dtype, b, hq, hkv, lq, n, d=64, tol=1e-5, layout="bhnd", path="sa", labels=4, runs=0):
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    q, k, lab, positions = make_case(seed, b, hq, hkv, lq, n, d, pad=n // 2, scattered_pad=n // 50, labels=labels,
                                     runs=runs)
    q = torch.from_numpy(q).to(dtype)
    k = torch.from_numpy(k).to(dtype)
    ref = pad_oracle(q.float().numpy(), k.float().numpy(), lab, positions, 0.125, 1e-6)
    kc = k.cuda() if layout == "bhnd" else k.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    out = modality_scores_cuda(q.cuda(), kc, torch.from_numpy(lab).cuda(), torch.from_numpy(positions).cuda(),
                               0.125, 1e-6, path=path).cpu()
    check(seed, f"cuda {dtype} {(b, hq, hkv, lq, n)} {layout} {path}", out.numpy(), ref, lab, tol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(("b", "hq", "hkv", "lq", "n"), [(3, 28, 4, 4, 20000), (4, 24, 2, 3, 20000),
                                                         (1, 4, 4, 1, 33)])
def test_cuda_kernels_match_the_pad_oracle(seed, dtype, b, hq, hkv, lq, n):
    _run_cuda(seed, dtype, b, hq, hkv, lq, n)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_split_kernels_small_case_for_the_sanitizer(seed, dtype, layout):
    """B * Hkv = 64 CTAs per split index, 34 rows per KV head (two row tiles), PAD keys, all 9 labels (evictions),
    both cache layouts: every barrier, ring slot, counter and partial of the S-A kernels, small enough for racecheck
    and synccheck."""
    _run_cuda(seed, dtype, 8, 16, 8, 17, 2600, layout=layout, labels=9)


@pytest.mark.cuda
def test_cuda_sb_small_case_for_the_sanitizer(seed):
    """The persistent S-B kernel (where built and eligible) on a small cooperative grid: 7B heads, N = 3000 (47 tiles,
    so 47 CTAs, 4 combine groups, every unit on chip), label runs and scattered PAD keys, against the oracle; small
    enough for racecheck and synccheck (benchmarks/gpu_check.sh)."""
    _run_cuda(seed, torch.bfloat16, 1, 28, 4, 4, 3000, d=128, path="auto", labels=3, runs=120)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_paths_agree_at_the_7b_shapes(seed, dtype):
    """S-B (where built and eligible: sm_90a, B = 1) and S-A on the 7B shapes (28 / 4 heads, D = 128, Lq = 4) with
    label runs: each against the oracle; on a device where S-B is ineligible both calls take S-A."""
    for path in ("auto", "sa"):
        _run_cuda(seed, dtype, 1, 28, 4, 4, 20000, d=128, path=path, labels=3, runs=120)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("path", ["auto", "sa"])
def test_cuda_error_within_twice_pytorchs_fp32_error(seed, dtype, path):
    """FlashAttention's 2x rule on the GPU at the 7B shapes (N = 20k, label runs): each path's error against the
    float64 reference is at most 2x that of PyTorch's own fp32 path (the torch backend, same device, same inputs)
    plus 2 fp32 ulp of the norm."""
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    q, k, lab, positions = make_case(seed, 1, 28, 4, 4, 20000, 128, labels=3, runs=120)
    qt, kt = torch.from_numpy(q).to(dtype), torch.from_numpy(k).to(dtype)
    ref = pad_oracle(qt.float().numpy(), kt.float().numpy(), lab, positions, 128 ** -0.5, 1e-6)
    dev = [t.cuda() for t in (qt.float(), kt.float(), torch.from_numpy(lab), torch.from_numpy(positions))]
    out = modality_scores_cuda(qt.cuda(), kt.cuda(), dev[2], dev[3], 128 ** -0.5, 1e-6, path=path)
    err, bound = _two_x_rule(out, *dev, 128 ** -0.5, 1e-6, ref)
    assert err <= bound, f"seed={seed} {dtype} {path}: error {err:.3g} > {bound:.3g}"


_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cuda_unsplit_grid_of_many_tiles(seed, dtype):
    """The other side of the split plan: B * Hkv = 68800 CTAs, at least 16 waves on any GPU, so each CTA runs all
    3 tiles of its (batch, KV head) as one split; vs the float64 reference."""
    from macer_kernels.cuda.modality_scores import modality_scores_cuda

    b, hq, hkv, lq, n, d = 4300, 16, 16, 1, 130, 16
    wave_bound = torch.cuda.get_device_properties(0).multi_processor_count * 32
    assert _C.modality_scores_split_plan(b, hkv, 1, n, wave_bound)[1] == 1
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


@pytest.mark.cuda
def test_cuda_counters_stay_zero_across_calls_and_graph_replays(seed):
    """Each unit's last CTA resets its counter and label mask: after calls of several shapes and a captured graph
    replayed on fresh inputs, the cached counter buffer is all zero and every result matches eager."""
    from macer_kernels.cuda import modality_scores as cuda_scores

    shapes = [(1, 28, 4, 4, 3000), (2, 16, 8, 17, 2600), (3, 8, 2, 3, 500)]
    for b, hq, hkv, lq, n in shapes:
        _run_cuda(seed, torch.bfloat16, b, hq, hkv, lq, n)
    torch.cuda.synchronize()
    for buffer in cuda_scores._COUNTERS.values():
        assert int(buffer.abs().sum()) == 0
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 28, 4, 128, generator=g, device="cuda").bfloat16()
    k = torch.randn(1, 4, 5000, 128, generator=g, device="cuda").bfloat16()
    lab = torch.randint(0, 3, (1, 5000), generator=g, device="cuda")
    pos = torch.arange(4996, 5000, device="cuda")[None]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cuda_scores.modality_scores_cuda(q, k, lab, pos, 0.1, 1e-6)  # warm-up: the counters of this stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = cuda_scores.modality_scores_cuda(q, k, lab, pos, 0.1, 1e-6)
        for _ in range(3):
            k.copy_(torch.randn(k.shape, generator=g, device="cuda").bfloat16())
            graph.replay()
            want = cuda_scores.modality_scores_cuda(q, k, lab, pos, 0.1, 1e-6)
            assert torch.equal(out, want)
    torch.cuda.synchronize()
    for buffer in cuda_scores._COUNTERS.values():
        assert int(buffer.abs().sum()) == 0


@pytest.mark.cuda
def test_cuda_stream_k_reads_every_byte_of_k(seed):
    """The K-streaming baseline reads K through the scoring kernel's grid and loads: the XOR of its per-CTA words is
    the XOR of every 32-bit word of K (each byte read exactly once), on both cache layouts."""
    from macer_kernels.cuda.modality_scores import stream_k_cuda

    g = torch.Generator(device="cuda").manual_seed(seed)
    for layout in ("bhnd", "bnhd"):
        k = torch.randn(2, 4, 3001, 128, generator=g, device="cuda").bfloat16()
        if layout == "bnhd":
            k = k.transpose(1, 2).contiguous().transpose(1, 2)
        words = stream_k_cuda(k)
        got = int(np.bitwise_xor.reduce(words.cpu().numpy().view(np.uint32)))
        want = int(np.bitwise_xor.reduce(k.contiguous().cpu().view(torch.int32).numpy().ravel().view(np.uint32)))
        assert got == want, f"seed={seed} {layout}"


def test_replay_runs_in_reasonable_time_on_the_7b_group():
    """A guard on this file's own cost: one replay at the 7B group (28 rows) and N = 640 stays small."""
    q, k, lab, positions = make_case(1, 1, 7, 1, 4, 640, 8, labels=3, runs=100)
    out = replay(q, k, lab, positions, 0.3, 1e-6)
    assert out.shape == (1, 640) and math.isfinite(float(np.nansum(out)))
