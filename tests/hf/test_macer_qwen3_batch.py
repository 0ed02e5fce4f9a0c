"""Batch size > 1 on Qwen3-Omni under ``macer.compress`` (issue #11): a left-padded batch of prompts of different
lengths and media gives, per sample, the kept sets, prefill logits and greedy tokens of that prompt alone under
``compress`` (itself checked against an independent staged forward, deepstack included, in test_macer_qwen3).

The stages sit before (Random, layer 0), among (MACER at layers 1 and 2) and after (layer 3) the three deepstack
levels, which add visual features after ``layers[0..2]``: a wrong deepstack row for a re-packed batch moves the
logits (by ~0.5 on these prompts), so the logits are what check the adapter's remapping. One batch has a long
text-only prompt, so re-packing keeps the padded width while the other samples move. A batch that mixes layouts under
one ``use_audio_in_video`` is refused (transformers' Qwen3-Omni ``get_rope_index`` gives it wrong positions silently);
beam search and ``num_return_sequences`` rows share their prompt's selection.
"""

from __future__ import annotations

import functools

import macer
import pytest
import torch
from macer.testing import SYNTHETIC_TOKENS, batch_inputs
from macer.testing_qwen3 import build_qwen3_omni_model, build_qwen3_thinker, qwen3_clip_inputs
from test_macer_batch import check_batch_against_each_prompt_alone, check_expanded_rows, check_mixed_layouts_refused
from tiny_models import SMALL_PROMPT

TOK = SYNTHETIC_TOKENS
SMALL = SMALL_PROMPT


@functools.cache
def _thinker(attn: str):
    return build_qwen3_thinker(num_layers=4, hidden_size=64, attn_implementation=attn, seed=5)


def _block_prompts(model):
    """Audio-only, video-only and audio + video in blocks (use_audio_in_video=False), all of different lengths."""
    return [
        qwen3_clip_inputs(model, frames=0, seconds=3.0, use_audio_in_video=False, seed=1, **SMALL),
        qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, audio=False, use_audio_in_video=False,
                          seed=2, **SMALL),
        qwen3_clip_inputs(model, frames=4, grid_hw=(8, 4), seconds=2.0, use_audio_in_video=False, seed=3, **SMALL),
    ]


def _interleaved_prompts(model):
    """Interleaved clips (one with an image before it), an audio-only prompt and the longest, text-only prompt
    (use_audio_in_video=True for all)."""
    return [
        qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, seed=4, **SMALL),
        dict(qwen3_clip_inputs(model, frames=0, seconds=2.0, use_audio_in_video=False, seed=5, **SMALL),
             use_audio_in_video=True),
        qwen3_clip_inputs(model, frames=6, grid_hw=(4, 8), seconds=3.0, image_grid_hw=(4, 4), seed=6, **SMALL),
        dict(qwen3_clip_inputs(model, frames=0, audio=False, use_audio_in_video=False, seed=8, question_tokens=130,
                               system_tokens=4), use_audio_in_video=True),
    ]


def _macer(audio_layer: int, video_layer: int, **kw):
    return macer.MacerConfig(keep_ratio=0.3, audio_layer=audio_layer, video_layer=video_layer, coverage_weight=0.05,
                             end_of_turn_token_id=TOK.im_end, **kw)


POLICIES = {
    "among": lambda: _macer(1, 2),  # both stages among the deepstack levels
    "among-reversed": lambda: _macer(2, 1),
    "after-trim": lambda: _macer(3, 3, trim_early_cache=True),  # after the last deepstack level
    "random": lambda: macer.RandomConfig(keep_ratio=0.3, seed=3),  # before layer 0: every level on the kept rows
    "fastv": lambda: macer.FastVConfig(keep_ratio=0.3, layer=2),
}


@pytest.mark.parametrize(("attn", "layout", "policy"), [
    ("eager", "block", "among"), ("sdpa", "interleaved", "among-reversed"), ("sdpa", "block", "after-trim"),
    ("eager", "interleaved", "random"), ("sdpa", "interleaved", "fastv")])
def test_batch_matches_each_prompt_alone(attn, layout, policy):
    model = _thinker(attn)
    prompts = _block_prompts(model) if layout == "block" else _interleaved_prompts(model)

    def again(batch, logits):
        # A prompt alone and the batch again in the same context: no deepstack rows leak between prefills.
        model(**prompts[0])
        assert torch.equal(model(**batch).logits, logits), (attn, layout, policy)

    _, batch, samples, logits = check_batch_against_each_prompt_alone(model, POLICIES[policy](), prompts,
                                                                      f"{attn}, {layout}, {policy}", also=again)
    visual = [s for s in samples if s.n_video]
    assert visual and all(len(s.video_kept) < s.n_video for s in visual), "the visual rows must be pruned"
    if layout == "interleaved":
        # The text-only prompt is the longest and keeps every row: the batch is re-packed at its padded width.
        assert samples[-1].padding == 0 and not samples[-1].pruned
        assert logits.shape[1] == batch["input_ids"].shape[1]


def test_beam_search_and_several_sequences_share_their_prompt_selection():
    """num_beams and num_return_sequences expand each prompt (and its deepstack features) into rows of the batch
    before the prefill: each row is its prompt alone, with stages among the deepstack levels."""
    model = _thinker("sdpa")
    check_expanded_rows(model, POLICIES["among"](), _block_prompts(model)[1:])


@pytest.mark.parametrize("flag", [True, False])
def test_mixed_layouts_are_refused(flag):
    model = _thinker("sdpa")
    interleaved = qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, seed=4, **SMALL)
    block = qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, use_audio_in_video=False, seed=2, **SMALL)
    check_mixed_layouts_refused(model, POLICIES["among"](), interleaved, block, flag)


def test_full_model_through_thinker_batch():
    """The full Qwen3OmniMoeForConditionalGeneration (no talker), generate(return_audio=False) on a batch: each row's
    answer and kept sets are its prompt's alone."""
    model = build_qwen3_omni_model(num_layers=4, hidden_size=64, attn_implementation="sdpa", seed=5)
    prompts = _block_prompts(model)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=2, video_layer=1, coverage_weight=0.05)
    options = {"return_audio": False, "thinker_max_new_tokens": 3, "thinker_do_sample": False}
    batch = batch_inputs(prompts)
    width = batch["input_ids"].shape[1]
    with torch.no_grad(), macer.compress(model, config) as trace:
        out = model.generate(**batch, **options)
        samples = trace.samples
        for b, prompt in enumerate(prompts):
            alone = model.generate(**prompt, **options)
            n = prompt["input_ids"].shape[1]
            pad = width - n
            record = trace.history[-1]
            assert out[b, width:].tolist() == alone[0, n:].tolist(), b
            assert samples[b].audio_kept == [i + pad for i in record.audio_kept], b
            assert samples[b].video_kept == [i + pad for i in record.video_kept], b
    assert out.shape[1] == width + 3 and all(s.pruned for s in samples)
