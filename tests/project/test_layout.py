"""The package's layout (docs/architecture.md): rooms on floors with one-way doors, checked on the source.

* ``macer.core`` imports the standard library, torch, numpy (the host plan's arrays), ``macer_kernels`` and itself
  only (no transformers, no vLLM);
* ``macer.hf`` (the transformers engine) and ``macer.vllm`` (the vLLM plugin) import the core and never each other;
* above them the tools room, ``macer.tools`` (the command line and demo, diagnostics, the cost model, batching, the
  synthetic models), imports any engine room and never the package's face; then the face (``macer`` itself,
  ``__main__`` and the old public names of the tools, ``macer.cost``, ``macer.testing``, ...); then ``macer.eval``
  (lmms-eval's model), a client of all of them. An import runs down these floors or stays in its room, never up;
* the old public names only re-export their home in ``macer.tools``, and nothing in the package imports them;
* nothing imports another room's private (``_``) modules or names;
* no import cycle anywhere in the package (inside a room either).

Every import statement counts, also inside functions and under ``if TYPE_CHECKING:``: the source is read with ``ast``,
nothing is imported. The checker is itself checked on a planted package that breaks each rule. Two more checks: the
house's size limits (no module over 600 lines, no class over 250), and ``import macer.vllm`` with the plugin's modules
that load without vLLM loads no module of ``macer.hf`` or of the tools (the rest, with vLLM, in
``tests/serving/test_rooms.py``).

The tests live in rooms that mirror the package (docs/architecture.md, "The tests"): ``tests/kernels`` imports no
``macer``, ``tests/core`` no engine, ``tests/hf`` no vLLM, helpers no test module, and no test module one of another
room; no test module sits outside a room. The same ``ast`` reading, checked on a planted tree too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "macer"
ROOMS = ("core", "hf", "vllm")
CORE_MAY_IMPORT = {"torch", "numpy", "macer_kernels", "macer"}  # macer: the core's own modules (checked below)

FLOOR = {"core": 0, "hf": 1, "vllm": 1, "tools": 2, "face": 3, "eval": 4}
"""Each room's floor: an import into the package stays in its room or runs to a lower floor (hf and vllm share one
and never import each other). ``face``: the package itself, ``__main__`` and the old public names of the tools."""
FACE_CODE = ("macer", "macer.__main__")
"""The face's modules that hold code; the rest of the face are old names that only re-export."""


