"""Build script: pure-Python packages `macer_kernels` and `macer` (from python/macer), plus the CUDA extension
`macer_kernels._C` when it can be built.

The extension is built with CMake (CMakeLists.txt) when nvcc is found (on PATH, or under $CUDA_HOME/bin) and
MACER_NO_CUDA is not "1"; otherwise the install is pure Python and the "cuda" backend reports itself unavailable.
Build knobs (environment): MACER_CUDA_ARCHS (default "89;90;90a"), MACER_NO_CUDA=1, MACER_BUILD_JOBS (default: all
cores). The CMake build tree is kept under build/ (one per Python version and arch list), so a repeated
`pip install -e .` or `python setup.py build_ext --inplace` only recompiles what changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

packages = find_packages(include=["macer_kernels", "macer_kernels.*"])
packages += ["macer", *("macer." + p for p in find_packages("python/macer"))]


def find_nvcc() -> str | None:
    """Path of nvcc, or None: $CUDACXX, then PATH, then $CUDA_HOME/bin, then /usr/local/cuda/bin."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cuda_build_wanted() -> tuple[bool, str]:
    if os.environ.get("MACER_NO_CUDA", "0") == "1":
        return False, "MACER_NO_CUDA=1"
    if find_nvcc() is None:
        return False, "nvcc not found"
    return True, ""


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt, then place the module where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        if shutil.which("cmake") is None:
            raise RuntimeError("macer-kernels: nvcc was found but cmake (>= 3.24) was not; install cmake to build the "
                               "CUDA extension, or set MACER_NO_CUDA=1 for a pure-Python install")
        archs = os.environ.get("MACER_CUDA_ARCHS", "89;90;90a").replace(",", ";")
        tag = f"cmake-py{sys.version_info.major}{sys.version_info.minor}-sm{archs.replace(';', '_')}"
        build_dir = ROOT / "build" / tag
        build_dir.mkdir(parents=True, exist_ok=True)
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMACER_CUDA_ARCHS={archs}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja") and not (build_dir / "Makefile").exists():
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MACER_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        built = out_dir / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
        if not built.exists():
            raise RuntimeError(f"CMake did not produce {built}")


wanted, why_not = cuda_build_wanted()
if not wanted:
    print(f"macer-kernels: building without the CUDA extension ({why_not}); the 'cuda' backend will be unavailable")

setup(
    packages=packages,
    package_dir={"macer": "python/macer"},
    ext_modules=[CMakeExtension("macer_kernels._C")] if wanted else [],
    cmdclass={"build_ext": CMakeBuild},
)
