"""macer-kernels: the ops of MACER (modality-aware capacity-explicit retention) for omnimodal LLM prefill.

Public ops (each a plain function on tensors; the backend is picked per call, see ``macer_kernels.backend``):

========================  ===========================================  ================================
op                        definition (``macer_paper.tex`` label)       shapes
========================  ===========================================  ================================
``split_budget``          ``eq:capacity_nominal``, ``eq:capacity_split``  counts -> ``Budget``
``modality_scores``       ``eq:macer_score`` (ANMS)                     q, k ``[B,H,L,D]`` -> ``[B,N]``
``topk_indices``          ``Top-k``                                     ``[n]`` -> ``[k]``
``coverage_select``       ``eq:chunk_coverage_greedy``                  ``[n]``, ``[n]`` -> ``[k]``
``temporal_chunks``       Appendix B (C coarse temporal chunks)         ``[n]`` -> ``[n]``
``compact``               Sec. 4 (keep text + S_a + S_v in order)       ``x``, ``[k]`` -> ``x`` with k rows
``select_stage``          one readout: ANMS scores + every selection     q, k, labels -> ``[B,out_len]``
========================  ===========================================  ================================

No op synchronises with the host on CUDA tensors: shapes, dtypes, devices and strides are always checked, but values
(label and position ranges, NaN scores, sorted keep indices, chunk ids) are checked on CUDA tensors only in
validation mode (``validation()``, ``set_validation(True)`` or ``MACER_VALIDATE=1``); CPU tensors are always
value-checked. See ``macer_kernels._validate``.

``check_count`` and ``check_real``, the ops' checks of Python scalars (errors name the parameter and the allowed
range), are public so that the model layer (``macer.core.checks``) checks its own arguments with the same code.
"""

from macer_kernels import library  # noqa: F401  (registers torch.ops.macer.*, the ops as a traced caller sees them)
from macer_kernels._validate import check_count, check_real, set_validation, validation, validation_enabled
from macer_kernels.backend import available_backends, backend_status, current_backend, use_backend
from macer_kernels.compact import compact, compact_many
from macer_kernels.modality_scores import MAX_MODALITIES, PAD_LABEL, modality_scores
from macer_kernels.select import coverage_select, topk_indices
from macer_kernels.split_budget import decimal_fraction, split_budget
from macer_kernels.stage import StageModality, select_stage
from macer_kernels.temporal_chunks import temporal_chunks
from macer_kernels.types import Budget

__version__ = "0.1.0"

__all__ = [
    "MAX_MODALITIES",
    "PAD_LABEL",
    "Budget",
    "StageModality",
    "available_backends",
    "backend_status",
    "check_count",
    "check_real",
    "compact",
    "compact_many",
    "coverage_select",
    "current_backend",
    "decimal_fraction",
    "modality_scores",
    "select_stage",
    "set_validation",
    "split_budget",
    "temporal_chunks",
    "topk_indices",
    "use_backend",
    "validation",
    "validation_enabled",
]
