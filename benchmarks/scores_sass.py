"""The scoring kernels' machine code, read without a GPU: registers, shared memory and occupancy per architecture,
and what the hot loops contain (``tests/kernels/test_cuda_scores_sass.py`` asserts on it; docs/cuda.md holds the table).

    python -m benchmarks.scores_sass              # the table for the built extension (macer_kernels/_C*.so)

``cuobjdump --dump-resource-usage`` gives each kernel's registers, stack and static shared memory per cubin (sm_89,
sm_90, and sm_90a for S-B); ``cuobjdump -sass`` (with the ``nvdisasm`` Triton bundles) its instructions. A kernel's
hot loop is the largest loop found from its backward branches. Occupancy is the CUDA occupancy calculator's
arithmetic on those numbers for the 7B shapes (D = 128: the S-A tile kernel's dynamic shared memory is 2 query
chunks + the K ring): resident CTAs per SM = min(register file / (registers x threads, rounded to the allocation
unit), shared memory / CTA bytes, the block limit).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# SM facts the occupancy arithmetic needs (CUDA C Programming Guide, "Compute capabilities"): shared memory per SM
# usable by blocks, per-block opt-in maximum, registers per SM, max blocks and warps per SM.
SM = {
    "sm_89": {"smem_sm": 100 * 1024, "smem_block": 99 * 1024, "regs": 65536, "blocks": 24, "warps": 48},
    "sm_90": {"smem_sm": 228 * 1024, "smem_block": 227 * 1024, "regs": 65536, "blocks": 32, "warps": 64},
    "sm_90a": {"smem_sm": 228 * 1024, "smem_block": 227 * 1024, "regs": 65536, "blocks": 32, "warps": 64},
}
RESERVED_SMEM = 1024  # per block, by the runtime (sm_80+)

TILE = "_ZN5macer6scores18scores_tile_kernel"
REDUCE = "_ZN5macer6scores20scores_reduce_kernel"
STREAM = "_ZN5macer6scores15stream_k_kernel"
SB = "_ZN5macer6scores2sb16scores_sb_kernel"


def tool(name: str) -> str | None:
    """cuobjdump / nvdisasm from PATH, the `nvidia-cuda-cuobjdump` wheel, or Triton's bundle."""
    found = shutil.which(name)
    if found:
        return found
    for pkg in ("nvidia", "triton"):
        spec = importlib.util.find_spec(pkg)
        for base in (spec.submodule_search_locations or []) if spec else []:
            for candidate in sorted(Path(base).glob(f"**/bin/{name}")):
                if os.access(candidate, os.X_OK):
                    return str(candidate)
    return None


