"""Output of the end-to-end benchmark: where results go, the machine they name, the CSV/JSON files and the PNG."""

from __future__ import annotations

import os
import platform
import textwrap
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "out" / "bench"
"""Where a run writes unless told otherwise: outside the tracked ``benchmarks/results`` (``/out/`` is ignored by git),
so that trying the benchmark never overwrites a committed result. ``--record`` writes to ``common.RESULTS_DIR``."""


def cpu_model() -> str | None:
    """The host CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` is empty on many Linux hosts)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def machine(device: torch.device) -> dict[str, Any]:
    """What every results file names: the device, the host CPU, its cores and the torch threads used, versions and
    the git commit (``common.environment``)."""
    env = common.environment(device)
    return {**env, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}


def output_dir(out: Path | None, record: bool) -> Path:
    """``--out`` if given, else ``benchmarks/results`` with ``--record``, else ``DEFAULT_OUT``."""
    if out is not None and record:
        raise SystemExit("--out and --record exclude each other (--record writes to benchmarks/results)")
    if out is not None:
        return Path(out)
    return common.RESULTS_DIR if record else DEFAULT_OUT


def write(name: str, rows: list[dict], naive_rows: list[dict], meta: dict[str, Any], out_dir: Path,
          plot_png: bool) -> list[Path]:
    """Write ``<name>.csv/.json`` (+ ``<name>_naive.*`` and ``<name>.png``), print the tables; return the paths."""
    csv_path, json_path = common.write_results(name, rows, meta, out_dir)
    paths = [csv_path, json_path]
    if naive_rows:
        paths += common.write_results(f"{name}_naive", naive_rows, meta, out_dir)
    env = meta["machine"]
    print(f"device: {env['device']}  cpu: {env['cpu_model']} ({env['torch_threads']} torch threads)  "
          f"torch {env['torch']}  transformers {env['transformers']}  git {env['git_sha']}")
    common.print_table([{k: v for k, v in r.items() if k != "layer_tokens"} for r in rows])
    if naive_rows:
        common.print_table(naive_rows)
    if plot_png:
        paths.append(plot(rows, Path(out_dir) / f"{name}.png", title=env["device"]))
    for path in paths:
        print(f"wrote {path}")
    return paths


def plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """One column per (model, clip): LLM prefill time, the measured ratio next to the cost model, and memory, against
    the keep ratio, one line per policy; the full model as dotted horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One column per (model, clip, compiled layers or not): each setting against its own full model.
    groups = list(dict.fromkeys((r["model"], r["clip"], bool(r.get("compiled"))) for r in rows))
    fig, axes = plt.subplots(3, len(groups), figsize=(6 * len(groups), 10), squeeze=False)
    for col, (label, clip, compiled) in enumerate(groups):
        mine = [r for r in rows if r["model"] == label and r["clip"] == clip and bool(r.get("compiled")) == compiled]
        full = next(r for r in mine if r["method"] == "full")
        methods = list(dict.fromkeys(r["method"] for r in mine if r["method"] != "full"))
        time_key = "llm_prefill_cpu_ms" if full["llm_prefill_cpu_ms"] is not None else "llm_prefill_ms"
        decode_key = "decode_cpu_ms_per_token" if full["decode_cpu_ms_per_token"] is not None else "decode_ms_per_token"
        panels = [(0, time_key, "ms"), (1, "llm_prefill_ratio", "policy / full"), (2, "kv_cache_mib", "MiB")]
        for color, method in enumerate(methods):
            series = sorted((r for r in mine if r["method"] == method), key=lambda r: r["keep_ratio"])
            rhos = [r["keep_ratio"] for r in series]
            for row_index, key, _ in panels:
                axes[row_index][col].plot(rhos, [r[key] for r in series], "o-", color=f"C{color}",
                                          label=f"{method} {key}")
            axes[1][col].plot(rhos, [r["token_layer_ratio"] for r in series], "x--", color=f"C{color}",
                              label=f"{method} token-layer ratio (exact)")
            axes[2][col].plot(rhos, [r["peak_extra_mib"] for r in series], "s:", color=f"C{color}",
                              label=f"{method} peak above weights")
        axes[0][col].axhline(full[time_key], color="k", ls=":", label=f"full {time_key}")
        axes[2][col].axhline(full["kv_cache_mib"], color="k", ls=":", label="full kv_cache_mib")
        if full["peak_extra_mib"] is not None:
            axes[2][col].axhline(full["peak_extra_mib"], color="grey", ls=":", label="full peak above weights")
        decode = ", ".join(f"{r['method']}@{r['keep_ratio']:g} {r[decode_key]:.1f}" for r in mine)
        # Wrapped to the column's width: one line of every policy's decode time ran past the figure's edge.
        decode_line = textwrap.fill(f"{decode_key}: {decode}", width=80, break_long_words=False)
        setting = ", compiled layers" if compiled else ""
        axes[0][col].set_title(f"{label}, {clip} clip ({full['tokens']} tokens){setting}\n{decode_line}",
                               fontsize=8)
        for row_index, _, unit in panels:
            axes[row_index][col].set_ylabel(unit)
            axes[row_index][col].legend(fontsize=6)
        axes[2][col].set_xlabel("keep ratio rho")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
