"""``stage_select`` in one Triton launch: every selection of a readout stage, one program per sample.

A program owns one sample (row) of ``[B, N]`` scores and labels and keeps, in ascending order, every token whose
label is not a stage modality plus each stage modality's picks:

* **top-K** (key: score desc, index asc) by radix select on the score's bits: the budget's boundary key ``T`` (the
  keep-th smallest descending-order key) is found 8 bits at a time, each digit by a 256-bin histogram of the tokens
  that share the digits found so far (4 counting passes over the row for <= 32-bit scores, 8 for float64); the
  picks are every token below ``T`` and the first remaining-budget tokens at ``T`` in index order. O(N) work per
  pass, no sort, exact ties to the lower index.
* **coverage** (``eq:chunk_coverage_greedy``): the modality's tokens are listed in index order (a prefix count), then
  pairwise over that list the within-chunk rank (score desc, index asc), ``v = s + sqrt(lambda_c / (1 + rank))`` in
  float64, and each token's place in (v desc, score desc, index asc) (``triton/select.py`` explains why this is the
  greedy's pick order). O(count^2) comparisons in one program: this bounds the one-program path
  (``COVERAGE_ONE_PROGRAM_MAX_N``).

PAD tokens (label -1, the left padding of a batch) are never kept. Budgets are the spec's, or per sample (``keeps``
``[B, M]`` int32, read on the device). The picks and the other tokens are flagged in a per-row workspace and written
with a running prefix count, right-aligned (``-1`` on the left, like the batch's padding), so the output needs no
sort; a row that contradicts the host's sizes is all -1. Program-wide barriers (``tl.debug_barrier``) order the
phases: every phase reads what other threads of the program wrote to the workspace in the previous one.

Above the one-program limits the stage runs as the PyTorch composition (stable CUB sorts, ``stage._stage_select_torch``)
on the same tensors: more launches, still no host synchronisation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from macer_kernels.backend import register
from macer_kernels.stage import StageSpec, _stage_select_torch, stage_flags
from macer_kernels.triton._device import on_input_device

ONE_PROGRAM_MAX_N = 16384
"""Largest N handled by one program per sample for a stage of top-K modalities: each radix pass reads the row once
(5 passes with the final one for fp32 scores, about 80k element visits per modality at N = 16k, an estimate of
several microseconds on one SM; not measured, no GPU was available)."""

COVERAGE_ONE_PROGRAM_MAX_N = 4096
"""Largest N handled by one program per sample when a modality uses the coverage greedy: its pairwise passes cost
count^2 comparisons in one program (about 2 x 16.7M at count = 4096, estimated at a few hundred microseconds on one
SM, more than the sort-based composition's ~15 sort launches). An estimate, not a measurement: the benchmark of the
stage decides."""

_MAX_MODS = 8  # the kernel takes one runtime budget argument per modality (K0..K7): MAX_MODALITIES labels
_BLOCK = 512  # elements per step of the streaming passes (flags, token list, radix histograms, output)
# Pairwise coverage tiles: 64 x 64 in registers compiled; the interpreter pays per step in Python, so it takes bigger
# tiles (tails and multi-tile loops are still exercised above 256 tokens).
_BLOCK_I = 256 if triton.knobs.runtime.interpret else 64
_BLOCK_J = _BLOCK_I


@triton.jit
def _bonus_value(s64, rank, weight):
    """``v = s + sqrt(lambda_c / (1 + rank))`` in float64 (``weight`` is lambda_c as a float64 scalar).

    Equal values must compare equal here and in the reference, so every step must round like IEEE float64: on
    NVIDIA, Triton lowers float64 ``/`` to ``div.rn.f64`` and ``sqrt`` to ``sqrt.rn.f64`` (correctly rounded; its
    ``div_rn``/``sqrt_rn`` helpers are float32-only), and the interpreter uses numpy's IEEE operations."""
    return s64 + tl.sqrt((weight + tl.zeros_like(s64)) / (1.0 + rank.to(tl.float64)))


@triton.jit
def _pick(m: tl.constexpr, k0, k1, k2, k3, k4, k5, k6, k7):
    """The m-th of eight runtime arguments (m is a compile-time index)."""
    k = k0
    if m == 1:
        k = k1
    if m == 2:
        k = k2
    if m == 3:
        k = k3
    if m == 4:
        k = k4
    if m == 5:
        k = k5
    if m == 6:
        k = k6
    if m == 7:
        k = k7
    return k


@triton.jit
def _desc_key(s, WIDE: tl.constexpr):
    """A signed integer (int64) whose ascending order is the score's descending order: -0.0 ties with +0.0, and
    every NaN (any sign or payload, tested with ``s != s``, not from its bits) gets the largest key of its width,
    after -inf's: the selection rule for non-finite scores."""
    if WIDE:
        s = s.to(tl.float64)
        bits = tl.where(s == 0.0, 0.0, s).to(tl.int64, bitcast=True)
        key = ~(bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF))
        return tl.where(s != s, 9223372036854775807, key)
    else:
        s = s.to(tl.float32)
        bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
        key = ~(bits ^ ((bits >> 31) & 0x7FFFFFFF))
        return tl.where(s != s, 2147483647, key).to(tl.int64)


