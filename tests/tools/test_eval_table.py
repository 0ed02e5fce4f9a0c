"""macer.eval.table without lmms-eval: row specs, which model arguments each row gets, rows whose lmms-eval run
failed (lmms-eval's own process is replaced by a stand-in that writes what lmms-eval writes), the markdown table and
the --help texts of the evaluation commands. tests/tools/test_eval_lmms.py runs the table through the real lmms-eval
CLI."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
from macer.eval import table


def _model_args_of(printed: str) -> dict[str, dict[str, str]]:
    """Row name -> its ``--model_args`` as a dict, from the commands that --dry-run prints."""
    rows = {}
    for line in printed.splitlines():
        cmd = shlex.split(line)
        pairs = dict(item.split("=", 1) for item in cmd[cmd.index("--model_args") + 1].split(","))
        rows[cmd[cmd.index("--output_path") + 1].rsplit("/", 1)[-1]] = pairs
    return rows


def test_model_args_go_to_the_rows_that_take_them(tmp_path, capsys):
    """Guards: --model-args given to every row, so layer arguments broke the full row (FullConfig got audio_layer)
    and single_readout (which sets audio_layer itself); issue 21 item 6."""
    code = table.main(["--pretrained", "ckpt", "--out", str(tmp_path), "--dry-run", "--rows", "full",
                       "fastv:layer=2@0.5", "macer@0.25", "single_readout@0.3", "shared_topk:video_layer=3@0.25",
                       "--model-args", "audio_layer=1", "video_layer=2", "video_frontend=torch",
                       "query_tokens=2"])
    assert code == 0
    out, err = capsys.readouterr()
    rows = _model_args_of(out)
    assert set(rows) == {"full", "fastv-layer2@0.5", "macer@0.25", "single_readout@0.3",
                         "shared_topk-video_layer3@0.25"}
    assert all(r["video_frontend"] == "torch" and r["pretrained"] == "ckpt" for r in rows.values())
    assert not {"audio_layer", "video_layer", "query_tokens", "keep_ratio"} & set(rows["full"])
    assert "audio_layer" not in rows["fastv-layer2@0.5"] and rows["fastv-layer2@0.5"]["layer"] == "2"
    assert (rows["macer@0.25"]["audio_layer"], rows["macer@0.25"]["video_layer"]) == ("1", "2")
    assert "audio_layer" not in rows["single_readout@0.3"] and rows["single_readout@0.3"]["video_layer"] == "2"
    assert rows["shared_topk-video_layer3@0.25"]["video_layer"] == "3"  # the row spec's own field wins
    assert "audio_layer" not in rows["shared_topk-video_layer3@0.25"]
    assert all(r["query_tokens"] == "2" for name, r in rows.items() if name != "full")
    # The rows left out are said on stderr, not silently.
    assert "--model-args audio_layer=1: not given to ['full', 'fastv-layer2@0.5', 'single_readout@0.3'" in err
    assert "--model-args query_tokens=2: not given to ['full']" in err


@pytest.mark.parametrize(("extra", "message"), [
    (["--model-args", "keep_ratio=0.5"], "keep_ratio is set by the row spec's @RATIO"),
    (["--model-args", "policy=fastv"], "policy is set by the row spec"),
    (["--model-args", "sample_log=x"], "sample_log is set by --out"),
    (["--model-args", "colour=red"], "'colour' is neither a model argument"),
    (["--model-args", "layer=2"], "'layer' is neither a model argument .* nor a field of any row's policy"),
    (["--model-args", "audio_layer"], "written key=value"),
    (["--rows", "macer:seed=1@0.25"], "'seed' is neither a field of policy 'macer'"),
    (["--rows", "shared_topk:audio_layer=1@0.25"], "'audio_layer' is neither a field of policy 'shared_topk'"),
    (["--rows", "full:keep_ratio=1"], "keep_ratio is set by the row spec's @RATIO"),
    (["--rows", "macer@2"], r"keep ratios must lie in \(0, 1\]"),
    (["--limit", "0"], "--limit: must be an integer >= 1"),
])
def test_bad_rows_and_model_args_are_refused_before_any_run(tmp_path, capsys, extra, message):
    """A mistake in a row or a model argument stops the command at once with a usage error (exit status 2),
    instead of a traceback or an lmms-eval run per row that fails on it."""
    argv = ["--pretrained", "ckpt", "--out", str(tmp_path), "--rows", "macer@0.25", *extra]
    with pytest.raises(SystemExit) as info:
        table.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m macer.eval.table: error:" in err
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir())


def _fake_lmms_eval(outcomes: dict[str, tuple[int, dict | None]], calls: list[str]):
    """A stand-in for ``subprocess.run`` of one row's lmms-eval: by row name, the exit status and the results it
    writes (None: it writes none, as lmms-eval does when it logs a failing model and exits 0)."""

    class Done:
        def __init__(self, code: int):
            self.returncode = code

    def run(cmd, check=False):
        assert not check  # a failing row must not abort the table
        out = cmd[cmd.index("--output_path") + 1]
        name = os.path.basename(out)
        calls.append(name)
        code, results = outcomes[name]
        if results is not None:
            os.makedirs(os.path.join(out, "model"), exist_ok=True)
            with open(os.path.join(out, "model", "20261126_results.json"), "w") as f:
                json.dump({"results": {t: {"accuracy,none": v} for t, v in results.items()}}, f)
            with open(os.path.join(out, "macer_samples.jsonl"), "w") as f:
                f.write(json.dumps({"task": "dailyomni", "audio_kept": 1, "video_kept": 3}) + "\n")
        return Done(code)

    return run


def test_failed_rows_are_marked_and_the_other_rows_still_run(tmp_path, capsys, monkeypatch):
    """Guards: lmms-eval logging an error and exiting 0 made the runner die with a FileNotFoundError traceback and
    write no table for the rows that had finished (issue 21 item 6); also an earlier run's results file in a row's
    folder must not stand in for the run that just failed."""
    stale = tmp_path / "full" / "model"
    stale.mkdir(parents=True)
    (stale / "old_results.json").write_text(json.dumps({"results": {"avutbench": {"accuracy,none": 99.0},
                                                                    "dailyomni": {"accuracy,none": 99.0}}}))
    os.utime(stale / "old_results.json", (1, 1))
    calls: list[str] = []
    outcomes = {"full": (0, None), "random@0.55": (1, None), "fastv-layer2@0.5": (0, {"dailyomni": 40.0}),
                "macer@0.25": (0, {"avutbench": 45.0, "dailyomni": 40.0})}
    monkeypatch.setattr(table.subprocess, "run", _fake_lmms_eval(outcomes, calls))
    monkeypatch.setattr(table, "_lmms_eval_installed", lambda: True)
    code = table.main(["--pretrained", "ckpt", "--out", str(tmp_path), "--benchmarks", "avutbench,dailyomni",
                       "--rows", "full", "random@0.55", "fastv:layer=2@0.5", "macer@0.25"])
    assert code == 1 and calls == list(outcomes)
    out = capsys.readouterr().out
    assert "rows failed: ['full', 'random@0.55', 'fastv-layer2@0.5']" in out
    text = (tmp_path / "table.md").read_text()
    assert "| full (failed) | 100% | - | failed | failed | - |" in text
    assert "| random@0.55 (failed) | 55% | - | failed | failed | - |" in text
    assert "| fastv-layer2@0.5 (failed) | 50% | 25.0 / 75.0 | failed | 40.00 | - |" in text
    assert "| macer@0.25 | 25% | 25.0 / 75.0 | 45.00 | 40.00 | - |" in text  # no full score: no Norm. Avg.
    assert "- full: lmms-eval wrote no score for ['avutbench', 'dailyomni']" in text
    assert "- random@0.55: lmms-eval exited with status 1" in text
    assert "- fastv-layer2@0.5: lmms-eval wrote no score for ['avutbench']" in text


def test_every_argument_of_the_wrapper_reaches_each_row(tmp_path, capsys):
    """Every argument of ``macer_qwen2_5_omni``'s constructor that the table does not set itself and that is no
    policy field (``attn_implementation``, ``dtype``, ``num_frames``, ...) reaches every row's ``--model_args``, given
    by --model-args or in a row spec. The names come from the wrapper's signature (importing it imports lmms-eval),
    so an argument the table would refuse or drop fails here."""
    import inspect

    lmms_model = pytest.importorskip("macer.eval.lmms_model", reason="needs lmms-eval (requirements-eval.txt)")
    signature = inspect.signature(lmms_model.MacerQwen2_5Omni.__init__)
    names = [name for name, p in signature.parameters.items()
             if name != "self" and p.kind != p.VAR_KEYWORD and name not in table._SET_BY_TABLE]
    assert "attn_implementation" in names and "dtype" in names
    given = {name: f"v{i}" for i, name in enumerate(names)}
    common = ["--pretrained", "ckpt", "--out", str(tmp_path), "--dry-run"]
    code = table.main([*common, "--rows", "full", "macer@0.25", "fastv:layer=2@0.5",
                       "--model-args", *(f"{k}={v}" for k, v in given.items())])
    assert code == 0, capsys.readouterr().err
    for name, args in _model_args_of(capsys.readouterr().out).items():
        assert {k: args.get(k) for k in given} == given, name
    for key, value in given.items():  # the same argument in one row's spec, for that row only
        code = table.main([*common, "--rows", f"random:{key}={value}@0.5", "full"])
        assert code == 0, capsys.readouterr().err
        rows = _model_args_of(capsys.readouterr().out)
        assert rows[f"random-{key}{value}@0.5"][key] == value and key not in rows["full"], key


def test_a_keep_ratio_of_one_is_a_row(tmp_path, capsys):
    """Keep ratio 1 lies in (0, 1]: ``macer@1`` is a row (the policy machinery at no pruning) whose keep_ratio
    reaches lmms-eval and builds the policy with keep ratio 1."""
    from macer.eval.policy import resolve_policy

    assert [(r.policy, r.keep_ratio) for r in table.parse_row("macer@0.5,1")] == [("macer", 0.5), ("macer", 1.0)]
    code = table.main(["--pretrained", "ckpt", "--out", str(tmp_path), "--dry-run", "--rows", "macer@1",
                       "random@1", "fastv:layer=2@1", "--model-args", "audio_layer=1", "video_layer=2"])
    assert code == 0, capsys.readouterr().err
    rows = _model_args_of(capsys.readouterr().out)
    assert set(rows) == {"macer@1", "random@1", "fastv-layer2@1"}
    for name, args in rows.items():
        assert float(args["keep_ratio"]) == 1.0, name
        fields = {k: int(v) if k.endswith("layer") else float(v) for k, v in args.items()
                  if k in ("keep_ratio", "audio_layer", "video_layer", "layer")}
        assert resolve_policy(args["policy"], **fields).keep_ratio == 1.0, name


def test_lmms_eval_missing_is_said_before_any_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(table, "_lmms_eval_installed", lambda: False)
    with pytest.raises(SystemExit):
        table.main(["--pretrained", "ckpt", "--out", str(tmp_path), "--rows", "full"])
    assert 'pip install --no-deps "lmms-eval==0.7.3"' in capsys.readouterr().err


def test_table_batch_size_option(tmp_path, capsys):
    common = ["--pretrained", "ckpt", "--out", str(tmp_path), "--rows", "full", "--dry-run"]
    assert table.main(common) == 0
    assert "--batch_size 1 " in capsys.readouterr().out
    assert table.main([*common, "--batch-size", "4"]) == 0
    assert "--batch_size 4 " in capsys.readouterr().out
    for bad in ("0", "auto", "-1"):
        with pytest.raises(SystemExit):
            table.main([*common, "--batch-size", bad])
        assert "--batch-size: must be an integer >= 1" in capsys.readouterr().err


def test_table_rows_and_rendering(tmp_path):
    rows = table.parse_row("macer:audio_share=0.4@0.25,0.35")
    assert [(r.policy, r.keep_ratio, r.params) for r in rows] == [("macer", 0.25, {"audio_share": "0.4"}),
                                                                  ("macer", 0.35, {"audio_share": "0.4"})]
    assert table.parse_row("full:num_frames=16")[0].params == {"num_frames": "16"}  # a model argument per row
    for bad, match in (("full@0.5", "no @ratio"), ("macer", "keep ratios"), ("omnizip@0.25", "policy must be"),
                       ("macer@1.5", r"\(0, 1\]"), ("macer:x@0.25", "key=value")):
        with pytest.raises(ValueError, match=match):
            table.parse_row(bad)
    log = tmp_path / "log.jsonl"
    samples = [("a", 3, 7), ("a", 1, 9), ("b", 5, 5)]  # task a: shares 0.3, 0.1 -> 0.2; task b: 0.5
    log.write_text("".join(json.dumps({"task": t, "audio_kept": a, "video_kept": v}) + "\n" for t, a, v in samples))
    audio, video = table.retained_av(log)
    assert abs(audio - 35.0) < 1e-9 and abs(video - 65.0) < 1e-9
    full, macer_row = table.parse_row("full")[0], table.parse_row("macer@0.25")[0]
    text = table.render([table.RowResult(full, {"avutbench": 50.0, "dailyomni": 40.0}),
                         table.RowResult(macer_row, {"avutbench": 45.0, "dailyomni": 40.0}, (30.0, 70.0))],
                        ["avutbench", "dailyomni"], "3B")
    assert "| macer@0.25 | 25% | 30.0 / 70.0 | 45.00 | 40.00 | 95.0% |" in text  # (45/50 + 40/40) / 2
    assert "| full | 100% | - | 50.00 | 40.00 | 100.0% |" in text
    assert "| MACER | 25% | 59.74 | 58.40 |" in text
    assert "Failed rows" not in text


def _help(main, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_texts_are_whole(capsys):
    """Guards: --help descriptions cut mid-sentence (the first line of a wrapped docstring) and a --rows help that
    said "see above" with nothing above (issue 21 item 6); prepare's --help must list the key names that
    docs/evaluation.md says it lists."""
    from macer.eval import prepare

    from benchmarks import bench_e2e

    text = _help(table.main, capsys)
    assert " ".join(table.__doc__.split()) in text  # the whole description, row specs included
    assert "A row spec is POLICY[:FIELD=VALUE...][@RATIO[,RATIO...]]" in text and "see above" not in text
    text = _help(prepare.main, capsys)
    assert " ".join(prepare.__doc__.split()) in text and "video_name" in text and "candidates" in text
    text = _help(bench_e2e.main, capsys)
    first = " ".join(bench_e2e.__doc__.split("\n\n")[0].split())
    assert first.endswith(".") and first in text, first


@pytest.mark.parametrize(("argv", "message"), [
    (["dailyomni", "--root", "/nonexistent/release"], r"release folder /nonexistent/release \(--root\) does not exist"),
    (["dailyomni", "--root", "{root}"], r"no qa\.json in .*pass --qa"),
    (["avutbench", "--root", "{root}", "--qa", "{root}/missing.json"],
     r"QA file .*missing\.json \(--qa\) does not exist"),
])
def test_prepare_missing_paths_are_usage_errors(tmp_path, capsys, argv, message):
    """Guards: ``prepare dailyomni --root /nonexistent`` and a missing --qa ended in a FileNotFoundError traceback
    (issue 21 item 7); each must be a usage error naming the path and the option."""
    from macer.eval import prepare

    argv = [a.replace("{root}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as info:
        prepare.main([*argv, "--out", str(tmp_path / "tasks")])
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_prepare_avutbench_passes_over_json_files_that_are_not_questions(tmp_path, capsys):
    """Guards: ``prepare avutbench`` took any ``*.jsonl`` under --root for the QA file (e.g. a macer_samples.jsonl
    log, or the task folder it wrote itself) and then failed with a ValueError traceback (issue 21 item 7)."""
    from macer.eval import prepare

    root = tmp_path / "release"
    (root / "videos").mkdir(parents=True)
    (root / "videos" / "v1.mp4").write_bytes(b"")
    (root / "macer_samples.jsonl").write_text(json.dumps({"task": "avutbench", "audio_kept": 1}) + "\n")
    (root / "meta.json").write_text(json.dumps({"version": 1}))
    (root / "annotations").mkdir()
    (root / "annotations" / "test.json").write_text(json.dumps([{"Question": "q", "Options": ["a", "b"],
                                                                 "Answer": "B", "video": "v1"}]))
    assert prepare.main(["avutbench", "--root", str(root), "--out", str(root / "tasks")]) == 0
    rows = [json.loads(x) for x in (root / "tasks" / "avutbench.jsonl").read_text().splitlines()]
    assert [(r["question"], r["answer"], r["video"]) for r in rows] == [("q", "B", str(root / "videos" / "v1.mp4"))]
    # Run again with the task folder inside the release: its avutbench.jsonl is not a second QA file.
    assert prepare.main(["avutbench", "--root", str(root), "--out", str(root / "tasks")]) == 0
    # Two QA files: ambiguous, said as a usage error that lists both.
    (root / "other.jsonl").write_text(json.dumps({"question": "q", "choices": ["a", "b"], "gt": 0, "video": "v1"}))
    with pytest.raises(SystemExit) as info:
        prepare.main(["avutbench", "--root", str(root), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "other.jsonl" in err and "test.json" in err and "pass --qa" in err


def test_a_new_results_file_counts_whatever_time_it_carries(tmp_path):
    """Guards reading this run's results by comparing file times with the clock: file systems stamp files with a
    coarser clock than ``time.time()`` (CI saw a file written just after a row started stamped before it, and the row
    marked failed). A file that is new, or changed, since the snapshot counts; an unchanged one does not."""
    old = tmp_path / "model" / "old_results.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"results": {"dailyomni": {"accuracy,none": 99.0}}}))
    before = table.result_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="from this run"):
        table.scores(tmp_path, before=before)
    new = tmp_path / "model" / "new_results.json"
    new.write_text(json.dumps({"results": {"dailyomni": {"accuracy,none": 40.0}}}))
    os.utime(new, (1, 1))  # stamped long before the snapshot was taken
    assert table.scores(tmp_path, before=before) == {"dailyomni": 40.0}
    os.utime(old, (2, 2))  # rewritten by this run (a changed time), and newer than the other
    assert table.scores(tmp_path, before=before) == {"dailyomni": 99.0}
