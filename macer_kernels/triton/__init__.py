"""Triton backend: fused modality scoring and GPU selection.

Importing this package imports Triton and registers the ``"triton"`` implementations of ``modality_scores``,
``topk_indices`` and ``coverage_select``. ``macer_kernels`` itself never imports it: the backend registry
(``macer_kernels.backend``) imports it the first time the backend is probed, so a plain ``import macer_kernels`` costs
nothing and works without Triton.

Triton decides at ``@triton.jit`` time whether kernels are compiled or interpreted, so ``TRITON_INTERPRET=1`` must be
set before this package is first imported for the kernels to run on CPU tensors (the test suite does this on machines
without a GPU).
"""

from __future__ import annotations

import torch
import triton  # a missing Triton surfaces as ImportError, which the registry reports as the reason

# Read once, here: the kernels below are decorated (compiled or interpreted) during this import.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""True when the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` was set before the import)."""

from macer_kernels.triton import compact, modality_scores, select, stage  # noqa: E402, F401  (importing registers the kernels)


def unavailable_reason() -> str | None:
    """None when the kernels can run (a CUDA device, or the interpreter), else the reason they cannot."""
    if INTERPRETED or torch.cuda.is_available():
        return None
    return ("Triton is installed but there is no CUDA device, and TRITON_INTERPRET=1 was not set before importing "
            "triton (it runs the kernels on CPU tensors, slowly)")
