"""``topk_indices`` and ``coverage_select`` (``eq:chunk_coverage_greedy``) on the CUDA kernels.

Up to ``select_cta_max_n(device, coverage, wide)`` scores: one launch of the radix selection kernel of
``csrc/kernels/select_cta.cuh`` (one CTA up to its shared memory, tens of thousands of scores; on sm_90 a thread block
cluster above, a few hundred thousand for top-K and 65536 for coverage). Above that, and for coverage over float64
scores: the multi-CTA chain of ``csrc/kernels/select.cuh`` (elementwise kernels and CUB stable radix sorts, no k-step
loop). Neither path synchronises with the host.
"""

from __future__ import annotations

import torch

from macer_kernels.backend import register
from macer_kernels.cuda._ext import (
    check_cuda_tensor,
    dtype_code,
    ext,
    launch_args,
    select_cta_max_n,
    select_workspace_bytes,
    workspace,
)

# CUB counts items in int32; the launchers (csrc/select.cu) accept n <= INT_MAX // 2, which leaves the sorts headroom.
MAX_SCORES = (2**31 - 1) // 2


def _check_scores(op: str, scores: torch.Tensor) -> None:
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"{op} (cuda): scores must be float32, float16, bfloat16 or float64, got {scores.dtype}")
    if scores.numel() > MAX_SCORES:
        raise ValueError(f"{op} (cuda): the number of scores must be in [0, {MAX_SCORES}], got {scores.numel()}")
    check_cuda_tensor(op, "scores", scores)


def _select_one_cta(op: str, scores: torch.Tensor, chunk_ids: torch.Tensor | None, k: int,
                    coverage_weight: float | None, out: torch.Tensor, device: int, stream: int) -> None:
    """One launch of the one-CTA kernel: one row, every score a candidate, k picks into ``out``."""
    chunk_ptr, chunk_code, chunk_stride = 0, 0, 0
    if chunk_ids is not None:
        chunk_ptr, chunk_stride = chunk_ids.data_ptr(), chunk_ids.stride(0)
        chunk_code = dtype_code(op, "chunk_ids", chunk_ids)
    modality = (0, k, 0.0 if coverage_weight is None else float(coverage_weight), coverage_weight is not None)
    ext().select_cta(op, scores.data_ptr(), dtype_code(op, "scores", scores), (0, scores.stride(0)), 0, 0, (0, 0),
                     chunk_ptr, chunk_code, (0, chunk_stride), out.data_ptr(), 0, k, 1, scores.numel(), [modality], 0,
                     0, device, stream)


def topk_indices_cuda(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[k]`` (int64, ascending) of the k largest of ``scores`` ``[n]`` (any stride), ties to the lower
    index, scores compared exactly (32-bit order keys of fp32/fp16/bf16, 64-bit of fp64). One launch up to the
    kernel's limit (a radix select in shared memory); above it one stable radix sort by descending score, then one
    sort of the first k indices."""
    _check_scores("topk_indices", scores)
    out = torch.empty(k, dtype=torch.long, device=scores.device)
    if k == 0:
        return out
    n = scores.numel()
    device, stream = launch_args(scores)
    if n <= select_cta_max_n(device, False, scores.dtype == torch.float64):
        _select_one_cta("topk_indices", scores, None, k, None, out, device, stream)
        return out
    nbytes = select_workspace_bytes(n, device)
    scratch = workspace(nbytes, scores.device)
    ext().topk_indices(scores.data_ptr(), dtype_code("topk_indices", "scores", scores), n, scores.stride(0), k,
                       out.data_ptr(), scratch.data_ptr(), nbytes, device, stream)
    return out


def coverage_select_cuda(scores: torch.Tensor, chunk_ids: torch.Tensor, k: int, coverage_weight: float) -> torch.Tensor:
    """The chunk-coverage greedy's k picks, ascending: values ``s + sqrt(lambda_c / (1 + t))`` by rank t inside the
    chunk, ordered exactly as ``macer_kernels.select._coverage_order`` orders them (ties as the literal greedy)."""
    _check_scores("coverage_select", scores)
    chunk_code = dtype_code("coverage_select", "chunk_ids", chunk_ids)
    check_cuda_tensor("coverage_select", "chunk_ids", chunk_ids)
    out = torch.empty(k, dtype=torch.long, device=scores.device)
    if k == 0:
        return out
    n = scores.numel()
    device, stream = launch_args(scores)
    # The kernel ranks inside a chunk by 32-bit score keys: exact for fp32/fp16/bf16 scores, not for float64 ones.
    if scores.dtype != torch.float64 and n <= select_cta_max_n(device, True, False):
        _select_one_cta("coverage_select", scores, chunk_ids, k, coverage_weight, out, device, stream)
        return out
    nbytes = select_workspace_bytes(n, device)
    scratch = workspace(nbytes, scores.device)
    ext().coverage_select(scores.data_ptr(), dtype_code("coverage_select", "scores", scores), n, scores.stride(0),
                          chunk_ids.data_ptr(), chunk_code, chunk_ids.stride(0), k, float(coverage_weight),
                          out.data_ptr(), scratch.data_ptr(), nbytes, device, stream)
    return out


register("topk_indices", "cuda")(topk_indices_cuda)
register("coverage_select", "cuda")(coverage_select_cuda)
