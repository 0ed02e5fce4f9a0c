"""Literal definitions of every MACER op, in float64 PyTorch, following the paper's equations.

These are the ground truth for the tests, the CPU-side check of every fast path, and the "naive PyTorch" provider
of the benchmarks. They favour being obviously right over being fast: K is expanded per query head, the full
causal softmax is materialised, and the coverage greedy runs its k steps literally. Equation labels refer to
``macer_paper.tex``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from macer_kernels._validate import decimal_fraction
from macer_kernels.types import Budget


def split_budget_ref(n_audio: int, n_video: int, keep_ratio: float | Fraction, audio_share: float | Fraction) -> Budget:
    """Sec. 4 K_mm, ``eq:capacity_nominal`` and ``eq:capacity_split``, with floor(x + 0.5) rounding, in exact
    rational arithmetic on the decimal numbers the user wrote (``decimal_fraction``: 0.35 is 35/100)."""
    rho, alpha, half = decimal_fraction(keep_ratio), decimal_fraction(audio_share), Fraction(1, 2)
    n = n_audio + n_video
    total = min(n, math.floor(rho * n + half))
    nominal_audio = math.floor(alpha * total + half)
    nominal_video = total - nominal_audio
    audio = min(n_audio, nominal_audio + max(0, nominal_video - n_video))
    return Budget(total=total, audio=audio, video=total - audio)


def modality_scores_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    modality: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``eq:macer_score`` (ANMS), computed naively in ``dtype``.

    query ``[B, Hq, Lq, D]``, key ``[B, Hkv, N, D]``, modality ``[B, N]`` (0 = unscored), query_positions ``[B, Lq]``.
    Returns ``[B, N]`` in ``dtype``: ``s_i = mean_{q,h} A_h(q,i) / (sum_{j in m(i)} A_h(q,j) + eps)``, 0 for label 0.
    """
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    if query_positions is None:
        query_positions = torch.arange(n - lq, n, device=query.device).expand(b, lq)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = key.to(dtype).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, N, D]: the naive GQA expansion
    logits = scale * torch.einsum("bhqd,bhnd->bhqn", query.to(dtype), k)
    visible = torch.arange(n, device=query.device)[None, None, :] <= query_positions[:, :, None]  # [B, Lq, N]
    visible = visible & (modality >= 0)[:, None, :]  # padding (label -1) is no key of its batch element
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    attn = torch.softmax(logits, dim=-1)  # A_h(q, i), [B, Hq, Lq, N]
    scores = torch.zeros(b, n, dtype=dtype, device=query.device)
    for m in modality.unique().tolist():
        if m <= 0:
            continue
        in_m = (modality == m)[:, None, None, :]  # [B, 1, 1, N]
        mass = (attn * in_m).sum(-1, keepdim=True)  # sum_{j in I_m} A_h(q, j)
        # Only the modality's own keys are divided. A row that sees no key of the modality contributes 0 to it: its
        # numerators are exactly 0, so 0 / (0 + eps) = 0 for every eps > 0, and eps = 0 takes that limit (no NaN).
        denom = torch.where(mass > 0, mass + eps, 1.0)
        normalised = torch.where(in_m, attn / denom, 0.0)
        scores += normalised.sum(dim=(1, 2)) / (lq * hq)
    return scores


