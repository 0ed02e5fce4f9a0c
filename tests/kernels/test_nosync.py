"""No public op synchronises with the host on CUDA tensors: proved on CPU, and checked on a GPU where one is present.

A GPU is not needed to see a synchronisation coming back. Every way host code can wait for the GPU reads tensor
values on the host, so each public op's host code runs here with tensors whose values cannot or may not be read:

* PyTorch path: the op on ``meta`` tensors with the ``torch`` backend forced. Meta tensors take the code path of
  CUDA tensors (``values_checked`` is False for both, and the PyTorch implementations are device-generic), and have
  no values: ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``, and aten kernels that need values
  (``one_hot`` without ``num_classes``) all raise.
* CUDA wrappers (``macer_kernels/cuda``): the same meta tensors against a recording stand-in for the compiled
  module ``_C``, so the wrappers' whole host path up to the launch runs.
* Triton wrappers (``macer_kernels/triton``): the real kernels in the interpreter on CPU tensors, with CPU tensors
  treated as device tensors by the checks (``_validate.HOST_DEVICE_TYPES`` emptied).

All three run under ``sync_guard.no_host_reads()``, which raises when ``macer_kernels`` code reads values on the
host. They fail if a synchronisation is added. Tried once each (then removed): ``int(scores.max())`` in the PyTorch
``topk_indices``, ``keep.max().item()`` in place of ``values_checked(keep)`` in ``compact``'s checks,
``one_hot(labels, int(labels.max()) + 1)`` back in the PyTorch scoring path, and ``int(scores.argmax())`` in the
CUDA wrapper ``topk_indices_cuda``: 13 tests failed, each with ``HostRead`` naming the added line.
``test_an_added_sync_is_caught`` keeps such a case (and one inside an aten kernel) as a test.

Validation mode (``macer_kernels.validation()``) turns the value checks on for device tensors: the tests below show
it reads values back (so the guard sees it) and raises the CPU errors, with the same messages.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading

import pytest
import torch
from binding_args import bind, declared
from sync_guard import HostRead, no_host_reads

import macer_kernels as mk
from macer_kernels import _validate, backend

# ---- inputs: small valid CPU tensors for every public op ----------------------------------------------------------


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 24
    keep = torch.sort(torch.randperm(n, generator=g)[:10]).values
    return {
        "q": torch.randn(2, 4, 2, 8, generator=g),
        "k": torch.randn(2, 2, n, 8, generator=g),
        "k_bnhd": torch.randn(2, n, 2, 8, generator=g).transpose(1, 2),  # a FlashAttention cache, read via strides
        "labels": torch.randint(0, 3, (2, n), generator=g),
        "positions": torch.tensor([[15, 23], [9, 20]]),
        "scores": torch.rand(30, generator=g),
        "chunks": torch.arange(30) // 4,
        "x": torch.randn(2, n, 6, generator=g),
        "cos": torch.randn(2, n, 8, generator=g),
        "pos_ids": torch.arange(n).expand(3, 2, n),
        "keep": keep,
        "t_float": torch.arange(30, dtype=torch.float32) * 0.5,
        "t_int": torch.arange(30) * 3,
        # a stage's labels with the counts its modalities say (6 of label 1, 10 of label 2 per sample)
        "stage_labels": torch.tensor([0] * 8 + [1] * 6 + [2] * 10).expand(2, n).contiguous(),
        "stage_chunks": (torch.arange(n) // 4).expand(2, n).contiguous(),
    }


def _prepared_stage(a: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``prepare_stage`` then one call: the prepared stage's host path (the CUDA chain itself, whose launch reads
    nothing, is tested against a recording module in test_prepared_stage.py)."""
    from macer_kernels.prepared import prepare_stage

    mods = [mk.StageModality(1, 6, 2), mk.StageModality(2, 10, 3, coverage_weight=0.2)]
    stage = prepare_stage(a["q"], a["k"], a["stage_labels"], mods, chunk_ids=a["stage_chunks"],
                          gather=[a["stage_labels"], a["x"]], gather_dims=[1, 1])
    return list(stage(a["q"], a["k"], a["stage_labels"], a["stage_chunks"], [a["stage_labels"], a["x"]]))


