"""Backend registry and dispatch.

Every public op has a PyTorch implementation (registered under ``"torch"``); faster backends register their own
implementation of the same op under ``"triton"`` or ``"cuda"``. The choice is made per call:

* ``use_backend(name)`` (a context manager) or the environment variable ``MACER_BACKEND`` force a backend;
* ``"auto"`` (the default) prefers CUDA, then Triton, then PyTorch, for CUDA tensors, and PyTorch for CPU tensors.

A forced backend that does not implement an op runs that op in PyTorch (e.g. ``split_budget`` is scalar arithmetic).
A forced backend that is unavailable, or that cannot run on the tensor's device, raises ``RuntimeError`` with the
reason; it never falls back silently.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

BACKENDS: tuple[str, ...] = ("cuda", "triton", "torch")
"""Known backends, in the order ``"auto"`` prefers them."""

_CHOICES = ("auto", *BACKENDS)

# op name -> backend name -> implementation
_REGISTRY: dict[str, dict[str, Callable]] = {}
# backend name -> module whose import registers that backend's implementations
_BACKEND_MODULES = {"triton": "macer_kernels.triton", "cuda": "macer_kernels.cuda"}
_status_cache: dict[str, str | None] = {}
_local = threading.local()


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``op``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return deco


def _probe(backend: str) -> str | None:
    """Return None if ``backend`` is usable, else the reason it is not. Imports its module (which registers ops)."""
    if backend == "torch":
        return None
    if backend in _status_cache:
        return _status_cache[backend]
    try:
        module = importlib.import_module(_BACKEND_MODULES[backend])
        reason = module.unavailable_reason()
    except ImportError as exc:  # the backend's own dependency is missing
        reason = f"import failed: {exc}"
    _status_cache[backend] = reason
    return reason


def backend_status() -> dict[str, str | None]:
    """Map every known backend to ``None`` when usable, else a sentence saying why it is not."""
    return {name: _probe(name) for name in BACKENDS}


def available_backends() -> list[str]:
    """Usable backends, in the order ``"auto"`` prefers them (``"torch"`` is always last and always present).

    ``backend_status()`` gives the reason for each missing one.
    """
    return [name for name, why in backend_status().items() if why is None]


def _validate_choice(name: str, source: str) -> str:
    if name not in _CHOICES:
        raise ValueError(f"{source} must be one of {_CHOICES}, got {name!r}")
    return name


def current_backend() -> str:
    """The backend choice in force: the innermost ``use_backend``, else ``MACER_BACKEND``, else ``"auto"``."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    return _validate_choice(os.environ.get("MACER_BACKEND", "auto").strip() or "auto", "MACER_BACKEND")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (thread-local; nests).

    ``name`` is ``"auto"``, ``"cuda"``, ``"triton"`` or ``"torch"``. Forcing an unavailable backend raises
    ``RuntimeError`` with the reason at once.
    """
    _validate_choice(name, "backend")
    if name != "auto":
        reason = _probe(name)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} is not available: {reason}")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _runs_on(backend: str, device: torch.device) -> bool:
    if backend == "torch":
        return True
    if backend == "triton":
        return _triton_runs_on(device)
    return device.type == "cuda"


def resolve(op: str, device: torch.device) -> tuple[str, Callable]:
    """Pick the implementation of ``op`` for tensors on ``device``: returns ``(backend name, function)``."""
    impls = _REGISTRY[op]
    choice = current_backend()
    if choice == "auto":
        if device.type == "cuda":
            for name in BACKENDS:
                if _probe(name) is None and name in _REGISTRY[op]:
                    return name, impls[name]
        return "torch", impls["torch"]
    reason = _probe(choice)
    if reason is not None:
        raise RuntimeError(f"{op}: backend {choice!r} is not available: {reason}")
    if choice not in impls:
        return "torch", impls["torch"]
    if not _runs_on(choice, device):
        hint = " (set TRITON_INTERPRET=1 before importing triton to run it on CPU)" if choice == "triton" else ""
        raise RuntimeError(f"{op}: backend {choice!r} cannot run on {device.type} tensors{hint}")
    return choice, impls[choice]


def dispatch(op: str, device: torch.device, *args, **kwargs):
    """Run ``op`` with the backend that ``resolve`` picks."""
    return resolve(op, device)[1](*args, **kwargs)
