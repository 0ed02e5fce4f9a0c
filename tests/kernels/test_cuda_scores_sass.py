"""What the scoring kernels compile to, checked on CPU from the built extension's SASS (item 6 of issue 37).

The H200 profile of the previous tile kernel (kernel-plan 1.1) found its instructions in K-load address arithmetic (a
runtime division and 8 predicated 16-bit loads beside every 128-bit load), in one scalar store per (row, key) logit
and in 64-bit index compares, not in the per-label statistics. These tests keep each of those out of the new kernels'
hot loops and keep the loops' size, registers and occupancy where docs/cuda.md records them:

* S-A (sm_89, sm_90): the tile kernel's loop holds LDGSTS (cp.async) for K, LDSM + HMMA.16816 for the dot products,
  16-byte stores for the logits, and no runtime division (I2F.U32.RP), no 16-bit global load, no scalar global store,
  no 64-bit compare; its registers leave >= 3 CTAs per SM on sm_90 and >= 2 on sm_89 at the 7B shapes, with no
  stack (no spills);
* S-B (sm_90a): HGMMA (wgmma), UTMALDG (TMA) and SYNCS (mbarrier) present, no cp.async, <= 168 registers (384
  threads, one CTA per SM), no stack.
"""

from __future__ import annotations

import re

import pytest

from benchmarks import scores_sass as ss

SO = ss.extension_path()
pytestmark = pytest.mark.skipif(SO is None or ss.tool("cuobjdump") is None or ss.tool("nvdisasm") is None,
                                reason="needs the built extension, cuobjdump and nvdisasm (Triton's bundle)")

VEC_BF16 = ss.TILE + "I13__nv_bfloat16Lb1EEEvNS0_8TileArgsE"
VEC_FP16 = ss.TILE + "I6__halfLb1EEEvNS0_8TileArgsE"
GENERIC_FP64 = ss.TILE + "IdLb0EEEvNS0_8TileArgsE"
# Recorded bounds (nvcc 13.0): the loop's static size, and registers at which the occupancy below holds.
MAX_LOOP_INSTRUCTIONS = 1700
MAX_TILE_REGS = 168


@pytest.fixture(scope="module")
def sa_sass():
    return {arch: ss.sass(SO, arch) for arch in ("sm_89", "sm_90")}


@pytest.fixture(scope="module")
def usage():
    return ss.resource_usage(SO)


def _sb_archs(usage):
    return {u.arch for u in usage if u.function.startswith(ss.SB)}


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
@pytest.mark.parametrize("kernel", [VEC_BF16, VEC_FP16])
def test_tile_kernel_hot_loop_is_tensor_cores_and_vector_traffic_only(sa_sass, arch, kernel):
    loop = ss.hot_loop(sa_sass[arch][kernel], "HMMA")
    assert loop, f"{arch}: no loop holding HMMA in {kernel}"
    ops = [t.split()[0] if not t.startswith("@") else t.split()[1] for t in loop]
    text = "\n".join(loop)
    hmma = [op for op in ops if op.startswith("HMMA.16816.F32")]
    assert len(hmma) == 16, f"{arch}: {len(hmma)} HMMA per chunk (4 k16-steps x 4 n-tiles expected)"
    assert sum(op.startswith("LDSM") for op in ops) == 12, f"{arch}: ldmatrix.x4 count"
    assert sum(op.startswith("LDGSTS.E.BYPASS.128") for op in ops) == 4, f"{arch}: cp.async 16-byte copies"
    assert sum(op == "STG.E.128" for op in ops) >= 4, f"{arch}: the logits' 16-byte stores"
    # what the old kernel spent its issue slots on
    assert "I2F.U32.RP" not in text, f"{arch}: a runtime integer division in the hot loop"
    assert not re.search(r"LDG\.E\.(U16|16)\b", text), f"{arch}: a 16-bit global load (scalar K fallback)"
    assert not re.search(r"\bSTG\.E(\.32)? ", text), f"{arch}: a scalar global store"
    assert not re.search(r"ISETP\.\w+\.\w+\.EX", text), f"{arch}: a 64-bit compare"
    assert len(loop) <= MAX_LOOP_INSTRUCTIONS, f"{arch}: {len(loop)} static instructions in the tile loop"


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_generic_kernel_is_separate_from_the_vector_one(sa_sass, arch):
    """fp64 and unaligned K take element loads in their own instantiation (LDG, no cp.async): the vectorised kernel
    never carries the fallback."""
    generic = "\n".join(t for _, t in sa_sass[arch][GENERIC_FP64])
    assert "LDGSTS" not in generic and re.search(r"LDG\.E\.64", generic), arch
    vec = "\n".join(t for _, t in sa_sass[arch][VEC_BF16])
    assert "LDGSTS" in vec


