"""``macer demo`` on a tiny random thinker, its argument errors (run as a user runs them), and ``macer bench``'s
pointer to the moved benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from macer.cli import main

TINY = ["--layers", "6", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--frames", "4", "--audio-tokens", "100",
        "--new-tokens", "2", "--repeats", "1"]


@pytest.mark.parametrize("blocks", [False, True])
def test_demo_prints_budget_stages_caches_and_saves_png(tmp_path, capsys, blocks):
    assert main(["demo", *TINY, "--out", str(tmp_path), *(["--blocks"] if blocks else [])]) == 0
    text = capsys.readouterr().out
    assert "budget (split_budget): K_mm=97  K_a=29  K_v=68" in text  # 288 video + 100 audio tokens at 0.25
    assert "after layer 3 (audio pruned): audio 29/100, video 288/288" in text
    assert "after layer 5 (video pruned): audio 29/100, video 68/288" in text
    assert "tokens per layer (1..6):" in text and "KV cache per layer, MACER:" in text
    assert "prefill time, 1 run of each after a warm-up, min / median / max: full " in text
    assert "machine busy:" in text or "machine quiet:" in text
    assert "generate 2 tokens" in text
    assert ("blocks" in text) == blocks
    assert (tmp_path / "macer_kept_tokens.png").stat().st_size > 0


def test_demo_real_checkpoint_needs_all_three_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--model", "/nonexistent"])
    assert "--model, --video and --question go together" in capsys.readouterr().err


def _run_macer(*args: str) -> subprocess.CompletedProcess:
    """The installed console script when present (as a user runs it), else ``python -m macer``."""
    script = Path(sys.executable).with_name("macer")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "macer"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep-ratio", "0"], "macer demo: error: argument --keep-ratio: must be a number in (0, 1], got 0"),
        (["--frames", "3"], "macer demo: error: argument --frames: must be an even integer >= 0"),
        (["--heads", "3"], "macer demo: error: --heads 3 must divide --hidden 512 into an even head size"),
        (["--kv-heads", "3"], "macer demo: error: --kv-heads 3 must divide --heads 8"),
        (["--layers", "2"], "macer demo: error: --audio-layer (default 3, the paper's 7B layer) and --video-layer "
                            "(default 5, the paper's 7B layer) must be in [1, 1] for --layers 2"),
        (["--layers", "4", "--audio-layer", "4", "--video-layer", "2"],
         "--audio-layer 4 must be in [1, 3] for --layers 4"),
        (["--layers", "1"], "macer demo: error: argument --layers: must be an integer >= 2, got 1"),
        (["--repeats", "0"], "macer demo: error: argument --repeats: must be an integer >= 1, got 0"),
        (["--frames", "0", "--audio-tokens", "0"],
         "macer demo: error: --frames 0 with --audio-tokens 0 leaves no audio or video tokens"),
        (["--model", "/nonexistent", "--video", "x.mp4", "--question", "y"],
         "macer demo: error: --model /nonexistent: the local path does not exist"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args, message, capsys):
    # In process (each subprocess pays ~1 s of imports); the same path as a subprocess, which the tests below run.
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep-ratio", "0"], "macer demo: error: argument --keep-ratio: must be a number in (0, 1], got 0"),
        (["--layers", "2"], "must be in [1, 1] for --layers 2"),
        (["--model", "/nonexistent", "--video", "x.mp4", "--question", "y"],
         "macer demo: error: --model /nonexistent: the local path does not exist"),
    ],
)
def test_bad_arguments_in_a_subprocess(args, message):
    result = _run_macer("demo", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr


def test_missing_video_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", str(tmp_path), "--video", str(tmp_path / "clip.mp4"), "--question", "y"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"macer demo: error: --video {tmp_path / 'clip.mp4'}: the file does not exist" in err


def test_bench_points_to_the_moved_harness():
    result = _run_macer("bench", "--out", "benchmarks/results")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "python -m benchmarks.bench_e2e" in result.stderr


@pytest.mark.parametrize(("frames", "audio", "kind"), [(2, 30, "interleaved"), (0, 30, "audio only"),
                                                   (2, 0, "video only")])
def test_readout_layer_flags_make_a_shallow_model_work_with_any_media(tmp_path, capsys, frames, audio, kind):
    args = ["demo", "--layers", "2", "--audio-layer", "1", "--video-layer", "1", "--hidden", "32", "--heads", "2",
            "--kv-heads", "1", "--frames", str(frames), "--audio-tokens", str(audio), "--new-tokens", "1",
            "--repeats", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "audio_layer=1, video_layer=1" in text and "tokens per layer (1..2):" in text and kind in text
    assert (tmp_path / "macer_kept_tokens.png").stat().st_size > 0


class _FakeTokenizer:
    unk_token_id = None

    def convert_tokens_to_ids(self, token):
        from macer.testing import SYNTHETIC_TOKENS

        return {"<|im_end|>": SYNTHETIC_TOKENS.im_end}[token]


class _FakeProcessor:
    """Stands in for Qwen2_5OmniProcessor (no tokenizer files here): returns a synthetic clip's inputs."""

    def __init__(self, model, fail: bool = False):
        self.model, self.fail = model, fail
        self.tokenizer = _FakeTokenizer()

    def apply_chat_template(self, conversation, **kwargs):
        assert kwargs["load_audio_from_video"] and conversation[1]["content"][1] == {"type": "audio"}
        if self.fail:
            raise ValueError("cannot decode")
        from macer.testing import clip_inputs

        return clip_inputs(self.model, frames=4, grid_hw=(8, 8), audio_tokens=100)

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row.tolist())) for row in ids]


