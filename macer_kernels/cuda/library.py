"""``torch.library`` custom ops over the CUDA kernels, for models run under ``torch.compile``.

Why two entry points: the public ops (``macer_kernels.modality_scores`` ...) validate their arguments with
data-dependent checks (label ranges, NaN, sorted ``keep``) that synchronise with the GPU and break a compiled graph,
and eager dispatch through ``torch.library`` adds per-call Python overhead. So the backend registry calls the
launchers directly (``macer_kernels.cuda.modality_scores`` ...), and these custom ops expose the same launchers as
opaque graph nodes with fake (meta) implementations: ``torch.compile`` traces through them with shapes only.
They validate only what the kernels need; the caller guarantees the value ranges that the public ops check.
``benchmarks/bench_readout.py --overhead`` measures the cost of a call through ``torch.ops.macer_cuda.*`` against
the direct call (see docs/cuda.md).

Ops (namespace ``macer_cuda``): ``modality_scores``, ``topk_indices``, ``coverage_select``, ``stage_select``,
``compact``, ``compact_many``; arguments as in ``macer_kernels.backend``'s contract (``stage_select`` takes its
modalities as parallel lists, a weight < 0 meaning top-K, since a schema has no optional tuple entries, and the
optional int32 ``[B, M]`` per-sample budgets last; ``compact`` / ``compact_many`` take a 1-D or a batch's 2-D keep).
"""

from __future__ import annotations

import torch

from macer_kernels.cuda.compact import compact_cuda, compact_many_cuda
from macer_kernels.cuda.modality_scores import modality_scores_cuda
from macer_kernels.cuda.select import coverage_select_cuda, topk_indices_cuda
from macer_kernels.cuda.stage import stage_select_cuda

NAMESPACE = "macer_cuda"


@torch.library.custom_op(f"{NAMESPACE}::modality_scores", mutates_args=(), device_types="cuda")
def modality_scores(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor, query_positions: torch.Tensor,
                    scale: float, eps: float) -> torch.Tensor:
    """``eq:macer_score``: ``[B, N]`` float32 scores (see ``macer_kernels.modality_scores``)."""
    return modality_scores_cuda(query, key, modality, query_positions, scale, eps)


@modality_scores.register_fake
def _(query, key, modality, query_positions, scale, eps):
    return key.new_empty((key.shape[0], key.shape[2]), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::topk_indices", mutates_args=(), device_types="cuda")
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[k]`` int64 indices of the k largest scores, ascending, ties to the lower index."""
    return topk_indices_cuda(scores, k)


@topk_indices.register_fake
def _(scores, k):
    return scores.new_empty((k,), dtype=torch.long)


@torch.library.custom_op(f"{NAMESPACE}::coverage_select", mutates_args=(), device_types="cuda")
def coverage_select(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    """``eq:chunk_coverage_greedy``: ``[k]`` int64 picks, ascending."""
    return coverage_select_cuda(scores, chunk_ids, k, coverage_weight)


@coverage_select.register_fake
def _(scores, chunk_ids, k, coverage_weight):
    return scores.new_empty((k,), dtype=torch.long)


@torch.library.custom_op(f"{NAMESPACE}::stage_select", mutates_args=(), device_types="cuda")
def stage_select(scores: torch.Tensor, labels: torch.Tensor, chunk_ids: torch.Tensor | None, mod_labels: list[int],
                 keeps: list[int], coverage_weights: list[float], out_len: int,
                 budgets: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, out_len]`` int64 kept positions of a stage, right-aligned per row; ``coverage_weights[i] < 0`` selects
    top-K for modality i; ``budgets``: the optional int32 ``[B, M]`` per-sample keeps (``keeps`` their maxima)."""
    modalities = tuple((label, keep, None if weight < 0 else weight, None)
                       for label, keep, weight in zip(mod_labels, keeps, coverage_weights, strict=True))
    return stage_select_cuda(scores, labels, chunk_ids, modalities, out_len, budgets)


@stage_select.register_fake
def _(scores, labels, chunk_ids, mod_labels, keeps, coverage_weights, out_len, budgets=None):
    return scores.new_empty((scores.shape[0], out_len), dtype=torch.long)


@torch.library.custom_op(f"{NAMESPACE}::compact", mutates_args=(), device_types="cuda")
def compact(x: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with only the positions ``keep`` along ``dim`` (a new contiguous tensor); a 2-D keep ``[B, W]`` gathers
    per batch element (the dim before ``dim``), -1 entries giving zero rows."""
    return compact_cuda(x, keep, dim % x.dim())


@compact.register_fake
def _(x, keep, dim):
    shape = list(x.shape)
    shape[dim % x.dim()] = keep.shape[-1]
    return x.new_empty(shape)


@torch.library.custom_op(f"{NAMESPACE}::compact_many", mutates_args=(), device_types="cuda")
def compact_many(tensors: list[torch.Tensor], keep: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """``compact`` of several tensors sharing one sequence axis, in one launch."""
    return compact_many_cuda(list(tensors), keep, [d % t.dim() for t, d in zip(tensors, dims)])


@compact_many.register_fake
def _(tensors, keep, dims):
    outs = []
    for t, d in zip(tensors, dims):
        shape = list(t.shape)
        shape[d % t.dim()] = keep.shape[-1]
        outs.append(t.new_empty(shape))
    return outs
