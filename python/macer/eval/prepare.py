"""Turn a benchmark's public release into an lmms-eval task folder.

    python -m macer.eval.prepare dailyomni --root /data/Daily-Omni --out tasks/
    python -m macer.eval.prepare avutbench --root /data/AVUT --out tasks/
    lmms-eval --include_path tasks/ --tasks dailyomni,avutbench ...

writes tasks/NAME.jsonl (one question per line, absolute video paths; schema in macer.eval.tasks.mcq) and
tasks/NAME.yaml (the task shipped in macer/eval/tasks; lmms-eval resolves its data_files beside it).

Public formats read:

* Daily-Omni (liarliar/Daily-Omni: qa.json + Videos/): a JSON list (or an object of entries) with Question, Choice
  (["A. ...", ...]), Answer (a letter), video_id, Type; the video is Videos/VIDEO_ID/VIDEO_ID_video.mp4 (the layout
  of the authors' evaluation script). --qa names another QA file.
* AVUTBench: a JSON list / object of entries or a JSONL file, given as --qa or found under --root: the one *.json /
  *.jsonl file there whose first entry has a question and an options key (other JSON files, such as a
  macer_samples.jsonl log or a task folder's NAME.jsonl, are passed over). Keys are matched case-insensitively:
  question (question), options (options, choices, choice, candidates; a list, or an object letter -> text), answer
  (a letter, an option's text or a 0-based index; answer, gt, label, correct_answer), video (video, video_path,
  video_name, video_id, videoid; relative to --root or --root/videos, .mp4 added when missing), category (task,
  task_type, type, category). The release's exact field names could not be checked here; a missing key is an error
  that names the keys tried.

A missing --root or QA file, a missing key or a missing video is an error that names it (--skip-missing leaves the
questions whose video is missing out and says how many).
"""

from __future__ import annotations

import argparse
import json
import shutil
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TASKS", "main", "prepare"]

TASKS = ("dailyomni", "avutbench")
_KEYS = {
    "question": ("question",),
    "options": ("options", "choices", "choice", "candidates"),
    "answer": ("answer", "gt", "label", "correct_answer"),
    "video": ("video", "video_path", "video_name", "video_id", "videoid"),
    "category": ("task", "task_type", "type", "category"),
}