@pytest.mark.parametrize("fail", [False, True])
def test_demo_real_checkpoint_path_with_stand_ins(tmp_path, capsys, monkeypatch, fail):
    """The --model path end to end with the checkpoint and processor replaced by a 28-layer random thinker (identified
    as the 7B checkpoint, so ``for_model`` picks its defaults) and a stand-in processor; the real processor is not
    exercised here."""
    import transformers
    from macer.adapters.qwen2_5_omni import Qwen25OmniAdapter
    from macer.testing import build_thinker

    model = build_thinker(num_layers=28, hidden_size=64, seed=0)
    # for_model keys the paper's defaults by model identity (type and sizes), not depth: identify the stand-in as 7B.
    monkeypatch.setattr(Qwen25OmniAdapter, "identify", lambda self, m: "qwen2.5-omni-7b")
    monkeypatch.setattr(transformers.Qwen2_5OmniThinkerForConditionalGeneration, "from_pretrained",
                        classmethod(lambda cls, path, **kw: model))
    monkeypatch.setattr(transformers.Qwen2_5OmniProcessor, "from_pretrained",
                        classmethod(lambda cls, path, **kw: _FakeProcessor(model, fail)))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "clip.mp4").touch()
    code = main(["demo", "--model", str(tmp_path / "ckpt"), "--video", str(tmp_path / "clip.mp4"), "--question",
                 "what?", "--new-tokens", "2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    if fail:
        assert code == 2 and f"the processor could not read {tmp_path / 'clip.mp4'}: cannot decode" in captured.err
        return
    assert code == 0
    assert "audio_layer=3, video_layer=5, coverage_weight=0.2" in captured.out
    # The end-of-turn id comes from the checkpoint's tokenizer (the synthetic vocabulary's <|im_end|> here).
    assert "end_of_turn_token_id=2" in captured.out
    assert "after layer 3 (audio pruned)" in captured.out and "after layer 5 (video pruned)" in captured.out
    assert "MACER (" in captured.out and (tmp_path / "macer_kept_tokens.png").exists()


def test_demo_real_checkpoint_folder_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    import transformers

    def refuse(cls, path, **kwargs):
        raise OSError(f"Can't load the processor for '{path}'.\nMore lines of advice.")

    monkeypatch.setattr(transformers.Qwen2_5OmniProcessor, "from_pretrained", classmethod(refuse))
    (tmp_path / "clip.mp4").touch()
    assert main(["demo", "--model", str(tmp_path), "--video", str(tmp_path / "clip.mp4"), "--question", "y"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--model {tmp_path}: not a loadable Qwen2.5-Omni checkpoint directory (Can't load the processor" in err


def test_demo_real_checkpoint_without_transformers(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` raises ImportError
    (tmp_path / "clip.mp4").touch()
    assert main(["demo", "--model", str(tmp_path), "--video", str(tmp_path / "clip.mp4"), "--question", "what?"]) == 2
    assert "macer demo --model needs transformers with Qwen2.5-Omni" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("load", "spread", "expected"),
    [
        (0.2, 1.05, "machine quiet: load average 0.2 on 4 cores before the demo started, runs within 5% of each other"),
        (3.0, 1.05, "machine busy: load average 3.0 on 4 cores before the demo started"),
        (0.2, 1.50, "machine busy: repeated runs differ by up to 50%."),
        (None, 1.05, "machine quiet: load average unknown on 4 cores"),
    ],
)
def test_timings_report_spread_and_a_busy_machine(monkeypatch, capsys, load, spread, expected):
    from types import SimpleNamespace

    from macer.cli import _print_times

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    times = {"full": [1.0, spread, 1.01], "MACER": [0.5, 0.5, 0.5], "full decoder": [0.9, 0.9, 0.9],
             "MACER decoder": [0.4, 0.4, 0.4]}
    record = SimpleNamespace(layer_tokens=[100, 100, 50, 50], overhead_s=0.01)
    _print_times(times, record, 100, load)
    text = capsys.readouterr().out
    assert f"full 1.00 / 1.01 / {spread:.2f} s, MACER 0.50 / 0.50 / 0.50 s (median x2.02)" in text
    assert "token-layer proxy 0.750 (ideal x1.33)" in text
    assert expected in text, text
