"""Fused allocation-normalised modality scores (``eq:macer_score``) in three Triton launches.

For one query row ``r = (q, h)`` with logits ``l_i = scale * q . k_i`` over its visible keys ``i <= pos(q)``, the
row maximum ``M``, the all-keys sum ``Z = sum_i exp(l_i - M)`` and the per-modality sums
``S_m = sum_{i in I_m} exp(l_i - M)``, the softmax normaliser cancels except inside ``eps``:

``A(i) / (sum_{j in m} A(j) + eps) = exp(l_i - M) / (S_m + eps * Z)``                                  (1)

so a token's score is ``sum_r exp(l_ri - M_r) / (S_{r,m(i)} + eps Z_r) / (Lq Hq)`` and no probability is ever
normalised. The kernels follow flash-decoding:

1. ``_partial_stats_kernel``, grid ``(B * Hkv, key tiles)``: loads one ``[BLOCK_N, D]`` tile of K for one KV head
   and scores it against all ``G * Lq`` query rows that share the head (GQA: K is read once per KV head, never
   once per query head), applies each row's causal limit, and writes the tile's per-row maximum and its
   rescaled ``Z`` and ``S_m`` (an online softmax per modality, split over tiles).
2. ``_combine_kernel``, grid ``(B * Hq * Lq,)``: merges the tiles of one row into ``M`` and the weights
   ``1 / ((S_m + eps Z) Lq Hq)`` of (1).
3. ``_scores_kernel``, grid ``(B, key tiles)``: recomputes the logits of its tile for every KV head (or reads them
   back, see ``STORE_LOGITS``) and writes ``sum_r exp(l_ri - M_r) * weight_{r, m(i)}``, one fp32 per key, without
   atomics (so results are deterministic).

PAD keys (label ``-1``, ``macer_kernels.PAD_LABEL``: left padding of a batch) are masked in every row exactly like
keys past the row's causal limit: they add nothing to ``Z`` or any ``S_m``, their K rows are never part of a logit
(so a garbage or non-finite padding row flags nothing), and their score is exactly 0. A sample's scores on its real
keys are therefore those of the sample run alone without its padding. Labels are only ever compared, never used as
an index.

Non-finite inputs (the rule of ``macer_kernels.modality_scores``): phase 1 flags a row with a non-finite logit of a
kept pair (its tile maximum stored as NaN), the combine turns the flags of a row's tiles into weight slot 0, and
phase 3 writes NaN for the scored keys of a batch element with a flagged row and exactly 0 for label-0 keys; the
flag is an explicit test reduced as an integer, never NaN propagating through a max.

All arithmetic after the dot product is fp32; products of bf16/fp16 inputs are exact in fp32, fp32 inputs use the
IEEE (not TF32) dot. Logits are kept in base 2 (``exp2`` with ``log2(e)`` folded into the scale).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from macer_kernels.backend import register
from macer_kernels.modality_scores import MAX_MODALITIES
from macer_kernels.triton._device import on_input_device

STORE_LOGITS = False
"""Default strategy of phase 3: recompute the logits from K (False) or store fp32 logits in phase 1 and read them
back (True). Recomputing re-reads ``Hkv * N * D`` elements of K; storing writes and reads ``Hq * Lq * N`` fp32. For
the 7B shapes (28 / 4 heads, D = 128, Lq = 4, bf16) that is 1024 vs 896 bytes per key, but storing grows with Lq and
needs an O(Hq Lq N) workspace. ``docs/triton.md`` gives the reasoning; ``benchmarks/bench_modality_scores.py``
times both."""

MAX_DOT_ROWS = 64
"""Most query rows in one ``tl.dot``. The ``G * Lq`` rows that share a KV head go through the dot in blocks of at most
this many, each against the same K tile. Without the bound the q operand grows with the question span: at
``G * Lq = 512`` rows (Lq = 37 with 7 query heads per KV head) a D = 128 bf16 program needs 132 KB of shared memory,
more than sm_89 has, and at 1024 rows more than sm_90's 227 KB, and the launch fails."""