def read_package(root: Path) -> dict[str, str]:
    """``{module name: source}`` of every module of the package at ``root`` (a package's name is its folder's)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path.read_text()
    return modules


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOOR else "face"


def import_edges(modules: dict[str, str]) -> list[tuple[str, str, str | None, int]]:
    """``(importer, imported module, imported name or None, line)`` for every import statement of every module."""
    edges = []
    for module, source in modules.items():
        package = module if _is_package(module, modules) else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges += [(module, alias.name, None, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, one level up per extra dot
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        edges.append((module, submodule, None, node.lineno))
                    else:
                        edges.append((module, base, alias.name, node.lineno))
    return edges


def _is_package(module: str, modules: dict[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in modules)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def cycles(modules: dict[str, str], edges: list[tuple[str, str, str | None, int]]) -> list[list[str]]:
    """The package's import cycles: strongly connected components of more than one module, or a module importing
    itself (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for source, target, _, _ in edges:
        if target in modules:
            graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(modules: dict[str, str]) -> list[str]:
    """Every broken rule of the module docstring, one line each."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    edges = import_edges(modules)
    out = []
    for source, target, name, line in edges:
        where = f"{source}:{line} imports {target}" + (f".{name}" if name else "")
        top = target.split(".")[0]
        src_room = room_of(source)
        if top != "macer":
            if src_room == "core" and top not in stdlib | CORE_MAY_IMPORT:
                out.append(f"core imports {top}: {where}")
            continue
        dst_room = room_of(target)
        if dst_room != src_room and FLOOR[dst_room] >= FLOOR[src_room]:
            out.append(f"{src_room} -> {dst_room}: {where}")
        if dst_room == "face" and target not in FACE_CODE:
            out.append(f"old name imported: {where}")
        if dst_room != src_room:
            parts = [*target.split(".")[1:], *([name] if name else [])]
            if any(_private(part) for part in parts):
                out.append(f"private name of {dst_room}: {where}")
    out += [f"old name with code: {module}" for module in modules
            if room_of(module) == "face" and module not in FACE_CODE and not _only_reexports(modules[module])]
    out += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(modules, edges)]
    return out


def _only_reexports(source: str) -> bool:
    """An old name's whole module: a docstring, ``from macer.tools... import`` lines, and at most an
    ``if __name__ == "__main__":`` guard that runs the home's ``main``."""
    for node in ast.parse(source).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        reexport = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("macer.tools.")
        main_guard = (isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
                      and [ast.unparse(line) for line in node.body] == ["raise SystemExit(main())"])
        if not (docstring or reexport or main_guard):
            return False
    return True


def test_the_package_keeps_the_rooms_rules():
    modules = read_package(PACKAGE)
    assert {"macer.core", "macer.hf", "macer.vllm"} <= set(modules)
    assert all(room_of(m) == "core" for m in ("macer.core.policy", "macer.core.stage", "macer.core.prefill"))
    assert violations(modules) == []


def test_the_checker_finds_each_broken_rule():
    """The checker is not vacuous: a planted package breaks every rule once, at module level, inside a function and
    under ``TYPE_CHECKING``, and each break is reported."""
    planted = {
        "macer": "",
        "macer.__main__": "from macer.tools.cli import main\n",
        "macer.cost": '"""An old name."""\n\nfrom macer.tools.cost import *\n',
        "macer.testing": "from macer.tools.cost import *\n\n\ndef extra():\n    pass\n",
        "macer.core": "",
        "macer.core.plan": "import torch\n\n\ndef f():\n    from macer.hf.run import go\n",
        "macer.core.names": "import transformers\nfrom macer.tools import cli\n",
        "macer.hf": "",
        "macer.hf.run": "from typing import TYPE_CHECKING\n\nfrom macer.core.plan import f\n\nif TYPE_CHECKING:\n"
                        "    from macer.vllm._engine import Engine\n",
        "macer.hf.session": "from .run import go\n",
        "macer.vllm": "",
        "macer.vllm._engine": "from macer.core.plan import _hidden\n",
        "macer.vllm.model": "from macer.vllm._engine import Engine\n",
        "macer.tools": "",
        "macer.tools.cli": "import macer\nfrom macer.core import names\nfrom macer.hf import session\n"
                           "from macer.vllm import model\n",
        "macer.tools.cost": "",
        "macer.tools.batching": "from macer.eval import table\n",
        "macer.eval": "",
        "macer.eval.table": "import macer\nfrom macer.tools import cli\nfrom macer.cost import x\n",
    }
    found = violations(planted)
    assert sorted(found) == sorted([
        "core -> hf: macer.core.plan:5 imports macer.hf.run.go",
        "core imports transformers: macer.core.names:1 imports transformers",
        "core -> tools: macer.core.names:2 imports macer.tools.cli",
        "hf -> vllm: macer.hf.run:6 imports macer.vllm._engine.Engine",
        "private name of vllm: macer.hf.run:6 imports macer.vllm._engine.Engine",
        "private name of core: macer.vllm._engine:1 imports macer.core.plan._hidden",
        "tools -> face: macer.tools.cli:1 imports macer",
        "tools -> eval: macer.tools.batching:1 imports macer.eval.table",
        "old name imported: macer.eval.table:3 imports macer.cost.x",
        "old name with code: macer.testing",
        "import cycle: macer.core.plan -> macer.hf.run -> macer.vllm._engine",
        "import cycle: macer.core.names -> macer.tools.cli",
    ]), found
    # The relative import resolves inside its package, a room's private module is its own room's to use, a tool may
    # import any engine room's public modules, the face's code and its old names import the tools, and eval imports
    # the face and the tools: none of these is reported.
    assert not [v for v in found if v.startswith(("macer.hf.session", "macer.vllm.model", "macer.__main__"))]
    assert not [v for v in found if "macer.tools.cli:2" in v or "macer.tools.cli:3" in v or "macer.tools.cli:4" in v]
    assert not [v for v in found if "macer.eval.table:1" in v or "macer.eval.table:2" in v or v.endswith("macer.cost")]


def test_no_module_over_600_lines_and_no_class_over_250():
    """The house's size limits (docs/conventions.md): a longer module or class is a sign to split by responsibility."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if len(source.splitlines()) > 600:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                too_long.append(f"{name}: class {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_importing_the_plugin_loads_no_transformers_engine(tmp_path):
    """``import macer.vllm`` imports the package ``macer`` first: the package loads the core eagerly and the
    transformers engine only when one of its names is used, so the plugin and its modules that load without vLLM
    bring the core and themselves only (a fresh interpreter; the plugin's model classes in
    tests/serving/test_rooms.py)."""
    code = ("import sys\n"
            "import macer.vllm, macer.vllm.backend, macer.vllm.checks, macer.vllm.prompt, macer.vllm.records\n"
            "import macer.vllm.settings, macer.vllm.staged, macer.vllm.testing\n"
            "loaded = sorted(m for m in sys.modules if m == 'macer' or m.startswith('macer.'))\n"
            "others = [m for m in loaded if m != 'macer' and not m.startswith(('macer.core', 'macer.vllm'))]\n"
            "assert 'macer.vllm.staged' in loaded and 'macer.core.prefill' in loaded, loaded\n"
            "assert others == [], others\n"
            "assert 'transformers' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_every_vllm_module_is_in_the_rooms_table_and_the_package_docstring():
    """docs/architecture.md's "The vLLM room, module by module" lists every module of ``macer/vllm`` (and nothing
    else), and ``macer.vllm``'s docstring names each: the map a joiner reads stays the room."""
    import ast
    import re

    modules = sorted(p.stem for p in (PACKAGE / "vllm").glob("*.py"))
    doc = (PACKAGE.parents[1] / "docs" / "architecture.md").read_text()
    section = doc.split("### The vLLM room, module by module", 1)[1].split("\n## ", 1)[0]
    listed = sorted(re.findall(r"^\| `(\w+)\.py` \|", section, flags=re.M))
    assert listed == modules, f"docs/architecture.md's vLLM table lists {listed}, the room has {modules}"
    docstring = ast.get_docstring(ast.parse((PACKAGE / "vllm" / "__init__.py").read_text())) or ""
    missing = [m for m in modules if m != "__init__" and f"``{m}``" not in docstring]
    assert not missing, f"macer.vllm's docstring does not name {missing}"


