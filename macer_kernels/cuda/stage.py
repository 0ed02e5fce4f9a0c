"""``stage_select`` on the CUDA kernels: the selection half of a fused MACER stage, one launch per stage.

Contract (shared with ``macer_kernels.stage``): ``stage_select(scores, labels, chunk_ids, modalities, out_len, keeps)``
returns ``keep`` ``[B, out_len]`` int64. Row b keeps every token whose label is >= 0 and not selected plus, for each
selected modality ``(label, keep, coverage_weight, num_chunks)``, its budget of picks: ``keeps[b, m]`` when the int32
``[B, M]`` table ``keeps`` is given (``0 <= keeps[b, m] <= keep``, the spec's keep being the maximum over samples),
else ``keep``. Picks are top-K with ties to the lower index when ``coverage_weight`` is None, else the chunk-coverage
greedy (``eq:chunk_coverage_greedy``, the tie rule of ``reference.coverage_select_ref``) over that modality's tokens
with their ``chunk_ids``. Padding (label -1, ``PAD_LABEL``) is never a candidate and never kept. The row's ``len_b``
kept positions are ascending and right-aligned: ``out[b, out_len - len_b:]``, with -1 before them.

Up to the one-CTA limit (``select_cta_max_n``: the device's shared memory) this is one launch of
``csrc/kernels/select_cta.cuh`` with one thread block per sample, each reading its row of ``keeps`` on the device.
Above it, and for coverage over float64 scores, a batched chain of torch sorts on the GPU
(:func:`stage_select_sorts`, about 10 launches per modality, no loop over the batch). Neither path synchronises with
the host: every output size is a host integer. A row whose data contradicts the host's numbers (a budget outside
``[0, keep]``, a modality with fewer tokens than its budget, or ``len_b > out_len``) comes back filled with -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from macer_kernels.backend import backend_status, register
from macer_kernels.cuda._ext import check_cuda_tensor, dtype_code, ext, launch_args, select_cta_max_n, workspace
from macer_kernels.select import descending_order, order_key
from macer_kernels.stage import stage_flags

_OP = "stage_select"
# (label, keep, coverage_weight, num_chunks); num_chunks (0 for top-K, a bound or None for coverage) is not needed:
# the kernel checks on the device whether the chunk ids fit its key field.
Modality = tuple[int, int, float | None, int | None]


def _check(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
           modalities: tuple[Modality, ...], out_len: int, keeps: torch.Tensor | None) -> None:
    """Host-side checks only (shapes, dtypes, devices, strides, host numbers): nothing reads device memory."""
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"{_OP}: scores must be a floating [B, N] tensor, got {scores.dtype} {tuple(scores.shape)}")
    b, n = scores.shape
    for name, t in (("labels", labels), ("chunk_ids", chunk_ids)):
        if t is None:
            continue
        if t.shape != scores.shape or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{_OP}: {name} must be an integer tensor of shape {(b, n)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if b < 1:
        raise ValueError(f"{_OP}: B must be >= 1, got {b}")
    if not 1 <= len(modalities) <= int(ext().MAX_STAGE_MODALITIES):
        raise ValueError(f"{_OP}: modalities must hold 1 to {int(ext().MAX_STAGE_MODALITIES)} entries, "
                         f"got {len(modalities)}")
    seen = set()
    for label, keep, weight, _ in modalities:
        if label in seen:
            raise ValueError(f"{_OP}: modality label {label} is listed twice")
        seen.add(label)
        if label < 0:
            raise ValueError(f"{_OP}: modality labels must be >= 0 (-1 is padding), got {label}")
        if not 0 <= keep <= n:
            raise ValueError(f"{_OP}: keep of modality {label} must be in [0, {n}], got {keep}")
        if weight is not None and not weight >= 0:
            raise ValueError(f"{_OP}: coverage_weight of modality {label} must be >= 0 or None, got {weight}")
        if weight is not None and chunk_ids is None:
            raise ValueError(f"{_OP}: modality {label} uses coverage, so chunk_ids must be given")
    if not 0 <= out_len <= n:
        raise ValueError(f"{_OP}: out_len must be in [0, {n}], got {out_len}")
    if keeps is not None:
        m = len(modalities)
        if keeps.dtype != torch.int32 or tuple(keeps.shape) != (b, m):
            raise ValueError(f"{_OP}: keeps must be an int32 tensor of shape {(b, m)} (B, number of modalities), got "
                             f"{keeps.dtype} {tuple(keeps.shape)}")
        if keeps.device != scores.device:
            raise ValueError(f"{_OP}: keeps must be on the scores' device {scores.device}, got {keeps.device}")
        if not keeps.is_contiguous():
            raise ValueError(f"{_OP}: keeps must be contiguous, got strides {keeps.stride()}")


def _stable_argsort(x: torch.Tensor, descending: bool = False) -> torch.Tensor:
    return torch.sort(x, dim=1, descending=descending, stable=True).indices


def stage_select_sorts(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
                       modalities: tuple[Modality, ...], out_len: int,
                       keeps: torch.Tensor | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract with batched torch sorts (any device, no host synchronisation): the multi-CTA path.

    Per modality: the candidates first, in (score desc, index asc) order; for coverage each candidate's rank t inside
    its chunk in that order gives ``v = s + sqrt(lambda_c / (1 + t))`` and a stable sort by v keeps the order for
    equal values (score desc, index asc): the greedy's pick order, as ``macer_kernels.select._coverage_order``.
    Per-sample budgets are a mask on the rank in that order (``rank < keeps[b, m]``), not a loop over the batch.
    Scores and values are sorted as ``select.order_key``s: -0.0 equal to +0.0, NaN after every number.
    ``flags``: None or ``[B]`` bool, filled as ``stage.stage_flags`` does.
    """
    stage_flags(scores, labels, modalities, flags)
    b, n = scores.shape
    device = scores.device
    s = scores.to(torch.float64)
    index = torch.arange(n, device=device).expand(b, n)
    picked = torch.zeros(b, n, dtype=torch.bool, device=device)
    listed = torch.zeros(b, n, dtype=torch.bool, device=device)
    bad = torch.zeros(b, dtype=torch.bool, device=device)
    by_score = descending_order(s)  # (score desc, index asc, NaN last): the same for every modality
    for m, (label, keep, weight, _) in enumerate(modalities):
        member = labels == label
        listed |= member
        if keeps is None:
            bad |= member.sum(1) < keep
        else:
            want = keeps[:, m].long()
            bad |= (want < 0) | (want > keep) | (member.sum(1) < want)
        if keep == 0:  # the spec's keep bounds every sample's: nothing to pick (larger entries flagged above)
            continue
        order = by_score.gather(1, _stable_argsort((~member).gather(1, by_score).to(torch.uint8)))  # candidates first
        if weight is not None:
            assert chunk_ids is not None  # checked on the host: a coverage modality needs chunk ids
            big = torch.iinfo(torch.int64).max
            chunks = torch.where(member, chunk_ids.to(torch.int64), big)  # other tokens: one chunk, sorted last
            by_chunk = order.gather(1, _stable_argsort(chunks.gather(1, order)))
            sorted_chunks = chunks.gather(1, by_chunk)
            new_chunk = torch.ones(b, n, dtype=torch.bool, device=device)
            new_chunk[:, 1:] = sorted_chunks[:, 1:] != sorted_chunks[:, :-1]
            start = torch.cummax(torch.where(new_chunk, index, 0), dim=1).values
            rank = (index - start).to(torch.float64)
            value = torch.empty(b, n, dtype=torch.float64, device=device)
            value.scatter_(1, by_chunk, s.gather(1, by_chunk) + torch.sqrt(weight / (1.0 + rank)))
            # Others below every candidate (NaN's key included): a stable sort keeps the candidates first.
            key = torch.where(member, order_key(value), torch.iinfo(torch.int64).min)
            order = order.gather(1, _stable_argsort(key.gather(1, order), descending=True))
        if keeps is None:
            picked.scatter_(1, order[:, :keep], True)
        else:  # the first keeps[b, m] of row b's order (ranks < keep: the spec's keep is the maximum)
            take = index[:, :keep] < want[:, None]
            picked |= torch.zeros_like(picked).scatter_(1, order[:, :keep], take)
    kept = (~listed & (labels >= 0)) | picked  # padding (label -1) is never kept
    bad |= kept.sum(1) > out_len
    # Not-kept first, then the kept in index order (a stable sort): the last out_len entries end with the row's kept
    # positions, right-aligned after its largest not-kept positions, which become -1.
    tail = _stable_argsort(kept.to(torch.uint8))[:, n - out_len:]
    return tail.masked_fill_(~kept.gather(1, tail) | bad[:, None], -1)


