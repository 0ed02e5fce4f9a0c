"""Resource and SASS report of the radix selection kernels (``csrc/kernels/select_cta.cuh``), without a GPU.

    python -m benchmarks.select_resources             # compile for sm_89, sm_90, sm_90a; print; write the record
    python -m benchmarks.select_resources --no-write  # print only

For each architecture ``csrc/select_cta.cu`` is compiled alone with nvcc (the build's flags plus ``-Xptxas -v``) to a
cubin; per kernel instantiation (``select_cta_kernel<key, cluster>``) the record holds ptxas' registers, stack frame,
spill stores / loads and static shared memory, the occupancy they allow (CTAs and warps per SM, from the register file
and shared memory of the architecture), and SASS counts from ``cuobjdump -sass``: static instructions (the
instruction-cache finding of the H200 profile: the previous one-CTA kernel was 23,936), global loads (every one of
them is in a per-dtype prologue loop: the hot loops read shared memory only), local-memory loads and stores,
``MATCH``, barriers and calls. It also records the largest row each path takes (``select_cta_max_n_for``) on
sm_89 (99 KB of shared memory per block, no clusters) and sm_90 (227 KB, clusters of 8). Results go to
``benchmarks/results/select_resources.json`` with the nvcc version and the git SHA;
``tests/kernels/test_select_resources.py``
checks the built module against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "select_resources.json"
ARCHS = ("89", "90", "90a")
KERNEL = "select_cta_kernel"
# Per SM: 64 K 32-bit registers, and the shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin).
REGISTERS_PER_SM = 65536
OPTIN_BYTES = {"89": 99 * 1024, "90": 227 * 1024, "90a": 227 * 1024}
THREADS = 1024


def find_tool(name: str) -> str | None:
    """nvcc / cuobjdump / nvdisasm: PATH, the CUDA toolkit, the nvidia-cuda-cuobjdump wheel, Triton's bundle."""
    exe = shutil.which(name) or (f"/usr/local/cuda/bin/{name}" if os.access(f"/usr/local/cuda/bin/{name}", os.X_OK)
                                 else None)
    if exe:
        return exe
    import importlib.util

    for package, pattern in (("nvidia", f"*/bin/{name}"), ("triton", f"backends/nvidia/bin/{name}")):
        spec = importlib.util.find_spec(package)
        for base in (spec.submodule_search_locations or []) if spec else []:
            for candidate in sorted(Path(base).glob(pattern)):
                return str(candidate)
    return None


def _env_with_nvdisasm() -> dict:
    """cuobjdump -sass runs nvdisasm, which may live only in Triton's bundle."""
    env = dict(os.environ)
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm:
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
    return env


def _short(name: str) -> str:
    """``select_cta_kernel<u32|u64, single|cluster>`` from the mangled name."""
    match = re.search(r"select_cta_kernelI([jm])Lb([01])E", name)
    assert match, name
    return f"{KERNEL}<{'u32' if match.group(1) == 'j' else 'u64'}, {'cluster' if match.group(2) == '1' else 'single'}>"


def sass_stats(binary: str | Path, arch: str) -> dict[str, dict[str, int]]:
    """Per selection kernel of ``binary`` (a cubin or the extension) for ``sm_<arch>``: SASS counts."""
    cuobjdump = find_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    sass = subprocess.run([cuobjdump, "-sass", "-arch", f"sm_{arch}", str(binary)], capture_output=True, text=True,
                          check=True, env=_env_with_nvdisasm()).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if KERNEL not in name:
            continue
        ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body, re.M)
        heads = [op.split(".")[0] for op in ops]
        out[_short(name)] = {
            "instructions": len(ops),
            "global_loads": heads.count("LDG"),
            "local_loads": heads.count("LDL"),
            "local_stores": heads.count("STL"),
            "match": heads.count("MATCH"),
            "barriers": heads.count("BAR"),
            "calls": heads.count("CALL"),
        }
    return out


