"""Registers and stack of the Triton scoring kernel's phase 3 for sm_89 / sm_90, compiled offline (no GPU needed).

``python -m benchmarks.triton_registers`` prints, per dtype and head dimension of the 7B shapes (32 query rows per KV
head, 4 KV heads), phase 3 at the launcher's key tile (``_block_n_scores``) and at phase 1's (the tile it had
before). Triton's own pipeline compiles the kernel for a ``GPUTarget`` with the bundled ``ptxas``; the bundled
``cuobjdump --dump-resource-usage`` reads the cubin. The signature reproduces what the JIT specialises for a
contiguous launch (16-aligned pointers, ``D`` and the K strides divisible by 16, unit strides constant): without it
the K loads are not vectorised and the counts are not those of a real launch. docs/triton.md holds the table.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from macer_kernels.triton import modality_scores as ms

ROWS = 32  # 7 query heads x Lq = 4 = 28 rows per KV head, padded to the dot's power of two
HKV = 4


def compile_phase3(arch: int, dtype: str, d: int, block_n: int, num_warps: int, num_stages: int):
    """Phase 3 (recomputed logits) compiled for sm_<arch>; dtype "bf16" or "fp32"."""
    ptr = {"bf16": "*bf16", "fp32": "*fp32"}[dtype]
    sig = {"q_ptr": ptr, "k_ptr": ptr, "lab_ptr": "*i64", "pos_ptr": "*i64", "rowmax_ptr": "*fp32",
           "weight_ptr": "*fp32", "logit_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "R": "i32", "LQ": "i32",
           "D": "i32", "stride_kb": "i64", "stride_kh": "i64", "stride_kn": "i32", "stride_lb": "i32",
           "stride_ln": "constexpr", "stride_pb": "i32", "stride_pl": "constexpr", "scale_log2": "fp32",
           **dict.fromkeys(("HKV", "NUM_M", "M_PAD", "ROWS", "ROW_LOOP", "BLOCK_N", "BLOCK_D", "DOT_FP32", "STORE"),
                           "constexpr")}
    constexprs = {"stride_ln": 1, "stride_pl": 1, "HKV": HKV, "NUM_M": 8, "M_PAD": 16, "ROWS": ROWS,
                  "ROW_LOOP": False, "BLOCK_N": block_n, "BLOCK_D": max(16, triton.next_power_of_2(d)),
                  "DOT_FP32": dtype == "fp32", "STORE": False}
    names = list(sig)
    aligned = ("q_ptr", "k_ptr", "lab_ptr", "pos_ptr", "rowmax_ptr", "weight_ptr", "logit_ptr", "out_ptr", "D",
               "stride_kb", "stride_kh", "stride_kn")
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=ms._scores_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(kernel) -> tuple[int, int]:
    """(registers, stack bytes) of a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


def main() -> None:
    print("phase 3 | BLOCK_N, warps, stages | sm_89 regs / stack | sm_90 regs / stack")
    for dtype, d in (("bf16", 128), ("bf16", 256), ("fp32", 128), ("fp32", 256)):
        dot_fp32 = dtype == "fp32"
        block_d = max(16, triton.next_power_of_2(d))
        operand = 4 if dot_fp32 else 2
        warps = 8 if block_d >= 128 else 4
        # A large N: no halving of the tiles for a small grid.
        tiles = {"phase 1's tile (before)": ms._block_n(d, 0, 10**6, 1, dot_fp32),
                 "_block_n_scores (now)": ms._block_n_scores(d, 0, 10**6, 1, dot_fp32)}
        for name, block_n in tiles.items():
            stages = ms._num_stages(ROWS, block_n, block_d, operand, False, dot_fp32)
            cells = [resource_usage(compile_phase3(arch, dtype, d, block_n, warps, stages)) for arch in (89, 90)]
            print(f"{dtype} D={d} {name} | {block_n}, {warps}, {stages} | "
                  + " | ".join(f"{r} / {s}" for r, s in cells), flush=True)


if __name__ == "__main__":
    main()
