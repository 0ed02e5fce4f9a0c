"""A guard that fails when code of ``macer_kernels`` reads a tensor's values on the host.

On a GPU every such read (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``nonzero``, a boolean
mask index, ...) is a host synchronisation. ``no_host_reads()`` replaces those entry points of ``torch.Tensor`` and
``torch`` for the duration of a ``with`` block; a call whose nearest caller outside ``torch`` is a module of
``macer_kernels`` raises ``HostRead`` naming the call and the line. Calls from anywhere else (the test itself,
Triton's interpreter copying its arguments) pass through, so the guard also works on CPU tensors.

Reads inside aten kernels (e.g. ``one_hot`` without ``num_classes``, ``repeat_interleave`` without
``output_size``) are not Python calls; run the op on ``meta`` tensors to catch those: a meta tensor has no values,
so any kernel that needs them raises.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostRead(AssertionError):
    """A host read of tensor values from ``macer_kernels`` code (a synchronisation on a GPU)."""


# Tensor methods that read values back (or, for `cpu`/`numpy`, copy them to the host).
_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
                   "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")
# torch functions whose output size depends on values, or whose result is a host bool.
_TORCH_FUNCTIONS = ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "equal", "allclose",
                    "is_nonzero")


def _culprit() -> str | None:
    """``file:line`` of the nearest frame outside torch and this module, if it belongs to macer_kernels."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and module.split(".")[0] != "torch":
            if module.split(".")[0] == "macer_kernels":
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


def model_layer_caller(skip: str) -> str | None:
    """``module:line`` of the first frame outside torch and module ``skip`` (the calling test's ``__name__``) that
    called the patched read which calls this, if it belongs to the model layer (``macer``, not ``macer_kernels``).
    Used by the tests that count the model layer's host reads instead of refusing them (test_macer_sync, the vLLM
    conformance test)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("torch") or name == skip:
            frame = frame.f_back
            continue
        return f"{name}:{frame.f_lineno}" if name == "macer" or name.startswith("macer.") else None
    return None


READ_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")
"""The ``torch.Tensor`` methods that the model-layer read counters patch."""

ENGINE_READ_METHODS = (*READ_METHODS, "argwhere", "unique", "unique_consecutive", "masked_select")
"""``READ_METHODS`` and the methods whose output size depends on values (the engine's counter)."""


def counting(name: str, original, window: list[int], found: list, skip: str):
    """``original`` wrapped to append ``(name, model_layer_caller(skip))`` to ``found`` for each call the model
    layer makes while ``window[0]`` is non-zero (a hot window the test opens around the code it checks)."""
    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if window[0]:
            where = model_layer_caller(skip)
            if where is not None:
                found.append((name, where))
        return original(*args, **kwargs)

    return wrapped


def count_engine_reads(monkeypatch, macer, skip: str) -> list[tuple[str, str]]:
    """Count the model layer's host reads inside a vLLM engine's staged decoder ``macer``: ``ENGINE_READ_METHODS`` of
    ``torch.Tensor``, the ``torch`` functions of ``no_host_reads`` (``nonzero``, ``equal``, ``allclose``, ...) and
    ``Tensor.to`` towards the CPU are counted (``counting``) while its step plan (``planner.plan``), its metadata build
    (the runner binding's ``_build``) or its forward run, except inside a request's planning
    (``planner.plan_request``: its host prompt ids may be read). Returns the list the reads are appended to, as
    ``(method, module:line)``; ``skip`` is the calling test's ``__name__``. (Reads inside aten kernels, e.g. a boolean
    mask index, are not Python calls: ``no_host_reads`` on meta tensors and the transformers engine's counter see
    those.)"""
    found: list[tuple[str, str]] = []
    window = [0]

    def windowed(method, delta):
        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            window[0] += delta
            try:
                return method(*args, **kwargs)
            finally:
                window[0] -= delta

        return wrapped

    for name in ENGINE_READ_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(f"Tensor.{name}", getattr(torch.Tensor, name), window, found,
                                                         skip))
    for name in _TORCH_FUNCTIONS:
        monkeypatch.setattr(torch, name, counting(f"torch.{name}", getattr(torch, name), window, found, skip))
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if window[0] and _to_host(self, *args, **kwargs):
            where = model_layer_caller(skip)
            if where is not None:
                found.append(("Tensor.to(cpu)", where))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(macer.planner, "plan", windowed(macer.planner.plan, 1))
    monkeypatch.setattr(macer.binding, "_build", windowed(macer.binding._build, 1))
    monkeypatch.setattr(macer, "forward", windowed(macer.forward, 1))
    monkeypatch.setattr(macer.planner, "plan_request", windowed(macer.planner.plan_request, -1))
    return found


def _is_cpu(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _guarded(what: str, fn, condition=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if condition is None or condition(*args, **kwargs):
            where = _culprit()
            if where is not None:
                raise HostRead(f"{what} called from {where}: a host synchronisation on a GPU")
        return fn(*args, **kwargs)

    return wrapper


def _to_host(self, *args, **kwargs) -> bool:
    """``Tensor.to(...)`` towards the CPU."""
    return _is_cpu(kwargs.get("device")) or any(_is_cpu(a) for a in args if isinstance(a, (str, torch.device)))


def _bool_mask_index(self, index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class _BoolMaskIndexGuard(torch.overrides.TorchFunctionMode):
    """Indexing with a boolean mask (its output size depends on values), seen through torch's function mode.

    Not a class attribute patch like the others: assigning ``Tensor.__getitem__`` (even deleting it again afterwards)
    gives the class CPython's sequence slot, after which ``torch.tensor([t])`` of a 0-d tensor ``t`` calls ``len(t)``
    and fails for the rest of the process.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and _bool_mask_index(*args):
            where = _culprit()
            if where is not None:
                raise HostRead(f"indexing with a boolean mask called from {where}: a host synchronisation on a GPU")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Inside the block, ``macer_kernels`` code that reads tensor values on the host raises ``HostRead``."""
    patches = [(torch.Tensor, name, _guarded(f"Tensor.{name}", getattr(torch.Tensor, name)))
               for name in _TENSOR_METHODS]
    patches += [(torch, name, _guarded(f"torch.{name}", getattr(torch, name))) for name in _TORCH_FUNCTIONS]
    patches.append((torch.Tensor, "to", _guarded("Tensor.to(cpu)", torch.Tensor.to, _to_host)))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        with _BoolMaskIndexGuard():
            yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


class NoAtenOps(TorchDispatchMode):
    """Fails on any aten op (an allocation, a copy, an index kernel) made inside its block."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
