"""The radix selection kernels' SASS and resources, without a GPU (issue 37 item 6).

``benchmarks/results/select_resources.json`` records, per architecture (sm_89, sm_90, sm_90a) and kernel
instantiation, ptxas' registers, stack, spills and static shared memory, the occupancy they allow, and SASS counts
(``python -m benchmarks.select_resources`` rewrites it). These tests hold the record to what the design needs, and
the extension that ``make test`` built (sm_89 and sm_90) to the record: the same registers, stack and shared memory
(``cuobjdump --dump-resource-usage``) and the same SASS, instruction for instruction in count.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import select_replay as R

from benchmarks.select_resources import KERNEL, RECORD, find_tool, resource_usage, sass_stats

RECORDED = json.loads(RECORD.read_text())
KERNELS = [f"{KERNEL}<{key}, {mode}>" for key in ("u32", "u64") for mode in ("single", "cluster")]
OLD_ONE_CTA_KERNEL = {"instructions": 23936, "global_loads": 1740}  # the sm_90 SASS of the kernel this replaced


def _real(arch: str, kernel: str) -> bool:
    """sm_89 has no clusters: its cluster instantiations are a trap the launcher never launches."""
    return not (arch == "sm_89" and kernel.endswith("cluster>"))


def test_the_record_covers_every_architecture_and_kernel():
    assert sorted(RECORDED["kernels"]) == ["sm_89", "sm_90", "sm_90a"]
    for arch, kernels in RECORDED["kernels"].items():
        assert sorted(kernels) == sorted(KERNELS), arch
        for kernel, info in kernels.items():
            if not _real(arch, kernel):
                assert info["instructions"] < 64 and info["static_smem"] == 0, (arch, kernel)


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_90a"])
def test_selection_kernels_fit_the_instruction_cache_and_read_global_memory_only_in_the_prologue(arch):
    """The H200 profile: the previous one-CTA kernel was 23,936 instructions with 1,740 global loads (dtype-generic
    loads inlined into every loop) and 43 % of its stalls were instruction fetch. The 32-bit kernel of one CTA is a
    third of that; every global load is in a prologue loop specialised for one dtype (13 of them, unrolled) or the
    out-of-line direct rank count; the 64-bit (float64 top-K) kernels have no coverage code at all."""
    kernels = RECORDED["kernels"][arch]
    single = kernels[f"{KERNEL}<u32, single>"]
    assert single["instructions"] <= 8500 < OLD_ONE_CTA_KERNEL["instructions"] / 2.5
    assert single["global_loads"] <= 64 < OLD_ONE_CTA_KERNEL["global_loads"] / 25
    for kernel in KERNELS:
        info = kernels[kernel]
        if not _real(arch, kernel):
            continue
        assert info["instructions"] <= 13000 and info["global_loads"] <= 64, kernel
        if kernel.startswith(f"{KERNEL}<u64"):
            assert info["instructions"] <= 5000 and info["global_loads"] <= 16, kernel


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_90a"])
def test_registers_spills_shared_memory_and_occupancy(arch):
    """1024 threads, __launch_bounds__(1024, 1): at most 64 registers, one CTA (32 warps) per SM, the whole opt-in
    shared memory but ~20 KB of static state for the per-token arrays; no spills, no stack, no local memory. (The
    float64 bonus past the table is an out-of-line call; an earlier layout of the candidate sweeps spilled 28 bytes
    around it, so this is watched.)"""
    for kernel, info in RECORDED["kernels"][arch].items():
        if not _real(arch, kernel):
            continue
        assert info["registers"] <= 64 and info["occupancy"]["ctas_per_sm"] == 1, kernel
        assert info["occupancy"]["warps_per_sm"] == 32, kernel
        assert info["static_smem"] == R.STATIC_SMEM[int(arch[3:5])], kernel
        assert info["occupancy"]["dynamic_smem_per_cta"] == R.OPTIN_BYTES[int(arch[3:5])] - info["static_smem"]
        assert info["spill_stores"] == info["spill_loads"] == info["stack_frame"] == 0, kernel
        assert info["local_loads"] == info["local_stores"] == 0, kernel


def test_recorded_limits_are_the_replays():
    """The largest rows the record lists (from _C's plan) are those the replay's plan arithmetic gives."""
    for name, limits in RECORDED["max_n"].items():
        arch = int(name[3:5])
        clusters = int(name.rsplit("<= ", 1)[1])
        avail = R.OPTIN_BYTES[arch] - R.STATIC_SMEM[arch]
        assert limits == {"top-K fp32/fp16/bf16": R.max_n(False, False, avail, clusters),
                          "top-K fp64": R.max_n(False, True, avail, clusters),
                          "coverage": R.max_n(True, False, avail, clusters)}, name


def _extension() -> Path | None:
    spec = importlib.util.find_spec("macer_kernels._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


@pytest.mark.skipif(_extension() is None, reason="macer_kernels._C is not built")
def test_the_built_module_is_the_recorded_code():
    """The extension `make test` built (sm_89 and sm_90, the build's own flags) against the record of the
    standalone compile: the same registers, stack and static shared memory per kernel (sm_90 adds its 1 KB of
    reserved shared memory in the cubin's count), and the same SASS counts."""
    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not found (requirements-ci.txt's nvidia-cuda-cuobjdump; Triton's bundle)")
    so = _extension()
    usage = resource_usage(so)
    built = sorted(usage)
    assert built, "no SASS of the selection kernels in the extension"
    for arch in built:
        recorded = RECORDED["kernels"][f"sm_{arch}"]
        reserved = 1024 if arch.startswith("9") else 0
        for kernel, info in usage[arch].items():
            want = recorded[kernel]
            assert info["registers"] == want["registers"] and info["stack"] == want["stack_frame"], (arch, kernel)
            assert info["shared"] == (want["static_smem"] + reserved if want["static_smem"] else 0), (arch, kernel)
        sass = sass_stats(so, arch)
        for kernel, counts in sass.items():
            assert counts == {name: recorded[kernel][name] for name in counts}, (arch, kernel)


def test_the_sanitizer_driver_runs_on_cpu():
    """benchmarks/sanitize_select.py (what gpu_check.sh runs under racecheck and synccheck) builds every case -- the
    split sizes one above sm_90's single-CTA thresholds, the clusters, the select's ends, the stage rows -- and runs
    it on the torch backend here; on a GPU each case is the CUDA kernel against that backend."""
    import subprocess
    import sys

    from benchmarks import sanitize_select

    assert sanitize_select.CPU_SPLIT_SIZES == {"coverage": R.SINGLE_COVERAGE_MAX + 1, "top-K": R.SINGLE_TOPK_MAX + 1}
    run = subprocess.run([sys.executable, "-m", "benchmarks.sanitize_select", "--device", "cpu"], capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "sanitize pass select" in run.stdout
