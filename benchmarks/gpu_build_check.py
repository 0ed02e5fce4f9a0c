"""The check after ``gpu_check.sh``'s build step: the CUDA backend is usable, which architectures the module holds, and
which scoring path the 7B shape takes (S-B needs an sm_90a build on an sm_90 device).

    python -m benchmarks.gpu_build_check        # exits non-zero with the reason when the build is not usable

A module built with ``90a`` in ``MACER_CUDA_ARCHS`` whose S-B path reports that it was not built is a wrong build (a
stale or mismatched prebuilt module, or a build that dropped the 90a object library): the step fails, and a prebuilt
module is then rebuilt from source.
"""

from __future__ import annotations

import argparse
import os

import torch

import macer_kernels as mk

SHAPE_7B = {"hq": 28, "hkv": 4, "lq": 4, "d": 128}


def check(device: str = "cuda", n: int = 20_000) -> str:
    """The build's report; raises SystemExit with the reason when it is not usable."""
    status = mk.backend_status()
    if status["cuda"] is not None:
        raise SystemExit(f"gpu_build_check: the cuda backend is not usable: {status['cuda']}")
    from macer_kernels.cuda._ext import ext
    from macer_kernels.cuda.modality_scores import scores_path

    lines = [f"backends: {status}", f"module: SASS {list(ext().compiled_archs())}, PTX {ext().ptx_arch()}"]
    q = torch.zeros(1, SHAPE_7B["hq"], SHAPE_7B["lq"], SHAPE_7B["d"], dtype=torch.bfloat16, device=device)
    k = torch.zeros(1, SHAPE_7B["hkv"], n, SHAPE_7B["d"], dtype=torch.bfloat16, device=device)
    path, why = scores_path(q, k)
    lines.append(f"scoring path at the 7B shape, N = {n}: {path}" + (f" ({why})" if why else ""))
    archs = os.environ.get("MACER_CUDA_ARCHS", "").replace(",", ";").split(";")
    if "90a" in archs and path != "sb" and "built" in why:
        raise SystemExit("\n".join([*lines, "gpu_build_check: MACER_CUDA_ARCHS has 90a but the module has no S-B"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="key count of the scoring-path probe")
    args = parser.parse_args(argv)
    print(check("cuda", args.n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
