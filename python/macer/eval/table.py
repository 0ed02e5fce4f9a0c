"""Run a table (rows = policies x keep ratios, columns = benchmarks) with lmms-eval and write it as markdown beside
the paper's numbers: ``python -m macer.eval.table``.

    python -m macer.eval.table --pretrained Qwen/Qwen2.5-Omni-7B --tasks-dir tasks/ --out runs/7b \\
        --rows full macer@0.45,0.35,0.25 random@0.55 fastv:layer=2@0.5

Each row runs one ``lmms-eval --model macer_qwen2_5_omni`` process (so GPU memory is freed between rows) with
``--output_path <out>/<row>`` and the sample log ``<out>/<row>/macer_samples.jsonl``; ``<out>/table.md`` gets one
line per row: the scores, ``Norm. Avg.`` (``eq:normavg``: the mean over benchmarks of score / Full's score, in %,
when a ``full`` row is in the table) and ``Retained A/V`` (``tab:ablation``: per benchmark the mean over samples of
the audio share of the kept audio+video tokens, then the mean over benchmarks), followed by the paper's rows.
A row spec is ``POLICY[:field=value...][@RATIO[,RATIO...]]``; ``--batch-size N`` (default 1) is lmms-eval's
``--batch_size`` for every row (greedy answers and kept counts do not depend on it); ``--dry-run`` prints the
commands only.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BENCHMARKS", "PAPER", "Row", "main", "parse_row", "render", "retained_av", "scores"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    # task name -> (column title, metric key of lmms-eval's results)
    "avutbench": ("AVUT", "accuracy,none"),
    "dailyomni": ("DailyOmni", "accuracy,none"),
    "worldsense": ("WorldSense", "worldsense_score,none"),
    "videomme": ("Video-MME", "videomme_perception_score,none"),
}

PAPER: dict[str, list[tuple[str, float | None, dict[str, float | None]]]] = {
    # tab:main (Qwen2.5-Omni-7B / 3B): (row, retained ratio, {task: score}); tab:ablation rows at 25% for 7B.
    "7B": [
        ("Full Tokens", 1.0, {"avutbench": 64.5, "dailyomni": 62.1, "worldsense": 46.8, "videomme": 66.0}),
        ("Random", 0.55, {"avutbench": 61.0, "dailyomni": 59.2, "worldsense": 43.6, "videomme": 65.4}),
        ("FastV", 0.50, {"avutbench": 58.4, "dailyomni": 59.8, "worldsense": 44.3, "videomme": None}),
        ("MACER", 0.45, {"avutbench": 64.72, "dailyomni": 63.32, "worldsense": 44.00, "videomme": 66.9}),
        ("MACER", 0.35, {"avutbench": 64.63, "dailyomni": 62.32, "worldsense": 45.05, "videomme": 66.2}),
        ("MACER", 0.25, {"avutbench": 63.67, "dailyomni": 62.07, "worldsense": 44.80, "videomme": 66.2}),
        ("Shared top-K (ablation, A/V 57.6/42.4)", 0.25,
         {"avutbench": 61.27, "dailyomni": 59.57, "worldsense": 43.60}),
        ("MACER no coverage (ablation, A/V 30.0/70.0)", 0.25,
         {"avutbench": 63.33, "dailyomni": 61.82, "worldsense": 44.47}),
        ("Single readout layer (ablation, A/V 30.0/70.0)", 0.25,
         {"avutbench": 57.47, "dailyomni": 60.87, "worldsense": 44.80}),
    ],
    "3B": [
        ("Full Tokens", 1.0, {"avutbench": 62.2, "dailyomni": 60.2, "worldsense": 46.4, "videomme": 62.6}),
        ("Random", 0.55, {"avutbench": 58.7, "dailyomni": 57.4, "worldsense": 42.8, "videomme": 61.1}),
        ("FastV", 0.50, {"avutbench": 55.9, "dailyomni": 58.0, "worldsense": 44.4, "videomme": None}),
        ("MACER", 0.45, {"avutbench": 62.13, "dailyomni": 59.15, "worldsense": 46.45, "videomme": 63.21}),
        ("MACER", 0.35, {"avutbench": 60.52, "dailyomni": 58.15, "worldsense": 45.55, "videomme": 63.37}),
        ("MACER", 0.25, {"avutbench": 59.74, "dailyomni": 58.40, "worldsense": 44.24, "videomme": 63.01}),
    ],
}
"""The paper's numbers (``tab:main``, ``tab:ablation``); None where the paper has none (FastV on Video-MME)."""


@dataclass
class Row:
    """One table row: a policy, its fields and a keep ratio (None for ``full``)."""

    policy: str
    keep_ratio: float | None
    params: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in sorted(self.params.items()))
        return f"{self.policy}{extra}" + ("" if self.keep_ratio is None else f"@{self.keep_ratio:g}")


def parse_row(spec: str) -> list[Row]:
    """``"macer:audio_share=0.4@0.25,0.35"`` -> two rows; ``"full"`` -> one row without a keep ratio."""
    import macer

    head, _, ratios = spec.partition("@")
    policy, *fields = head.split(":")
    if policy not in macer.POLICY_NAMES:
        raise ValueError(f"row {spec!r}: policy must be one of {list(macer.POLICY_NAMES)}")
    params = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"row {spec!r}: fields are written key=value, got {item!r}")
        params[key] = value
    if policy == "full":
        if ratios:
            raise ValueError(f"row {spec!r}: the full row keeps every token; give no @ratio")
        return [Row(policy, None, params)]
    if not ratios:
        raise ValueError(f"row {spec!r}: give the keep ratios, e.g. {policy}@0.25,0.35")
    rows = []
    for text in ratios.split(","):
        ratio = float(text)
        if not 0 < ratio <= 1:
            raise ValueError(f"row {spec!r}: keep ratios must lie in (0, 1], got {text}")
        rows.append(Row(policy, ratio, params))
    return rows


