"""lmms-eval in process on a synthetic Daily-Omni release with a tiny random Qwen2.5-Omni checkpoint (no download).

Each policy runs through ``--model macer_qwen2_5_omni`` (the entry point), the shipped ``dailyomni`` task YAML
(written by ``macer.eval.prepare``) and real MP4 files with audio tracks; the per-sample log must show that the
policy ran (kept counts against the budget), and a failing generation must raise instead of scoring "".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("lmms_eval", reason="needs the eval extra (make test installs requirements-eval.txt)")
pytest.importorskip("av", reason="needs PyAV (requirements-eval.txt)")

import macer
from macer import FastVConfig, FullConfig, MacerConfig, RandomConfig
from macer.eval import prepare as prepare_module
from macer.eval.policy import describe_policy
from macer.eval.synthetic import write_checkpoint, write_clip, write_dailyomni_release
from macer.testing import SYNTHETIC_TOKENS

LAYERS = {"audio_layer": 1, "video_layer": 2}
# Non-default keep ratios and fields (the class defaults are keep_ratio 0.25, audio_share 0.30, coverage_weight 0.20,
# num_chunks 8, query_tokens 4, query "last", seed 0): a field that does not reach the policy changes the log.
POLICY_ARGS = {
    "full": {},
    "macer": {"keep_ratio": 0.4, "audio_share": 0.5, "coverage_weight": 0.6, "num_chunks": 3, "query_tokens": 2,
              **LAYERS},
    "fastv": {"keep_ratio": 0.45, "layer": 2, "query": "question", "query_tokens": 3},
    "random": {"keep_ratio": 0.55, "seed": 3},
    "macer_raw": {"keep_ratio": 0.35, "audio_share": 0.45, **LAYERS},
    "shared_topk": {"keep_ratio": 0.4, "video_layer": 2, "query_tokens": 2},
    "no_coverage": {"keep_ratio": 0.3, "num_chunks": 3, **LAYERS},
    "single_readout": {"keep_ratio": 0.3, "video_layer": 2},  # the tiny model has no paper layers: give the one
}
FRAMES = 12
CLIP_SIZE = (64, 48)  # width, height: smart_resize -> 56 x 56 -> 2 x 2 merged tokens per 2-frame group


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    # lmms-eval caches the loaded JSONL under ~/.cache/huggingface unless told otherwise (also for the CLI run).
    env = pytest.MonkeyPatch()
    env.setenv("LMMS_EVAL_DATASETS_CACHE", str(root / "datasets_cache"))
    checkpoint = write_checkpoint(root / "tiny")
    release = write_dailyomni_release(root / "release", questions=2)
    tasks = root / "tasks"
    prepare_module.prepare("dailyomni", release, tasks)
    from lmms_eval.tasks import TaskManager

    # include_defaults=False: indexing lmms-eval's ~200 built-in task folders takes seconds and none is used here.
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    # Three questions about clips of different lengths: prompts of three lengths, so a batch is left-padded, and an
    # odd count, so the last batch of 2 is short.
    batch_release = write_dailyomni_release(root / "batch_release", questions=3, seconds=(2.0, 3.0, 2.5))
    batch_tasks = root / "batch_tasks"
    prepare_module.prepare("dailyomni", batch_release, batch_tasks)
    batch_manager = TaskManager(include_path=str(batch_tasks), include_defaults=False)
    yield {"root": root, "checkpoint": checkpoint, "tasks": tasks, "manager": manager, "batch_manager": batch_manager}
    env.undo()


def _evaluate(setup, policy: str, log, limit: int | None = None, batch_size: int | str = 1, manager: str = "manager",
              **extra):
    from lmms_eval.evaluator import simple_evaluate

    args = {"pretrained": setup["checkpoint"], "policy": policy, "video_frontend": "torch", "sample_log": log,
            "num_frames": FRAMES, **POLICY_ARGS.get(policy, {}), **extra}
    model_args = ",".join(f"{k}={v}" for k, v in args.items())
    return simple_evaluate(model="macer_qwen2_5_omni", model_args=model_args, tasks=["dailyomni"],
                           task_manager=setup[manager], log_samples=True, batch_size=batch_size, device="cpu",
                           limit=limit)


def _paper_policy(name: str):
    """The policy ``name`` with ``POLICY_ARGS[name]``, written from its definition (``macer.ABLATIONS``), not through
    ``make_policy`` / ``resolve_policy``: the oracle of what the wrapper must run."""
    args, eot = dict(POLICY_ARGS[name]), SYNTHETIC_TOKENS.im_end
    if name == "full":
        return FullConfig()
    if name == "random":
        return RandomConfig(**args)
    if name == "fastv":
        return FastVConfig(**args, end_of_turn_token_id=eot)
    if name == "shared_topk":
        return FastVConfig(keep_ratio=args["keep_ratio"], layer=args["video_layer"], query="question",
                           query_tokens=args["query_tokens"], end_of_turn_token_id=eot)
    fixed = {"macer": {}, "macer_raw": {"scoring": "raw"}, "no_coverage": {"coverage_weight": 0.0},
             "single_readout": {"audio_layer": args["video_layer"]}}[name]
    return MacerConfig(**args, **fixed, end_of_turn_token_id=eot)


def _record_runs(monkeypatch) -> list[dict]:
    """Record every ``macer.compress`` the wrapper opens: the model, the policy object, the trace, and the inputs of
    the ``generate`` inside it."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Thinker

    runs, compress, generate = [], macer.compress, Thinker.generate

    @contextlib.contextmanager
    def recording_compress(model, policy, **kwargs):
        with compress(model, policy, **kwargs) as trace:
            runs.append({"model": model, "policy": policy, "trace": trace})
            yield trace

    def recording_generate(self, *args, **kwargs):
        runs[-1]["inputs"] = kwargs
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(macer, "compress", recording_compress)
    monkeypatch.setattr(Thinker, "generate", recording_generate)
    return runs


