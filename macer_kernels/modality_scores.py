"""Allocation-normalised modality scores (ANMS) read from a layer's post-RoPE queries and keys."""

from __future__ import annotations

import functools
import math

import torch

from macer_kernels._validate import (
    check_float,
    check_int,
    check_real,
    check_same_device,
    check_tensor,
    read_back,
    tracing,
    values_checked,
)
from macer_kernels.backend import dispatch, register

MAX_MODALITIES = 8
"""Largest modality label accepted (labels are 0..MAX_MODALITIES; 0 = not scored). Kernels size per-row state by it."""

PAD_LABEL = -1
"""The label of a position that is not a token of its batch element (the left padding of a batch): no query row
attends to it (it is outside every softmax, as a key past the causal limit is), it scores 0, and ``select_stage``
never keeps it. A batch element's scores on its other keys are those of the element alone without its padding."""

# Keys are processed in blocks of this many positions, so the fp32 copy of K made for the product is bounded by
# one block (never a full-length copy, never one per query head).
_KEY_BLOCK = 4096


def modality_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    modality: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Allocation-normalised modality scores, ``eq:macer_score`` (ANMS).

    With ``A_h(q, i)`` the causal softmax of ``scale * q . k_i`` over keys ``0..pos(q)`` of query row ``q`` and head
    ``h``, a token ``i`` of modality ``m`` scores

    ``s_i = 1 / (Lq Hq) * sum_{q, h} A_h(q, i) / (sum_{j in I_m} A_h(q, j) + eps)``

    and tokens labelled 0 (text) score 0. Keys labelled ``PAD_LABEL`` (-1, a batch's padding) are outside every
    softmax and score 0, so each batch element scores as if it ran alone without its padding. Each (q, h) row is
    renormalised over its own modality only, so the scores of one modality never depend on how much attention another
    modality receives (except through ``eps``). A row that sees no key of a modality (causal limit) contributes 0 to
    it, also for ``eps = 0`` (the limit eps -> 0+).

    Non-finite inputs, the same in every backend: tokens labelled 0 always score exactly 0. In a batch element where
    some logit ``scale * q . k_j`` of a kept pair (a query row of any head and a key ``j <= position`` it sees) is
    NaN or infinite -- which it is whenever an element of a query row, or of a key that some row sees, is NaN or
    +-inf -- every token labelled > 0 scores NaN. Keys that no query row sees do not matter, and other batch
    elements are unaffected. (IEEE propagation through the softmax would do the same except for ``-inf`` logits,
    which it would turn into zero weights; the rule does not depend on the signs of the products.)

    Value checks (label range, ``query_positions`` in ``[0, N-1]``) run on CPU tensors always and on CUDA tensors
    only in validation mode (``macer_kernels.validation()``); otherwise the call never synchronises with the host,
    and labels or positions out of range give unspecified results (the kernels may fault).

    Args:
        query: ``[B, Hq, Lq, D]`` post-RoPE queries of the question span (fp32, bf16, fp16 or fp64).
        key: ``[B, Hkv, N, D]`` post-RoPE keys with ``Hq % Hkv == 0`` (query head ``h`` reads KV head
            ``h // (Hq // Hkv)``); any strides, so a ``[B, N, Hkv, D]`` cache passed as ``.transpose(1, 2)`` works
            without a copy.
        modality: ``[B, N]`` integer labels in ``-1..MAX_MODALITIES``; 0 = not scored, -1 (``PAD_LABEL``) = padding.
        query_positions: ``[B, Lq]`` integer positions of the query rows among the N keys (default: the last Lq
            positions, ``N - Lq .. N - 1``). Each row attends to keys ``0..position``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        eps: the epsilon of ``eq:macer_score``, >= 0.

    Returns:
        ``[B, N]`` float32 scores. Accumulation is fp32 whatever the input dtype.
    """
    query, key, modality, positions, scale, eps = check_score_inputs(query, key, modality, query_positions, scale,
                                                                     eps, labels_name="modality")
    if values_checked(modality):
        check_label_values(modality, positions, key.shape[2], given=query_positions is not None,
                           labels_name="modality")
    if tracing():  # one opaque node in the caller's graph (macer_kernels.library)
        return torch.ops.macer.modality_scores(query, key, modality, positions, scale, eps)
    return dispatch("modality_scores", query.device, query, key, modality, positions, scale, eps)


@functools.lru_cache(maxsize=32)
def _default_positions(n: int, lq: int, device: torch.device) -> torch.Tensor:
    """``[1, Lq]`` positions ``N - Lq .. N - 1`` (the question rows end the sequence), cached: a fresh ``arange``
    would be one more kernel launch per call. Only ever read."""
    return torch.arange(n - lq, n, device=device)[None]


def check_label_values(labels: torch.Tensor, positions: torch.Tensor, n: int, *, given: bool, labels_name: str,
                       extra: tuple[torch.Tensor, ...] = ()) -> list[int]:
    """The data-dependent checks of the scoring inputs in one host read (callers ask ``values_checked`` first):
    labels in ``[PAD_LABEL, MAX_MODALITIES]``, given positions in ``[0, N-1]``, no query row at a padding key. ``extra``
    0-d tensors are read in the same synchronisation; their values are returned."""
    ranges: list[torch.Tensor] = []
    if n:  # every query row must sit on a token: given positions and the default last Lq rows alike
        pad_hit = (labels.gather(1, positions.long().clamp(0, n - 1)) == PAD_LABEL).any()
        ranges = [labels.min(), labels.max(), pad_hit]
    values = read_back(*ranges, *([positions.min(), positions.max()] if given else []), *extra)
    if n and (values[0] < PAD_LABEL or values[1] > MAX_MODALITIES):
        raise ValueError(f"{labels_name} labels must be in [{PAD_LABEL}, {MAX_MODALITIES}] ({PAD_LABEL} = padding), "
                         f"got range [{values[0]}, {values[1]}]")
    hit, values = (values[2], values[3:]) if n else (False, values)
    if given:
        lo, hi = values[:2]
        if lo < 0 or hi >= n:
            raise ValueError(f"query_positions must be in [0, N-1={n - 1}], got range [{lo}, {hi}]")
        values = values[2:]
    if hit:
        where = "query_positions" if given else "the default query rows (the last Lq positions)"
        raise ValueError(f"{where} must point at tokens, not at padding ({labels_name} == {PAD_LABEL})")
    return values


def check_score_inputs(query: object, key: object, labels: object, query_positions: object, scale: object,
                       eps: object, *, labels_name: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """Host checks (shapes, dtypes, devices, strides, scalars) of the scoring inputs, shared by ``modality_scores``
    and ``select_stage``; no value is read. Returns ``(query, key, labels, positions, scale, eps)`` with the default
    positions ``N - Lq .. N - 1`` filled in and the default scale ``1 / sqrt(D)``."""
    query = check_tensor("query", query, 4)
    key = check_tensor("key", key, 4)
    labels = check_tensor(labels_name, labels, 2)
    check_float("query", query)
    check_float("key", key)
    check_int(labels_name, labels)
    b, hq, lq, d = query.shape
    bk, hkv, n, dk = key.shape
    if bk != b or dk != d:
        raise ValueError(f"key must be [B={b}, Hkv, N, D={d}], got {tuple(key.shape)}")
    if hkv == 0 or hq == 0 or hq % hkv != 0:
        raise ValueError(f"query heads (Hq={hq}) must be a positive multiple of key heads (Hkv={hkv})")
    if b == 0 or lq == 0 or d == 0:
        raise ValueError(f"query must have B >= 1, at least one row and D > 0, got shape {tuple(query.shape)}")
    if tuple(labels.shape) != (b, n):
        raise ValueError(f"{labels_name} must be [B={b}, N={n}], got {tuple(labels.shape)}")
    if query_positions is None:
        if lq > n:
            raise ValueError(f"query has Lq={lq} rows but key has only N={n} positions")
        # Traced (fake tensors, or a graph's constants): a fresh arange, never the eager cache.
        positions = (torch.arange(n - lq, n, device=query.device)[None] if tracing()
                     else _default_positions(n, lq, query.device)).expand(b, lq)
    else:
        positions = check_tensor("query_positions", query_positions, 2)
        check_int("query_positions", positions)
        if tuple(positions.shape) != (b, lq):
            raise ValueError(f"query_positions must be [B={b}, Lq={lq}], got {tuple(positions.shape)}")
    check_same_device(query=query, key=key, **{labels_name: labels}, query_positions=positions)
    scale = 1.0 / math.sqrt(d) if scale is None else check_real("scale", scale, 0.0, math.inf, lo_open=True,
                                                                 hi_open=True)
    eps = check_real("eps", eps, 0.0, math.inf, hi_open=True)
    if key.stride(-1) != 1:
        raise ValueError(f"key must have a contiguous head dimension (stride(-1) == 1), got strides {key.stride()}")
    return query, key, labels, positions, scale, eps


@register("modality_scores", "torch")
def _modality_scores_torch(query, key, modality, query_positions, scale, eps):
    """GQA-aware PyTorch path: O(B Hq Lq N) memory, no per-head copy of K, keys upcast one block at a time."""
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    # [B, Hkv, G*Lq, D]: the query heads that share a KV head are stacked as rows against that head's keys.
    q = (query.to(torch.float32) * scale).reshape(b, hkv, group * lq, d)
    logits = torch.empty(b, hkv, group * lq, n, dtype=torch.float32, device=query.device)
    for start in range(0, n, _KEY_BLOCK):
        stop = min(n, start + _KEY_BLOCK)
        k_block = key[:, :, start:stop].to(torch.float32)
        logits[..., start:stop] = torch.matmul(q, k_block.transpose(-1, -2))
    logits = logits.view(b, hq, lq, n)
    visible = torch.arange(n, device=query.device)[None, None, :] <= query_positions[:, :, None].long()
    visible &= (modality != PAD_LABEL)[:, None, :]  # padding is outside every softmax
    # The non-finite rule of the docstring: a NaN or infinite logit of a kept (row, key) pair makes every scored token
    # of its batch element NaN. IEEE arithmetic alone gives that for NaN and +inf logits but a zero weight for -inf
    # ones, so the result would depend on the signs of the products; this test depends only on what is finite.
    broken = torch.isfinite(logits).logical_not_().logical_and_(visible[:, None]).flatten(1).any(dim=1)  # [B]
    logits.masked_fill_(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # A_h(q, i), fp32
    labels = modality.long().clamp(min=0)  # padding has weight 0 everywhere: any column will do
    # mass[b, (h, q), m] = sum_{j: label j = m} A_h(q, j): one product with the [N, labels] one-hot matrix. The
    # width is the largest allowed label, not the largest present one: reading that back would synchronise.
    one_hot = torch.nn.functional.one_hot(labels, MAX_MODALITIES + 1).to(torch.float32)  # [B, N, labels]
    rows = probs.view(b, hq * lq, n)
    mass = torch.bmm(rows, one_hot)
    denom = mass.gather(-1, labels[:, None, :].expand(b, hq * lq, n))
    # A row with no visible key of a modality has numerators exactly 0 there: it contributes 0 (the eps -> 0+ limit,
    # so eps = 0 gives 0, not 0/0 = NaN).
    unseen = denom == 0
    denom = denom.add_(eps).masked_fill_(unseen, 1.0)
    scores = rows.div_(denom).sum(dim=1) / (lq * hq)
    return scores.masked_fill_(broken[:, None], float("nan")).masked_fill_(modality.long() <= 0, 0.0)