def command(row: Row, args: argparse.Namespace) -> list[str]:
    """The lmms-eval command line of one row."""
    out = Path(args.out) / row.name
    model_args = {"pretrained": args.pretrained, "policy": row.policy, **row.params,
                  "sample_log": str(out / "macer_samples.jsonl")}
    if row.keep_ratio is not None:
        model_args["keep_ratio"] = row.keep_ratio
    for extra in args.model_args or []:
        key, _, value = extra.partition("=")
        model_args[key] = value
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "macer_qwen2_5_omni",
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", ",".join(args.benchmarks), "--batch_size", str(args.batch_size), "--log_samples",
           "--output_path", str(out)]
    if args.tasks_dir:
        cmd += ["--include_path", str(args.tasks_dir)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    return cmd


def scores(row_dir: Path) -> dict[str, float]:
    """``{task: score}`` from the newest ``*results.json`` lmms-eval wrote under ``row_dir``."""
    found = sorted(row_dir.rglob("*results.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no lmms-eval results under {row_dir}")
    results = json.loads(found[-1].read_text())["results"]
    return {task: float(results[task][metric]) for task, (_, metric) in BENCHMARKS.items() if task in results}


def retained_av(log: Path) -> tuple[float, float] | None:
    """Retained A/V (%) from a sample log: per task the mean over samples of ``audio_kept / (audio_kept +
    video_kept)``, then the mean over tasks (the benchmark-macro composition of ``tab:ablation``)."""
    if not log.exists():
        return None
    shares: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        sample = json.loads(line)
        kept = sample["audio_kept"] + sample["video_kept"]
        if kept:
            shares.setdefault(sample["task"], []).append(sample["audio_kept"] / kept)
    if not shares:
        return None
    audio = 100 * sum(sum(v) / len(v) for v in shares.values()) / len(shares)
    return audio, 100 - audio


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(results: list[tuple[Row, dict[str, float], tuple[float, float] | None]], benchmarks: Sequence[str],
           size: str) -> str:
    """The markdown table of measured rows, then the paper's rows for ``size`` (``"7B"`` / ``"3B"``)."""
    titles = [BENCHMARKS[b][0] for b in benchmarks]
    head = f"| Row | Retained | Retained A/V | {' | '.join(titles)} | Norm. Avg. |"
    lines = ["## Measured (macer_qwen2_5_omni)", "", head, "|" + "---|" * (len(titles) + 4)]
    full = next((s for r, s, _ in results if r.policy == "full"), None)
    for row, score, av in results:
        norm = None
        if full and all(b in score and full.get(b) for b in benchmarks):
            norm = 100 * sum(score[b] / full[b] for b in benchmarks) / len(benchmarks)
        ratio = "100%" if row.keep_ratio is None else f"{100 * row.keep_ratio:g}%"
        av_text = "-" if av is None else f"{av[0]:.1f} / {av[1]:.1f}"
        cells = " | ".join(_cell(score.get(b)) for b in benchmarks)
        lines.append(f"| {row.name} | {ratio} | {av_text} | {cells} | {'-' if norm is None else f'{norm:.1f}%'} |")
    lines += ["", f"## Paper (Qwen2.5-Omni-{size}, tab:main / tab:ablation)", "",
              f"| Row | Retained | {' | '.join(titles)} |", "|" + "---|" * (len(titles) + 2)]
    for name, ratio, paper_scores in PAPER[size]:
        cells = " | ".join(_cell(paper_scores.get(b)) for b in benchmarks)
        lines.append(f"| {name} | {100 * ratio:g}% | {cells} |")
    return "\n".join(lines) + "\n"


def _batch_size(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m macer.eval.table", description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", required=True, help="Qwen2.5-Omni checkpoint (folder or hub id)")
    parser.add_argument("--out", required=True, help="folder for the runs and table.md")
    parser.add_argument("--rows", nargs="+", default=["full", "random@0.55", "fastv:layer=2@0.5",
                                                      "macer@0.45,0.35,0.25"], help="row specs (see above)")
    parser.add_argument("--benchmarks", type=lambda s: s.split(","), default=list(BENCHMARKS),
                        help=f"comma-separated lmms-eval tasks, default {','.join(BENCHMARKS)}")
    parser.add_argument("--tasks-dir", help="folder of the prepared avutbench/dailyomni tasks (--include_path)")
    parser.add_argument("--size", choices=sorted(PAPER), default="7B", help="which paper numbers to print")
    parser.add_argument("--model-args", nargs="*", help="extra key=value model arguments for every row")
    parser.add_argument("--limit", type=int, help="questions per benchmark (smoke runs)")
    parser.add_argument("--batch-size", type=_batch_size, default=1,
                        help="prompts per generate call (lmms-eval's --batch_size, an integer >= 1; default 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    unknown = [b for b in args.benchmarks if b not in BENCHMARKS]
    if unknown:
        parser.error(f"--benchmarks: unknown {unknown}; known: {list(BENCHMARKS)}")
    rows = [row for spec in args.rows for row in parse_row(spec)]
    results = []
    for row in rows:
        cmd = command(row, args)
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        subprocess.run(cmd, check=True)
        row_dir = Path(args.out) / row.name
        results.append((row, scores(row_dir), retained_av(row_dir / "macer_samples.jsonl")))
    if args.dry_run:
        return 0
    table = Path(args.out) / "table.md"
    table.write_text(render(results, args.benchmarks, args.size))
    print(f"wrote {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