@pytest.mark.parametrize("arch,min_ctas", [("sm_89", 2), ("sm_90", 3)])
def test_tile_kernel_registers_and_occupancy(usage, arch, min_ctas):
    rows = {u.function: u for u in usage if u.arch == arch}
    for kernel in (VEC_BF16, VEC_FP16):
        u = rows[kernel]
        assert u.stack == 0 and u.local == 0, f"{arch} {kernel}: stack {u.stack}, local {u.local} (spills?)"
        assert u.regs <= MAX_TILE_REGS, f"{arch}: {u.regs} registers"
        ctas = ss.occupancy(arch, u.regs, 128, u.shared + ss.tile_dynamic_smem(2))
        assert ctas >= min_ctas, f"{arch}: {ctas} resident tile CTAs per SM at D = 128"


def test_every_scoring_kernel_is_spill_free(usage):
    for u in usage:
        if u.function.startswith((ss.TILE, ss.REDUCE, ss.STREAM, ss.SB)):
            assert u.stack == 0 and u.local == 0, (u.arch, u.function, u.stack, u.local)


def test_sb_kernel_is_wgmma_and_tma(usage):
    if "sm_90a" not in _sb_archs(usage):
        pytest.skip("built without 90a in MACER_CUDA_ARCHS")
    code = ss.sass(SO, "sm_90a")
    for name, instructions in code.items():
        if not name.startswith(ss.SB):
            continue
        text = "\n".join(t for _, t in instructions)
        assert len(re.findall(r"HGMMA\.64x32x16\.F32", text)) >= 8, name
        assert "UTMALDG.3D" in text and "SYNCS" in text, name
        assert "LDGSTS" not in text and "HMMA" not in re.sub(r"HGMMA", "", text), name
        # the 8 wgmmas of a unit are pipelined: no wait between them (ptxas serialises them, C7511, when a copy of
        # an accumulator register sits between two of them)
        starts = [m.start() for m in re.finditer("HGMMA", text)]
        assert "WARPGROUP.DEPBAR" not in text[starts[0]:starts[7]], name
        # shared memory through shared-space instructions (a generic LD/ST here was an alignment computed through an
        # integer cast of the pointer)
        assert not re.search(r"\b(LD|ST)\.E\b", text), name
        # the stage's chain (csrc/kernels/launch.cuh): the wait (ACQBULK) before any global access, and PREEXIT
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in instructions]
        waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
        accesses = [i for i, op in enumerate(ops) if re.match(r"(LDG|STG|LD|ST|ATOM|ATOMG|RED|UTMALDG)\b", op)]
        assert waits and accesses and waits[0] < accesses[0] and "PREEXIT" in ops, name
    for u in usage:
        if u.function.startswith(ss.SB):
            assert u.arch == "sm_90a", "S-B must exist only as sm_90a SASS"
            assert u.regs <= 168 and u.stack == 0, (u.regs, u.stack)
            assert ss.occupancy("sm_90a", u.regs, 384, u.shared + ss.sb_dynamic_smem(4, 0)) >= 1


def test_the_table_names_every_kernel_and_arch(usage):
    rows = ss.table(SO)
    kinds = {(r["kernel"], r["arch"]) for r in rows}
    for arch in ("sm_89", "sm_90"):
        assert ("S-A tile vec bf16", arch) in kinds and ("S-A reduce", arch) in kinds and ("stream K", arch) in kinds
    if "sm_90a" in _sb_archs(usage):
        assert ("S-B persistent bf16", "sm_90a") in kinds


def test_l2_microbenchmark_compiles_and_refuses_bad_arguments(tmp_path):
    """benchmarks/l2_setaside.cu (gpu_check.sh's first timed step) builds warning-free for sm_90 with the toolkit
    here; its argument checks run before any CUDA call."""
    import shutil
    import subprocess
    from pathlib import Path

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("nvcc not found")
    exe = tmp_path / "l2_setaside"
    src = Path(__file__).resolve().parents[2] / "benchmarks" / "l2_setaside.cu"
    subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "--Werror=all-warnings",
                    "-Xcompiler=-Wall,-Wextra,-Werror", str(src), "-o", str(exe)], check=True, capture_output=True)
    assert "usage: l2_setaside" in subprocess.run([exe, "--help"], capture_output=True, text=True).stdout
    bad = subprocess.run([exe, "--sizes", "0"], capture_output=True, text=True)
    assert bad.returncode == 1 and "--sizes must be positive MB values" in bad.stderr
