"""Batch size > 1 under ``macer.compress`` (issue #11): a left-padded batch of prompts of different lengths and media
gives, per sample, the kept sets, prefill logits and greedy tokens of running that prompt alone; right padding, a
batch that mixes layouts under one ``use_audio_in_video`` flag, and the single-prompt trace attributes after a batch
give clear errors."""

from __future__ import annotations

import macer
import pytest
import torch
from macer.testing import batch_inputs, build_thinker, clip_inputs, macer_config_for

SMALL = {"question_tokens": 6, "system_tokens": 4}


def _thinker(attn: str):
    return build_thinker(num_layers=4, hidden_size=64, attn_implementation=attn, seed=7)


def _block_prompts(model):
    """Audio-only, video-only and block layout (use_audio_in_video=False), all of different lengths."""
    return [
        clip_inputs(model, frames=0, audio_tokens=70, use_audio_in_video=False, seed=1, **SMALL),
        clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=0, use_audio_in_video=False, seed=2, **SMALL),
        clip_inputs(model, frames=4, grid_hw=(8, 4), audio_tokens=90, use_audio_in_video=False, seed=3, **SMALL),
    ]


def _interleaved_prompts(model):
    """Interleaved clips of two lengths and an audio-only prompt (use_audio_in_video=True for all)."""
    return [
        clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=4, **SMALL),
        dict(clip_inputs(model, frames=0, audio_tokens=40, use_audio_in_video=False, seed=5, **SMALL),
             use_audio_in_video=True),
        clip_inputs(model, frames=6, grid_hw=(4, 8), audio_tokens=150, seed=6, **SMALL),
    ]


def _alone(model, config, prompt, new_tokens):
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**prompt).logits[0]
        record = trace.last
        tokens = model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)[0, -new_tokens:]
    return record, logits, tokens


POLICIES = {
    "macer": lambda m: macer_config_for(m, keep_ratio=0.3, audio_layer=1, video_layer=2),
    "macer-trim": lambda m: macer_config_for(m, keep_ratio=0.3, audio_layer=2, video_layer=1, trim_early_cache=True),
    "fastv": lambda m: macer.FastVConfig(keep_ratio=0.3, layer=2),
    "random": lambda m: macer.RandomConfig(keep_ratio=0.3, seed=3),
}


@pytest.mark.parametrize(("attn", "layout", "policy"), [
    ("sdpa", "block", "macer"), ("eager", "interleaved", "macer"), ("sdpa", "interleaved", "macer-trim"),
    ("eager", "block", "fastv"), ("sdpa", "interleaved", "random")])
def test_batch_matches_each_prompt_alone(attn, layout, policy):
    model = _thinker(attn)
    prompts = _block_prompts(model) if layout == "block" else _interleaved_prompts(model)
    config = POLICIES[policy](model)
    batch = batch_inputs(prompts)
    new_tokens = 4
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**batch).logits
        samples = trace.samples
        tokens = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)[:, -new_tokens:]
    assert len(samples) == len(prompts)
    width = batch["input_ids"].shape[1]
    for b, prompt in enumerate(prompts):
        record, want_logits, want_tokens = _alone(model, config, prompt, new_tokens)
        pad = width - prompt["input_ids"].shape[1]
        got = samples[b]
        where = f"sample {b} ({attn}, {layout}, {policy})"
        assert got.padding == pad, where
        assert got.audio_kept == [i + pad for i in record.audio_kept], where
        assert got.video_kept == [i + pad for i in record.video_kept], where
        assert got.query_positions == [i + pad for i in record.query_positions], where
        assert got.budget == record.budget, where
        assert got.layer_tokens == record.layer_tokens, where
        assert got.cache_lengths == record.cache_lengths, where
        assert got.pruned == record.pruned, where
        n = want_logits.shape[0]
        torch.testing.assert_close(logits[b, -n:], want_logits, rtol=1e-4, atol=1e-4, msg=where)
        assert tokens[b].tolist() == want_tokens.tolist(), where
    assert any(s.pruned for s in samples)
    with pytest.raises(ValueError, match=r"trace\.samples"):
        _ = trace.audio_kept
    with pytest.raises(ValueError, match=r"trace\.samples"):
        _ = trace.last


def test_beam_search_rows_share_their_prompt_selection():
    """num_beams expands each prompt into rows of the batch: each row is planned like its prompt alone."""
    model = _thinker("sdpa")
    prompts = _block_prompts(model)[1:]
    config = POLICIES["macer"](model)
    with torch.no_grad(), macer.compress(model, config) as trace:
        got = model.generate(**batch_inputs(prompts), max_new_tokens=3, num_beams=2, do_sample=False)[:, -3:]
        assert len(trace.samples) == 4 and trace.samples[0].video_kept == trace.samples[1].video_kept
        want = [model.generate(**p, max_new_tokens=3, num_beams=2, do_sample=False)[0, -3:].tolist()
                for p in prompts]
    assert got.tolist() == want


def test_batch_of_one_prompt_has_one_sample():
    model = _thinker("sdpa")
    prompt = _block_prompts(model)[2]
    with torch.no_grad(), macer.compress(model, POLICIES["macer"](model)) as trace:
        model(**prompt)
    assert trace.samples == [trace.last]
    assert trace.samples[0].padding == 0


def test_right_padding_is_refused():
    model = _thinker("sdpa")
    batch = batch_inputs(_block_prompts(model), padding_side="right")
    with macer.compress(model, POLICIES["macer"](model)), \
            pytest.raises(ValueError, match="not left-padded"), torch.no_grad():
        model(**batch)


@pytest.mark.parametrize("flag", [True, False])
def test_mixed_layouts_are_refused(flag):
    model = _thinker("sdpa")
    interleaved = clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=4, **SMALL)
    video_only = clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=0, use_audio_in_video=False, seed=2,
                             **SMALL)
    batch = batch_inputs([dict(interleaved, use_audio_in_video=flag), dict(video_only, use_audio_in_video=flag)])
    sample = 1 if flag else 0
    with macer.compress(model, POLICIES["macer"](model)), torch.no_grad(), \
            pytest.raises(ValueError, match=f"sample {sample} of the batch.*use_audio_in_video={flag}"):
        model(**batch)
