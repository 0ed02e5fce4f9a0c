"""``macer.batching.batch_inputs`` (also ``macer.testing.batch_inputs``): the recipe that turns single-prompt inputs
into one left-padded batch. Its use under ``macer.compress`` is tested in test_macer_batch.py and test_eval_lmms.py."""

from __future__ import annotations

import macer.testing
import pytest
import torch
from macer.batching import batch_inputs
from macer.testing import build_thinker, clip_inputs


@pytest.fixture(scope="module")
def model():
    return build_thinker(num_layers=1, seed=0)


def test_testing_alias_is_the_same_function():
    assert macer.testing.batch_inputs is batch_inputs


def test_left_padding_and_media_in_sample_order(model):
    a = clip_inputs(model, frames=4, audio_tokens=30, use_audio_in_video=True, seed=1)
    b = clip_inputs(model, frames=2, audio_tokens=60, use_audio_in_video=True, seed=2)
    batch = batch_inputs([a, b], pad_token_id=7)
    n_a, n_b = a["input_ids"].shape[1], b["input_ids"].shape[1]
    width = max(n_a, n_b)
    assert n_a != n_b, (n_a, n_b)
    for row, (sample, n) in enumerate(((a, n_a), (b, n_b))):
        assert torch.equal(batch["input_ids"][row, width - n:], sample["input_ids"][0])
        assert (batch["input_ids"][row, :width - n] == 7).all() and batch["attention_mask"][row].sum() == n
        assert not batch["attention_mask"][row, :width - n].any()
    assert torch.equal(batch["pixel_values_videos"], torch.cat([a["pixel_values_videos"], b["pixel_values_videos"]]))
    assert torch.equal(batch["video_grid_thw"], torch.cat([a["video_grid_thw"], b["video_grid_thw"]]))
    frames_a, frames_b = a["input_features"].shape[-1], b["input_features"].shape[-1]
    assert batch["input_features"].shape[-1] == max(frames_a, frames_b)
    assert torch.equal(batch["input_features"][0, :, :frames_a], a["input_features"][0])
    assert batch["feature_attention_mask"].sum(1).tolist() == [frames_a, frames_b]
    assert batch["use_audio_in_video"] is True


def test_audio_only_and_text_only_prompts_go_with_either_flag(model):
    """Guards issue 21.10: an audio-only prompt (processed with its natural ``use_audio_in_video=False``) next to
    interleaved ones (True) was refused, though the docs say audio-only prompts go with either layout. Only the
    samples with a video must agree; the batch takes their flag and is the batch built with the flags overridden."""
    interleaved = clip_inputs(model, frames=2, audio_tokens=30, use_audio_in_video=True, seed=1)
    audio_only = clip_inputs(model, frames=0, audio_tokens=40, use_audio_in_video=False, seed=2)
    text_only = clip_inputs(model, frames=0, audio_tokens=0, use_audio_in_video=False, seed=3)
    assert "video_grid_thw" not in audio_only and "video_grid_thw" not in text_only
    mixed = batch_inputs([interleaved, audio_only, text_only])
    forced = batch_inputs([interleaved, dict(audio_only, use_audio_in_video=True),
                           dict(text_only, use_audio_in_video=True)])
    assert mixed["use_audio_in_video"] is True and mixed.keys() == forced.keys()
    assert all(torch.equal(mixed[k], forced[k]) for k in mixed if isinstance(mixed[k], torch.Tensor))
    block = clip_inputs(model, frames=2, audio_tokens=30, use_audio_in_video=False, seed=4)
    assert batch_inputs([dict(audio_only, use_audio_in_video=True), block])["use_audio_in_video"] is False
    assert batch_inputs([audio_only, dict(text_only, use_audio_in_video=True)])["use_audio_in_video"] is True
    with pytest.raises(ValueError, match="samples with a video disagree on use_audio_in_video"):
        batch_inputs([interleaved, audio_only, block])


def test_refuses_what_it_cannot_batch(model):
    a = clip_inputs(model, frames=2, audio_tokens=20, use_audio_in_video=True, seed=1)
    with pytest.raises(ValueError, match=r"sample 1 has inputs \['rope_deltas'\] that cannot be batched"):
        batch_inputs([a, dict(a, rope_deltas=torch.zeros(1))])
    two = batch_inputs([a, a])
    with pytest.raises(ValueError, match=r"sample 0 must hold one prompt \(input_ids \[1, N\]\)"):
        batch_inputs([two])
    with pytest.raises(ValueError, match="disagree on use_audio_in_video"):
        batch_inputs([a, dict(a, use_audio_in_video=False)])
    with pytest.raises(ValueError, match="padding_side"):
        batch_inputs([a], padding_side="middle")
    with pytest.raises(ValueError, match="non-empty"):
        batch_inputs([])
