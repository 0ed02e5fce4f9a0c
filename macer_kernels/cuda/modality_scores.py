"""``modality_scores`` (``eq:macer_score``) on the CUDA kernels of ``csrc/kernels/modality_scores.cuh`` (step S-A,
every architecture) and ``csrc/kernels/modality_scores_sm90a.cuh`` (step S-B, sm_90a builds on an H100/H200)."""

from __future__ import annotations

import torch

from macer_kernels.backend import register
from macer_kernels.cuda._ext import check_cuda_tensor, dtype_code, ext, launch_args, workspace

_OP = "modality_scores"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_PATHS = {"auto": 0, "sa": 1}

_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(count: int, device: torch.device, stream: int) -> torch.Tensor:
    """The kernels' arrival counters and label masks: int32, zero before a call and zero again after it (each unit's
    last CTA resets its own), so one zeroed buffer per (device, stream) serves every call and graph replay on that
    stream; calls on one stream run in order. Grown (a fresh zeroed buffer) when a shape needs more."""
    key = (device, stream)
    buffer = _COUNTERS.get(key)
    if buffer is None or buffer.numel() < count:
        if buffer is None and len(_COUNTERS) >= 16:  # a bounded cache: one entry per stream in use
            _COUNTERS.pop(next(iter(_COUNTERS)))
        buffer = _COUNTERS[key] = torch.zeros(max(count, 1), dtype=torch.int32, device=device)
    return buffer


def _check(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor, query_positions: torch.Tensor) -> None:
    if query.dtype != key.dtype or key.dtype not in _FLOATS:
        raise TypeError(f"{_OP} (cuda): query and key must share one dtype out of float32, float16, bfloat16, "
                        f"float64; got {query.dtype} and {key.dtype}")
    b, _, _, d = query.shape
    hkv = key.shape[1]
    max_d = int(ext().modality_scores_max_head_dim())
    if not 1 <= d <= max_d:
        raise ValueError(f"{_OP} (cuda): head dimension D must be in [1, {max_d}], got {d}")
    if not (b <= 65535 and hkv <= 65535):
        raise ValueError(f"{_OP} (cuda): B and Hkv must be at most 65535 (CUDA grid limits), got B={b}, Hkv={hkv}")
    if key.shape[2] > 2**31 - 65:
        raise ValueError(f"{_OP} (cuda): N must be at most 2^31 - 65 (32-bit key indices), got {key.shape[2]}")
    if key.stride(-1) != 1:
        raise ValueError(f"{_OP} (cuda): key must have stride(-1) == 1, got strides {key.stride()}")


def modality_scores_cuda(query: torch.Tensor, key: torch.Tensor, modality: torch.Tensor,
                         query_positions: torch.Tensor, scale: float, eps: float, *, path: str = "auto"
                         ) -> torch.Tensor:
    """Scores ``[B, N]`` float32 from query ``[B, Hq, Lq, D]`` and key ``[B, Hkv, N, D]`` (any strides, head dim
    contiguous), labels ``[B, N]`` and query positions ``[B, Lq]`` of any integer dtype, read in place. A key labelled
    -1 (``PAD_LABEL``) is no key of its sample: no row sees it and it scores 0.

    The public op (``macer_kernels.modality_scores``) has validated shapes, label and position ranges; this checks
    what the kernels add: CUDA tensors, one float dtype for query and key, D <= 256, grid limits on B and Hkv.
    ``path``: ``"auto"`` (S-B where built and eligible, else S-A) or ``"sa"``. Workspace (docs/cuda.md): the fp32
    logits of every (row, key), in row tiles of 32 rows per KV head, ``B Hkv ceil(G Lq / 32) ceil(N / 64)`` x 8 KB,
    plus one (max, sum) per (label, row, split), at most 128 splits; and a zeroed int32 counter buffer cached per
    stream.
    """
    _check(query, key, modality, query_positions)
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    codes = (dtype_code(_OP, "query", query), dtype_code(_OP, "modality", modality),
             dtype_code(_OP, "query_positions", query_positions))
    for name, t in (("query", query), ("key", key), ("modality", modality), ("query_positions", query_positions)):
        check_cuda_tensor(_OP, name, t)
    out = torch.empty(b, n, dtype=torch.float32, device=key.device)
    if b == 0 or n == 0:
        return out
    device, stream = launch_args(key)
    scratch = workspace(ext().modality_scores_workspace_bytes(b, hq, lq, hkv, n), key.device)
    counters = _counters(int(ext().modality_scores_counter_count(b, hq, lq, hkv)), key.device, stream)
    ext().modality_scores(
        query.data_ptr(), key.data_ptr(), modality.data_ptr(), query_positions.data_ptr(), out.data_ptr(),
        scratch.data_ptr(), counters.data_ptr(), *codes, (b, hq, lq, d, hkv, n), query.stride(), key.stride()[:3],
        modality.stride(), query_positions.stride(), float(scale), float(eps), device, stream, _PATHS[path])
    return out


def scores_path(query: torch.Tensor, key: torch.Tensor, *, path: str = "auto") -> tuple[str, str]:
    """``("sa" | "sb", why not S-B)``: which kernels ``modality_scores_cuda`` takes for these tensors on their
    device (asks the device's compute capability and the cooperative grid's fit; launches nothing)."""
    b, hq, lq, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    device, _ = launch_args(key)
    kind, why = ext().modality_scores_path(dtype_code(_OP, "query", query), (b, hq, lq, d, hkv, n), query.stride(),
                                           key.stride()[:3], key.data_ptr(), device, _PATHS[path])
    return str(kind), str(why)


def stream_k_cuda(key: torch.Tensor) -> torch.Tensor:
    """Read ``key`` ``[B, Hkv, N, D]`` once with the scoring tile kernel's per-thread 16-byte loads, on a grid the
    device holds at once, through the same wrapper, module call and launcher as ``modality_scores_cuda``, and nothing
    else: the benchmark's measured "read K once" (``bench_modality_scores``' ``stream_k_us``). Returns one int32 word
    per CTA (an XOR of what it read, so no load is dead; the XOR of all of them is the XOR of K's words). K must take
    the vectorised path (16-byte aligned rows and strides, bf16 / fp16 / fp32). One launch, nothing else: the output
    is not zeroed."""
    check_cuda_tensor(_OP, "key", key)
    b, hkv, n, d = key.shape
    out = torch.empty(int(ext().modality_scores_stream_k_words(b, hkv, n)), dtype=torch.int32, device=key.device)
    device, stream = launch_args(key)
    written = ext().modality_scores_stream_k(key.data_ptr(), out.data_ptr(), dtype_code(_OP, "key", key),
                                             (b, hkv, n, d), key.stride()[:3], device, stream)
    return out[:written]


register(_OP, "cuda")(modality_scores_cuda)
