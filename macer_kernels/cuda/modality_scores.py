"""``modality_scores`` (``eq:macer_score``) on the CUDA kernels of ``csrc/kernels/modality_scores.cuh``."""

from __future__ import annotations

import torch

from macer_kernels.backend import register
from macer_kernels.cuda._ext import check_cuda_tensor, dtype_code, ext, launch_args, workspace

_OP = "modality_scores"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def modality_scores_cuda(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor,
                         query_positions: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """Scores ``[B, N]`` float32 from query ``[B, Hq, Lq, D]`` and key ``[B, Hkv, N, D]`` (any strides, head dim
    contiguous), labels ``[B, N]`` and query positions ``[B, Lq]`` of any integer dtype, read in place. A key labelled
    -1 (``PAD_LABEL``) is no key of its sample: no row sees it and it scores 0.

    The public op (``macer_kernels.modality_scores``) has validated shapes, label and position ranges; this checks
    what the kernels add: CUDA tensors, one float dtype for query and key, D <= 256, grid limits on B and Hkv.
    Workspace: fp32 logits ``[B, Hq*Lq, N]`` (O(B Hq Lq N), like the PyTorch path) plus one (max, sum) pair per
    (row, label, key-tile split), at most ``min(ceil(N / 32), 1024)`` splits (docs/cuda.md).
    """
    if query.dtype != key.dtype or key.dtype not in _FLOATS:
        raise TypeError(f"{_OP} (cuda): query and key must share one dtype out of float32, float16, bfloat16, "
                        f"float64; got {query.dtype} and {key.dtype}")
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    max_d = int(ext().modality_scores_max_head_dim())
    if not 1 <= d <= max_d:
        raise ValueError(f"{_OP} (cuda): head dimension D must be in [1, {max_d}], got {d}")
    if not (b <= 65535 and hkv <= 65535):
        raise ValueError(f"{_OP} (cuda): B and Hkv must be at most 65535 (CUDA grid limits), got B={b}, Hkv={hkv}")
    if key.stride(-1) != 1:
        raise ValueError(f"{_OP} (cuda): key must have stride(-1) == 1, got strides {key.stride()}")
    codes = (dtype_code(_OP, "query", query), dtype_code(_OP, "modality", modality),
             dtype_code(_OP, "query_positions", query_positions))
    for name, t in (("query", query), ("key", key), ("modality", modality), ("query_positions", query_positions)):
        check_cuda_tensor(_OP, name, t)
    out = torch.empty(b, n, dtype=torch.float32, device=key.device)
    if b == 0 or n == 0:
        return out
    device, stream = launch_args(key)
    scratch = workspace(ext().modality_scores_workspace_bytes(b, hq, lq, n), key.device)
    ext().modality_scores(
        query.data_ptr(), key.data_ptr(), modality.data_ptr(), query_positions.data_ptr(), out.data_ptr(),
        scratch.data_ptr(), *codes, (b, hq, lq, d, hkv, n), query.stride(),
        key.stride()[:3], modality.stride(), query_positions.stride(), float(scale), float(eps), device, stream)
    return out


register(_OP, "cuda")(modality_scores_cuda)
