"""Run a table (rows = policies x keep ratios, columns = benchmarks) with lmms-eval and write it as markdown beside
the paper's numbers.

    python -m macer.eval.table --pretrained Qwen/Qwen2.5-Omni-7B --tasks-dir tasks/ --out runs/7b \\
        --rows full macer@0.45,0.35,0.25 random@0.55 fastv:layer=2@0.5

A row spec is POLICY[:FIELD=VALUE...][@RATIO[,RATIO...]]: a policy of macer.POLICY_NAMES, fields of that policy (or
model arguments such as num_frames) for this row only, and its keep ratios in (0, 1], one row per ratio; "full" takes
no ratio. --model-args KEY=VALUE ... go to every row that takes them: model arguments (device, dtype,
attn_implementation, num_frames, max_pixels, video_frontend, system_prompt) to all rows, a policy field (audio_layer,
video_layer, layer, seed, ...) to the rows whose policy has that field (the others are listed on stderr); a row
spec's own fields win.

Each row runs one "lmms-eval --model macer_qwen2_5_omni" process (so GPU memory is freed between rows) with
--output_path OUT/ROW and the sample log OUT/ROW/macer_samples.jsonl. OUT/table.md gets one line per row: the scores,
Norm. Avg. (eq:normavg: the mean over benchmarks of score / Full's score, in %, when a full row is in the table) and
Retained A/V (tab:ablation: per benchmark the mean over samples of the audio share of the kept audio+video tokens,
then the mean over benchmarks), followed by the paper's rows. A row whose lmms-eval run failed or wrote no score for
a benchmark (lmms-eval logs a failing model and exits 0) is marked "failed" with the reason under the table; the
other rows still run, and the exit status is then 1. --batch-size N (default 1) is lmms-eval's --batch_size for every
row (greedy answers and kept counts do not depend on it); --dry-run prints the commands only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from macer.eval.policy import policy_fields

__all__ = ["BENCHMARKS", "MODEL_ARGS", "PAPER", "Row", "RowResult", "main", "parse_row", "render", "retained_av",
           "row_model_args", "scores"]

MODEL_ARGS = ("device", "dtype", "attn_implementation", "num_frames", "max_pixels", "video_frontend", "system_prompt")
"""The arguments of ``macer_qwen2_5_omni`` that are not policy fields (and not set by the table): every row takes
them."""

_SET_BY_TABLE = {"pretrained": "--pretrained", "policy": "the row spec", "keep_ratio": "the row spec's @RATIO",
                 "sample_log": "--out", "batch_size": "--batch-size", "max_batch_size": "--batch-size"}

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
        if key in _SET_BY_TABLE:
            raise ValueError(f"row {spec!r}: {key} is set by {_SET_BY_TABLE[key]}, not as a field")
        if key not in policy_fields(policy) and key not in MODEL_ARGS:
            raise ValueError(f"row {spec!r}: {key!r} is neither a field of policy {policy!r} "
                             f"{list(policy_fields(policy))} nor a model argument {list(MODEL_ARGS)}")
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


def row_model_args(row: Row, model_args: dict[str, str]) -> dict[str, str]:
    """The ``--model-args`` that ``row`` takes: every model argument, and the policy fields of its policy."""
    return {k: v for k, v in model_args.items() if k in MODEL_ARGS or k in policy_fields(row.policy)}


def command(row: Row, args: argparse.Namespace) -> list[str]:
    """The lmms-eval command line of one row (``args.model_args``: the parsed ``--model-args``)."""
    out = Path(args.out) / row.name
    model_args = {"pretrained": args.pretrained, "policy": row.policy, **row_model_args(row, args.model_args),
                  **row.params, "sample_log": str(out / "macer_samples.jsonl")}
    if row.keep_ratio is not None:
        model_args["keep_ratio"] = row.keep_ratio
    cmd = [sys.executable, "-m", "lmms_eval", "--model", "macer_qwen2_5_omni",
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", ",".join(args.benchmarks), "--batch_size", str(args.batch_size), "--log_samples",
           "--output_path", str(out)]
    if args.tasks_dir:
        cmd += ["--include_path", str(args.tasks_dir)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    return cmd


def result_files(row_dir: Path) -> dict[Path, int]:
    """The ``*results.json`` files under ``row_dir`` with their modification times (ns)."""
    return {p: p.stat().st_mtime_ns for p in row_dir.rglob("*results.json")} if row_dir.exists() else {}


def scores(row_dir: Path, before: dict[Path, int] | None = None) -> dict[str, float]:
    """``{task: score}`` from the newest ``*results.json`` lmms-eval wrote under ``row_dir``, leaving out the files
    ``before`` lists unchanged (``result_files`` taken before the run), so that an earlier run's file in the same
    folder is not taken for this run's. Files are told apart by path and modification time, not by comparing a file's
    time with the clock: the file system's timestamps are coarser than ``time.time()``, and a file written just after
    the run started may carry an earlier time."""
    found = sorted((p for p, mtime in result_files(row_dir).items() if before is None or before.get(p) != mtime),
                   key=lambda p: p.stat().st_mtime_ns)
    if not found:
        raise FileNotFoundError(f"no lmms-eval results under {row_dir}" + ("" if before is None else
                                                                           " from this run"))
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


@dataclass
class RowResult:
    """What one row's lmms-eval run gave: its scores by task, Retained A/V, and why it failed (None if it did not;
    a row with a score for some benchmarks only is failed for the others)."""

    row: Row
    scores: dict[str, float]
    retained: tuple[float, float] | None = None
    error: str | None = None


def render(results: Sequence[RowResult], benchmarks: Sequence[str], size: str) -> str:
    """The markdown table of measured rows (a failed row's missing scores read "failed", the reasons follow the
    table), then the paper's rows for ``size`` (``"7B"`` / ``"3B"``)."""
    titles = [BENCHMARKS[b][0] for b in benchmarks]
    head = f"| Row | Retained | Retained A/V | {' | '.join(titles)} | Norm. Avg. |"
    lines = ["## Measured (macer_qwen2_5_omni)", "", head, "|" + "---|" * (len(titles) + 4)]
    full = next((r.scores for r in results if r.row.policy == "full"), None)
    for result in results:
        row, score, av = result.row, result.scores, result.retained
        norm = None
        if full and all(b in score and full.get(b) for b in benchmarks):
            norm = 100 * sum(score[b] / full[b] for b in benchmarks) / len(benchmarks)
        ratio = "100%" if row.keep_ratio is None else f"{100 * row.keep_ratio:g}%"
        av_text = "-" if av is None else f"{av[0]:.1f} / {av[1]:.1f}"
        missing = "failed" if result.error else "-"
        cells = " | ".join(missing if score.get(b) is None else _cell(score[b]) for b in benchmarks)
        name = f"{row.name} (failed)" if result.error else row.name
        lines.append(f"| {name} | {ratio} | {av_text} | {cells} | {'-' if norm is None else f'{norm:.1f}%'} |")
    failed = [r for r in results if r.error]
    if failed:
        lines += ["", "Failed rows (rerun them; lmms-eval's output for each is in the log of this run):", ""]
        lines += [f"- {r.row.name}: {r.error}" for r in failed]
    lines += ["", f"## Paper (Qwen2.5-Omni-{size}, tab:main / tab:ablation)", "",
              f"| Row | Retained | {' | '.join(titles)} |", "|" + "---|" * (len(titles) + 2)]
    for name, ratio, paper_scores in PAPER[size]:
        cells = " | ".join(_cell(paper_scores.get(b)) for b in benchmarks)
        lines.append(f"| {name} | {100 * ratio:g}% | {cells} |")
    return "\n".join(lines) + "\n"