@triton.jit
def _label_of(lab_row, i, ok, stride_ln, LABELLED: tl.constexpr, LABEL0: tl.constexpr):
    if LABELLED:
        return tl.load(lab_row + i * stride_ln, mask=ok, other=0).to(tl.int32)
    else:
        return tl.where(ok, LABEL0, 0)  # every token belongs to the one modality (the single ops)


@triton.jit
def _topk_flags(s_row, lab_row, flag_row, N, keep, label, stride_sn, stride_ln,
                LABELLED: tl.constexpr, LABEL0: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Flag the ``keep`` tokens of ``label`` with the smallest (descending score key, index): a radix select of the
    boundary key ``T`` (the keep-th smallest), 8 bits per counting pass, then every key below ``T`` and the first
    tokens at ``T`` in index order. Returns the number of tokens of ``label`` (the first pass counts them all); with
    fewer than ``keep`` of them the flags are some subset of them (never an access out of the row) and the caller
    discards the row."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    PASSES: tl.constexpr = 8 if WIDE else 4
    # Unsigned order as a non-negative int64 (32-bit keys) or as the bit pattern of an int64 (64-bit keys).
    BIAS: tl.constexpr = -9223372036854775807 - 1 if WIDE else 2147483648
    prefix = tl.zeros([], tl.int64)  # the digits of T decided so far
    need = keep  # T's 1-based place among the tokens that share those digits
    count = tl.zeros([], tl.int32)
    for p in tl.static_range(PASSES):
        shift = 8 * (PASSES - 1 - p)
        # The bits above this digit, as an int64 tensor: a Python constant of this size is not kept 64-bit by
        # Triton 3.9's interpreter inside a called function (it read -2**56 as 0).
        if shift + 8 < 64:
            high = tl.full([], -1, tl.int64) << (shift + 8)
        else:
            high = tl.zeros([], tl.int64)
        hist = tl.zeros([256], tl.int32)
        for i0 in range(0, N, BLOCK):
            i = i0 + offs
            ok = i < N
            is_m = (_label_of(lab_row, i, ok, stride_ln, LABELLED, LABEL0) == label) & ok
            u = _desc_key(tl.load(s_row + i * stride_sn, mask=ok, other=0.0), WIDE)
            u = (u ^ BIAS) if WIDE else (u + BIAS)
            match = is_m & ((u & high) == prefix)
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        if p == 0:  # every token of the label shares the empty prefix
            count = tl.sum(hist, axis=0)
        cum = tl.cumsum(hist, axis=0)
        digit = tl.sum((cum < need).to(tl.int32), axis=0)  # the first bin whose running count reaches need
        need -= tl.sum(tl.where(bins < digit, hist, 0), axis=0)
        prefix = prefix | (digit.to(tl.int64) << shift)
    # prefix == T; need tokens at T are picked, in index order.
    at_seen = tl.zeros([], tl.int32)
    for i0 in range(0, N, BLOCK):
        i = i0 + offs
        ok = i < N
        is_m = (_label_of(lab_row, i, ok, stride_ln, LABELLED, LABEL0) == label) & ok
        u = _desc_key(tl.load(s_row + i * stride_sn, mask=ok, other=0.0), WIDE)
        u = (u ^ BIAS) if WIDE else (u + BIAS)
        below = is_m & (_unsigned_less(u, prefix, WIDE))
        at = is_m & (u == prefix)
        order_at = at_seen + tl.cumsum(at.to(tl.int32), axis=0)  # 1-based place among the ties, by index
        tl.store(flag_row + i, tl.full([BLOCK], 1, tl.int8), mask=below | (at & (order_at <= need)))
        at_seen += tl.sum(at.to(tl.int32), axis=0)
    return count


@triton.jit
def _unsigned_less(a, b, WIDE: tl.constexpr):
    """a < b for the unsigned keys above (64-bit ones held in int64 bit patterns: flip the sign bit back)."""
    if WIDE:
        return (a ^ (-9223372036854775807 - 1)) < (b ^ (-9223372036854775807 - 1))
    else:
        return a < b


@triton.jit
def _coverage_flags(s_row, lab_row, c_row, flag_row, list_row, v_row, N, keep, label, weight,
                    stride_sn, stride_ln, stride_cn,
                    LABELLED: tl.constexpr, LABEL0: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Flag the coverage greedy's ``keep`` picks among the tokens of ``label``; returns their number (with fewer than
    ``keep`` every one is flagged and the caller discards the row)."""
    offs = tl.arange(0, BLOCK)
    offs_i = tl.arange(0, BLOCK_I)  # pairwise tiles are BLOCK_I x BLOCK_J: registers, not the row block
    offs_j = tl.arange(0, BLOCK_J)
    # The modality's tokens in index order: list[0:count].
    count = tl.zeros([], tl.int32)
    for i0 in range(0, N, BLOCK):
        i = i0 + offs
        ok = i < N
        is_m = (_label_of(lab_row, i, ok, stride_ln, LABELLED, LABEL0) == label) & ok
        slot = count + tl.cumsum(is_m.to(tl.int32), axis=0) - 1
        tl.store(list_row + slot, i, mask=is_m)
        count += tl.sum(is_m.to(tl.int32), axis=0)
    tl.debug_barrier()
    # v of every listed token: rank = #{same chunk, (score desc, index asc) ahead}. List order is index order, so
    # comparing list slots compares indices.
    for i0 in range(0, count, BLOCK_I):
        a = i0 + offs_i
        a_ok = a < count
        tok = tl.load(list_row + a, mask=a_ok, other=0)
        s_raw = tl.load(s_row + tok * stride_sn, mask=a_ok, other=0.0)
        s_a = _desc_key(s_raw, WIDE)  # integer keys: a NaN ranks after every number (a float > would not)
        c_a = tl.load(c_row + tok * stride_cn, mask=a_ok, other=0).to(tl.int64)
        rank = tl.zeros([BLOCK_I], tl.int32)
        for j0 in range(0, count, BLOCK_J):
            j = j0 + offs_j
            j_ok = j < count
            tok_j = tl.load(list_row + j, mask=j_ok, other=0)
            s_j = _desc_key(tl.load(s_row + tok_j * stride_sn, mask=j_ok, other=0.0), WIDE)
            c_j = tl.load(c_row + tok_j * stride_cn, mask=j_ok, other=0).to(tl.int64)
            ahead = (s_j[None, :] < s_a[:, None]) | ((s_j[None, :] == s_a[:, None]) & (j[None, :] < a[:, None]))
            rank += tl.sum((ahead & (c_j[None, :] == c_a[:, None]) & j_ok[None, :]).to(tl.int32), axis=1)
        tl.store(v_row + a, _bonus_value(s_raw.to(tl.float64), rank, weight), mask=a_ok)
    tl.debug_barrier()
    # Place of each token in (v desc, score desc, index asc); the first keep are the picks.
    for i0 in range(0, count, BLOCK_I):
        a = i0 + offs_i
        a_ok = a < count
        tok = tl.load(list_row + a, mask=a_ok, other=0)
        s_a = _desc_key(tl.load(s_row + tok * stride_sn, mask=a_ok, other=0.0), WIDE)
        v_a = _desc_key(tl.load(v_row + a, mask=a_ok, other=0.0), True)
        place = tl.zeros([BLOCK_I], tl.int32)
        for j0 in range(0, count, BLOCK_J):
            j = j0 + offs_j
            j_ok = j < count
            tok_j = tl.load(list_row + j, mask=j_ok, other=0)
            s_j = _desc_key(tl.load(s_row + tok_j * stride_sn, mask=j_ok, other=0.0), WIDE)
            v_j = _desc_key(tl.load(v_row + j, mask=j_ok, other=0.0), True)
            score_first = (s_j[None, :] < s_a[:, None]) | ((s_j[None, :] == s_a[:, None]) & (j[None, :] < a[:, None]))
            ahead = (v_j[None, :] < v_a[:, None]) | ((v_j[None, :] == v_a[:, None]) & score_first)
            place += tl.sum((ahead & j_ok[None, :]).to(tl.int32), axis=1)
        tl.store(flag_row + tok, tl.full([BLOCK_I], 1, tl.int8), mask=a_ok & (place < keep))
    return count


@triton.jit
def _stage_select_kernel(s_ptr, lab_ptr, c_ptr, w_ptr, keeps_ptr, out_ptr, list_ptr, v_ptr, flag_ptr, nonfinite_ptr,
                         N, OUT_LEN, stride_sb, stride_sn, stride_lb, stride_ln, stride_cb, stride_cn,
                         K0, K1, K2, K3, K4, K5, K6, K7,
                         NUM_MODS: tl.constexpr, LABELS: tl.constexpr, COVER: tl.constexpr, LABELLED: tl.constexpr,
                         PER_SAMPLE: tl.constexpr, NONFINITE: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """One sample per program. ``LABELS`` packs the stage's labels 4 bits each, ``COVER`` has bit m set when
    modality m uses coverage; the budgets are ``keeps[b, m]`` (``PER_SAMPLE``: an int32 ``[B, NUM_MODS]`` tensor read
    here, on the device) or ``K0..K7`` for every sample (runtime, so budgets that change per prompt do not
    recompile). ``LABELLED = False``: no label tensor, every token is modality 0 (the single selection ops).
    ``NONFINITE``: also write ``nonfinite[b]`` (bool): whether a token of a stage label has a non-finite score, found
    in the first pass over the row (the select_stage flags, no launch of their own).

    The row's kept positions are written ascending and right-aligned: ``out[b, OUT_LEN - len:]``, with
    ``out[b, :OUT_LEN - len] = -1``. A row that contradicts the host (a modality with fewer tokens than its budget,
    a negative budget, or more kept tokens than ``OUT_LEN``) is all -1. Every store is masked to the row, whatever
    the labels, budgets or scores hold."""
    b = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + b * stride_sb
    lab_row = lab_ptr + b * stride_lb
    c_row = c_ptr + b * stride_cb
    flag_row = flag_ptr + b * N
    list_row = list_ptr + b * N
    v_row = v_ptr + b * N
    out_row = out_ptr + b * OUT_LEN
    offs = tl.arange(0, BLOCK)
    label0: tl.constexpr = LABELS & 15
    # Flags: 1 for the tokens of no stage modality (always kept), 0 for stage tokens until picked and for PAD tokens
    # (label < 0: not a token of this sample, never kept).
    broken = tl.zeros([], tl.int32)
    for i0 in range(0, N, BLOCK):
        i = i0 + offs
        ok = i < N
        lab = _label_of(lab_row, i, ok, stride_ln, LABELLED, label0)
        staged = tl.zeros([BLOCK], tl.int1)
        for m in tl.static_range(NUM_MODS):
            staged = staged | (lab == ((LABELS >> (4 * m)) & 15))
        tl.store(flag_row + i, (~(staged | (lab < 0))).to(tl.int8), mask=ok)
        if NONFINITE:
            x = tl.load(s_row + i * stride_sn, mask=ok & staged, other=0.0)
            bad_x = (x != x) | (tl.abs(x) == float("inf"))
            broken = tl.maximum(broken, tl.max((bad_x & staged & ok).to(tl.int32), axis=0))
    if NONFINITE:
        tl.store(nonfinite_ptr + b, broken != 0)
    tl.debug_barrier()
    bad = tl.zeros([], tl.int32)  # 1 when the row contradicts the host: written as all -1
    for m in tl.static_range(NUM_MODS):
        label = (LABELS >> (4 * m)) & 15
        if PER_SAMPLE:
            keep = tl.load(keeps_ptr + b * NUM_MODS + m)
        else:
            keep = _pick(m, K0, K1, K2, K3, K4, K5, K6, K7)
        bad = tl.where(keep < 0, 1, bad)
        if keep > 0:
            if (COVER >> m) & 1:
                count = _coverage_flags(s_row, lab_row, c_row, flag_row, list_row, v_row, N, keep, label,
                                        tl.load(w_ptr + m), stride_sn, stride_ln, stride_cn, LABELLED, label0, WIDE,
                                        BLOCK, BLOCK_I, BLOCK_J)
            else:
                count = _topk_flags(s_row, lab_row, flag_row, N, keep, label, stride_sn, stride_ln, LABELLED, label0,
                                    WIDE, BLOCK)
            bad = tl.where(count < keep, 1, bad)
        tl.debug_barrier()  # the next modality reuses the list and value workspace
    # The row's length, then -1 left of its first slot and the flagged tokens in index order from there, each at its
    # running prefix count (so the output needs no sort).
    total = tl.zeros([], tl.int32)
    for i0 in range(0, N, BLOCK):
        i = i0 + offs
        total += tl.sum((tl.load(flag_row + i, mask=i < N, other=0) != 0).to(tl.int32), axis=0)
    bad = tl.where(total > OUT_LEN, 1, bad)
    first = tl.where(bad != 0, OUT_LEN, OUT_LEN - total)  # a contradicting row writes no token
    for j0 in range(0, OUT_LEN, BLOCK):
        j = j0 + offs
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int64), mask=j < first)
    run = first
    for i0 in range(0, N, BLOCK):
        i = i0 + offs
        ok = i < N
        kept = (tl.load(flag_row + i, mask=ok, other=0) != 0) & ok
        slot = run + tl.cumsum(kept.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, i.to(tl.int64), mask=kept & (slot < OUT_LEN))
        run += tl.sum(kept.to(tl.int32), axis=0)


@functools.lru_cache(maxsize=64)
def _weights(weights: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The stage's lambda_c values as float64 (Triton passes Python floats as float32). A stage's configuration is
    fixed, so this is made once, not per call; it is only ever read."""
    return torch.tensor(weights, dtype=torch.float64, device=device)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(b: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row flags (int8), token list (int32) and coverage values (float64), cached per shape, device and stream
    (the kernel writes every entry it reads, so no fill is needed; calls on one stream run in order)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, b, n)
    if key not in _WORKSPACES:
        if len(_WORKSPACES) >= 16:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
        _WORKSPACES[key] = (torch.empty(b, n, dtype=torch.int8, device=device),
                            torch.empty(b, n, dtype=torch.int32, device=device),
                            torch.empty(b, n, dtype=torch.float64, device=device))
    return _WORKSPACES[key]


def launch_stage_select(scores: torch.Tensor, labels: torch.Tensor | None, chunk_ids: torch.Tensor | None,
                        spec: StageSpec, out_len: int, keeps: torch.Tensor | None = None,
                        nonfinite: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``_stage_select_kernel`` for ``scores [B, N]``; ``labels`` None: every token is the first
    modality's (the single selection ops, which pass one modality). ``keeps``: None (every sample keeps the spec's
    budgets) or the per-sample budgets, int32 ``[B, len(spec)]`` on the scores' device, read by the kernel.
    ``nonfinite``: None, or a ``[B]`` bool tensor the kernel fills (``stage.stage_flags``)."""
    b, n = scores.shape
    dev = scores.device
    out = torch.empty(b, out_len, dtype=torch.long, device=dev)
    if b == 0 or out_len == 0:  # nothing to keep: no launch (the flags, if asked, from the composition)
        if labels is not None:
            stage_flags(scores, labels, spec, nonfinite)
        return out
    flags, token_list, values = _workspace(b, n, dev)
    budgets = [keep for _, keep, _, _ in spec] + [0] * (_MAX_MODS - len(spec))
    packed = sum(label << (4 * m) for m, (label, _, _, _) in enumerate(spec))
    cover = sum(1 << m for m, (_, _, weight, _) in enumerate(spec) if weight is not None)
    weights = _weights(tuple(0.0 if w is None else w for _, _, w, _ in spec), dev)
    lab = labels if labels is not None else scores
    chunks = chunk_ids if chunk_ids is not None else scores  # never read when no modality uses coverage
    _stage_select_kernel[(b,)](
        scores, lab, chunks, weights, keeps if keeps is not None else flags, out, token_list, values, flags,
        nonfinite if nonfinite is not None else flags, n, out_len, scores.stride(0), scores.stride(1), lab.stride(0),
        lab.stride(1), chunks.stride(0), chunks.stride(1), *budgets, NUM_MODS=len(spec), LABELS=packed, COVER=cover,
        LABELLED=labels is not None, PER_SAMPLE=keeps is not None, NONFINITE=nonfinite is not None,
        WIDE=scores.dtype == torch.float64, BLOCK=_BLOCK, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J, num_warps=8,
    )
    return out


def one_program_fits(n: int, spec: StageSpec) -> bool:
    """Whether the one-launch kernel handles a row of ``n`` tokens for this stage (see the two limits)."""
    coverage = any(weight is not None for _, _, weight, _ in spec)
    return n <= (COVERAGE_ONE_PROGRAM_MAX_N if coverage else ONE_PROGRAM_MAX_N)


def _check_keeps(keeps: torch.Tensor, scores: torch.Tensor, spec: StageSpec) -> None:
    """Host metadata only (free): the kernel reads ``keeps[b, m]`` at ``b * len(spec) + m``."""
    shape = (scores.shape[0], len(spec))
    if not isinstance(keeps, torch.Tensor):
        raise TypeError(f"keeps must be None or an int32 tensor [B, M], got {type(keeps).__name__}")
    if keeps.dtype != torch.int32 or tuple(keeps.shape) != shape or not keeps.is_contiguous():
        raise ValueError(f"keeps must be a contiguous int32 tensor [B={shape[0]}, M={shape[1]}] (M = len(spec)), got "
                         f"{keeps.dtype} {tuple(keeps.shape)}{'' if keeps.is_contiguous() else ' non-contiguous'}")
    if keeps.device != scores.device:
        raise ValueError(f"keeps must be on the scores' device {scores.device}, got {keeps.device}")


@register("stage_select", "triton")
@on_input_device
def stage_select_triton(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
                        spec: StageSpec, out_len: int, keeps: torch.Tensor | None = None,
                        flags: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``stage_select``: one launch (one program per sample) up to the one-program limits, the PyTorch
    composition above them. ``keeps`` (None or int32 ``[B, len(spec)]``): per-sample budgets; rows come out
    right-aligned with -1 on the left, PAD tokens (label -1) are never kept (``docs/triton.md``). ``flags``: None or
    a ``[B]`` bool tensor filled with the non-finite flags (``macer_kernels.stage`` contract)."""
    if keeps is not None:
        _check_keeps(keeps, scores, spec)
    if flags is not None and (flags.dtype != torch.bool or tuple(flags.shape) != (scores.shape[0],)
                              or flags.device != scores.device):
        raise ValueError(f"flags must be None or a bool tensor [B={scores.shape[0]}] on {scores.device}, got "
                         f"{flags.dtype} {tuple(flags.shape)} on {flags.device}")
    if not one_program_fits(labels.shape[1], spec):
        return _stage_select_torch(scores, labels, chunk_ids, spec, out_len, keeps, flags)
    return launch_stage_select(scores, labels, chunk_ids, spec, out_len, keeps, flags)
