"""Backend selection: names, environment variable, forcing, fallbacks."""

import pytest
import torch

import macer_kernels as mk
from macer_kernels import backend as be


def test_torch_is_always_available_and_last():
    names = mk.available_backends()
    assert names[-1] == "torch"
    status = mk.backend_status()
    assert set(status) == {"cuda", "triton", "torch"} and status["torch"] is None
    for name, why in status.items():
        assert (why is None) == (name in names)
        assert why is None or (isinstance(why, str) and why)


def test_use_backend_nests_and_restores():
    assert mk.current_backend() == "auto"
    with mk.use_backend("torch"):
        assert mk.current_backend() == "torch"
        with mk.use_backend("auto"):
            assert mk.current_backend() == "auto"
        assert mk.current_backend() == "torch"
    assert mk.current_backend() == "auto"


def test_unknown_backend_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'cuda', 'triton', 'torch'\)"):
        with mk.use_backend("cutlass"):
            pass
    monkeypatch.setenv("MACER_BACKEND", "tpu")
    with pytest.raises(ValueError, match="MACER_BACKEND must be one of"):
        mk.current_backend()


def test_environment_variable_forces_a_backend(monkeypatch):
    monkeypatch.setenv("MACER_BACKEND", "torch")
    assert mk.current_backend() == "torch"
    name, _ = be.resolve("modality_scores", torch.device("cpu"))
    assert name == "torch"


def test_auto_uses_torch_for_cpu_tensors():
    for op in ("modality_scores", "topk_indices", "coverage_select", "compact", "compact_many"):
        assert be.resolve(op, torch.device("cpu"))[0] == "torch"


def test_forcing_an_unavailable_backend_says_why(monkeypatch):
    monkeypatch.setitem(be._status_cache, "cuda", "extension not built (test)")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' is not available: extension not built \(test\)"):
        with mk.use_backend("cuda"):
            pass
    monkeypatch.setenv("MACER_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="topk_indices: backend 'cuda' is not available"):
        mk.topk_indices(torch.rand(5), 2)


def test_ops_without_a_backend_implementation_run_in_torch(monkeypatch):
    # A backend that registers nothing for an op (here a fake "triton" that is usable) leaves that op to PyTorch.
    monkeypatch.setitem(be._status_cache, "triton", None)
    monkeypatch.setitem(be._REGISTRY, "compact", {"torch": be._REGISTRY["compact"]["torch"]})
    with mk.use_backend("triton"):
        assert be.resolve("compact", torch.device("cpu"))[0] == "torch"


def test_forced_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setitem(be._status_cache, "triton", None)
    monkeypatch.setitem(be._REGISTRY, "topk_indices", {**be._REGISTRY["topk_indices"], "triton": lambda s, k: None})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with mk.use_backend("triton"):
        with pytest.raises(RuntimeError, match=r"backend .triton. cannot run on cpu tensors.*TRITON_INTERPRET=1"):
            mk.topk_indices(torch.rand(5), 2)


def test_register_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        be.register("compact", "opencl")