# ---------------------------------------------------------------------------------------------------------------
# The tests' house: rooms that mirror the package
# ---------------------------------------------------------------------------------------------------------------
TESTS = Path(__file__).resolve().parents[1]
TEST_ROOMS = {
    "kernels": "the ops of macer_kernels",
    "core": "macer.core",
    "hf": "the transformers engine, macer.hf",
    "serving": "the vLLM engine, macer.vllm",
    "tools": "macer.tools, macer.eval and the benchmarks",
    "project": "the repository: layout, docs, README, public API, install lines, the test harness",
    "helpers": "oracles and shared test utilities (on pytest's path)",
}
TEST_ROOM_MAY_NOT_IMPORT = {
    "kernels": ("macer",),  # the ops alone: no engine, no core
    "core": ("macer.hf", "macer.vllm"),
    "hf": ("macer.vllm",),
    "helpers": ("macer.hf", "macer.vllm"),
}


def violations_of_tests(tests: Path) -> list[str]:
    """What breaks the tests' layout under ``tests``: a test module outside a room, a room that is not one of
    ``TEST_ROOMS``, an import a room may not make (``TEST_ROOM_MAY_NOT_IMPORT``), a helper that imports a test
    module, a test module that imports one of another room."""
    bad = []
    rooms = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    bad += [f"tests/{r}/ is not a room of {sorted(TEST_ROOMS)}" for r in sorted(rooms - set(TEST_ROOMS))]
    bad += [f"tests/{p.name} sits outside the rooms" for p in sorted(tests.glob("*.py")) if p.name != "conftest.py"]
    where = {p.stem: p.parent.name for room in TEST_ROOMS for p in (tests / room).glob("test_*.py")}
    for room in sorted(rooms & set(TEST_ROOMS)):
        for path in sorted((tests / room).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    at = f"tests/{room}/{path.name}:{node.lineno}"
                    for banned in TEST_ROOM_MAY_NOT_IMPORT.get(room, ()):
                        if name == banned or name.startswith(banned + "."):
                            bad.append(f"{at} imports {name} ({room} tests may not import {banned})")
                    if name in where and (room == "helpers" or where[name] != room):
                        bad.append(f"{at} imports the test module {name} of tests/{where[name]}")
                    if name == "conftest":  # every room's conftest.py is a module named conftest: which one loads?
                        bad.append(f"{at} imports conftest (the gates are in tests/helpers/gating.py)")
    return bad




def test_the_tests_mirror_the_package():
    """tests/{kernels,core,hf,serving,tools,project,helpers}: every test module in a room, each room importing only
    what its package room may (the ops' tests no ``macer``, the core's no engine, the transformers engine's no vLLM),
    helpers importing no test module, and no test module importing one of another room (shared code lives in
    tests/helpers)."""
    assert violations_of_tests(TESTS) == []


def test_the_tests_checker_finds_each_broken_rule(tmp_path):
    for room in TEST_ROOMS:
        (tmp_path / room).mkdir()
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "test_flat.py").write_text("")
    (tmp_path / "misc").mkdir()
    (tmp_path / "kernels" / "test_ops.py").write_text("import macer.core\n")
    (tmp_path / "core" / "test_plan.py").write_text("from macer.vllm.state import x\nimport test_ops\n")
    (tmp_path / "hf" / "test_engine.py").write_text("import macer.vllm\nimport test_engine_twin\n")
    (tmp_path / "hf" / "test_engine_twin.py").write_text("import macer.core\n")
    (tmp_path / "helpers" / "oracle.py").write_text("from test_plan import y\n")
    (tmp_path / "kernels" / "test_gate.py").write_text("def test_x():\n    from conftest import HAS_GPU\n")
    found = "\n".join(violations_of_tests(tmp_path))
    for expected in ("tests/misc/ is not a room", "tests/test_flat.py sits outside the rooms",
                     "tests/kernels/test_ops.py:1 imports macer.core", "tests/core/test_plan.py:1 imports macer.vllm",
                     "tests/core/test_plan.py:2 imports the test module test_ops of tests/kernels",
                     "tests/hf/test_engine.py:1 imports macer.vllm",
                     "tests/helpers/oracle.py:1 imports the test module",
                     "tests/kernels/test_gate.py:2 imports conftest"):
        assert expected in found, (expected, found)
    assert "test_engine_twin" not in found  # a sibling test module of the same room is allowed
    assert len(violations_of_tests(tmp_path)) == 8