# op -> (call on the inputs, expected output shape(s), whether it has value checks)
OPS = {
    "modality_scores": (lambda a: mk.modality_scores(a["q"], a["k"], a["labels"]), [(2, 24)], True),
    "modality_scores(positions, bnhd)": (
        lambda a: mk.modality_scores(a["q"], a["k_bnhd"], a["labels"], a["positions"], eps=0.0), [(2, 24)], True),
    "topk_indices": (lambda a: mk.topk_indices(a["scores"], 7), [(7,)], True),
    "coverage_select": (lambda a: mk.coverage_select(a["scores"], a["chunks"], 7, 0.2), [(7,)], True),
    "coverage_select(weight 0)": (lambda a: mk.coverage_select(a["scores"], a["chunks"], 7, 0.0), [(7,)], True),
    "compact": (lambda a: mk.compact(a["x"], a["keep"], 1), [(2, 10, 6)], True),
    "compact_many": (lambda a: mk.compact_many([a["x"], a["cos"], a["pos_ids"]], a["keep"], [1, -2, 2]),
                     [(2, 10, 6), (2, 10, 8), (3, 2, 10)], True),
    "prepared_stage": (_prepared_stage, [(2, 13), (2,), (2, 13), (2, 13, 6)], True),
    "temporal_chunks(float)": (lambda a: mk.temporal_chunks(a["t_float"], 4), [(30,)], True),
    "temporal_chunks(int)": (lambda a: mk.temporal_chunks(a["t_int"], 4), [(30,)], False),
}


def _shapes(out) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in (out if isinstance(out, list) else [out])]


def _devices(out) -> set[str]:
    return {t.device.type for t in (out if isinstance(out, list) else [out])}