def resource_usage(binary: str | Path) -> dict[str, dict[str, dict[str, int]]]:
    """``cuobjdump --dump-resource-usage``: per SASS architecture, per selection kernel, REG / STACK / SHARED."""
    cuobjdump = find_tool("cuobjdump")
    text = subprocess.run([cuobjdump, "--dump-resource-usage", str(binary)], capture_output=True, text=True,
                          check=True).stdout
    out: dict[str, dict[str, dict[str, int]]] = {}
    arch = None
    for line in text.splitlines():
        found = re.search(r"arch = sm_(\w+)", line)
        if found:
            arch = found.group(1)
        found = re.match(r"\s*Function (\S+):", line)
        if found:
            function = found.group(1)
            continue
        found = re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:(\d+)", line)
        if found and arch and KERNEL in function:
            out.setdefault(arch, {})[_short(function)] = {"registers": int(found.group(1)),
                                                          "stack": int(found.group(2)),
                                                          "shared": int(found.group(3))}
    return out


def compile_cubin(arch: str, out_dir: Path) -> tuple[Path, dict[str, dict[str, int]]]:
    """nvcc -cubin of csrc/select_cta.cu for sm_<arch>, with ptxas' report per selection kernel."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    cubin = out_dir / f"select_cta.sm_{arch}.cubin"
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "--Werror=all-warnings",
           "-Xcompiler=-Wall,-Wextra,-Werror", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-cubin",
           "-Xptxas", "-v", "-o", str(cubin), str(ROOT / "csrc" / "select_cta.cu")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed for sm_{arch}:\n{run.stderr[-3000:]}")
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in run.stderr.splitlines():
        found = re.search(r"Compiling entry function '(\S+)'", line) or re.search(r"Function properties for (\S+)",
                                                                                   line)
        if found:
            current = _short(found.group(1)) if KERNEL in found.group(1) else None
            continue
        if current is None:
            continue
        found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if found:
            report.setdefault(current, {}).update(stack_frame=int(found.group(1)), spill_stores=int(found.group(2)),
                                                  spill_loads=int(found.group(3)))
        found = re.search(r"Used (\d+) registers", line)
        if found:
            smem = re.search(r"(\d+) bytes smem", line)
            report.setdefault(current, {}).update(registers=int(found.group(1)),
                                                  static_smem=int(smem.group(1)) if smem else 0)
    return cubin, report


def occupancy(registers: int, static_smem: int, arch: str) -> dict[str, int]:
    """CTAs of 1024 threads per SM the registers allow (the kernel is built for one: __launch_bounds__(1024, 1)),
    and the dynamic shared memory left to a CTA."""
    per_thread = max(registers, 1)
    by_registers = REGISTERS_PER_SM // (per_thread * THREADS)
    return {"ctas_per_sm": by_registers, "warps_per_sm": by_registers * THREADS // 32,
            "dynamic_smem_per_cta": OPTIN_BYTES[arch] - static_smem}


def limits(static_smem: dict[str, int]) -> dict[str, dict[str, int]]:
    """The largest row of each path, from the module's plan arithmetic (select_cta_max_n_for)."""
    from macer_kernels.cuda._ext import ext

    c = ext()
    out = {}
    for arch, clusters in (("89", 1), ("90", 1), ("90", 8)):
        avail = OPTIN_BYTES[arch] - static_smem[arch]
        out[f"sm_{arch}, cluster <= {clusters}"] = {
            "top-K fp32/fp16/bf16": c.select_cta_max_n_for(avail, False, False, clusters),
            "top-K fp64": c.select_cta_max_n_for(avail, False, True, clusters),
            "coverage": c.select_cta_max_n_for(avail, True, False, clusters),
        }
    return out


def collect() -> dict:
    nvcc = find_tool("nvcc")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    record: dict = {"nvcc": version, "kernels": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            cubin, ptxas = compile_cubin(arch, Path(tmp))
            sass = sass_stats(cubin, arch)
            entry = {}
            for kernel in sorted(ptxas):
                info = {**ptxas[kernel], **sass.get(kernel, {})}
                info["occupancy"] = occupancy(info["registers"], info["static_smem"], arch)
                entry[kernel] = info
            record["kernels"][f"sm_{arch}"] = entry
    smem = {arch: record["kernels"][f"sm_{arch}"][f"{KERNEL}<u32, single>"]["static_smem"] for arch in ("89", "90")}
    record["max_n"] = limits(smem)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the report, write nothing")
    args = parser.parse_args(argv)
    record = collect()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = "unknown"
    record = {"machine": "CPU only (compiled and disassembled; nothing ran on a GPU)", "git_sha": sha, **record}
    json.dump(record, sys.stdout, indent=1)
    print()
    if not args.no_write:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print("wrote", RECORD)


if __name__ == "__main__":
    main()
