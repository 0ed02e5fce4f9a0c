"""The prepared stage: ``select_stage`` and the compaction of the caller's tables, checked once per shape and then
run by one call per stage.

A model runs the same stage shape many times (one prompt layout: the same token counts, budgets and question rows).
``prepare_stage`` does the host work of ``select_stage`` once -- every metadata check, the spec, the output length,
the per-sample budget table, the question rows' positions -- and returns a ``PreparedStage`` whose call runs the
stage:

* on the CUDA backend, **one host call** (``_C.StagePlan.launch``) launches the scoring kernels, the selection kernel
  and one gather of the caller's tables with the stage's keep, chained with programmatic dependent launch on sm_90
  (docs/cuda.md, "The prepared stage"). The workspace, the scores and the question rows' positions are persistent
  buffers of the prepared stage (the kernels overwrite them on every call, so a captured CUDA graph replays it);
  the outputs are the caller's buffers (``out=``) or new tensors. Nothing else is allocated, nothing is read back;
* on the other backends (PyTorch, Triton; CUDA above its one-CTA selection limit or for N = 0): ``select_stage``'s
  own implementations, then the backend's ``compact_many``: the same results.

The question rows are a contiguous, host-known range of the query's rows (MACER's question span; FastV's last row),
so no gather of the query and no positions tensor is built per call. A left-padded batch of prompts
(``macer.hf.batch``) may give each sample its own range (its question sits at its own distance from the batch's last
row): the positions are then a ``[B, Lq]`` table uploaded once, at prepare, and a call gathers each sample's rows of
the query into a buffer of the stage first (on CUDA one ``torch.gather`` into the stream's persistent buffer before
the ``_C`` call: one launch more, still no allocation); ranges equal in every sample are one shared range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from macer_kernels._validate import check_int, check_tensor, tracing, values_checked
from macer_kernels.backend import dispatch, resolve
from macer_kernels.modality_scores import check_score_inputs
from macer_kernels.stage import (
    Counts,
    StageModality,
    StageSpec,
    _check_modalities,
    _check_values,
    _keeps_table,
    _per_sample,
)

__all__ = ["PreparedStage", "prepare_stage"]


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _describe(meta: tuple) -> str:
    shape, stride, dtype, device = meta
    return f"shape {shape}, strides {stride}, {dtype} on {device}"


class PreparedStage:
    """One stage of one shape, ready to run (see the module docstring); made by ``prepare_stage``.

    Attributes:
        out_len: the length of each keep row (``select_stage``'s ``out_len``).
        spec: the ``StageSpec`` the selection backends receive.
        cuda: the CUDA half (``macer_kernels.cuda.stage.StageHandle``: the ``_C`` plan and its buffers), or None
            where the stage runs through the backends' ops.
    """

    def __init__(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, spec: StageSpec, out_len: int,
                 keeps: torch.Tensor | None, positions: torch.Tensor, rows: range | None, scale: float, eps: float,
                 chunk_ids: torch.Tensor | None, gather: list[torch.Tensor], dims: list[int],
                 checks: tuple, chain: bool = True, row_index: torch.Tensor | None = None) -> None:
        self.spec, self.out_len = spec, out_len
        self.batch, self.num_keys = labels.shape
        self._keeps, self._positions, self._rows = keeps, positions, rows
        # Per-sample question rows: the [B, Hq, Lq, D] index (a view of the positions table) that gathers them.
        self._row_index = row_index
        self._scale, self._eps, self._dims = scale, eps, dims
        self._value_checks = checks  # (mods, counts, pads): select_stage's value checks, where values are checked
        self._coverage = chunk_ids is not None
        self._metas = {"query": _meta(query), "key": _meta(key), "labels": _meta(labels)}
        if chunk_ids is not None:
            self._metas["chunk_ids"] = _meta(chunk_ids)
        self._gather_metas = [_meta(t) for t in gather]
        self._outs = [(_out_shape(t, d, out_len), t.dtype) for t, d in zip(gather, dims, strict=True)]
        self.last_scores: torch.Tensor | None = None
        from macer_kernels.library import register_prepared

        self._number = register_prepared(self)  # torch.ops.macer.prepared_stage's handle on this stage
        self.cuda = None
        from macer_kernels.cuda import stage as cuda_stage  # imports without a GPU or the compiled module

        if cuda_stage.prepared_on_cuda(labels, self._coverage):
            self.cuda = cuda_stage.StageHandle(query, key, labels, spec, out_len, keeps, positions,
                                               0 if rows is None else rows.start, scale, eps, chunk_ids, gather,
                                               dims, chain, row_index=row_index)

    def output_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of each output ``(keep, flags, *gathered)``."""
        return [((self.batch, self.out_len), torch.long), ((self.batch,), torch.bool), *self._outs]

    def allocate(self) -> tuple[torch.Tensor, ...]:
        """New output buffers ``(keep, flags, *gathered)`` for ``out=`` (a caller that keeps them across calls
        allocates nothing per stage)."""
        device = self._metas["labels"][3]
        keep = torch.empty(self.batch, self.out_len, dtype=torch.long, device=device)
        flags = torch.empty(self.batch, dtype=torch.bool, device=device)
        return keep, flags, *self.allocate_gathered()

    def allocate_gathered(self, start: int = 0) -> list[torch.Tensor]:
        """New buffers for the gathered tensors ``gather[start:]`` alone (``allocate()[2 + start:]``)."""
        device = self._metas["labels"][3]
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._outs[start:]]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor,
                 chunk_ids: torch.Tensor | None = None, gather: Sequence[torch.Tensor] = (), *,
                 out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """Run the stage: returns ``(keep, flags, *gathered)``.

        Args:
            query, key, labels, chunk_ids, gather: tensors with the shapes, strides, dtypes and device of those
                the stage was prepared with (checked here, on the host).
            out: ``(keep, flags, *gathered)`` buffers to write (``allocate()`` makes them): contiguous, of the
                shapes and dtypes of the results. None: new tensors.

        ``keep`` ``[B, out_len]`` int64 and ``flags`` ``[B]`` bool are ``select_stage``'s (``return_flags``);
        ``gathered[i]`` is ``gather[i]`` compacted along its sequence dim with ``keep`` (``compact_many`` with a
        ``[B, W]`` keep: rows of -1 give zeros). The scores of the call are ``last_scores`` afterwards (on CUDA a
        persistent buffer that the next call overwrites).
        """
        given: dict[str, torch.Tensor | None] = {"query": query, "key": key, "labels": labels}
        if self._coverage:
            given["chunk_ids"] = chunk_ids
        elif chunk_ids is not None:
            raise ValueError("chunk_ids must be None: the stage was prepared without a coverage modality")
        for name, t in given.items():
            if not isinstance(t, torch.Tensor) or _meta(t) != self._metas[name]:
                got = _describe(_meta(t)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have the {_describe(self._metas[name])} the stage was prepared "
                                 f"with, got {got}")
        if len(gather) != len(self._gather_metas):
            raise ValueError(f"gather must hold the {len(self._gather_metas)} tensors the stage was prepared with, "
                             f"got {len(gather)}")
        for i, (t, meta) in enumerate(zip(gather, self._gather_metas, strict=True)):
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                raise ValueError(f"gather[{i}] must have the {_describe(meta)} the stage was prepared with")
        if out is not None:
            self._check_out(out)
        return self.run(query, key, labels, chunk_ids, gather, out=out)

    def _check_out(self, out: Sequence[torch.Tensor]) -> None:
        device = self._metas["labels"][3]
        want = self.output_shapes()
        if len(out) != len(want):
            raise ValueError(f"out must hold (keep, flags, *gathered): {len(want)} tensors, got {len(out)}")
        for i, (t, (shape, dtype)) in enumerate(zip(out, want, strict=True)):
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype
                    or t.device != device or not t.is_contiguous()):
                raise ValueError(f"out[{i}] must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}")

    def run(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None,
            gather: Sequence[torch.Tensor], *, out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """The call without its per-call metadata checks, for a caller whose cache key already pins the metadata
        (``macer.core.stage``); the arguments are those of ``__call__``. Traced (``macer_kernels.library``): one
        opaque node, whose results are copied into ``out`` where given; ``last_scores`` is not set."""
        if tracing():
            results = torch.ops.macer.prepared_stage(self._number, query, key, labels, chunk_ids, list(gather))
            if out is None:
                return tuple(results)
            for dst, src in zip(out, results, strict=True):
                dst.copy_(src)
            return tuple(out)
        if values_checked(labels):
            mods, counts, pads = self._value_checks
            _check_values(labels, self._positions, chunk_ids, mods, counts, pads, True, self.num_keys)
        outs = self.allocate() if out is None else tuple(out)
        if self.cuda is not None and resolve("stage_select", labels.device)[0] == "cuda":
            self.last_scores = self.cuda.launch(query, key, labels, chunk_ids, gather, outs)
            return outs
        rows = self._rows
        if self._row_index is not None:
            q = query.gather(2, self._row_index)
        else:
            q = query if rows is None else query[:, :, rows.start:rows.stop]
        scores = resolve("modality_scores", q.device)[1](q, key, labels, self._positions, self._scale, self._eps)
        self.last_scores = scores
        extra = () if self._keeps is None else (self._keeps,)
        keep = dispatch("stage_select", labels.device, scores, labels, chunk_ids, self.spec, self.out_len, *extra,
                        flags=outs[1])
        outs[0].copy_(keep)
        if gather:
            for dst, src in zip(outs[2:], dispatch("compact_many", labels.device, list(gather), keep, self._dims),
                                strict=True):
                dst.copy_(src)
        return outs


def _out_shape(t: torch.Tensor, dim: int, length: int) -> tuple[int, ...]:
    shape = list(t.shape)
    shape[dim] = length
    return tuple(shape)


def prepare_stage(query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, modalities: Sequence[StageModality],
                  *, chunk_ids: torch.Tensor | None = None, query_rows: range | Sequence[range] | None = None,
                  scale: float | None = None, eps: float = 1e-6, padding: Counts = 0,
                  gather: Sequence[torch.Tensor] = (), gather_dims: Sequence[int] = (),
                  chain: bool = True) -> PreparedStage:
    """Check a stage once and prepare it for its shape (see the module docstring).

    The arguments are ``select_stage``'s, given as example tensors (only their metadata is read, except where values
    are checked: CPU tensors and validation mode), with two additions:

    Args:
        query_rows: None: ``query`` is ``[B, Hq, Lq, D]``, the question rows, at positions ``N - Lq .. N - 1``
            (``select_stage``'s default). A ``range(start, stop)`` (step 1) inside ``[0, N)``: ``query`` is
            ``[B, Hq, N, D]``, one row per sequence position, and rows ``start .. stop - 1`` are the question rows,
            at those positions (the kernels read them in place: no gather). A sequence of B such ranges, all of one
            length: sample b's question rows are ``query_rows[b]`` (a left-padded batch whose samples' questions end
            at different distances from the last row); where they differ, a call gathers them (one launch).
        gather, gather_dims: tensors compacted with the stage's keep in the same call, each with a batch dim of
            size B just before its sequence dim ``gather_dims[i]`` (of size N): e.g. the prompt positions, labels
            and chunk ids of the rows entering the stage, which become those of the next stage.
        chain: on the CUDA backend, chain the launches with programmatic dependent launch where the device allows
            it (sm_90+); False launches them one after the other (the benchmark's comparison).
    """
    b_q, _, rows_in_query, _ = check_tensor("query", query, 4).shape
    n = check_tensor("key", key, 4).shape[2]
    rows: range | None = None
    positions, row_index = None, None
    if query_rows is None:
        q_view = query
    else:
        per_sample = list(query_rows) if not isinstance(query_rows, range) else [query_rows] * b_q
        if len(per_sample) != b_q:
            raise ValueError(f"query_rows must be one range or B={b_q} ranges (one per sample), got "
                             f"{len(per_sample)}")
        for i, r in enumerate(per_sample):
            name = "query_rows" if isinstance(query_rows, range) else f"query_rows[{i}]"
            if not isinstance(r, range) or r.step != 1 or len(r) == 0:
                raise ValueError(f"{name} must be a non-empty range with step 1, got {r!r}")
            if rows_in_query != n or not 0 <= r.start < r.stop <= n:
                raise ValueError(f"{name} must lie in [0, N={n}) and query must hold N={n} rows (one per position) "
                                 f"with query_rows given; got {r!r} and {rows_in_query} rows")
            if len(r) != len(per_sample[0]):
                raise ValueError(f"query_rows must all have one length (the question's Lq rows), got "
                                 f"{len(per_sample[0])} rows in query_rows[0] and {len(r)} in {name}")
        lq = len(per_sample[0])
        if all(r == per_sample[0] for r in per_sample):
            rows = per_sample[0]
            q_view = query[:, :, rows.start:rows.stop]
            positions = torch.arange(rows.start, rows.stop, device=query.device).expand(b_q, lq)
        else:  # one table, uploaded now; the calls gather the rows with a view of it
            positions = torch.tensor([list(r) for r in per_sample], dtype=torch.long).to(query.device)
            row_index = positions[:, None, :, None].expand(b_q, query.shape[1], lq, query.shape[3])
            q_view = query[:, :, :lq]  # the gathered rows' metadata, for the checks
    _, key, labels, positions, scale, eps = check_score_inputs(q_view, key, labels, positions, scale, eps,
                                                              labels_name="labels")
    b, n = labels.shape
    pads = _per_sample("padding", padding, b)
    mods, counts, keeps = _check_modalities(modalities, n, pads)
    coverage = any(m.coverage_weight is not None for m in mods)
    if coverage != (chunk_ids is not None):
        raise ValueError("chunk_ids is required exactly when a modality uses coverage_weight")
    if chunk_ids is not None:
        check_int("chunk_ids", check_tensor("chunk_ids", chunk_ids, 2))
        if tuple(chunk_ids.shape) != (b, n) or chunk_ids.device != labels.device:
            raise ValueError(f"chunk_ids must be [B={b}, N={n}] on {labels.device}, got {tuple(chunk_ids.shape)} on "
                             f"{chunk_ids.device}")
    gather, dims = list(gather), list(gather_dims)
    if len(dims) != len(gather):
        raise ValueError(f"gather_dims must give one dim per gathered tensor ({len(gather)}), got {len(dims)}")
    for i, (t, dim) in enumerate(zip(gather, dims, strict=True)):
        check_tensor(f"gather[{i}]", t)
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim < t.dim():
            raise ValueError(f"gather_dims[{i}] must be an int in [1, {t.dim() - 1}] (a batch dim comes first), got "
                             f"{dim!r}")
        if t.shape[dim] != n or t.shape[dim - 1] != b or t.device != labels.device:
            raise ValueError(f"gather[{i}] must hold N={n} rows along dim {dim} after a batch dim of size B={b}, on "
                             f"{labels.device}; got shape {tuple(t.shape)} on {t.device}")
    out_len = max(n - pads[s] - sum(c[s] - k[s] for c, k in zip(counts, keeps, strict=True)) for s in range(b))
    spec: StageSpec = tuple(
        (m.label, max(keep), None if m.coverage_weight is None else float(m.coverage_weight),
         0 if m.coverage_weight is None else m.num_chunks)
        for m, keep in zip(mods, keeps, strict=True))
    table = _keeps_table(keeps, labels.device) if any(len(set(k)) > 1 for k in keeps) else None
    if not isinstance(chain, bool):
        raise ValueError(f"chain must be a bool, got {chain!r}")
    return PreparedStage(query, key, labels, spec, out_len, table, positions, rows, scale, eps, chunk_ids, gather,
                         dims, (mods, counts, pads), chain, row_index)
