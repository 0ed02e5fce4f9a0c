"""CUDA backend: the kernels of ``csrc/`` through the torch-free module ``macer_kernels._C``.

Importing this package registers the ``"cuda"`` implementations of ``modality_scores``, ``topk_indices``,
``coverage_select``, ``stage_select``, ``compact`` and ``compact_many`` (see ``macer_kernels.backend``), and the
``torch.library`` custom ops ``torch.ops.macer_cuda.*`` that ``torch.compile`` can trace
(``macer_kernels.cuda.library``). Importing never touches a GPU and works on a machine without one, or without the
compiled module; ``unavailable_reason()`` then says why the backend cannot run.
"""

from __future__ import annotations

import torch

from macer_kernels.cuda import compact, library, modality_scores, select, stage  # noqa: F401  (importing registers)
from macer_kernels.cuda._ext import IMPORT_ERROR, ext


def unavailable_reason() -> str | None:
    """None when the CUDA kernels can run here, else one sentence saying why not.

    In order: the compiled module is missing; the CUDA driver or a device is missing (the module's own, statically
    linked CUDA runtime is asked, not torch); the GPU's architecture is neither compiled in nor reachable from the
    embedded PTX; torch itself cannot use CUDA (a CPU build of torch on a GPU machine).
    """
    if IMPORT_ERROR is not None:
        if isinstance(IMPORT_ERROR, ModuleNotFoundError):
            return "extension not built (installed without nvcc or with MACER_NO_CUDA=1)"
        return f"extension failed to import: {IMPORT_ERROR}"
    report = ext().device_report()
    if report["error"]:
        return f"no CUDA device/driver: {report['error']}"
    if report["count"] == 0:
        return "no CUDA device/driver: the driver reports no CUDA device"
    major, minor = report["capability"]
    arch = 10 * major + minor
    sass, ptx = list(ext().compiled_archs()), int(ext().ptx_arch())
    if arch not in sass and arch < ptx:
        return (f"the GPU is sm_{arch} but this build has SASS for {', '.join(f'sm_{a}' for a in sass)} and PTX for "
                f"sm_{ptx} only; rebuild with MACER_CUDA_ARCHS=\"{arch}\"")
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} cannot use CUDA (a CPU build of torch?), so there are no CUDA tensors"
    return None
