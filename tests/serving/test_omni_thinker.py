"""The Qwen-Omni thinkers' side of the vLLM plugin that runs without vLLM's thinker modules (which import
torchvision, absent beside the CPU torch build of ``make test``): how their rows are labelled, where their question
ends, which temporal positions their stages read, and the policies their engines refuse at load. The staged forward
is checked against transformers in ``test_conformance.py`` (labelled Qwen2) and ``test_omni_macer.py`` (the real
thinkers, in ``make test-vllm``).
"""

from __future__ import annotations

import macer
import pytest
import torch
from macer.hf.adapters.qwen2_5_omni import Qwen25OmniAdapter
from macer.testing import SYNTHETIC_TOKENS, build_thinker, clip_inputs, thinker_config
from macer.vllm.checks import check_policy
from macer.vllm.prompt import omni_prompt_labels, temporal_row


def test_omni_labels_and_question_end_follow_the_transformers_adapter():
    """Guards the thinker labelling its rows (or closing its question) differently from the Qwen2.5-Omni adapter of
    the transformers runtime, on a clip prompt with audio and video placeholders."""
    model = build_thinker(num_layers=2, hidden_size=64)
    inputs = clip_inputs(model, frames=2, grid_hw=(4, 4), audio_tokens=12, seed=0)
    ids = inputs["input_ids"][0]
    prompt = omni_prompt_labels(model.config)
    want = Qwen25OmniAdapter().labels(model, ids[None])[0]
    got = prompt.labels(ids)
    assert torch.equal(got, want)
    assert int((got == macer.AUDIO).sum()) == int((ids == SYNTHETIC_TOKENS.audio).sum()) > 0
    assert int((got == macer.VISUAL).sum()) == int((ids == SYNTHETIC_TOKENS.video).sum()) > 0
    assert prompt.end_of_turn_token_id == SYNTHETIC_TOKENS.im_end == Qwen25OmniAdapter().end_of_turn_token_id(model)


def test_qwen3_omni_labels_and_question_end_follow_its_transformers_adapter():
    """Guards the Qwen3-Omni thinker (``macer.vllm.qwen3_omni``) labelling its rows or closing its question
    differently from the Qwen3-Omni adapter, on an interleaved clip prompt (its own audio id, 151675 in the real
    vocabulary, differs from Qwen2.5-Omni's)."""
    from macer.core.families import QWEN3_OMNI
    from macer.hf.adapters.qwen3_omni import Qwen3OmniAdapter
    from macer.testing_qwen3 import build_qwen3_thinker, qwen3_clip_inputs

    model = build_qwen3_thinker(num_layers=2, hidden_size=64, deepstack_layers=1)
    ids = qwen3_clip_inputs(model, frames=2, grid_hw=(4, 4), seconds=2.0, seed=0)["input_ids"][0]
    prompt = omni_prompt_labels(model.config, QWEN3_OMNI)
    got = prompt.labels(ids)
    assert torch.equal(got, Qwen3OmniAdapter().labels(model, ids[None])[0])
    assert int((got == macer.AUDIO).sum()) == int((ids == model.config.audio_token_id).sum()) > 0
    assert int((got == macer.VISUAL).sum()) == int((ids == model.config.video_token_id).sum()) > 0
    assert prompt.end_of_turn_token_id == SYNTHETIC_TOKENS.im_end == Qwen3OmniAdapter().end_of_turn_token_id(model)


def test_omni_question_end_defaults_to_im_end_on_the_real_vocabulary():
    """Guards the real-size thinker (vocabulary past 151645) getting no end-of-turn id: its question rows would be
    refused at load."""
    config = thinker_config(num_layers=2, hidden_size=64, vocab_size=151936)
    del config.im_end_token_id  # the published config names none
    assert omni_prompt_labels(config).end_of_turn_token_id == 151645


def test_temporal_row_reads_the_mrope_temporal_row():
    """Guards the coverage chunks of an M-RoPE thinker reading the height or width row instead of time."""
    positions = torch.stack([torch.arange(6) // 2, torch.arange(6) % 2, torch.arange(6) % 3])
    assert torch.equal(temporal_row(positions), positions[0])
    assert torch.equal(temporal_row(torch.arange(5)), torch.arange(5))
    with pytest.raises(ValueError, match=r"positions must be \[T\] or \[3, T\]"):
        temporal_row(torch.zeros(2, 5, dtype=torch.long))


def test_policies_the_engine_cannot_serve_are_refused_at_load():
    """Guards a prefill error stopping the engine: a policy without an end-of-turn id for its question rows, and
    trim_early_cache (the early layers' pages are not compacted), are refused when the model loads; policies that
    read no question rows need no end-of-turn id."""
    with pytest.raises(ValueError, match="end_of_turn_token_id"):
        check_policy(macer.MacerConfig(keep_ratio=0.25), None)
    with pytest.raises(ValueError, match="trim_early_cache"):
        check_policy(macer.MacerConfig(keep_ratio=0.25, trim_early_cache=True), 2)
    check_policy(macer.MacerConfig(keep_ratio=0.25), 2)
    check_policy(macer.MacerConfig(keep_ratio=0.25, question_span="prompt_end"), None)
    check_policy(macer.FastVConfig(keep_ratio=0.25, layer=2), None)
    check_policy(macer.RandomConfig(keep_ratio=0.25), None)


def test_image_rows_are_visual_rows_for_both_thinkers():
    """Guards image rows not being labelled as visual (mutation audit 3: planted by dropping the image token id from
    ``QwenOmni.labels``, it was caught only by the transformers suite, because the tests above compare with the
    transformers adapter, which reads the same core function): labels are checked against the token ids directly,
    for both families. An image row must be a visual row: it is pruned with the video budget (the paper's rule)."""
    from macer.core.families import QWEN3_OMNI
    from macer.testing_qwen3 import qwen3_thinker_config

    for config, family in ((thinker_config(num_layers=2, hidden_size=64), None),
                           (qwen3_thinker_config(num_layers=2, hidden_size=64, deepstack_layers=1), QWEN3_OMNI)):
        prompt = omni_prompt_labels(config) if family is None else omni_prompt_labels(config, family)
        ids = [11, config.image_token_id, config.image_token_id, 12, config.video_token_id, config.audio_token_id,
               13, prompt.end_of_turn_token_id]
        want = [macer.TEXT, macer.VISUAL, macer.VISUAL, macer.TEXT, macer.VISUAL, macer.AUDIO, macer.TEXT, macer.TEXT]
        assert prompt.labels(torch.tensor(ids)).tolist() == want, type(config).__name__
