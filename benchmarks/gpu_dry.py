"""The dry run of ``benchmarks/gpu_check.sh`` (``GPU_CHECK_DRY=1``): stand-ins for the programs its GPU steps call,
each of which checks that its command line resolves and runs nothing on a GPU.

    python -m benchmarks.gpu_dry python -m benchmarks.bench_select --sizes 864     # what the python stand-in does
    python -m benchmarks.gpu_dry ncu --clock-control none --section SpeedOfLight python -m benchmarks.ncu_hot_path
    python -m benchmarks.gpu_dry compute-sanitizer --tool racecheck python -m benchmarks.sanitize_select

In dry mode ``gpu_check.sh`` puts a folder of small scripts first on ``PATH`` (``nvidia-smi``, ``compute-sanitizer``,
``ncu``) and sets ``PYTHON`` to one more (``python``); each runs this module with its own name first. What each
checks, so that a typo costs a CPU second here rather than device minutes on a lent GPU machine:

* ``python -m pytest ARGS``: pytest collects ``ARGS`` (``--collect-only``: the files exist, the markers and ``-k``
  expressions parse, every option is known) and must select at least one test;
* ``python -m MODULE ARGS`` / ``python SCRIPT.py ARGS``: the module is imported and run as ``__main__`` up to its
  ``ArgumentParser.parse_args``, which parses ``ARGS`` (unknown options, bad choices and bad numbers fail) and then
  stops it: nothing after the parse runs. A module that returns without parsing arguments is reported as a failure;
* ``python setup.py CMD ARGS``: ``setup.py CMD --help`` loads, and every ``--option`` in ``ARGS`` is one it lists;
* ``python -c CODE`` (the script's probes): the code compiles and every module it imports resolves here
  (``importlib.util.find_spec``); it is not run. A probe for a package that is missing here (flash-attn, vLLM) fails as
  it fails on the device machine, whose image has neither, and the step takes its "not importable" branch;
* ``compute-sanitizer`` / ``ncu``: every option is one the dry run knows (with its value where it takes one; the
  sanitizer's tool, ncu's section names and metric names' form are checked), then the program after the options is
  checked as above;
* ``nvidia-smi``: prints a placeholder line.

Exit code 0 when the command line resolves, 1 otherwise (with a line starting ``dry:`` that says why).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# compute-sanitizer options the dry run knows: name -> takes a value. Extend it when the script uses another one.
SANITIZER_OPTIONS = {
    "--tool": True, "--error-exitcode": True, "--print-limit": True, "--leak-check": True, "--log-file": True,
    "--racecheck-report": True, "--racecheck-detect-level": True, "--target-processes": True,
    "--launch-timeout": True, "--kernel-name": True, "--kernel-name-exclude": True, "--show-backtrace": True,
    "--check-exit-code": True, "--require-cuda-init": True, "--padding": True, "--track-unused-memory": True,
    "--check-device-heap": True, "--destroy-on-device-error": True, "--xml": True, "--save": True,
    "--demangle": True, "--print-level": True, "--nvtx": True, "--version": False, "--help": False,
}
# ncu options the dry run knows: name -> takes a value.
NCU_OPTIONS = {
    "--clock-control": True, "--profile-from-start": True, "--metrics": True, "--section": True, "--set": True,
    "--kernel-name": True, "-k": True, "--kernel-name-base": True, "--launch-count": True, "-c": True,
    "--launch-skip": True, "-s": True, "--csv": False, "--page": True, "--print-units": True, "--log-file": True,
    "--export": True, "-o": True, "--force-overwrite": False, "-f": False, "--target-processes": True,
    "--replay-mode": True, "--cache-control": True, "--nvtx": False, "--nvtx-include": True,
    "--print-summary": True, "--devices": True, "--version": False, "--help": False,
}
NCU_CHOICES = {"--clock-control": ("base", "none", "reset"), "--profile-from-start": ("on", "off", "yes", "no"),
               "--cache-control": ("all", "none"), "--replay-mode": ("kernel", "application", "range", "app-range"),
               "--target-processes": ("application-only", "all"), "--page": ("details", "raw", "source", "session")}
# Nsight Compute's section identifiers (``ncu --list-sections``, 2025.x).
NCU_SECTIONS = (
    "ComputeWorkloadAnalysis", "InstructionStats", "LaunchStats", "MemoryWorkloadAnalysis",
    "MemoryWorkloadAnalysis_Chart", "MemoryWorkloadAnalysis_Tables", "NumaAffinity", "Nvlink", "Nvlink_Tables",
    "Nvlink_Topology", "Occupancy", "PmSampling", "PmSampling_WarpStates", "SchedulerStats", "SourceCounters",
    "SpeedOfLight", "SpeedOfLight_HierarchicalDoubleRooflineChart", "SpeedOfLight_HierarchicalHalfRooflineChart",
    "SpeedOfLight_HierarchicalSingleRooflineChart", "SpeedOfLight_HierarchicalTensorRooflineChart",
    "SpeedOfLight_RooflineChart", "WarpStateStats", "WorkloadDistribution",
)
# A metric name: unit__counter[.rollup][.submetric], e.g. lts__t_sector_hit_rate.pct, gpu__time_duration.sum.
METRIC = re.compile(r"^[a-z0-9]+__[a-z0-9_]+(\.[a-z0-9_]+)*$")


class DryError(Exception):
    """The command line does not resolve; the message says why."""


class ProbeFails(DryError):
    """A ``-c`` probe imports a module that is missing here: the probe fails, as on a machine without it."""


def fail(message: str) -> None:
    raise DryError(message)


# ---- python ------------------------------------------------------------------------------------------------------


class _Parsed(BaseException):
    """Raised by the patched ``parse_args`` once the arguments parsed: stops the module before it does anything."""


def _run_parse_only(target: str, args: list[str], *, module: bool) -> None:
    """Import ``target`` as ``__main__`` with ``sys.argv`` = ``args`` and stop it right after its arguments parse."""
    parsed: list[argparse.Namespace] = []
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        result = original(self, args, namespace)
        parsed.append(result)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_args
    saved_argv = sys.argv
    sys.argv = [target, *args]
    try:
        if module:
            if importlib.util.find_spec(target) is None:
                fail(f"no module named {target!r}")
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            if not Path(target).is_file():
                fail(f"no such script {target!r}")
            runpy.run_path(target, run_name="__main__")
    except _Parsed:
        print(f"dry: {target} {' '.join(args)}: imported, arguments parse ({vars(parsed[0])}); nothing run")
        return
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            fail(f"{target}: exited {exit_.code} before or while parsing its arguments")
        fail(f"{target}: exited before parsing its arguments (a --help?); nothing to check")
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv
    fail(f"{target}: returned without parsing arguments with argparse, so the dry run cannot check it")


def _probe(code: str) -> None:
    """A ``-c`` probe: it compiles, and each module it imports resolves here. Not run."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        fail(f"-c code does not compile: {e}")
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ProbeFails(f"module {name!r} is not importable here (as on a machine without it)")
    print(f"dry: -c probe compiles and its imports resolve ({', '.join(names) or 'none'}); not run")


