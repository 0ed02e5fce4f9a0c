"""The CUDA extension on a machine without a GPU: built (or buildable), the right architectures inside, importable,
torch-free, and reported unavailable with a clear reason instead of crashing.

`make test` builds the extension once, during the editable install (setup.py drives CMake when nvcc is present);
these tests inspect that build. Only if it is missing and nvcc is here (an install with MACER_NO_CUDA=1) does the
`extension_path` fixture build it into a temporary directory (about a minute on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

import macer_kernels
from macer_kernels.cuda import _ext, compact, library, select
from macer_kernels.cuda import modality_scores as cuda_scores

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = shutil.which("nvidia-smi") is not None
EXPECTED_ARCHS = sorted(int(a) for a in os.environ.get("MACER_CUDA_ARCHS", "89;90").replace(",", ";").split(";"))
NOT_BUILT = "extension not built (installed without nvcc or with MACER_NO_CUDA=1)"


def _find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _find_cuobjdump() -> str | None:
    """cuobjdump from PATH, else from the `nvidia-cuda-cuobjdump` wheel (requirements-ci.txt)."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(base).glob("*/bin/cuobjdump")):
            return str(candidate)
    return None


@pytest.fixture(scope="session")
def extension_path(tmp_path_factory) -> Path:
    """The compiled module: the installed one, else a fresh CMake build (skipped only where nothing can build it)."""
    spec = importlib.util.find_spec("macer_kernels._C")
    if spec is not None and spec.origin:
        return Path(spec.origin)
    nvcc = _find_nvcc()
    if nvcc is None or shutil.which("cmake") is None:
        pytest.skip("the extension is not installed and nvcc/cmake are missing, so it cannot be built here")
    build = tmp_path_factory.mktemp("cmake")
    out = build / "out"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DCMAKE_CUDA_COMPILER={nvcc}",
                    f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
                    f"-DMACER_CUDA_ARCHS={';'.join(map(str, EXPECTED_ARCHS))}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--parallel"], check=True, capture_output=True)
    return out / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))


def _load_by_path(path: Path) -> str:
    """Python code that imports the module from `path` in a fresh interpreter."""
    return ("import importlib.util, json\n"
            f"spec = importlib.util.spec_from_file_location('macer_kernels._C', {str(path)!r})\n"
            "C = importlib.util.module_from_spec(spec); spec.loader.exec_module(C)\n")


def test_extension_is_built(extension_path):
    assert extension_path.is_file()
    assert extension_path.name.endswith(sysconfig.get_config_var("EXT_SUFFIX"))


def test_shared_object_has_sass_for_each_arch_and_ptx_for_the_highest(extension_path):
    cuobjdump = _find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump, pinned in requirements-ci.txt)")
    elf = subprocess.run([cuobjdump, "--list-elf", str(extension_path)], capture_output=True, text=True, check=True)
    ptx = subprocess.run([cuobjdump, "--list-ptx", str(extension_path)], capture_output=True, text=True, check=True)
    assert sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.cubin", elf.stdout)}) == EXPECTED_ARCHS, elf.stdout
    assert {int(a) for a in re.findall(r"\.sm_(\d+)\.ptx", ptx.stdout)} == {max(EXPECTED_ARCHS)}, ptx.stdout


