"""The synthetic clips of ``macer.testing`` have the processor's layout: the model's own ``get_rope_index`` gives
audio tokens consecutive temporal positions and video tokens their grid times (it assumes that layout)."""

from __future__ import annotations

import pytest
import torch
from macer.testing import SYNTHETIC_TOKENS, build_thinker, clip_inputs, thinker_config


@pytest.fixture(scope="module")
def model():
    return build_thinker(num_layers=2, hidden_size=64, seed=0)


def _rope(model, inputs):
    return model.get_rope_index(
        inputs["input_ids"], None, inputs.get("video_grid_thw"), inputs["attention_mask"],
        inputs["use_audio_in_video"],
        inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None,
        inputs.get("video_second_per_grid"))[0][:, 0]


@pytest.mark.parametrize("interleaved", [True, False])
def test_paper_clip_layout_matches_get_rope_index(model, interleaved):
    inputs = clip_inputs(model, use_audio_in_video=interleaved)
    ids = inputs["input_ids"][0]
    audio, video = ids == SYNTHETIC_TOKENS.audio, ids == SYNTHETIC_TOKENS.video
    assert int(audio.sum()) == 1460 and int(video.sum()) == 864
    tail = [SYNTHETIC_TOKENS.im_end, SYNTHETIC_TOKENS.newline, SYNTHETIC_TOKENS.im_start, SYNTHETIC_TOKENS.assistant,
            SYNTHETIC_TOKENS.newline]
    assert ids[-5:].tolist() == tail
    rope = _rope(model, inputs)
    t_audio = rope[0][audio]
    assert torch.equal(t_audio - t_audio[0], torch.arange(1460))  # 25 audio tokens per second, in order
    assert torch.equal(rope[1][audio], t_audio)
    t_video = rope[0][video]
    grid = torch.arange(6).repeat_interleave(144)
    spg = float(inputs["video_second_per_grid"])
    assert torch.equal(t_video - t_video[0], (torch.arange(6) * torch.tensor(spg).float() * 25).long()[grid])
    if interleaved:
        # chunks of both modalities alternate, and audio starts where video starts (same clip clock)
        assert int(t_audio[0]) == int(t_video[0])
        assert bool(audio[: int(video.nonzero()[-1])].any())


def test_every_modality_mix_feeds_its_features_to_the_model(model):
    # Values, not shapes: the text-only clip gives the logits of a plain text forward, and in every other mix the
    # clip's features reach the model at the right place: perturbing them leaves the logits before the first
    # audio/video token bit for bit unchanged (causal) and changes them from that token on.
    for kwargs in ({}, {"use_audio_in_video": False}, {"frames": 0, "use_audio_in_video": False},
                   {"audio_tokens": 0, "use_audio_in_video": False},
                   {"frames": 0, "audio_tokens": 0, "use_audio_in_video": False}):
        inputs = clip_inputs(model, grid_hw=(4, 4), audio_tokens=kwargs.pop("audio_tokens", 60), **kwargs)
        ids = inputs["input_ids"][0]
        with torch.no_grad():
            logits = model(**inputs).logits[0]
            features = [key for key in ("input_features", "pixel_values_videos") if key in inputs]
            if not features:
                plain = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[0]
                assert torch.equal(logits, plain), kwargs
                continue
            perturbed = model(**{**inputs, **{key: inputs[key] + 1 for key in features}}).logits[0]
        multimodal = (ids == SYNTHETIC_TOKENS.audio) | (ids == SYNTHETIC_TOKENS.video)
        first = int(multimodal.nonzero()[0])
        assert torch.isfinite(logits).all(), kwargs
        assert torch.equal(perturbed[:first], logits[:first]), kwargs
        assert not torch.allclose(perturbed[first:], logits[first:]), kwargs


def test_builder_errors():
    with pytest.raises(ValueError, match="frames must be an even integer >= 0"):
        clip_inputs(thinker_config(), frames=3)
    with pytest.raises(ValueError, match="use_audio_in_video=True needs both"):
        clip_inputs(thinker_config(), frames=0)
    with pytest.raises(ValueError, match=r"grid_hw must be two even integers >= 2"):
        clip_inputs(thinker_config(), grid_hw=(3, 4))
    with pytest.raises(ValueError, match="audio_tokens must be >= 0"):
        clip_inputs(thinker_config(), audio_tokens=-1, use_audio_in_video=False)
    with pytest.raises(ValueError, match=r"text_shape must be one of \['3B', '7B'\]"):
        thinker_config(text_shape="1B")
    with pytest.raises(ValueError, match="vocab_size must be >= 64"):
        thinker_config(vocab_size=10)
    with pytest.raises(ValueError, match=r"hidden_size \(64\) / num_heads \(3\) must be an even integer"):
        thinker_config(num_heads=3)
    shape = thinker_config(text_shape="7B").text_config
    assert (shape.num_hidden_layers, shape.hidden_size, shape.num_attention_heads) == (28, 3584, 28)
    assert shape.rope_parameters["mrope_section"] == [16, 24, 24]