SMEM_PER_PROGRAM = 96 * 1024
"""Shared memory a scoring program's pipelined tiles may take: under the 99 KB per block of sm_86 / sm_89, the
smallest of the GPUs the package targets (Triton's small reduction scratch comes on top)."""

COMBINE_BLOCK_T = 1024
"""Key tiles the combine (phase 2) reads per step of its loops over a row's tiles. Above ``COMBINE_BLOCK_T`` tiles
(N above 32k fp32 / 131k bf16 keys at 32 / 128 keys per tile) the loops take several steps; the tests set it small
to run those steps in the interpreter."""

COMBINE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
"""Compile options of the combine (phase 2). Without FP fusion: with it, the first step of each cross-lane sum (the
butterfly of ``tl.sum(sums * factor, axis=1)``) becomes ``fma(own sum, own factor, partner's rounded product)``, so
the lanes that share one result compute it in different orders, get values an ulp apart, and all store their own to
the same shared-memory slot: compute-sanitizer's racecheck reported those writes as hazards (H200, 2026-11-27; the
Triton issue is triton-lang/triton#7264). Unfused, each butterfly step is a plain commutative add, every lane of a
group holds the same bits, and which lane's store lands cannot change the result. The offline compile test
(``tests/kernels/test_triton_kernels.py``) checks that no ``fma`` takes a shuffled value."""

_LOG2E = 1.4426950408889634
_INTERPRETED = bool(triton.knobs.runtime.interpret)

SMALL_PHASE3_TILES = not _INTERPRETED
"""Phase 3 takes a smaller key tile than phase 1 (``_block_n_scores``): compiled, it saves registers; the interpreter
has none to save and runs each program in Python (3.5x the time of the scoring tests), so there it keeps phase 1's
tile unless a test sets this."""