def test_module_links_neither_libtorch_nor_a_shared_cuda_runtime(extension_path):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found")
    dynamic = subprocess.run([readelf, "-d", str(extension_path)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert needed, dynamic
    assert not [lib for lib in needed if re.match(r"lib(torch|c10|cudart|cuda\.)", lib)], needed


def test_module_imports_and_reports_without_gpu(extension_path):
    code = _load_by_path(extension_path) + (
        "print(json.dumps({'report': C.device_report(), 'archs': C.compiled_archs(), 'ptx': C.ptx_arch()}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["archs"] == EXPECTED_ARCHS and info["ptx"] == max(EXPECTED_ARCHS)
    if not HAS_GPU:
        assert info["report"]["count"] == 0
        assert info["report"]["error"].startswith("cuda"), info["report"]


@pytest.mark.skipif(HAS_GPU, reason="checks the report of a machine without a GPU")
def test_cuda_backend_is_unavailable_with_a_clear_reason(monkeypatch):
    reason = macer_kernels.backend_status()["cuda"]
    expected = NOT_BUILT if _ext.IMPORT_ERROR is not None else "no CUDA device/driver: cuda"
    assert reason is not None and reason.startswith(expected), reason
    assert "cuda" not in macer_kernels.available_backends()
    with pytest.raises(RuntimeError, match=re.escape(f"backend 'cuda' is not available: {reason}")):
        with macer_kernels.use_backend("cuda"):
            pass
    monkeypatch.setenv("MACER_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match=re.escape(f"topk_indices: backend 'cuda' is not available: {reason}")):
        macer_kernels.topk_indices(torch.rand(5), 2)


@pytest.mark.parametrize(("error", "expected"), [
    ("ModuleNotFoundError('No module named macer_kernels._C')", NOT_BUILT),
    ("ImportError('undefined symbol: cudaFoo')", "extension failed to import: undefined symbol: cudaFoo"),
])
def test_unavailable_reason_without_a_working_extension(error, expected):
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == 'macer_kernels._C': raise {error}\n"
        "sys.meta_path.insert(0, Block())\n"
        "import macer_kernels\n"
        "print(macer_kernels.backend_status()['cuda'])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected


def test_pure_python_wheel_without_cuda(tmp_path):
    env = {**os.environ, "MACER_NO_CUDA": "1"}
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    (wheel,) = tmp_path.glob("macer_kernels-*.whl")
    assert "-py3-none-any.whl" in wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "macer_kernels/cuda/__init__.py" in names and "macer/__init__.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))]



@pytest.mark.skipif(os.environ.get("MACER_NO_CUDA") == "1", reason="MACER_NO_CUDA=1")
def test_cuda_wheel_holds_the_extension_for_each_arch(tmp_path):
    """What `make wheel` runs; the CMake build tree of the editable install is reused, so this only relinks."""
    if _find_nvcc() is None or shutil.which("cmake") is None:
        pytest.skip("nvcc/cmake not found: the wheel would be pure Python")
    env = {**os.environ, "MACER_CUDA_ARCHS": ";".join(map(str, EXPECTED_ARCHS))}
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (wheel,) = tmp_path.glob(f"macer_kernels-*-{tag}-{tag}-*.whl")
    so_name = "macer_kernels/_C" + sysconfig.get_config_var("EXT_SUFFIX")
    with zipfile.ZipFile(wheel) as zf:
        assert so_name in zf.namelist()
        so_path = tmp_path / "_C.so"
        so_path.write_bytes(zf.read(so_name))
    cuobjdump = _find_cuobjdump()
    if cuobjdump is not None:
        elf = subprocess.run([cuobjdump, "--list-elf", str(so_path)], capture_output=True, text=True, check=True)
        assert sorted({int(a) for a in re.findall(r"\.sm_(\d+)\.cubin", elf.stdout)}) == EXPECTED_ARCHS

# --- errors raised inside the module: ValueError for arguments, RuntimeError naming the op and CUDA's error ----------

needs_module = pytest.mark.skipif(_ext.IMPORT_ERROR is not None, reason="macer_kernels._C is not installed")
SCORES_ARGS = dict(sizes=(1, 4, 2, 64, 2, 16), q_stride=(512, 128, 64, 1), k_stride=(2048, 1024, 64),
                   mod_stride=(16, 1), pos_stride=(2, 1))


def _scores_call(**overrides):
    a = {**SCORES_ARGS, "q_dtype": 2, "modality_dtype": 8, "positions_dtype": 8, **overrides}
    _ext.ext().modality_scores(0, 0, 0, 0, 0, 0, a["q_dtype"], a["modality_dtype"], a["positions_dtype"], a["sizes"],
                               a["q_stride"], a["k_stride"], a["mod_stride"], a["pos_stride"], 0.1, 1e-6, 0, 0)


@needs_module
@pytest.mark.parametrize(("overrides", "message"), [
    ({"sizes": (1, 4, 2, 300, 2, 16)}, "head dimension D must be in [1, 256], got 300"),
    ({"sizes": (1, 4, 2, 64, 3, 16)}, "Hq must be a positive multiple of Hkv"),
    ({"sizes": (1, 0, 2, 64, 2, 16)}, "Hq must be a positive multiple of Hkv"),  # else a 0-block combine launch
    ({"sizes": (70000, 4, 2, 64, 2, 16)}, "B and Hkv must be at most 65535 (CUDA grid limits)"),
    ({"sizes": (1, 4, 0, 64, 2, 16)}, "Lq must be >= 1"),
    ({"q_dtype": 8}, "query/key dtype code must be float32, float16, bfloat16 or float64, got 8"),
    ({"modality_dtype": 0}, "modality and query_positions dtype codes must be integer codes"),
])
def test_module_rejects_bad_scores_arguments(overrides, message):
    with pytest.raises(ValueError, match=re.escape("macer_kernels.modality_scores: " + message)):
        _scores_call(**overrides)


@needs_module
def test_module_rejects_bad_selection_and_compact_arguments():
    C = _ext.ext()
    with pytest.raises(ValueError, match=re.escape("macer_kernels.select_workspace_bytes: n must be in [0, ")):
        C.select_workspace_bytes(-1, 0)
    with pytest.raises(ValueError, match=re.escape("macer_kernels.topk_indices: k must be in [0, n]")):
        C.topk_indices(0, 0, 4, 1, 5, 0, 0, 1 << 20, 0, 0)
    with pytest.raises(ValueError, match=r"macer_kernels\.topk_indices: workspace too small"):
        C.topk_indices(0, 0, 4, 1, 2, 0, 0, 16, 0, 0)
    with pytest.raises(ValueError, match="topk_indices: scores dtype code must be a floating code"):
        C.topk_indices(0, 8, 4, 1, 2, 0, 0, 1 << 20, 0, 0)
    with pytest.raises(ValueError, match=re.escape("macer_kernels.coverage_select: coverage_weight must be >= 0")):
        C.coverage_select(0, 0, 4, 1, 0, 8, 1, 2, -1.0, 0, 0, 1 << 20, 0, 0)
    with pytest.raises(ValueError, match="coverage_select: chunk_ids dtype code must be an integer code"):
        C.coverage_select(0, 0, 4, 1, 0, 0, 1, 2, 1.0, 0, 0, 1 << 20, 0, 0)
    with pytest.raises(ValueError, match=re.escape("compact: unit_bytes must be 1, 2, 4, 8 or 16, got 3")):
        C.compact_many([(0, 0, 1, 1, 3, 0, 3, 3)], 0, 1, 0, 0)
    with pytest.raises(ValueError, match=re.escape("macer_kernels.compact: outer and row_units must be >= 0")):
        C.compact_many([(0, 0, -1, 1, 4, 0, 4, 4)], 0, 1, 0, 0)


@needs_module
@pytest.mark.skipif(HAS_GPU, reason="provokes CUDA errors by having no driver")
@pytest.mark.parametrize("op", ["modality_scores", "topk_indices", "coverage_select", "compact",
                                "select_workspace_bytes"])
def test_cuda_errors_become_runtime_errors_naming_the_op(op):
    C = _ext.ext()
    calls = {
        "modality_scores": lambda: _scores_call(),
        "topk_indices": lambda: C.topk_indices(0, 0, 4, 1, 2, 0, 0, 1 << 20, 0, 0),
        "coverage_select": lambda: C.coverage_select(0, 0, 4, 1, 0, 8, 1, 2, 1.0, 0, 0, 1 << 20, 0, 0),
        "compact": lambda: C.compact_many([(0, 0, 1, 1, 4, 0, 4, 4)], 0, 1, 0, 0),
        "select_workspace_bytes": lambda: C.select_workspace_bytes(10, 0),
    }
    with pytest.raises(RuntimeError, match=rf"^macer_kernels\.{op}: cudaGetDevice failed: cuda\w+ \(.+\)$"):
        calls[op]()


# --- the Python wrappers' own checks (reached on CPU with CPU tensors, or with fake CUDA tensors) --------------------

def _fake_cuda(*shapes_dtypes):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in shapes_dtypes]


@needs_module
def test_wrappers_reject_what_the_kernels_cannot_take():
    q, k = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    m, p = torch.ones(1, 4, dtype=torch.long), torch.full((1, 1), 3)
    with pytest.raises(TypeError, match=re.escape("modality_scores (cuda): query and key must share one dtype")):
        cuda_scores.modality_scores_cuda(q, k, m, p, 0.1, 1e-6)
    with pytest.raises(ValueError, match=re.escape("(cuda): head dimension D must be in [1, 256], got 300")):
        cuda_scores.modality_scores_cuda(torch.zeros(1, 1, 1, 300), torch.zeros(1, 1, 4, 300), m, p, 0.1, 0.0)
    with pytest.raises(ValueError, match=re.escape("B and Hkv must be at most 65535 (CUDA grid limits), got B=65536")):
        big = torch.zeros(65536, 1, 1, 1)
        labels = torch.ones(65536, 1, dtype=torch.long)
        cuda_scores.modality_scores_cuda(big, big, labels, labels - 1, 0.1, 0.0)
    with pytest.raises(ValueError, match=re.escape("modality_scores (cuda): key must have stride(-1) == 1")):
        cuda_scores.modality_scores_cuda(q, torch.zeros(1, 1, 4, 16)[..., ::2], m, p, 0.1, 1e-6)
    with pytest.raises(TypeError, match=re.escape("modality_scores (cuda): modality has dtype torch.uint16")):
        cuda_scores.modality_scores_cuda(q, q.new_zeros(1, 1, 4, 8), m.to(torch.uint16), p, 0.1, 1e-6)
    with pytest.raises(ValueError, match=re.escape("(cuda): query must be a CUDA tensor, got device cpu")):
        cuda_scores.modality_scores_cuda(q, q.new_zeros(1, 1, 4, 8), m, p, 0.1, 1e-6)

    with pytest.raises(TypeError, match=re.escape("topk_indices (cuda): scores must be float32, float16, bfloat16")):
        select.topk_indices_cuda(torch.zeros(4, dtype=torch.float8_e4m3fn), 2)
    with pytest.raises(ValueError, match=re.escape(f"the number of scores must be in [0, {select.MAX_SCORES}]")):
        select.topk_indices_cuda(torch.zeros(1).expand(select.MAX_SCORES + 1), 2)
    with pytest.raises(ValueError, match=re.escape("topk_indices (cuda): scores must be a CUDA tensor")):
        select.topk_indices_cuda(torch.zeros(4), 2)
    scores, chunks_cpu = torch.zeros(4), torch.zeros(4, dtype=torch.long)
    (scores_cuda,) = _fake_cuda(((4,), torch.float32, "cuda"))
    with pytest.raises(ValueError, match=re.escape("coverage_select (cuda): chunk_ids must be a CUDA tensor")):
        select.coverage_select_cuda(scores_cuda, chunks_cpu, 2, 1.0)
    with pytest.raises(ValueError, match=re.escape("coverage_select (cuda): scores must be a CUDA tensor")):
        select.coverage_select_cuda(scores, chunks_cpu, 2, 1.0)

    hidden_cuda, keep_cuda = _fake_cuda(((1, 4, 8), torch.float32, "cuda"), ((2,), torch.long, "cuda"))
    with pytest.raises(ValueError, match=re.escape("compact (cuda): tensors[0] must be a CUDA tensor, got device cpu")):
        compact.compact_cuda(torch.zeros(1, 4, 8), keep_cuda, 1)
    with pytest.raises(ValueError, match=re.escape("compact (cuda): keep must be a CUDA tensor, got device cpu")):
        compact.compact_cuda(hidden_cuda, torch.tensor([0, 2]), 1)
    with pytest.raises(RuntimeError, match=re.escape("macer_kernels._C is not available: boom")):
        saved = _ext._ext_module, _ext.IMPORT_ERROR
        try:
            _ext._ext_module, _ext.IMPORT_ERROR = None, ImportError("boom")
            _ext.ext()
        finally:
            _ext._ext_module, _ext.IMPORT_ERROR = saved


# --- compact's layout descriptor, checked on CPU by replaying the kernel's address arithmetic ------------------------

def _replay_gather(x: torch.Tensor, spec: tuple, keep: torch.Tensor) -> torch.Tensor:
    """What compact_kernel writes for one descriptor: unit i of the output comes from
    src + o * outer_stride + keep[j] * seq_stride + u * unit_stride (bytes)."""
    _, _, outer, row_units, unit, outer_stride, seq_stride, unit_stride = spec
    storage = x.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    base = x.data_ptr() - storage.data_ptr()
    o = torch.arange(outer)[:, None, None, None]
    j = keep[None, :, None, None]
    u = torch.arange(row_units)[None, None, :, None]
    b = torch.arange(unit)[None, None, None, :]
    offsets = base + o * outer_stride + j * seq_stride + u * unit_stride + b
    return raw[offsets.reshape(-1)]


LAYOUTS = {
    "hidden bf16 [B,N,H]": (lambda: torch.randn(2, 37, 64).to(torch.bfloat16), 1, 16),
    "cos fp32 [B,N,D]": (lambda: torch.randn(1, 37, 80), -2, 16),
    "positions int64 [3,B,N]": (lambda: torch.arange(3 * 2 * 37).view(3, 2, 37), 2, 8),
    "odd fp16 rows [N,7]": (lambda: torch.randn(37, 7).half(), 0, 2),
    "transposed [B,H,N]->[B,N,H]": (lambda: torch.randn(2, 6, 37).transpose(1, 2), 1, 4),
    "offset view": (lambda: torch.randn(2, 38, 8)[:, 1:, 1:5], 1, 4),
    "1-D": (lambda: torch.randn(37), 0, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compact_descriptor_addresses_the_kept_rows(layout):
    make, dim, expected_unit = LAYOUTS[layout]
    x = make()
    dim = dim % x.dim()
    keep = torch.tensor([0, 3, 4, 20, 36])
    out = x.index_select(dim, keep).contiguous()
    spec = compact._spec(x, dim, out)
    assert spec[4] == expected_unit
    assert torch.equal(_replay_gather(x, spec, keep), out.view(torch.uint8).reshape(-1))


def test_compact_many_keeps_its_contiguous_copies_alive_through_the_launch(monkeypatch):
    """A layout that must be copied to contiguous memory first: the copy must stay alive until the launch. Freed
    earlier, the caching allocator hands its block to the next output of the same size, and the one launch then
    reads a source from memory it writes."""
    import weakref

    copies, alive_at_launch = [], []

    class FakeModule:
        MAX_COMPACT_TENSORS = 8

        def compact_many(self, specs, keep_ptr, k, device, stream):
            alive_at_launch.extend(ref() is not None for ref in copies)

    contiguous = torch.Tensor.contiguous

    def recording_contiguous(self, *args, **kwargs):
        out = contiguous(self, *args, **kwargs)
        if out.data_ptr() != self.data_ptr():
            copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(compact, "ext", FakeModule)
    monkeypatch.setattr(compact, "check_cuda_tensor", lambda *args: None)
    monkeypatch.setattr(compact, "launch_args", lambda t: (0, 0))
    monkeypatch.setattr(torch.Tensor, "contiguous", recording_contiguous)
    tangled = torch.randn(4, 16, 3, 2).transpose(2, 3)  # dims after the sequence dim do not flatten to one stride
    compact.compact_many_cuda([tangled, torch.randn(4, 16, 2, 3)], torch.arange(16), [1, 1])
    assert len(copies) == 1 and alive_at_launch == [True]


# --- torch.library: the fake implementations let a graph be traced without running a kernel ------------------------

def test_custom_ops_trace_with_fake_tensors():
    from torch.fx.experimental.proxy_tensor import make_fx

    def readout(q, k, m, p, c, hidden, cos, positions):
        s = torch.ops.macer_cuda.modality_scores(q, k, m, p, 0.125, 1e-6).squeeze(0)
        audio = torch.ops.macer_cuda.topk_indices(s, 3)
        video = torch.ops.macer_cuda.coverage_select(s, c, 5, 0.5)
        keep = torch.cat([audio, video])
        return [torch.ops.macer_cuda.compact(hidden, keep, 1),
                *torch.ops.macer_cuda.compact_many([cos, positions], keep, [-2, 2])]

    args = _fake_cuda(((1, 4, 2, 64), torch.bfloat16, "cuda"), ((1, 2, 40, 64), torch.bfloat16, "cuda"),
                      ((1, 40), torch.long, "cuda"), ((1, 2), torch.long, "cuda"), ((40,), torch.int32, "cuda"),
                      ((1, 40, 32), torch.bfloat16, "cuda"), ((1, 40, 64), torch.float32, "cuda"),
                      ((3, 1, 40), torch.long, "cuda"))
    graph = make_fx(readout, tracing_mode="fake")(*args)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {f"{library.NAMESPACE}.{op}.default" for op in
            ("modality_scores", "topk_indices", "coverage_select", "compact", "compact_many")} <= targets
    (output,) = [node for node in graph.graph.nodes if node.op == "output"]
    shapes = [tuple(value.meta["val"].shape) for value in output.args[0]]
    assert shapes == [(1, 8, 32), (1, 8, 64), (3, 1, 8)]


# --- the readout benchmark's CPU smoke mode ---------------------------------------------------------------------------

def test_readout_benchmark_quick_mode_runs_and_writes_nothing(capsys, monkeypatch, tmp_path):
    from benchmarks import bench_readout, common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    bench_readout.main(["--quick"])
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["provider", "tokens", "kept", "median_us", "wall_us", "launches", "syncs",
                                             "d2h", "kernel_us", "speedup", "exact"]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert {"naive", "torch"} <= set(rows) and all(r[-1] == "True" for r in rows.values())
    assert not list(tmp_path.iterdir())