def _kept(model, policy, inputs) -> list[tuple[list[int], list[int]]]:
    """The model layer's own run of ``policy`` on ``inputs``: the kept audio and video positions of each prompt."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Thinker

    with torch.no_grad(), macer.compress(model, policy) as trace:
        Thinker.generate(model, **{**inputs, "max_new_tokens": 1})
    return [(record.audio_kept, record.video_kept) for record in trace.samples]


def test_every_policy_of_the_model_layer_is_covered():
    assert set(POLICY_ARGS) == set(macer.POLICY_NAMES)


@pytest.mark.parametrize("policy", list(POLICY_ARGS))
def test_lmms_eval_runs_policy(setup, policy, tmp_path, monkeypatch):
    """Every policy through lmms-eval, with a non-default keep ratio and fields. Guards (issue 22 items 1-2): an
    ablation resolved to another policy (macer_raw / no_coverage / shared_topk run as macer), a field such as
    keep_ratio that never reaches the policy, and a wrapper that runs another object than it logs: the log must
    name the paper's definition of the policy with the fields asked for, and each prompt's kept sets must equal the
    model layer's own run of that definition on the same inputs."""
    runs = _record_runs(monkeypatch)
    log = tmp_path / "samples.jsonl"
    limit = 2 if policy == "macer" else 1
    result = _evaluate(setup, policy, log, limit=limit)
    samples = result["samples"]["dailyomni"]
    answers = [s["resps"][0][0] for s in samples]
    assert len(answers) == limit and all(isinstance(a, str) and a for a in answers), answers
    assert "accuracy,none" in result["results"]["dailyomni"]

    expected = _paper_policy(policy)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["doc_id"] for line in lines] == [s["doc_id"] for s in samples]
    # The clip's token counts from the processor's own rules: 12 frames -> 6 temporal groups of 2 x 2 tokens;
    # 2 s of audio at 25 tokens/s (AAC adds a few ms of padding, hence the range).
    for line in lines:
        assert line["policy"] == policy and line["n_video"] == FRAMES // 2 * 4
        assert {"class": line["policy_class"], "fields": line["policy_fields"]} == describe_policy(expected), line
        assert 50 <= line["n_audio"] <= 53, line
        n_media = line["n_audio"] + line["n_video"]
        kept = line["audio_kept"] + line["video_kept"]
        if policy == "full":
            assert (line["audio_kept"], line["video_kept"]) == (line["n_audio"], line["n_video"])
        else:
            # K_mm = min(n, floor(rho n + 0.5)) (tab:macer_algorithm step 1) with the keep ratio asked for
            rho = POLICY_ARGS[policy]["keep_ratio"]
            assert line["keep_ratio"] == rho and line["budget_total"] == min(n_media, math.floor(rho * n_media + 0.5))
            assert kept == line["budget_total"] < n_media, line
        if policy in ("macer", "macer_raw", "no_coverage", "single_readout"):
            assert (line["audio_kept"], line["video_kept"]) == (line["budget_audio"], line["budget_video"]), line

    # What ran is what was asked: the object handed to macer.compress, and the kept sets against the model layer.
    assert len(runs) == limit
    for run, line in zip(runs, lines):
        assert describe_policy(run["policy"]) == describe_policy(expected), run["policy"]
        ran = [(r.audio_kept, r.video_kept) for r in run["trace"].samples]
        assert ran == _kept(run["model"], expected, run["inputs"]), policy
        assert [(len(a), len(v)) for a, v in ran] == [(line["audio_kept"], line["video_kept"])]
    if policy not in ("full", "macer", "macer_raw"):
        # These clips tell the policies apart: MACER with the same fields keeps other tokens, so an ablation run
        # as MACER would fail the kept-set comparison above as well as the logged fields. (Not macer_raw: on a
        # random-weight model the attention is near uniform across heads and rows, so renormalising per modality
        # seldom reorders a modality; there the policy object handed to macer.compress is the check.)
        macer_fields = {f.name for f in dataclasses.fields(MacerConfig)}
        same = MacerConfig(**{**LAYERS, **{k: v for k, v in POLICY_ARGS[policy].items() if k in macer_fields}},
                           end_of_turn_token_id=SYNTHETIC_TOKENS.im_end)
        assert _kept(runs[0]["model"], same, runs[0]["inputs"]) != ran, policy