def _on(device: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # .to() keeps the strides of the transposed cache view.
    return {name: t.to(device) for name, t in inputs.items()}


# ---- the switch itself --------------------------------------------------------------------------------------------


def test_values_checked_on_cpu_always_on_devices_only_in_validation_mode(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.delenv("MACER_VALIDATE", raising=False)
    monkeypatch.setattr(_validate, "_process_setting", None)
    monkeypatch.setattr(_validate, "_env_setting", None)
    with FakeTensorMode():
        fake_cuda = torch.empty(3, device="cuda")  # a CUDA tensor's metadata, on a CPU-only build
    cpu, meta = torch.empty(3), torch.empty(3, device="meta")
    with mk.validation(False):
        assert _validate.values_checked(cpu)
    assert not _validate.values_checked(fake_cuda) and not _validate.values_checked(meta)
    with mk.validation():
        assert _validate.values_checked(fake_cuda) and _validate.values_checked(meta)
        with mk.validation(False):  # the innermost block wins
            assert not _validate.values_checked(fake_cuda)
        assert mk.validation_enabled()
    assert not mk.validation_enabled()
    monkeypatch.setenv("MACER_VALIDATE", "1")
    assert not mk.validation_enabled()  # the environment is read once, not on every call
    mk.set_validation(None)  # ... and again after set_validation(None)
    assert mk.validation_enabled() and _validate.values_checked(fake_cuda)
    mk.set_validation(False)  # the process setting beats the environment
    assert not mk.validation_enabled()
    with mk.validation():  # a block beats the process setting
        assert mk.validation_enabled()
    mk.set_validation(True)
    seen = []
    with mk.validation(False):
        worker = threading.Thread(target=lambda: seen.append(mk.validation_enabled()))
        worker.start()
        worker.join()
    assert seen == [True]  # blocks are per thread; the process setting is shared
    monkeypatch.setenv("MACER_VALIDATE", "maybe")
    mk.set_validation(None)
    with pytest.raises(ValueError, match="MACER_VALIDATE must be 0 or 1"):
        mk.validation_enabled()
    with pytest.raises(ValueError, match="MACER_VALIDATE must be 0 or 1"):  # a bad value is not cached
        mk.validation_enabled()
    monkeypatch.setenv("MACER_VALIDATE", "off")
    assert not mk.validation_enabled()
    with pytest.raises(TypeError, match="enabled must be True or False"):
        with mk.validation(1):
            pass
    with pytest.raises(TypeError, match="enabled must be True, False or None"):
        mk.set_validation("yes")


# ---- the PyTorch path on device (meta) tensors ----------------------------------------------------------------------


@pytest.fixture
def validation_off(monkeypatch):
    """Validation off whatever the environment or conftest says (the default of a serving process)."""
    monkeypatch.delenv("MACER_VALIDATE", raising=False)
    with mk.validation(False):
        yield


@pytest.mark.parametrize("op", list(OPS))
def test_torch_path_reads_no_device_values(op, validation_off):
    call, shapes, _ = OPS[op]
    args = _on("meta", _inputs())
    with mk.use_backend("torch"), no_host_reads():
        out = call(args)
    assert _shapes(out) == shapes and _devices(out) == {"meta"}


@pytest.mark.parametrize("op", [name for name, (_, _, checked) in OPS.items() if checked])
def test_validation_mode_reads_device_values_back(op):
    call, _, _ = OPS[op]
    args = _on("meta", _inputs())
    with mk.use_backend("torch"), mk.validation(), no_host_reads(), pytest.raises(HostRead, match="macer_kernels"):
        call(args)


def test_an_added_sync_is_caught(monkeypatch, validation_off):
    """The guard and the meta tensors catch a synchronisation added to an op: a Python read (``int(t)``) and one
    inside an aten kernel (``one_hot`` without ``num_classes`` reads the largest label)."""
    args = _on("meta", _inputs())
    # The PyTorch top-k with one added line, compiled as code of macer_kernels.select (the guard only blames
    # macer_kernels code; the test's own reads are allowed).
    namespace = {"__name__": "macer_kernels.select", "topk": backend._REGISTRY["topk_indices"]["torch"]}
    source = ("def topk_with_a_sync(scores, k):\n"
              "    largest = int(scores.argmax())  # the kind of line that must never come back\n"
              "    return topk(scores, k)\n")
    exec(compile(source, "macer_kernels/select.py (with an added sync)", "exec"), namespace)
    monkeypatch.setitem(backend._REGISTRY["topk_indices"], "torch", namespace["topk_with_a_sync"])
    with mk.use_backend("torch"):
        with no_host_reads(), pytest.raises(HostRead, match=r"Tensor.__int__ called from .*with an added sync.*:2"):
            mk.topk_indices(args["scores"], 3)
        with pytest.raises(RuntimeError, match="meta tensors"):  # without the guard: the meta tensor itself
            mk.topk_indices(args["scores"], 3)
    with pytest.raises(RuntimeError, match="meta tensors"):
        torch.nn.functional.one_hot(args["labels"])
    assert torch.nn.functional.one_hot(args["labels"], mk.MAX_MODALITIES + 1).device.type == "meta"


# ---- validation mode on device tensors raises the CPU errors ------------------------------------------------------

BAD_VALUES = {
    "label 9": (lambda a: mk.modality_scores(a["q"], a["k"], a["labels"] + 7), "modality labels must be in [-1, 8]"),
    "label -2": (lambda a: mk.modality_scores(a["q"], a["k"], a["labels"] - 2), "modality labels must be in [-1, 8]"),
    "position N": (lambda a: mk.modality_scores(a["q"], a["k"], a["labels"], a["positions"] + 1),
                   "query_positions must be in [0, N-1=23]"),
    "position -1": (lambda a: mk.modality_scores(a["q"], a["k"], a["labels"], a["positions"] - 10),
                    "query_positions must be in [0, N-1=23]"),
    "NaN top-k score": (lambda a: mk.topk_indices(a["scores"].clone().index_fill_(0, torch.tensor([3]), torch.nan),
                                                  2), "scores contains NaN"),
    "NaN coverage score": (lambda a: mk.coverage_select(a["scores"] * torch.nan, a["chunks"], 2, 0.2),
                           "scores contains NaN"),
    "negative chunk id": (lambda a: mk.coverage_select(a["scores"], a["chunks"] - 1, 2, 0.2),
                          "chunk_ids must be non-negative"),
    "keep unsorted": (lambda a: mk.compact(a["x"], a["keep"].flip(0), 1), "keep must be strictly increasing"),
    "keep repeated": (lambda a: mk.compact_many([a["x"]], a["keep"][[0, 0, 1]], [1]),
                      "keep must be strictly increasing"),
    "keep out of range": (lambda a: mk.compact(a["x"], a["keep"] + 20, 1), "keep must hold indices in [0, 23]"),
    "temporal inf": (lambda a: mk.temporal_chunks(a["t_float"] / 0.0, 4), "temporal_positions must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_validation_mode_catches_bad_values_on_device_tensors(case, monkeypatch, validation_off):
    """CPU tensors treated as device tensors (``HOST_DEVICE_TYPES`` emptied): the value checks run only in validation
    mode, with the CPU messages; without it the op does not check (it may fail later, in its own way)."""
    call, message = BAD_VALUES[case]
    monkeypatch.setattr(_validate, "HOST_DEVICE_TYPES", ())
    args = _inputs()
    with mk.use_backend("torch"):
        with mk.validation(), pytest.raises(ValueError) as raised:
            call(args)
        assert message in str(raised.value)
        try:
            call(args)
        except Exception as exc:  # e.g. index_select's own IndexError; never the skipped check's message
            assert message not in str(exc)


# ---- the CUDA wrappers' host code, against a recording stand-in for _C -------------------------------------------


class _RecordingExt:
    """Stands in for ``macer_kernels._C``: records every call; query functions return plausible sizes."""

    MAX_COMPACT_TENSORS = 8
    MAX_STAGE_MODALITIES = 8

    def __init__(self):
        self.calls: list[str] = []
        self.DTYPE_CODES = {name: code for code, name in enumerate(
            ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64"))}

    def __getattr__(self, name: str):
        def record(*args, **kwargs):
            if name in declared():
                bind(name, args, kwargs)  # the binding's py::arg names
            self.calls.append(name)
            if name == "modality_scores_max_head_dim":
                return 256
            return 1 << 16  # workspace bytes, size limits (e.g. the one-CTA selection's largest n)

        return record


@pytest.fixture
def fake_cuda_backend(monkeypatch, validation_off):
    """The ``cuda`` backend made runnable on meta tensors: the compiled module replaced by ``_RecordingExt``, the
    device/stream query and the "is a CUDA tensor" check of the wrappers stubbed (both read only metadata)."""
    import macer_kernels.cuda  # noqa: F401  (registers the cuda implementations)
    from macer_kernels.cuda import _ext

    fake = _RecordingExt()
    monkeypatch.setattr(_ext, "_ext_module", fake)
    monkeypatch.setattr(_ext, "IMPORT_ERROR", None)
    for name, module in list(sys.modules.items()):
        if name.startswith("macer_kernels.cuda") and module is not None:
            if hasattr(module, "launch_args"):
                monkeypatch.setattr(module, "launch_args", lambda t: (0, 0))
            if hasattr(module, "check_cuda_tensor"):
                monkeypatch.setattr(module, "check_cuda_tensor", lambda *args: None)
            for attr in vars(module).values():  # per-(n, device) caches of the size queries
                if hasattr(attr, "cache_clear"):
                    attr.cache_clear()
    monkeypatch.setitem(backend._status_cache, "cuda", None)
    monkeypatch.setattr(backend, "_runs_on", lambda name, device: True)
    yield fake
    for module in [m for n, m in sys.modules.items() if n.startswith("macer_kernels.cuda") and m is not None]:
        for attr in vars(module).values():
            if hasattr(attr, "cache_clear"):
                attr.cache_clear()


@pytest.mark.parametrize("op", list(OPS))
def test_cuda_wrappers_read_no_device_values(op, fake_cuda_backend):
    call, shapes, _ = OPS[op]
    args = _on("meta", _inputs())
    with mk.use_backend("cuda"), no_host_reads():
        out = call(args)
    assert _shapes(out) == shapes and _devices(out) == {"meta"}
    if not op.startswith("temporal_chunks"):  # temporal_chunks has no CUDA kernel: it runs in PyTorch
        assert fake_cuda_backend.calls, f"{op} never reached the extension"


# ---- the Triton wrappers' host code, in the interpreter ------------------------------------------------------------

# The Triton scoring wrapper sized its per-row state with this host read; while the line is there its cases are
# expected to fail (strict), and once it is gone they must pass.
TRITON_SCORING_SYNC = "int(modality.max())"


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels in the interpreter")
@pytest.mark.parametrize("op", list(OPS))
def test_triton_wrappers_read_no_device_values(op, monkeypatch, validation_off, request):
    from macer_kernels.triton import modality_scores as triton_scores

    if op.startswith("modality_scores") and TRITON_SCORING_SYNC in inspect.getsource(triton_scores):
        request.applymarker(pytest.mark.xfail(raises=HostRead, strict=True, reason=(
            f"macer_kernels/triton/modality_scores.py reads {TRITON_SCORING_SYNC} back to size its per-row state; "
            "MAX_MODALITIES (or a host integer) must size it")))
    call, shapes, _ = OPS[op]
    args = _inputs()
    with mk.use_backend("torch"):
        expected = call(args)
    monkeypatch.setattr(_validate, "HOST_DEVICE_TYPES", ())  # the checks treat these CPU tensors as GPU ones
    with mk.use_backend("triton"), no_host_reads():
        out = call(args)
    assert _shapes(out) == shapes
    for got, want in zip(out if isinstance(out, list) else [out], expected if isinstance(expected, list) else
                         [expected]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- on a GPU: torch's own detector of synchronising CUDA calls ---------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_no_sync_on_a_gpu(op):
    """Every usable backend, real CUDA tensors: with ``torch.cuda.set_sync_debug_mode("error")`` torch raises on any
    synchronising call it makes (``.item()``, copies to the host, ``nonzero``); in validation mode it must raise
    for the ops that check values, which shows the detector is live."""
    call, shapes, checked = OPS[op]
    args = _on("cuda", _inputs())
    for name in mk.available_backends():
        with mk.use_backend(name):
            call(args)  # compile / warm up outside the detector
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with mk.validation(False):
                    out = call(args)
                if checked:
                    with mk.validation(), pytest.raises(RuntimeError, match="synchroniz"):
                        call(args)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        assert _shapes(out) == shapes, name
