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
    code = main(["demo", "--model", "ckpt", "--video", "clip.mp4", "--question", "what?", "--new-tokens", "2",
                 "--out", str(tmp_path)])
    captured = capsys.readouterr()
    if fail:
        assert code == 2 and "the processor could not read clip.mp4: cannot decode" in captured.err
        return
    assert code == 0
    assert "audio_layer=3, video_layer=5, coverage_weight=0.2" in captured.out
    # The end-of-turn id comes from the checkpoint's tokenizer (the synthetic vocabulary's <|im_end|> here).
    assert "end_of_turn_token_id=2" in captured.out
    assert "after layer 3 (audio pruned)" in captured.out and "after layer 5 (video pruned)" in captured.out
    assert "MACER (" in captured.out and (tmp_path / "macer_kept_tokens.png").exists()


def test_demo_real_checkpoint_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import ...` raises ImportError
    assert main(["demo", "--model", "ckpt", "--video", "clip.mp4", "--question", "what?"]) == 2
    assert "macer demo --model needs transformers with Qwen2.5-Omni" in capsys.readouterr().err
