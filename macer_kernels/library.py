"""The public ops as ``torch.library`` custom ops (namespace ``macer``), so that a traced caller keeps each op as one
opaque node: ``torch.compile`` (also with ``fullgraph=True``), ``make_fx`` and ``torch.export`` see the op's output
shapes through its fake implementation and never trace into a kernel or a backend's Python.

When they run: the public functions (``macer_kernels.modality_scores``, ``topk_indices``, ``coverage_select``,
``compact``, ``compact_many``, ``select_stage`` and a ``PreparedStage``'s call) check their arguments on the host as
always, then call the op here while ``tracing()`` says the caller is being traced, and the backend directly otherwise:
an eager call pays no custom-op dispatch (per-call Python time the hot path does not need). While tracing, the value
checks (label ranges, sorted keeps, NaN scores: host reads) do not run, as on CUDA without validation mode: a graph
holds no host read, and fake tensors have no values.

What they run: the backend that ``macer_kernels.backend.resolve`` picks for the tensors' device when the graph runs
(``use_backend`` in force then), with the arguments the public function checked; outputs are contiguous, as the fake
implementations say (a backend may return a view, e.g. the last ``out_len`` columns of a sort). Every output size
is a host integer known before the call (``k``, ``keep``'s length, ``out_len``, the prepared stage's shapes), so the
fake implementations create no data-dependent shape.

The CUDA launchers alone, without any check, are ``torch.ops.macer_cuda.*`` (``macer_kernels.cuda.library``).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from macer_kernels.backend import dispatch, resolve

if TYPE_CHECKING:
    from macer_kernels.prepared import PreparedStage

NAMESPACE = "macer"

__all__ = ["NAMESPACE", "register_prepared"]


@torch.library.custom_op(f"{NAMESPACE}::modality_scores", mutates_args=())
def modality_scores(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor, positions: torch.Tensor,
                    scale: float, eps: float) -> torch.Tensor:
    """``eq:macer_score``: ``[B, N]`` float32 (``macer_kernels.modality_scores`` with its positions filled in)."""
    return resolve("modality_scores", query.device)[1](query, key, modality, positions, scale, eps).contiguous()


@modality_scores.register_fake
def _(query, key, modality, positions, scale, eps):
    return key.new_empty((key.shape[0], key.shape[2]), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::topk_indices", mutates_args=())
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[k]`` int64 indices of the k largest scores, ascending, ties to the lower index."""
    return dispatch("topk_indices", scores.device, scores, k).contiguous()


@topk_indices.register_fake
def _(scores, k):
    return scores.new_empty((k,), dtype=torch.long)


@torch.library.custom_op(f"{NAMESPACE}::coverage_select", mutates_args=())
def coverage_select(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    """``eq:chunk_coverage_greedy``: ``[k]`` int64 picks, ascending."""
    return dispatch("coverage_select", scores.device, scores, chunk_ids, k, coverage_weight).contiguous()


@coverage_select.register_fake
def _(scores, chunk_ids, k, coverage_weight):
    return scores.new_empty((k,), dtype=torch.long)


@torch.library.custom_op(f"{NAMESPACE}::compact", mutates_args=())
def compact(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with the positions ``keep`` along ``dim`` (``dim`` already non-negative)."""
    return dispatch("compact", x.device, x, keep, dim).contiguous()


@compact.register_fake
def _(x, keep, dim):
    return x.new_empty(_kept_shape(x, keep, dim))


@torch.library.custom_op(f"{NAMESPACE}::compact_many", mutates_args=())
def compact_many(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """``compact`` of several tensors sharing one sequence axis."""
    return [t.contiguous() for t in dispatch("compact_many", keep.device, list(tensors), keep, list(dims))]


@compact_many.register_fake
def _(tensors, keep, dims):
    return [t.new_empty(_kept_shape(t, keep, d)) for t, d in zip(tensors, dims, strict=True)]


def _kept_shape(x: torch.Tensor, keep: torch.Tensor, dim: int) -> list[Any]:
    shape = list(x.shape)
    shape[dim] = keep.shape[-1]
    return shape


@torch.library.custom_op(f"{NAMESPACE}::select_stage", mutates_args=())
def select_stage(query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                 chunk_ids: torch.Tensor | None, stage_labels: list[int], keeps: list[int],
                 coverage_weights: list[float], num_chunks: list[int], out_len: int, budgets: torch.Tensor | None,
                 scale: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stage: ``(keep [B, out_len] int64, scores [B, N] float32, flags [B] bool)``. The stage spec comes as
    parallel lists (a schema has no tuple of optionals): ``coverage_weights[i] < 0`` selects top-K for modality i;
    ``budgets``: the optional int32 ``[B, M]`` per-sample keeps (``keeps`` their maxima)."""
    spec = tuple((label, keep, None if weight < 0 else weight, chunks)
                 for label, keep, weight, chunks in zip(stage_labels, keeps, coverage_weights, num_chunks, strict=True))
    scores = resolve("modality_scores", query.device)[1](query, key, labels, positions, scale, eps)
    flags = torch.empty(labels.shape[0], dtype=torch.bool, device=labels.device)
    keep = dispatch("stage_select", query.device, scores, labels, chunk_ids, spec, out_len,
                    *(() if budgets is None else (budgets,)), flags=flags)
    return keep.contiguous(), scores.contiguous(), flags


@select_stage.register_fake
def _(query, key, labels, positions, chunk_ids, stage_labels, keeps, coverage_weights, num_chunks, out_len, budgets,
      scale, eps):
    b, n = labels.shape
    return (labels.new_empty((b, out_len), dtype=torch.long), labels.new_empty((b, n), dtype=torch.float32),
            labels.new_empty((b,), dtype=torch.bool))


# ---- the prepared stage ------------------------------------------------------------------------------------------
# A prepared stage holds host state (its spec, budget table, positions, the CUDA plan and buffers) that no schema
# type carries: the op takes the stage's number in this registry. It holds the stages weakly: a stage the caller
# dropped is gone from the registry too.
_PREPARED: weakref.WeakValueDictionary[int, PreparedStage] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register_prepared(stage: PreparedStage) -> int:
    """A number for ``stage`` that ``torch.ops.macer.prepared_stage`` finds it by (while the caller keeps it)."""
    number = next(_NUMBERS)
    _PREPARED[number] = stage
    return number


def _prepared(number: int) -> PreparedStage:
    stage = _PREPARED.get(number)
    if stage is None:
        raise RuntimeError(f"torch.ops.{NAMESPACE}.prepared_stage: prepared stage {number} no longer exists (its "
                           "PreparedStage was garbage-collected; keep it alive as long as a graph calls it)")
    return stage


@torch.library.custom_op(f"{NAMESPACE}::prepared_stage", mutates_args=())
def prepared_stage(stage: int, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor,
                   chunk_ids: torch.Tensor | None, gather: list[torch.Tensor]) -> list[torch.Tensor]:
    """A ``PreparedStage``'s call: ``[keep, flags, *gathered]`` in new tensors."""
    return [t.contiguous() for t in _prepared(stage).run(query, key, labels, chunk_ids, gather)]


@prepared_stage.register_fake
def _(stage, query, key, labels, chunk_ids, gather):
    shapes = _prepared(stage).output_shapes()
    return [labels.new_empty(shape, dtype=dtype) for shape, dtype in shapes]