def _pytest(args: list[str]) -> None:
    # One -q: pytest lists the selected test ids, one a line (-qq would print counts per file instead).
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", *(a for a in args if a not in ("-q", "-qq"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    selected = sum(1 for line in lines if "::" in line and not line.startswith(("SKIPPED", "ERROR")))
    if proc.returncode != 0 or selected == 0:
        print("\n".join(lines[-15:]))
        fail(f"pytest {' '.join(args)}: collection exited {proc.returncode} with {selected} tests selected")
    print(f"dry: pytest {' '.join(args)}: {selected} tests selected ({lines[-1]})")


def _setup(args: list[str]) -> None:
    commands = [a for a in args if not a.startswith("-")]
    if not commands:
        fail("setup.py without a command")
    cmd = [sys.executable, "setup.py", commands[0], "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.getcwd())
    if proc.returncode != 0:
        fail(f"setup.py {commands[0]} --help exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    known = set(re.findall(r"(--[a-z][a-z0-9-]*)", proc.stdout))
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        fail(f"setup.py {commands[0]}: unknown options {unknown}")
    print(f"dry: setup.py {' '.join(args)}: command and options known; nothing built")


def check_python(argv: list[str]) -> None:
    """``python ARGV`` as the script runs it; once per distinct command line and run where ``GPU_DRY_CACHE`` names a
    folder (the script's steps that run one driver under several sanitizer tools check it once)."""
    cache = os.environ.get("GPU_DRY_CACHE")
    if not cache:
        _check_python(argv)
        return
    import fcntl
    import hashlib

    key = Path(cache) / hashlib.sha256("\0".join([os.getcwd(), *argv]).encode()).hexdigest()[:24]
    with open(key.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a parallel step with the same command waits for the first one's check
        if key.is_file():
            print(f"dry: python {' '.join(argv)}: resolved earlier in this run ({key.read_text().strip()})")
            return
        _check_python(argv)
        key.write_text("ok\n")


def _check_python(argv: list[str]) -> None:
    args = list(argv)
    while args and args[0] in ("-u", "-B", "-O", "-s", "-E"):
        args.pop(0)
    if not args:
        fail("python without arguments")
    if args[0] == "-c":
        if len(args) < 2:
            fail("python -c without code")
        _probe(args[1])
    elif args[0] == "-m":
        if len(args) < 2:
            fail("python -m without a module")
        if args[1] == "pytest":
            _pytest(args[2:])
        elif args[1] == "pip":
            fail("python -m pip: the dry run does not install anything (GPU_CHECK_INSTALL_FLASH_ATTN is for a device)")
        else:
            _run_parse_only(args[1], args[2:], module=True)
    elif Path(args[0]).name == "setup.py":
        _setup(args[1:])
    elif args[0].endswith(".py"):
        _run_parse_only(args[0], args[1:], module=False)
    else:
        fail(f"python {args[0]!r}: neither -c, -m nor a script")


# ---- the profilers -------------------------------------------------------------------------------------------------


def _options(tool: str, argv: list[str], known: dict[str, bool]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Split ``argv`` into (option, value) pairs and the program's command line; unknown options fail."""
    pairs, i = [], 0
    while i < len(argv) and argv[i].startswith("-"):
        name, _, inline = argv[i].partition("=")
        if name not in known:
            fail(f"{tool}: option {name!r} is not one the dry run knows (a typo? else add it to benchmarks/gpu_dry.py)")
        if known[name] and not inline:
            if i + 1 >= len(argv):
                fail(f"{tool}: {name} needs a value")
            pairs.append((name, argv[i + 1]))
            i += 2
        else:
            pairs.append((name, inline or None))
            i += 1
    return pairs, argv[i:]


def _program(tool: str, program: list[str]) -> None:
    if not program:
        fail(f"{tool}: no program to run")
    exe = program[0]
    if Path(exe).name.startswith("python"):
        check_python(program[1:])
    elif shutil.which(exe) is None and not Path(exe).is_file():
        fail(f"{tool}: program {exe!r} not found")
    else:
        print(f"dry: {tool}: program {exe} found")


def check_sanitizer(argv: list[str]) -> None:
    pairs, program = _options("compute-sanitizer", argv, SANITIZER_OPTIONS)
    if any(name == "--version" for name, _ in pairs):
        print("dry: compute-sanitizer --version (stand-in)")
        return
    tools = [value for name, value in pairs if name == "--tool"]
    if len(tools) != 1 or tools[0] not in SANITIZER_TOOLS:
        fail(f"compute-sanitizer: --tool {tools} is not exactly one of {SANITIZER_TOOLS}")
    for name, value in pairs:
        if name in ("--error-exitcode", "--print-limit") and not (value or "").isdigit():
            fail(f"compute-sanitizer: {name} {value!r} is not a number")
        if name == "--leak-check" and value not in ("full", "no"):
            fail(f"compute-sanitizer: --leak-check {value!r} is not full or no")
    print(f"dry: compute-sanitizer --tool {tools[0]}: options known")
    _program("compute-sanitizer", program)


def check_ncu(argv: list[str]) -> None:
    pairs, program = _options("ncu", argv, NCU_OPTIONS)
    if any(name == "--version" for name, _ in pairs):
        print("dry: ncu --version (stand-in)")
        return
    for name, value in pairs:
        if name in NCU_CHOICES and value not in NCU_CHOICES[name]:
            fail(f"ncu: {name} {value!r} is not one of {NCU_CHOICES[name]}")
        if name == "--section" and value not in NCU_SECTIONS:
            fail(f"ncu: section {value!r} is not one of Nsight Compute's section identifiers")
        if name == "--metrics":
            bad = [m for m in (value or "").split(",") if not METRIC.match(m)]
            if bad:
                fail(f"ncu: metric names {bad} do not have the form unit__counter[.rollup]")
    print(f"dry: ncu: options known ({len(pairs)})")
    _program("ncu", program)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__)
        return 2
    tool, rest = argv[0], argv[1:]
    try:
        if tool == "python":
            check_python(rest)
        elif tool == "compute-sanitizer":
            check_sanitizer(rest)
        elif tool == "ncu":
            check_ncu(rest)
        elif tool == "nvidia-smi":
            print("DRY RUN (no GPU), 0 MiB, -, - MHz")
        else:
            fail(f"no stand-in for {tool!r}")
    except ProbeFails as e:
        print(f"dry: -c probe fails: {e}", flush=True)
        return 1
    except DryError as e:
        print(f"dry: FAILED: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