def topk_indices_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``TopKIdx`` (eq. ``Top-k``): the k largest, ties to the lower index, returned sorted ascending. A NaN ranks
    below every number (-inf included), NaNs among themselves by index: the selection rule for non-finite scores."""
    values = scores.to(torch.float64).tolist()
    order = sorted(range(len(values)), key=lambda i: (math.isnan(values[i]), -values[i], i))
    return torch.tensor(sorted(order[:k]), dtype=torch.long)


def coverage_greedy_picks(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int,
                          coverage_weight: float) -> torch.Tensor:
    """``eq:chunk_coverage_greedy`` run literally for k steps: the picks ``[k]`` (int64) in the order taken.

    Each step takes the unpicked token with the largest key ``(value, score, -index)``, value ``s_j + sqrt(lambda_c /
    (1 + r_{c(j)}))`` in float64, ``r_g`` the tokens already taken from chunk ``g``: equal values go to the higher
    score, then to the lower index. For equal scores (and for ``lambda_c = 0``) this is "ties to the lower index";
    preferring the higher score first only matters where the float64 sum absorbs a score difference (scores ~1e-16
    times the bonus or smaller), and keeps the rule's exact-arithmetic property that a token is never picked before a
    higher-scored token of its own chunk. A NaN score (its value is NaN) is taken only when no token with a number
    is left, the lowest index first: the selection rule for non-finite scores. Tensor ops on the inputs' device with
    no host read, so the "naive" benchmark provider runs this same definition on a GPU.
    """
    s = scores.to(torch.float64)
    nan = torch.isnan(s)
    s_num = s.masked_fill(nan, float("-inf"))  # NaNs only ever compete among themselves, where all tie
    taken = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    in_chunk = torch.zeros_like(s)  # r_{c(j)} for every token j
    picks = torch.empty(k, dtype=torch.long, device=s.device)
    for step in range(k):
        numbers = ~taken & ~nan
        pool = torch.where(numbers.any(), numbers, ~taken)  # the NaN tokens once every number is taken
        value = (s_num + torch.sqrt(coverage_weight / (1.0 + in_chunk))).masked_fill_(~pool, float("-inf"))
        best = pool & (value == value.max())  # the largest value ...
        best &= s_num == torch.where(best, s_num, float("-inf")).max()  # ... then the largest score among those ...
        pick = torch.argmax(best.to(torch.uint8))  # ... then the lowest index (argmax returns the first maximum)
        picks[step] = pick
        taken[pick] = True
        in_chunk += chunk_ids == chunk_ids[pick]
    return picks


def coverage_select_ref(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    """``eq:chunk_coverage_greedy``, the literal k-step greedy in float64 (``coverage_greedy_picks``); sorted result
    on the CPU."""
    return torch.sort(coverage_greedy_picks(scores.cpu(), chunk_ids.cpu(), k, coverage_weight)).values


def temporal_chunks_ref(temporal_positions: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Chunk id ``floor(C (t - t_min) / (t_max - t_min + 1))`` per video token (Appendix B, coverage greedy)."""
    if not temporal_positions.is_floating_point():  # integers: exact, in Python's unbounded ints
        t = temporal_positions.tolist()
        if not t:
            return torch.empty(0, dtype=torch.long)
        lo, hi = min(t), max(t)
        return torch.tensor([num_chunks * (x - lo) // (hi - lo + 1) for x in t], dtype=torch.long)
    # Floats: the formula in float64 on t / 2**33 (exact scaling, so C (t - t_min) cannot overflow); the exact value
    # is below C, so a quotient that rounds up to C (spans past 2**53) is the last chunk, C - 1.
    s = 2.0**-33
    t = [x * s for x in temporal_positions.to(torch.float64).tolist()]
    if not t:
        return torch.empty(0, dtype=torch.long)
    lo, hi = min(t), max(t)
    return torch.tensor([min(math.floor(num_chunks * (x - lo) / (hi - lo + s)), num_chunks - 1) for x in t],
                        dtype=torch.long)


def compact_ref(x: torch.Tensor, keep: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep the rows ``keep`` (sorted indices) of ``x`` along ``dim``."""
    return torch.stack([x.select(dim, int(i)) for i in keep], dim=dim) if len(keep) else x.narrow(dim, 0, 0)


def stage_select_ref(scores: torch.Tensor, labels: torch.Tensor, modalities, chunk_ids: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The selection of one stage from given scores ``[B, N]``: per sample, every token whose label is not a stage
    modality plus, per stage modality (``StageModality``-like: ``label``, ``keep``, ``coverage_weight``), the picks of
    ``topk_indices_ref`` (``coverage_weight`` None) or ``coverage_select_ref`` on that modality's tokens in index
    order. Returns ``[B, out_len]`` int64, rows ascending."""
    rows = []
    for b in range(labels.shape[0]):
        kept = torch.ones(labels.shape[1], dtype=torch.bool)
        for m in modalities:
            where = (labels[b].cpu() == m.label).nonzero().flatten()
            kept[where] = False
            s = scores[b].cpu()[where]
            if m.coverage_weight is None:
                picks = topk_indices_ref(s, m.keep)
            else:
                assert chunk_ids is not None  # a coverage modality needs them (checked by the op)
                picks = coverage_select_ref(s, chunk_ids[b].cpu()[where], m.keep, m.coverage_weight)
            kept[where[picks]] = True
        rows.append(kept.nonzero().flatten())
    return torch.stack(rows)


def stage_flags_ref(scores: torch.Tensor, labels: torch.Tensor, modalities) -> torch.Tensor:
    """``select_stage``'s ``return_flags`` output: per sample, whether a token of a stage modality has a score that is
    not finite (under ``modality_scores``' rule: a NaN/inf in the query rows or in a key they see). ``[B]`` bool."""
    stage = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    for m in modalities:
        stage |= labels == m.label
    return (stage & ~torch.isfinite(scores.to(labels.device))).any(dim=1)


def stage_ref(query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, modalities,
              chunk_ids: torch.Tensor | None = None, query_positions: torch.Tensor | None = None, *,
              scale: float | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``macer_kernels.select_stage``: ``modality_scores_ref`` in float64, then ``stage_select_ref`` on those scores.
    Returns ``(keep [B, out_len] int64, scores [B, N] float64)``."""
    scores = modality_scores_ref(query.cpu(), key.cpu(), labels.cpu(),
                                 None if query_positions is None else query_positions.cpu(), scale=scale, eps=eps)
    return stage_select_ref(scores, labels.cpu(), modalities, None if chunk_ids is None else chunk_ids.cpu()), scores