def stage_select_cuda(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
                      modalities: tuple[Modality, ...], out_len: int,
                      keeps: torch.Tensor | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """``stage_select`` on CUDA tensors: one launch up to the one-CTA limit (see the module docstring); ``flags``
    (None or ``[B]`` bool) are written by that same launch."""
    _check(scores, labels, chunk_ids, modalities, out_len, keeps)
    if flags is not None and (flags.dtype != torch.bool or tuple(flags.shape) != (scores.shape[0],)
                              or not flags.is_contiguous()):
        raise ValueError(f"{_OP}: flags must be None or a contiguous bool tensor of shape {(scores.shape[0],)}, got "
                         f"{flags.dtype} {tuple(flags.shape)}")
    for name, t in (("scores", scores), ("labels", labels), ("chunk_ids", chunk_ids), ("keeps", keeps),
                    ("flags", flags)):
        if t is not None:
            check_cuda_tensor(_OP, name, t)
    b, n = scores.shape
    coverage = any(weight is not None for _, _, weight, _ in modalities)
    device, stream = launch_args(scores)
    wide = scores.dtype == torch.float64  # 64-bit keys: a lower one-CTA limit for top-K
    if n > select_cta_max_n(device, coverage, wide) or (coverage and wide):
        return stage_select_sorts(scores, labels, chunk_ids, modalities, out_len, keeps, flags)
    out = torch.empty(b, out_len, dtype=torch.long, device=scores.device)
    if out_len == 0 and (flags is None or n == 0):  # nothing kept and no flag to find: no launch
        if flags is not None:
            flags.zero_()
        return out
    chunk_ptr, chunk_code = 0, 0
    chunk_stride: tuple[int, ...] = (0, 0)
    if chunk_ids is not None:
        chunk_ptr, chunk_stride = chunk_ids.data_ptr(), chunk_ids.stride()
        chunk_code = dtype_code(_OP, "chunk_ids", chunk_ids)
    mods = [(int(label), int(keep), 0.0 if weight is None else float(weight), weight is not None)
            for label, keep, weight, _ in modalities]
    ext().select_cta(op=_OP, scores=scores.data_ptr(), scores_dtype=dtype_code(_OP, "scores", scores),
                     scores_stride=scores.stride(), labels=labels.data_ptr(),
                     labels_dtype=dtype_code(_OP, "labels", labels), labels_stride=labels.stride(),
                     chunk_ids=chunk_ptr, chunk_dtype=chunk_code, chunk_stride=chunk_stride, out=out.data_ptr(),
                     out_stride=out_len, out_len=out_len, batch=b, n=n, modalities=mods,
                     keeps=0 if keeps is None else keeps.data_ptr(), nonfinite=0 if flags is None else flags.data_ptr(),
                     device=device, stream=stream)
    return out


register(_OP, "cuda")(stage_select_cuda)


# ---- the prepared stage's CUDA half (macer_kernels.prepared) -----------------------------------------------------


def _raw_stream(index: int) -> int:
    """The current stream's handle on device ``index`` (torch's raw query where it has one: no Stream object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def prepared_on_cuda(labels: torch.Tensor, coverage: bool) -> bool:
    """Whether a prepared stage over ``labels`` ``[B, N]`` runs as one ``_C`` call: CUDA tensors, the CUDA backend
    usable, and N scores within the one-CTA selection's limit (above it the selection is the multi-CTA sort chain,
    which the backends' ops run)."""
    if labels.device.type != "cuda" or backend_status()["cuda"] is not None or labels.shape[1] < 1:
        return False
    # The prepared stage's scores are float32 (StageHandle): 32-bit keys.
    return labels.shape[1] <= select_cta_max_n(launch_args(labels)[0], coverage, wide=False)


class StageHandle:
    """The CUDA half of a prepared stage: the arguments of its ``_C.StagePlan`` (checked here once) and, per stream
    it has run on, a plan with its own persistent buffers (the scoring workspace and the ``[B, N]`` fp32 scores,
    which every call overwrites in that stream's order). The question rows' positions and the per-sample budgets are
    read-only and shared.

    ``row_index`` (per-sample question rows, ``macer_kernels.prepared``): the ``[B, Hq, Lq, D]`` index of each
    sample's rows in the query; a call gathers them (``torch.gather`` with ``out=``: one launch, no allocation) into
    the stream's ``[B, Hq, Lq, D]`` query buffer, which the plan reads from row 0 with per-sample positions."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor,
                 spec: tuple[Modality, ...], out_len: int, keeps: torch.Tensor | None, positions: torch.Tensor,
                 query_row0: int, scale: float, eps: float, chunk_ids: torch.Tensor | None,
                 gather: list[torch.Tensor], dims: list[int], chain: bool = True,
                 row_index: torch.Tensor | None = None):
        b, hq, lq, d = query.shape[0], query.shape[1], positions.shape[1], query.shape[3]
        hkv, n = key.shape[1], key.shape[2]
        for name, t in (("query", query), ("key", key), ("labels", labels), ("chunk_ids", chunk_ids)):
            if t is not None:
                check_cuda_tensor(_OP, name, t)
        max_d = int(ext().modality_scores_max_head_dim())
        if query.dtype != key.dtype or not 1 <= d <= max_d or b > 65535 or hkv > 65535:
            raise ValueError(f"{_OP} (cuda): query and key must share a float dtype, D in [1, {max_d}], B and Hkv "
                             f"at most 65535; got {query.dtype}/{key.dtype}, D={d}, B={b}, Hkv={hkv}")
        if labels.stride(1) != 1 or (chunk_ids is not None and chunk_ids.stride(1) != 1):
            raise ValueError(f"{_OP} (cuda): labels and chunk_ids need stride 1 along N, got {labels.stride()} and "
                             f"{None if chunk_ids is None else chunk_ids.stride()}")
        self.device = labels.device
        self.index, stream = launch_args(labels)
        self.positions = positions if positions.stride(1) == 1 else positions.contiguous()
        self.keeps = keeps
        self.row_index = row_index
        self.query_shape, self.query_dtype = (b, hq, lq, d), query.dtype
        self.workspace_bytes = int(ext().modality_scores_workspace_bytes(b, hq, lq, hkv, n))
        self.counter_count = int(ext().modality_scores_counter_count(b, hq, lq, hkv))
        self.score_shape = (b, n)
        mods = [(int(label), int(keep), 0.0 if weight is None else float(weight), weight is not None)
                for label, keep, weight, _ in spec]
        chunk_code = 0
        chunk_stride: tuple[int, ...] = (0, 0)
        if chunk_ids is not None:
            chunk_code, chunk_stride = dtype_code(_OP, "chunk_ids", chunk_ids), chunk_ids.stride()
        layouts = [(list(t.shape), list(t.stride()), t.element_size(), dim) for t, dim in zip(gather, dims)]
        # Everything of the plan but the buffers of a stream (scores, workspace, counters), as _C.StagePlan names
        # them (it checks the layouts: a refused one fails here, at prepare, not at a call).
        self._plan_args = dict(
            q_dtype=dtype_code(_OP, "query", query), labels_dtype=dtype_code(_OP, "labels", labels),
            sizes=(b, hq, lq, d, hkv, n), labels_stride=labels.stride(), positions=self.positions.data_ptr(),
            scale=float(scale), eps=float(eps), out_len=out_len, modalities=mods, chunk_dtype=chunk_code,
            chunk_stride=chunk_stride, keeps=0 if keeps is None else keeps.data_ptr(), gather=layouts,
            query_row0=query_row0, chain=bool(chain) and bool(ext().stage_chain_supported(self.index)),
            device=self.index, positions_stride=0 if row_index is None else lq)
        # stream -> (plan, scores, workspace, scoring counters, the gathered question rows' buffer or None)
        self.streams: dict[int, tuple] = {}
        self._for_stream(stream)  # the current stream's buffers now: a first call allocates nothing either

    def _for_stream(self, stream: int) -> tuple:
        entry = self.streams.get(stream)
        if entry is None:
            scores = torch.empty(self.score_shape, dtype=torch.float32, device=self.device)
            scratch = workspace(self.workspace_bytes, self.device)
            # The scoring kernels' counters: zero once here; every call leaves them zero (csrc/launchers.h).
            counters = torch.zeros(self.counter_count, dtype=torch.int32, device=self.device)
            plan = ext().StagePlan(**self._plan_args, scores=scores.data_ptr(), workspace=scratch.data_ptr(),
                                   counters=counters.data_ptr())
            rows = None
            if self.row_index is not None:
                rows = torch.empty(self.query_shape, dtype=self.query_dtype, device=self.device)
            entry = self.streams[stream] = (plan, scores, scratch, counters, rows)
        return entry

    @property
    def chained(self) -> bool:
        """Whether the launches are chained with programmatic dependent launch (sm_90+)."""
        return bool(self._plan_args["chain"])

    def launch(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
               gather: Sequence[torch.Tensor], outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One host call on the current stream: scoring, selection and the gather, into ``outs = (keep, flags,
        *gathered)``. Returns the stream's scores buffer."""
        stream = _raw_stream(self.index)
        plan, scores, _, _, rows = self._for_stream(stream)
        if rows is not None and self.row_index is not None:  # the samples' question rows, read from row 0
            query = torch.gather(query, 2, self.row_index, out=rows)
        plan.launch(query=query.data_ptr(), q_stride=query.stride(), key=key.data_ptr(), k_stride=key.stride()[:3],
                    labels=labels.data_ptr(), chunk_ids=0 if chunk_ids is None else chunk_ids.data_ptr(),
                    keep=outs[0].data_ptr(), nonfinite=outs[1].data_ptr(),
                    gather_src=[t.data_ptr() for t in gather], gather_dst=[t.data_ptr() for t in outs[2:]],
                    stream=stream)
        return scores