@triton.jit
def _tile_logits(q_rows, k_head, pos_row, labels, offs_n, rows, N, R, LQ, D, stride_kn, stride_pl, scale_log2,
                 BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, MARK: tl.constexpr):
    """Base-2 logits ``[len(rows), BLOCK_N]`` of the query rows ``rows`` at ``q_rows`` (``R`` rows of ``D``,
    contiguous) against keys ``offs_n`` of the KV head at ``k_head``; -inf where a key is beyond the row's causal
    limit, past N or a PAD key (label < 0: not a key of the sample, ``macer_kernels.PAD_LABEL``), and on padded rows
    (``rows >= R``). With ``MARK``, every non-finite logit of a kept pair becomes NaN (a visible -inf would otherwise
    look like a masked key), so that NaN marks exactly the broken pairs; a PAD key's K row is never looked at."""
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    d_ok = offs_d < D
    n_ok = offs_n < N
    q = tl.load(q_rows + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k = tl.load(k_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        # fp32/fp64 (or mixed) inputs: the IEEE fp32 product, not TF32, keeps the fp32-accumulation error bound.
        acc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        # bf16 x bf16 and fp16 x fp16 products are exact in the fp32 accumulator.
        acc = tl.dot(q, tl.trans(k))
    pos = tl.load(pos_row + (rows % LQ) * stride_pl, mask=row_ok, other=-1)
    visible = (offs_n[None, :] <= pos[:, None]) & (n_ok & (labels >= 0))[None, :]
    logits = acc * scale_log2
    if MARK:
        # |l| < inf is false for NaN and +-inf alike.
        logits = tl.where(tl.abs(logits) < float("inf"), logits, float("nan"))
    return tl.where(visible, logits, float("-inf"))


@triton.jit
def _stats_rows(q_rows, k_head, lab_row, pos_row, max_ptr, sum_ptr, logit_ptr, row0, rows, offs_n, pid_t,
                N, R, LQ, D, T, stride_kn, stride_ln, stride_pl, scale_log2,
                NUM_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, STORE: tl.constexpr):
    """Phase 1 for the query rows ``rows`` (of the ``R`` at ``row0``) against one key tile: each row's tile maximum
    and its ``Z`` and ``S_1..S_NUM_M`` relative to it."""
    row_ok = rows < R
    labels = tl.load(lab_row + offs_n * stride_ln, mask=offs_n < N, other=0)
    l2 = _tile_logits(q_rows, k_head, pos_row, labels, offs_n, rows, N, R, LQ, D, stride_kn, stride_pl, scale_log2,
                      BLOCK_D, DOT_FP32, True)
    if STORE:
        tl.store(logit_ptr + (row0 + rows)[:, None] * N + offs_n[None, :], l2,
                 mask=row_ok[:, None] & (offs_n < N)[None, :])
    # The non-finite rule: a row with a NaN (marked) logit stores NaN as its tile maximum, the flag the combine reads.
    # The flag comes from an integer reduction of an explicit test, never from NaN propagating through tl.max, which
    # compiled code may drop.
    broken = tl.max((l2 != l2).to(tl.int32), axis=1) > 0
    m = tl.where(broken, float("nan"), tl.max(l2, axis=1))
    # A row that sees no key of this tile keeps max -inf and zero sums; subtracting 0 instead avoids inf - inf.
    p = tl.exp2(l2 - tl.where(m == float("-inf"), 0.0, m)[:, None])
    out_row = row0 + rows
    tl.store(max_ptr + out_row * T + pid_t, m, mask=row_ok)
    # sums[row, 0, t] = Z (all visible keys: the eps term needs it), sums[row, m, t] = S_m.
    tl.store(sum_ptr + (out_row * (NUM_M + 1)) * T + pid_t, tl.sum(p, axis=1), mask=row_ok)
    for mod in tl.static_range(1, NUM_M + 1):
        s_m = tl.sum(tl.where(labels[None, :] == mod, p, 0.0), axis=1)
        tl.store(sum_ptr + (out_row * (NUM_M + 1) + mod) * T + pid_t, s_m, mask=row_ok)


@triton.jit
def _partial_stats_kernel(q_ptr, k_ptr, lab_ptr, pos_ptr, max_ptr, sum_ptr, logit_ptr,
                          N, R, LQ, D, T, stride_kb, stride_kh, stride_kn, stride_lb, stride_ln, stride_pb, stride_pl,
                          scale_log2,
                          HKV: tl.constexpr, NUM_M: tl.constexpr, ROWS: tl.constexpr, ROW_LOOP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr, STORE: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    offs_n = pid_t * BLOCK_N + tl.arange(0, BLOCK_N)
    # The rows of one (b, kv head) are contiguous: (b * Hq + h) * Lq + q for the G heads h of the group.
    row0 = pid_bh.to(tl.int64) * R
    q_rows = q_ptr + row0 * D
    k_head = k_ptr + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    lab_row = lab_ptr + b.to(tl.int64) * stride_lb
    pos_row = pos_ptr + b.to(tl.int64) * stride_pb
    if ROW_LOOP:
        # More than ROWS rows share this K tile (a long question span): ROWS at a time, which bounds the shared
        # memory and registers of the q operand and of the logit tile. The K tile is loaded again for each block,
        # from L1/L2: DRAM traffic stays one read of K.
        for r0 in range(0, R, ROWS):
            _stats_rows(q_rows, k_head, lab_row, pos_row, max_ptr, sum_ptr, logit_ptr, row0, r0 + tl.arange(0, ROWS),
                        offs_n, pid_t, N, R, LQ, D, T, stride_kn, stride_ln, stride_pl, scale_log2, NUM_M, BLOCK_D,
                        DOT_FP32, STORE)
    else:
        _stats_rows(q_rows, k_head, lab_row, pos_row, max_ptr, sum_ptr, logit_ptr, row0, tl.arange(0, ROWS), offs_n,
                    pid_t, N, R, LQ, D, T, stride_kn, stride_ln, stride_pl, scale_log2, NUM_M, BLOCK_D, DOT_FP32,
                    STORE)


@triton.jit
def _combine_kernel(max_ptr, sum_ptr, rowmax_ptr, weight_ptr, T, eps, inv_rows,
                    NUM_M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    mods = tl.arange(0, M_PAD)
    mod_ok = mods <= NUM_M
    # Pass 1: the row maximum over all tiles, and whether a tile flagged the row broken (tile maximum NaN, see
    # _stats_rows), tested explicitly and reduced as an integer. The maximum is finite for valid inputs (a row sees its
    # own position, a real key); a row that sees no key at all (its position on a PAD key) gets weight 0 below.
    run_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    run_broken = tl.zeros([BLOCK_T], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        tile_max = tl.load(max_ptr + row * T + t, mask=t < T, other=float("-inf"))
        run_broken = tl.maximum(run_broken, (tile_max != tile_max).to(tl.int32))
        run_max = tl.maximum(run_max, tile_max)
    row_broken = tl.max(run_broken, axis=0) > 0
    # A broken row's maximum and weights are not used (phase 3 writes NaN for its whole batch element); 0 keeps
    # them from carrying NaN into its arithmetic.
    row_max = tl.max(run_max, axis=0)
    row_max = tl.where(row_broken | (row_max == float("-inf")), 0.0, row_max)
    # Pass 2: rescale each tile's sums to the row maximum and add them up, all modalities at once.
    acc = tl.zeros([M_PAD], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + offs_t
        tile_max = tl.load(max_ptr + row * T + t, mask=t < T, other=float("-inf"))
        factor = tl.exp2(tile_max - row_max)  # 0 for tiles the row cannot see
        sums = tl.load(sum_ptr + (row * (NUM_M + 1) + mods[:, None]) * T + t[None, :],
                       mask=mod_ok[:, None] & (t < T)[None, :], other=0.0)
        acc += tl.sum(sums * factor[None, :], axis=1)
    z = tl.sum(tl.where(mods == 0, acc, 0.0), axis=0)
    # Weight of eq. (1), with the 1 / (Lq Hq) mean folded in. A modality with no visible mass gets weight 0: its
    # keys all have exp(l - M) = 0 in this row, and 0 * (1 / 0) must not become NaN when eps = 0.
    scored = (mods >= 1) & (acc > 0.0)
    weight = tl.where(scored, inv_rows / tl.where(scored, acc + eps * z, 1.0), 0.0)
    # Slot 0 (label 0 is never scored) holds the row's broken flag for phase 3: 1.0 broken, 0.0 not.
    weight = tl.where(mods == 0, tl.where(row_broken, 1.0, 0.0), tl.where(row_broken, 0.0, weight))
    # The row maximum from one lane: a scalar store is issued by every thread of the program (compute-sanitizer's
    # racecheck reports the identical writes as a hazard), a one-element masked store by the lane that owns it.
    tl.store(rowmax_ptr + row + mods, tl.where(mods == 0, row_max, 0.0), mask=mods == 0)
    tl.store(weight_ptr + row * M_PAD + mods, weight)


@triton.jit
def _scores_rows(q_rows, k_head, pos_row, rowmax_ptr, weight_ptr, logit_ptr, labels, row0, rows, offs_n,
                 N, R, LQ, D, stride_kn, stride_pl, scale_log2,
                 NUM_M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
                 STORE: tl.constexpr):
    """Phase 3 for the query rows ``rows`` (of the ``R`` at ``row0``) of one KV head: ``sum_r exp(l - M_r) *
    weight[r, label]`` per key of the tile."""
    row_ok = rows < R
    if STORE:
        l2 = tl.load(logit_ptr + (row0 + rows)[:, None] * N + offs_n[None, :],
                     mask=row_ok[:, None] & (offs_n < N)[None, :], other=float("-inf"))
    else:
        l2 = _tile_logits(q_rows, k_head, pos_row, labels, offs_n, rows, N, R, LQ, D, stride_kn, stride_pl,
                          scale_log2, BLOCK_D, DOT_FP32, False)
    row_max = tl.load(rowmax_ptr + row0 + rows, mask=row_ok, other=0.0)
    p = tl.exp2(l2 - row_max[:, None])
    # weight[r, label of key]: a select per label (NUM_M = MAX_MODALITIES, unrolled).
    w = tl.zeros_like(p)
    for mod in tl.static_range(1, NUM_M + 1):
        w_m = tl.load(weight_ptr + (row0 + rows) * M_PAD + mod, mask=row_ok, other=0.0)
        w = tl.where(labels[None, :] == mod, w_m[:, None], w)
    return tl.sum(p * w, axis=0)


@triton.jit
def _scores_kernel(q_ptr, k_ptr, lab_ptr, pos_ptr, rowmax_ptr, weight_ptr, logit_ptr, out_ptr,
                   N, R, LQ, D, stride_kb, stride_kh, stride_kn, stride_lb, stride_ln, stride_pb, stride_pl,
                   scale_log2,
                   HKV: tl.constexpr, NUM_M: tl.constexpr, M_PAD: tl.constexpr, ROWS: tl.constexpr,
                   ROW_LOOP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
                   STORE: tl.constexpr):
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    labels = tl.load(lab_ptr + b.to(tl.int64) * stride_lb + offs_n * stride_ln, mask=n_ok, other=0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    b64 = b.to(tl.int64)
    k_head = k_ptr + b64 * stride_kb
    pos_row = pos_ptr + b64 * stride_pb
    row0 = b64 * HKV * R
    # One program covers every KV head of its key tile, so the sum over (q, h) needs no atomics.
    for _ in range(HKV):
        if ROW_LOOP:  # ROWS query rows at a time, as in phase 1
            for r0 in range(0, R, ROWS):
                acc += _scores_rows(q_ptr + row0 * D, k_head, pos_row, rowmax_ptr, weight_ptr, logit_ptr, labels, row0,
                                    r0 + tl.arange(0, ROWS), offs_n, N, R, LQ, D, stride_kn, stride_pl, scale_log2,
                                    NUM_M, M_PAD, BLOCK_D, DOT_FP32, STORE)
        else:
            acc += _scores_rows(q_ptr + row0 * D, k_head, pos_row, rowmax_ptr, weight_ptr, logit_ptr, labels, row0,
                                tl.arange(0, ROWS), offs_n, N, R, LQ, D, stride_kn, stride_pl, scale_log2, NUM_M,
                                M_PAD, BLOCK_D, DOT_FP32, STORE)
        k_head += stride_kh
        row0 += R
    # The non-finite rule, per batch element: if any of its HKV * R rows is flagged broken (weight slot 0, written
    # by the combine), every scored key is NaN. Label-0 keys are exactly 0 either way (sum_r p * 0 is NaN when a
    # broken row's p is). An integer reduction of the flags, not NaN propagation through the sums.
    broken = tl.zeros([ROWS], tl.int32)
    row_b = b64 * HKV * R
    for r0 in range(0, HKV * R, ROWS):
        r = r0 + tl.arange(0, ROWS)
        flag = tl.load(weight_ptr + (row_b + r) * M_PAD, mask=r < HKV * R, other=0.0)
        broken = tl.maximum(broken, (flag != 0.0).to(tl.int32))
    acc = tl.where(tl.max(broken, axis=0) > 0, float("nan"), acc)
    # PAD keys (label < 0) are exactly 0 as well, also in a batch element with a broken row.
    tl.store(out_ptr + b64 * N + offs_n, tl.where(labels <= 0, 0.0, acc), mask=n_ok)


def _row_block(rows_per_kv: int) -> int:
    """Query rows per ``tl.dot``: the rows of one KV head padded to a power of two, at least 16 (the smallest
    compiled ``tl.dot`` operand) and at most ``MAX_DOT_ROWS``; the kernels loop over blocks of this many rows."""
    return max(16, min(MAX_DOT_ROWS, triton.next_power_of_2(rows_per_kv)))


def _block_n(d: int, tiles_wanted: int, n: int, batch: int, dot_fp32: bool) -> int:
    """Key-tile width. 128 keys for half inputs (64 for D > 128, to bound registers), half that for the fp32 dot,
    whose operands take twice the shared memory (with at most ``MAX_DOT_ROWS`` query rows per dot this keeps every
    kernel under the 99 KB of sm_89, checked by compiling for sm_89); then halved down to 32 while the grid is too
    small to fill the GPU."""
    block = (128 if d <= 128 else 64) // (2 if dot_fp32 else 1)
    while block > 32 and batch * triton.cdiv(n, block) < tiles_wanted:
        block //= 2
    return block


def _block_n_scores(d: int, tiles_wanted: int, n: int, batch: int, dot_fp32: bool) -> int:
    """Key-tile width of phase 3: half of ``_block_n``'s (a quarter for the fp32 dot), at least 16. Phase 3 holds the
    logit tile of every row block, its exp2 and the per-label weights at once: at phase 1's width it took 151 / 154
    registers (sm_89 / sm_90, bf16, D = 128, 8 warps, one program per SM) and the fp32 variant spilled on sm_89
    (320 B of stack at D = 128, 4.3 KB at D = 256). At this width: 80 / 96 for bf16; fp32 48 (8 B) / 80 at D = 128,
    78 / no spill at D = 256 (cuobjdump of offline compiles, docs/triton.md). The query rows are re-read per program
    from L2; K is still read once."""
    block = _block_n(d, tiles_wanted, n, batch, dot_fp32)
    return max(16, block // (4 if dot_fp32 else 2)) if SMALL_PHASE3_TILES else block


def _num_stages(rows_pad: int, block_n: int, block_d: int, operand_bytes: int, row_loop: bool,
                dot_fp32: bool) -> int:
    """Pipeline stages of the loops that take a ``tl.dot`` (phase 3's loop over KV heads). With ``s`` stages a
    launch specialised by the JIT (aligned pointers, 16-divisible strides) keeps ``s - 1`` copies of the q and K tiles
    in shared memory (read off the cubins: 40 KB per copy at the 7B shapes), so ``s`` is capped to keep them within
    ``SMEM_PER_PROGRAM``: bf16 D = 256 with 33..64 query rows per KV head asked 3 stages, 128 KB, which sm_89 cannot
    launch. A loop over row blocks gets one stage: pipelining it would multi-buffer the tiles of every block."""
    if row_loop:
        return 1
    per_copy = (rows_pad + block_n) * block_d * operand_bytes
    return max(1, min(2 if dot_fp32 else 3, 1 + SMEM_PER_PROGRAM // per_copy))


_PARTIALS: dict[tuple, torch.Tensor] = {}


def _partials(device: torch.device, rows: int, tiles: int, num_m: int, m_pad: int, logit_cols: int
              ) -> tuple[torch.Tensor, ...]:
    """The workspace of one call as views of one fp32 buffer, cached per shape, device and stream: tile maxima
    ``[rows, tiles]``, tile sums ``[rows, num_m + 1, tiles]``, stored logits ``[rows, logit_cols]``, row maxima
    ``[rows]`` and weights ``[rows, m_pad]``. Every entry a kernel reads is written earlier in the same call, so
    reuse needs no fill; calls on one stream run in order, and another stream gets its own buffer."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    shapes = ((rows, tiles), (rows, num_m + 1, tiles), (rows, logit_cols), (rows,), (rows, m_pad))
    key = (device, stream, shapes)
    buffer = _PARTIALS.get(key)
    if buffer is None:
        if len(_PARTIALS) >= 16:  # a bounded cache: one entry per (shape, stream) in use
            _PARTIALS.pop(next(iter(_PARTIALS)))
        buffer = _PARTIALS[key] = torch.empty(sum(math.prod(shape) for shape in shapes), dtype=torch.float32,
                                              device=device)
    views, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(buffer[offset:offset + size].view(shape))
        offset += size
    return tuple(views)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any small grid


@register("modality_scores", "triton")
@on_input_device
def modality_scores_triton(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor,
                           query_positions: torch.Tensor, scale: float, eps: float, *,
                           store_logits: bool | None = None) -> torch.Tensor:
    """Triton ``eq:macer_score``; arguments as validated by ``macer_kernels.modality_scores``.

    ``store_logits`` overrides ``STORE_LOGITS`` (the benchmark times both strategies). Returns ``[B, N]`` fp32.
    """
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    # The label bound sizes the per-row state. It is the static MAX_MODALITIES, not the largest label present:
    # reading that back (modality.max()) would synchronise with the host on every call.
    num_m = MAX_MODALITIES
    out = torch.empty(b, n, dtype=torch.float32, device=query.device)  # phase 3 writes every key
    if n == 0:
        return out
    store = STORE_LOGITS if store_logits is None else store_logits
    group = hq // hkv
    rows_per_kv = group * lq  # the query rows that share one KV head
    rows_pad = _row_block(rows_per_kv)
    row_loop = rows_per_kv > rows_pad  # the kernels loop over blocks of rows_pad query rows
    block_d = max(16, triton.next_power_of_2(d))
    m_pad = triton.next_power_of_2(num_m + 1)
    # Tensor-core dot for matching half types; the IEEE fp32 dot otherwise. Triton 3.9's interpreter computes bf16
    # tl.dot wrongly, so there bf16 is upcast first (the same numbers: bf16 products are exact in fp32).
    half = query.dtype == key.dtype and query.dtype in (torch.bfloat16, torch.float16)
    dot_fp32 = not half or (_INTERPRETED and query.dtype == torch.bfloat16)
    query = query.contiguous()  # [B, Hq, Lq, D] is small; K is never copied
    sms = _num_sms(query.device)
    block_n1 = _block_n(d, 2 * sms, n, b * hkv, dot_fp32)
    tiles = triton.cdiv(n, block_n1)
    total_rows = b * hq * lq
    tile_max, tile_sums, logits, row_max, weight = _partials(query.device, total_rows, tiles, num_m, m_pad,
                                                             n if store else 0)
    logits = logits if store else tile_max  # not read when the logits are recomputed
    scale_log2 = scale * _LOG2E
    common = (n, rows_per_kv, lq, d)
    k_strides = (key.stride(0), key.stride(1), key.stride(2))
    lab_strides = (modality.stride(0), modality.stride(1))
    pos_strides = (query_positions.stride(0), query_positions.stride(1))
    # The fp32 dot's tiles are large: at most two pipeline stages over the KV heads; every choice is capped by the
    # shared memory its copies take (_num_stages).
    operand_bytes = 4 if dot_fp32 else query.element_size()
    _partial_stats_kernel[(b * hkv, tiles)](
        query, key, modality, query_positions, tile_max, tile_sums, logits, *common, tiles, *k_strides,
        *lab_strides, *pos_strides, scale_log2,
        HKV=hkv, NUM_M=num_m, ROWS=rows_pad, ROW_LOOP=row_loop, BLOCK_N=block_n1, BLOCK_D=block_d,
        DOT_FP32=dot_fp32, STORE=store, num_warps=8 if block_d >= 128 else 4,
        num_stages=_num_stages(rows_pad, block_n1, block_d, operand_bytes, row_loop, dot_fp32),
    )
    _combine_kernel[(total_rows,)](
        tile_max, tile_sums, row_max, weight, tiles, eps, 1.0 / (lq * hq),
        NUM_M=num_m, M_PAD=m_pad, BLOCK_T=min(COMBINE_BLOCK_T, triton.next_power_of_2(tiles)), **COMBINE_OPTIONS,
    )
    block_n3 = _block_n_scores(d, 2 * sms, n, b, dot_fp32)
    _scores_kernel[(b, triton.cdiv(n, block_n3))](
        query, key, modality, query_positions, row_max, weight, logits, out, *common, *k_strides, *lab_strides,
        *pos_strides, scale_log2,
        HKV=hkv, NUM_M=num_m, M_PAD=m_pad, ROWS=rows_pad, ROW_LOOP=row_loop, BLOCK_N=block_n3, BLOCK_D=block_d,
        DOT_FP32=dot_fp32, STORE=store, num_warps=8 if block_d >= 128 else 4,
        num_stages=_num_stages(rows_pad, block_n3, block_d, operand_bytes, row_loop, dot_fp32),
    )
    return out