def extension_path() -> Path | None:
    spec = importlib.util.find_spec("macer_kernels._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


@dataclass
class Usage:
    function: str
    arch: str
    regs: int
    stack: int
    shared: int  # static bytes
    local: int


def resource_usage(so: Path) -> list[Usage]:
    """Every function's registers / stack / static shared memory / local memory, per cubin architecture."""
    out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(so)], capture_output=True, text=True,
                         check=True).stdout
    usages, arch = [], None
    for line in out.splitlines():
        m = re.search(r"arch = (sm_\d+a?)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m:
            usages.append(Usage(name, arch, *map(int, m.groups())))
    return usages


def sass(so: Path, arch: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled function name: [(address, instruction)]} of every cubin of `arch` in the module."""
    env = {**os.environ, "PATH": os.path.dirname(tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", "")}
    out = subprocess.run([tool("cuobjdump"), "-sass", "-arch", arch, str(so)], capture_output=True, text=True,
                         check=True, env=env).stdout
    functions = {}
    for block in re.split(r"\n\s*Function : ", out)[1:]:
        name = block.split("\n", 1)[0].strip()
        functions[name] = [(int(m.group(1), 16), m.group(2).strip())
                           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", block)]
    return functions


def loops(instructions: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """(start, end, static instructions) of every backward branch's range, largest first."""
    found = []
    for addr, text in instructions:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            found.append((start, addr, sum(1 for a, _ in instructions if start <= a <= addr)))
    return sorted(found, key=lambda x: -x[2])


def hot_loop(instructions: list[tuple[int, str]], must_contain: str) -> list[str]:
    """The instructions of the smallest loop that contains `must_contain` (e.g. the tile kernel's HMMA: its loop
    over K chunks and tiles, epilogue included)."""
    best = None
    for start, end, size in loops(instructions):
        body = [t for a, t in instructions if start <= a <= end]
        if any(must_contain in t for t in body) and (best is None or size < len(best)):
            best = body
    return best or []


def occupancy(arch: str, regs: int, threads: int, smem: int) -> int:
    """Resident CTAs per SM by registers (allocated per warp in units of 256), shared memory and the limits."""
    f = SM[arch]
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = f["regs"] // (per_warp * (threads // 32))
    by_smem = f["smem_sm"] // (smem + RESERVED_SMEM) if smem else f["blocks"]
    return min(by_regs, by_smem, f["blocks"], f["warps"] // (threads // 32))


def tile_dynamic_smem(chunks: int) -> int:
    """csrc/kernels/scores_fragment.cuh tile_smem_bytes: chunks x 32 rows + stages x 64 keys, rows of `pitch` bytes
    (the module's own constants)."""
    from macer_kernels import _C

    k = dict(_C.MODALITY_SCORES_CONSTANTS)
    return (chunks * k["row_tile"] + k["stages"] * k["tile_keys"]) * k["pitch"]


def sb_dynamic_smem(kv_heads: int, slots: int) -> int:
    """csrc/kernels/modality_scores_sm90a.cuh smem_bytes."""
    fixed = 1024 + kv_heads * 8192 + 4 * 16384 + 8 * 288 * 8 + 1024
    return fixed + slots * 8192


def table(so: Path) -> list[dict]:
    """One row per scoring kernel and architecture: registers, stack, shared memory (static + dynamic at the 7B
    shapes), resident CTAs and warps per SM."""
    rows = []
    for u in resource_usage(so):
        if u.function.startswith(TILE):
            kind = "S-A tile " + ("vec " if "Lb1" in u.function else "generic ") + _dtype(u.function)
            threads, dynamic = 128, tile_dynamic_smem(2 if "Lb1" in u.function and "If" not in u.function else 4)
        elif u.function.startswith(REDUCE):
            kind, threads, dynamic = "S-A reduce", 128, 0
        elif u.function.startswith(STREAM):
            kind, threads, dynamic = "stream K", 128, 0
        elif u.function.startswith(SB):
            kind = "S-B persistent " + _dtype(u.function)
            slots = (SM["sm_90a"]["smem_block"] - sb_dynamic_smem(4, 0)) // 8192
            threads, dynamic = 384, sb_dynamic_smem(4, slots)
        else:
            continue
        ctas = occupancy(u.arch, u.regs, threads, u.shared + dynamic)
        rows.append({"kernel": kind, "arch": u.arch, "regs": u.regs, "stack": u.stack, "local": u.local,
                     "smem_static": u.shared, "smem_dynamic_7b": dynamic, "ctas_per_sm": ctas,
                     "warps_per_sm": ctas * threads // 32})
    return rows


def _dtype(name: str) -> str:
    for key, label in (("13__nv_bfloat16", "bf16"), ("6__half", "fp16"), ("Id", "fp64"), ("If", "fp32")):
        if key in name:
            return label
    return "?"


def main() -> None:
    so = extension_path()
    if so is None or tool("cuobjdump") is None:
        raise SystemExit("needs the built extension and cuobjdump (the nvidia-cuda-cuobjdump wheel or Triton's)")
    rows = table(so)
    keys = list(rows[0])
    print("  ".join(f"{k:>15}" for k in keys))
    for r in sorted(rows, key=lambda r: (r["kernel"], r["arch"])):
        print("  ".join(f"{r[k]!s:>15}" for k in keys))


if __name__ == "__main__":
    main()