def _entries(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        data = list(data.values())
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise ValueError("the QA file must hold a list of objects (or an object whose values are objects)")
    return data


def _load(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
                else json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid {'JSONL' if path.suffix == '.jsonl' else 'JSON'} ({exc})") from exc
    try:
        return _entries(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _looks_like_qa(path: Path) -> bool:
    """Whether ``path``'s first entry has a question and an options key (a QA file, not a log or a config)."""
    if path.suffix == ".jsonl" and path.stem in TASKS and path.with_suffix(".yaml").exists():
        return False  # a task folder this module wrote (its questions are already prepared)
    try:
        entries = _load(path)
    except (ValueError, UnicodeDecodeError):
        return False
    keys = {k.lower() for k in entries[0]} if entries else set()
    return bool(keys & set(_KEYS["question"])) and bool(keys & set(_KEYS["options"]))


def _get(entry: dict[str, Any], field: str, where: str) -> Any:
    lowered = {k.lower(): v for k, v in entry.items()}
    for key in _KEYS[field]:
        if key in lowered:
            return lowered[key]
    raise ValueError(f"{where}: no {field} key (tried {list(_KEYS[field])}); keys present: {sorted(entry)}")


def _options(raw: Any, where: str) -> list[str]:
    if isinstance(raw, dict):
        raw = [f"{k}. {v}" for k, v in sorted(raw.items())]
    if not isinstance(raw, list) or not 2 <= len(raw) <= 26:
        raise ValueError(f"{where}: options must be a list of 2..26 strings, got {raw!r}")
    out = []
    for letter, option in zip(string.ascii_uppercase, raw):
        option = str(option).strip()
        # Keep a release's own "A. text" / "(A) text" labels; label bare texts so the prompt names every letter.
        labelled = option[:1] == letter and option[1:2] in (".", ")", ":", " ")
        out.append(option if labelled or option.startswith(f"({letter})") else f"{letter}. {option}")
    return out


def _answer(raw: Any, options: list[str], where: str) -> str:
    letters = string.ascii_uppercase[: len(options)]
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < len(options):
        return letters[raw]
    text = str(raw).strip()
    if len(text) >= 1 and text[0] in letters and (len(text) == 1 or text[1] in ".):"):
        return text[0]
    for letter, option in zip(letters, options):
        if text and option.split(" ", 1)[-1].strip() == text:
            return letter
    raise ValueError(f"{where}: answer {raw!r} is not a letter in {letters}, an option's text or an index")


def _dailyomni(root: Path, qa: Path | None) -> list[dict[str, Any]]:
    if qa is None:
        qa = root / "qa.json"
        if not qa.is_file():
            raise FileNotFoundError(f"dailyomni: no qa.json in {root} (the release's QA file); pass --qa")
    rows = []
    for i, entry in enumerate(_load(qa)):
        where = f"{qa}: entry {i}"
        options = _options(_get(entry, "options", where), where)
        video_id = str(_get(entry, "video", where))
        rows.append({"id": f"{video_id}-{i}", "video": str(root / "Videos" / video_id / f"{video_id}_video.mp4"),
                     "question": str(_get(entry, "question", where)), "options": options,
                     "answer": _answer(_get(entry, "answer", where), options, where),
                     "category": str(entry.get("Type", ""))})
    return rows


def _avutbench(root: Path, qa: Path | None) -> list[dict[str, Any]]:
    if qa is None:
        files = sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
        found = [p for p in files if _looks_like_qa(p)]
        if len(found) != 1:
            raise ValueError(f"avutbench: expected one QA file (*.json/*.jsonl whose entries have question and "
                             f"options keys) under {root}, found {[str(p) for p in found]} among "
                             f"{[str(p) for p in files]}; pass --qa")
        qa = found[0]
    rows = []
    for i, entry in enumerate(_load(qa)):
        where = f"{qa}: entry {i}"
        options = _options(_get(entry, "options", where), where)
        name = str(_get(entry, "video", where))
        name = name if Path(name).suffix else f"{name}.mp4"
        candidates = [Path(name)] if Path(name).is_absolute() else [root / name, root / "videos" / name]
        video = next((c for c in candidates if c.exists()), candidates[0])
        category = next((entry[k] for k in entry if k.lower() in _KEYS["category"]), "")
        rows.append({"id": str(entry.get("id", i)), "video": str(video),
                     "question": str(_get(entry, "question", where)), "options": options,
                     "answer": _answer(_get(entry, "answer", where), options, where), "category": str(category)})
    return rows


def prepare(task: str, root: str | Path, out: str | Path, *, qa: str | Path | None = None,
            skip_missing: bool = False) -> Path:
    """Write ``out/<task>.jsonl`` and ``out/<task>.yaml`` from a release under ``root``; returns the YAML's path.

    Raises ``FileNotFoundError`` when ``root`` or ``qa`` does not exist, and when videos are missing unless
    ``skip_missing`` (then those questions are left out and their count is printed: the score is then over fewer
    questions than the benchmark's); ``ValueError`` for a QA file that cannot be read or lacks a key.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    root, out = Path(root).expanduser().resolve(), Path(out).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{task}: the release folder {root} (--root) does not exist or is not a folder")
    qa = Path(qa).expanduser() if qa else None
    if qa is not None and not qa.is_file():
        raise FileNotFoundError(f"{task}: the QA file {qa} (--qa) does not exist")
    rows = (_dailyomni if task == "dailyomni" else _avutbench)(root, qa)
    missing = [r["video"] for r in rows if not Path(r["video"]).is_file()]
    if missing and not skip_missing:
        raise FileNotFoundError(f"{len(missing)} of {len(rows)} videos are missing, e.g. {missing[:3]} "
                                "(--skip-missing leaves those questions out)")
    if missing:
        print(f"{task}: left out {len(missing)} of {len(rows)} questions whose video is missing", file=sys.stderr)
        rows = [r for r in rows if Path(r["video"]).is_file()]
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"{task}.jsonl").open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    yaml_path = out / f"{task}.yaml"
    shutil.copyfile(Path(__file__).parent / "tasks" / f"{task}.yaml", yaml_path)
    return yaml_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m macer.eval.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--root", required=True, help="the benchmark's release folder (QA file and videos)")
    parser.add_argument("--out", required=True, help="task folder to write (give it to --include_path)")
    parser.add_argument("--qa", help="QA file, when not at the release's usual place")
    parser.add_argument("--skip-missing", action="store_true", help="leave out questions whose video is missing")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.task, args.root, args.out, qa=args.qa, skip_missing=args.skip_missing)
    except (OSError, ValueError) as exc:  # a missing folder, file, key or video: the message names it
        parser.error(str(exc))
    print(f"wrote {path} and {path.with_suffix('.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