def run_row(row: Row, args: argparse.Namespace) -> RowResult:
    """Run one row's lmms-eval process and read what it wrote; a failure is recorded, not raised."""
    cmd = command(row, args)
    row_dir = Path(args.out) / row.name
    before = result_files(row_dir)
    code = subprocess.run(cmd).returncode
    try:
        got = scores(row_dir, before=before)
    except FileNotFoundError:
        got = {}
    missing = [b for b in args.benchmarks if b not in got]
    error = None
    if code:
        error = f"lmms-eval exited with status {code}"
    elif missing:
        error = (f"lmms-eval wrote no score for {missing} under {row_dir} (it logs an error of the model or a task "
                 "and still exits 0: see its output for this row)")
    return RowResult(row, got, retained_av(row_dir / "macer_samples.jsonl") if got else None, error)


def _lmms_eval_installed() -> bool:
    return importlib.util.find_spec("lmms_eval") is not None


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _model_args(items: Sequence[str], rows: Sequence[Row]) -> tuple[dict[str, str], list[str]]:
    """``--model-args`` -> ``{key: value}`` and the notes on rows that do not take a key; ``ValueError`` for a key
    the table sets itself or that no row takes."""
    parsed: dict[str, str] = {}
    notes = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"model arguments are written key=value, got {item!r}")
        if key in _SET_BY_TABLE:
            raise ValueError(f"{key} is set by {_SET_BY_TABLE[key]}, not by --model-args")
        if key not in MODEL_ARGS:
            skipped = [r.name for r in rows if key not in policy_fields(r.policy)]
            if len(skipped) == len(rows):
                raise ValueError(f"{key!r} is neither a model argument {list(MODEL_ARGS)} nor a field of any row's "
                                 f"policy ({sorted({r.policy for r in rows})})")
            if skipped:
                notes.append(f"--model-args {item}: not given to {skipped} (their policy has no field {key})")
        parsed[key] = value
    return parsed, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m macer.eval.table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", required=True, help="Qwen2.5-Omni checkpoint (folder or hub id)")
    parser.add_argument("--out", required=True, help="folder for the runs and table.md")
    parser.add_argument("--rows", nargs="+", default=["full", "random@0.55", "fastv:layer=2@0.5",
                                                      "macer@0.45,0.35,0.25"],
                        help="row specs POLICY[:FIELD=VALUE...][@RATIO[,RATIO...]] (see the description; default: "
                             "%(default)s)")
    parser.add_argument("--benchmarks", type=lambda s: s.split(","), default=list(BENCHMARKS),
                        help=f"comma-separated lmms-eval tasks (default: {','.join(BENCHMARKS)})")
    parser.add_argument("--tasks-dir", help="folder of the prepared avutbench/dailyomni tasks (--include_path)")
    parser.add_argument("--size", choices=sorted(PAPER), default="7B",
                        help="which paper numbers to print (default: %(default)s)")
    parser.add_argument("--model-args", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model arguments and policy fields for the rows that take them (see the description)")
    parser.add_argument("--limit", type=_positive_int, help="questions per benchmark (smoke runs)")
    parser.add_argument("--batch-size", type=_positive_int, default=1,
                        help="prompts per generate call (lmms-eval's --batch_size, an integer >= 1; "
                             "default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    unknown = [b for b in args.benchmarks if b not in BENCHMARKS]
    if unknown:
        parser.error(f"--benchmarks: unknown {unknown}; known: {list(BENCHMARKS)}")
    try:
        rows = [row for spec in args.rows for row in parse_row(spec)]
    except ValueError as exc:
        parser.error(f"--rows: {exc}")
    try:
        args.model_args, notes = _model_args(args.model_args, rows)
    except ValueError as exc:
        parser.error(f"--model-args: {exc}")
    for note in notes:
        print(note, file=sys.stderr)
    if not args.dry_run and not _lmms_eval_installed():
        parser.error("lmms-eval is not installed: pip install --no-deps \"lmms-eval==0.7.3\" after pip install "
                     "\".[eval]\" (README, Install)")
    results = []
    for row in rows:
        print(shlex.join(command(row, args)), flush=True)
        if not args.dry_run:
            results.append(run_row(row, args))
    if args.dry_run:
        return 0
    table = Path(args.out) / "table.md"
    table.write_text(render(results, args.benchmarks, args.size))
    failed = [r.row.name for r in results if r.error]
    print(f"wrote {table}" + (f"; {len(failed)} of {len(results)} rows failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