def test_failing_generate_raises(setup, tmp_path, monkeypatch):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    def broken(self, *args, **kwargs):
        raise RuntimeError("generate broke")

    monkeypatch.setattr(Qwen2_5OmniThinkerForConditionalGeneration, "generate", broken)
    log = tmp_path / "samples.jsonl"
    with pytest.raises(RuntimeError, match="generate broke"):
        _evaluate(setup, "macer", log, limit=1)
    assert not log.exists() or not log.read_text(), "a failed sample must not be logged as answered"


def test_clip_without_audio_is_refused(setup, tmp_path):
    from macer.eval.lmms_model import MacerQwen2_5Omni

    model = MacerQwen2_5Omni(pretrained=str(setup["checkpoint"]), policy="full", video_frontend="torch",
                             sample_log=str(tmp_path / "log.jsonl"))
    silent = write_clip(tmp_path / "silent.mp4", audio=False)
    with pytest.raises(ValueError, match="no audio track"):
        model.answer("Which?", [str(silent)], {})
    with pytest.raises(ValueError, match="exactly one video"):
        model.answer("Which?", [str(silent), str(silent)], {})


def test_wrapper_rejects_bad_arguments(setup, tmp_path):
    from macer.eval.lmms_model import MacerQwen2_5Omni

    common = {"pretrained": str(setup["checkpoint"]), "video_frontend": "torch", "sample_log": str(tmp_path / "l")}
    for bad in (0, -2, "0", "two", 1.5, "auto", "auto:4", True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            MacerQwen2_5Omni(policy="full", batch_size=bad, **common)
    with pytest.raises(ValueError, match="'auto' / 'auto:N' are not supported"):
        MacerQwen2_5Omni(policy="full", batch_size="auto:4", **common)
    with pytest.raises(ValueError, match="max_batch_size"):
        MacerQwen2_5Omni(policy="full", batch_size=2, max_batch_size=8, **common)
    with pytest.raises(ValueError, match="policy must be one of"):
        MacerQwen2_5Omni(policy="omnizip", **common)
    with pytest.raises(ValueError, match="keep_ratio"):
        MacerQwen2_5Omni(policy="macer", keep_ratio=1.5, **LAYERS, **common)


def test_generation_arguments_are_honoured_or_refused(setup, tmp_path):
    from macer.eval.lmms_model import MacerQwen2_5Omni

    model = MacerQwen2_5Omni(policy="full", pretrained=str(setup["checkpoint"]), video_frontend="torch",
                             sample_log=str(tmp_path / "l"))
    until, greedy = model._generation({"until": "\n\n", "max_new_tokens": 7, "temperature": 0, "top_p": None,
                                       "num_beams": 1, "do_sample": False})
    assert until == ["\n\n"]
    assert (greedy["max_new_tokens"], greedy["do_sample"], greedy["num_beams"]) == (7, False, 1)
    assert "temperature" not in greedy
    _, sampled = model._generation({"temperature": 0.7, "top_p": 0.9, "num_beams": 3})
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"], sampled["num_beams"]) == (True, 0.7, 0.9, 3)
    _, forced = model._generation({"do_sample": True})
    assert forced["do_sample"] and forced["temperature"] == 1.0
    with pytest.raises(ValueError, match=r"generation arguments \['length_penalty'\] are not supported"):
        model._generation({"length_penalty": 0.5})
    with pytest.raises(ValueError, match="num_beams must be an integer >= 1"):
        model._generation({"num_beams": 0})
    assert model._generation({"image_aspect_ratio": None})[1]["num_beams"] == 1  # None values are absent arguments


def test_batch_size_2_answers_as_batch_size_1(setup, tmp_path, monkeypatch):
    # MACER, greedy, 3 prompts of 3 lengths: batch size 1 (three generate calls) and 2 (a left-padded pair, then the
    # third alone) give the same generated tokens, answers and per-sample log, except the batch fields.
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Thinker

    generate, masks, new_tokens = Thinker.generate, [], []

    def recording(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        masks.append(kwargs["attention_mask"].clone())
        new_tokens.extend(out[:, kwargs["input_ids"].shape[1]:].tolist())
        return out

    monkeypatch.setattr(Thinker, "generate", recording)
    runs = {}
    for size in (1, "2"):  # the command line passes a string
        log = tmp_path / f"batch{size}.jsonl"
        result = _evaluate(setup, "macer", log, batch_size=size, manager="batch_manager")
        answers = [(s["doc_id"], s["resps"][0][0]) for s in result["samples"]["dailyomni"]]
        runs[size] = answers, [json.loads(line) for line in log.read_text().splitlines()]

    lengths = [m.shape[1] for m in masks[:3]]
    assert [tuple(m.shape) for m in masks[:3]] == [(1, n) for n in lengths] and len(set(lengths)) == 3, lengths
    pair, last = masks[3:]
    assert tuple(pair.shape) == (2, max(lengths[:2])) and tuple(last.shape) == (1, lengths[2]), masks
    assert pair.sum(1).tolist() == lengths[:2] and bool(pair[:, -1].all()), pair  # left padding

    # The random model's answers are mostly undecodable bytes, so compare the tokens themselves too.
    assert new_tokens[3:] == new_tokens[:3], new_tokens
    (answers1, lines1), (answers2, lines2) = runs[1], runs["2"]
    assert [line["new_tokens"] for line in lines2] == [len(row) for row in new_tokens[:3]], lines2
    assert len(answers1) == 3 and all(a for _, a in answers1), answers1
    assert answers2 == answers1
    assert [line["batch_size"] for line in lines1] == [1, 1, 1] and [line["batch_size"] for line in lines2] == [2, 2, 1]
    assert lines2[0]["seconds"] == lines2[1]["seconds"], lines2
    assert [line["prompt_tokens"] for line in lines2] == lengths, lines2
    same = ("doc_id", "answer", "prompt_tokens", "new_tokens", "n_audio", "n_video", "budget_total", "budget_audio",
            "budget_video", "audio_kept", "video_kept")
    for one, two in zip(lines1, lines2, strict=True):
        assert {k: one[k] for k in same} == {k: two[k] for k in same}, (one, two)
        assert two["audio_kept"] + two["video_kept"] == two["budget_total"] < two["n_audio"] + two["n_video"], two
    assert len({line["n_audio"] for line in lines2}) == 3, lines2  # three clip lengths, three audio counts


def test_batches_keep_request_order_and_split_on_generation_arguments(setup, tmp_path, monkeypatch):
    from lmms_eval.api.instance import Instance
    from macer.eval.lmms_model import MacerQwen2_5Omni

    model = MacerQwen2_5Omni(pretrained=str(setup["checkpoint"]), policy="full", video_frontend="torch",
                             sample_log=str(tmp_path / "log.jsonl"), batch_size=3)
    assert model.batch_size == 3
    model.task_dict = {"t": {"test": {i: {"video": f"v{i}.mp4"} for i in range(7)}}}
    tokens = [16, 16, 16, 16, 8, 8, 16]  # runs of equal generation arguments: 4 (3 + 1), 2, 1
    requests = [Instance("generate_until", (f"q{i}", {"max_new_tokens": n, "until": ["\n"]},
                                            lambda doc: [doc["video"]], i, "t", "test"), idx=i,
                         metadata={"task": "t", "doc_id": i, "repeats": 1})
                for i, n in enumerate(tokens)]
    batches = []

    def answer_batch(questions, gen_kwargs):
        batches.append(([q for q, _ in questions], gen_kwargs["max_new_tokens"]))
        record = {"audio_kept": 1, "n_audio": 2, "video_kept": 1, "n_video": 2, "budget_total": 2}
        return [(f"{question} -> {visuals[0]}", record) for question, visuals in questions]

    monkeypatch.setattr(model, "answer_batch", answer_batch)
    answers = model.generate_until(requests)
    assert answers == [f"q{i} -> v{i}.mp4" for i in range(7)]
    assert batches == [(["q0", "q1", "q2"], 16), (["q3"], 16), (["q4", "q5"], 8), (["q6"], 16)]
    assert [json.loads(line)["doc_id"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == list(range(7))


def test_prepare_reads_avut_style_entries(tmp_path):
    release, tmp_path = tmp_path / "release", tmp_path / "out"
    videos = release / "videos"
    videos.mkdir(parents=True)
    (videos / "v1.mp4").write_bytes(b"")
    (videos / "v2.mp4").write_bytes(b"")
    entries = [{"Question": "q1", "options": {"A": "x", "B": "y"}, "answer": "B", "video_name": "v1", "task": "t"},
               {"question": "q2", "choices": ["red", "blue", "green"], "gt": "green", "video": "v2.mp4"},
               {"question": "q3", "candidates": ["(A) a", "(B) b"], "label": 0, "video_id": "v1"}]
    (release / "qa.json").write_text(json.dumps(entries))
    prepare_module.prepare("avutbench", release, tmp_path / "out")
    rows = [json.loads(line) for line in (tmp_path / "out" / "avutbench.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["B", "C", "A"]
    assert rows[0]["options"] == ["A. x", "B. y"] and rows[1]["options"][2] == "C. green"
    assert rows[2]["options"] == ["(A) a", "(B) b"] and rows[0]["video"] == str(videos / "v1.mp4")
    assert (tmp_path / "out" / "avutbench.yaml").exists()

    (release / "qa.json").write_text(json.dumps([{"question": "q", "options": ["a", "b"], "video": "v1"}]))
    with pytest.raises(ValueError, match="no answer key"):
        prepare_module.prepare("avutbench", release, tmp_path / "out2")
    (release / "qa.json").write_text(json.dumps([{"question": "q", "options": ["a", "b"], "answer": "A",
                                                   "video": "gone"}]))
    with pytest.raises(FileNotFoundError, match="1 of 1 videos are missing"):
        prepare_module.prepare("avutbench", release, tmp_path / "out3")


def test_answer_letter_parsing():
    from macer.eval.tasks.mcq import parse_letter, process_results

    assert parse_letter("B", 4) == "B" and parse_letter(" (C) because", 4) == "C"
    assert parse_letter("Answer: D.", 4) == "D" and parse_letter("E", 4) is None and parse_letter("", 4) is None
    doc = {"options": ["A. a", "B. b", "C. c", "D. d"], "answer": "C"}
    assert process_results(doc, ["C"]) == {"accuracy": 100.0}
    assert process_results(doc, ["Absolutely B"]) == {"accuracy": 0.0}


def test_table_script_runs_lmms_eval_cli(setup, tmp_path):
    """The lmms-eval command line itself (``python -m lmms_eval --model macer_qwen2_5_omni ...``) through the table
    runner, a full row and a MACER row sharing --model-args with layer arguments (which broke the full row:
    FullConfig got audio_layer, issue 21 item 6); the default video frontend; then table.md holds both scores, Norm.
    Avg. and the paper's rows."""
    from macer.eval import table

    out = tmp_path / "runs"
    code = table.main(["--pretrained", str(setup["checkpoint"]), "--out", str(out), "--benchmarks", "dailyomni",
                       "--tasks-dir", str(setup["tasks"]), "--rows", "full", "macer@0.25",
                       "--model-args", "audio_layer=1", "video_layer=2", "--limit", "1"])
    assert code == 0
    text = (out / "table.md").read_text()
    assert "failed" not in text, text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.split("## Paper")[0].splitlines() if line.startswith(("| full |", "| macer@0.25 |"))}
    assert set(rows) == {"full", "macer@0.25"}, text
    full, macer_row = rows["full"], rows["macer@0.25"]
    assert full[1] == "100%" and full[3] in ("0.00", "100.00"), full  # one question: right or wrong
    assert macer_row[1] == "25%" and macer_row[3] in ("0.00", "100.00"), macer_row
    audio, video = (float(x) for x in macer_row[2].split(" / "))
    assert 0 < audio < 100 and abs(audio + video - 100) < 1e-6
    logged = json.loads((out / "macer@0.25" / "macer_samples.jsonl").read_text().splitlines()[0])
    assert (logged["policy_fields"]["audio_layer"], logged["policy_fields"]["video_layer"]) == (1, 2), logged
    assert "| MACER | 25% | 62.07 |" in text  # the paper's 7B DailyOmni number beside it
