"""The keyword names of the compiled module's functions as csrc/*bindings.cpp declares them (``py::arg``), for the
CPU tests' stand-ins for ``macer_kernels._C``: a stand-in binds each call to the declared names, so a call site that
passes a name the binding does not declare (or misses one it requires) fails on CPU, not first on a GPU."""

from __future__ import annotations

import functools
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_DEF = re.compile(r'\.def\(\s*(?:"(\w+)"|(py::init))')
_ARG = re.compile(r'py::arg\("(\w+)"\)(\s*=)?')


@functools.cache
def declared() -> dict[str, list[tuple[str, bool]]]:
    """``{function: [(argument, has_default), ...]}`` of every ``m.def`` / ``.def`` with ``py::arg`` names; the
    ``py::init`` of ``StagePlan`` under ``"StagePlan"``."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(CSRC.glob("*bindings.cpp")):
        text = path.read_text()
        starts = list(_DEF.finditer(text))
        for i, m in enumerate(starts):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
            args = [(a.group(1), a.group(2) is not None) for a in _ARG.finditer(text, m.end(), end)]
            if args:
                out["StagePlan" if m.group(2) else m.group(1)] = args
    return out


def bind(name: str, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` of a call of ``_C.<name>`` as one positional tuple in the declared order (arguments
    with a default that the call leaves out are left out); ``TypeError`` as pybind11 would raise it."""
    params = declared()[name]
    names = [p for p, _ in params]
    if len(args) > len(names):
        raise TypeError(f"{name}: {len(args)} positional arguments, the binding declares {len(names)}")
    given = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise TypeError(f"{name}: unexpected keyword argument {key!r} (declared: {', '.join(names)})")
        if key in given:
            raise TypeError(f"{name}: {key!r} given twice")
        given[key] = value
    missing = [p for p, has_default in params if not has_default and p not in given]
    if missing:
        raise TypeError(f"{name}: missing arguments {missing}")
    return tuple(given[p] for p in names if p in given)
