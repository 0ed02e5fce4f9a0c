"""``macer demo`` on a tiny random thinker, and the ``macer bench`` hand-off."""

from __future__ import annotations

import sys

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
    assert "prefill time" in text and "generate 2 tokens" in text
    assert ("blocks" in text) == blocks
    assert (tmp_path / "macer_kept_tokens.png").stat().st_size > 0


def test_demo_real_checkpoint_needs_all_three_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--model", "/nonexistent"])
    assert "--model, --video and --question go together" in capsys.readouterr().err


def test_bench_is_handed_to_macer_bench(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "usage: macer bench" in capsys.readouterr().out


def test_bench_says_when_macer_bench_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "macer.bench", None)  # makes `import macer.bench` raise ImportError
    assert main(["bench"]) == 2
    assert "macer bench is not available: the module macer.bench could not be imported" in capsys.readouterr().err
