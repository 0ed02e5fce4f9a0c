"""Shared benchmark plumbing: timing, environment description, result files.

Every benchmark reports the median of many timed runs after warm-up. On CUDA it times with
``triton.testing.do_bench`` when Triton is present (CUDA events, L2 flushed between runs), else with CUDA events;
on CPU with ``time.perf_counter``. Results are written with the device name, library versions and git SHA.
"""

from __future__ import annotations

import csv
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device | str) -> dict:
    """Device, versions and git SHA, stored next to every result."""
    env = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
           "git_sha": git_sha(), "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def runnable_backends(op: str, device: torch.device | str) -> list[str]:
    """Backends that can run ``op`` on ``device`` here, slowest first (torch, then triton, then cuda)."""
    from macer_kernels import available_backends, use_backend
    from macer_kernels.backend import resolve

    names = []
    for name in reversed(available_backends()):
        try:
            with use_backend(name):
                resolve(op, torch.device(device))
        except RuntimeError:  # e.g. Triton on CPU tensors without the interpreter
            continue
        names.append(name)
    return names


def median_time_us(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 5, reps: int = 50) -> float:
    """Median wall time of ``fn()`` in microseconds."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return 1e3 * do_bench(fn, warmup=25, rep=200, return_mode="median")
        except ImportError:
            pass
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(1e3 * start.elapsed_time(stop))
        return statistics.median(times)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + bytes written per second), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = median_time_us(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def write_results(name: str, rows: list[dict], meta: dict, out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``rows`` to ``<name>.csv`` and ``rows`` + ``meta`` to ``<name>.json``; return both paths."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{name}.csv", out_dir / f"{name}.json"
    if rows:
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return csv_path, json_path


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(str(c)), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(w) for c, w in zip(cols, widths)))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
