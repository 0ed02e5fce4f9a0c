"""Qwen3-Omni (transformers ``qwen3_omni_moe``): tiny random thinkers with a sparse-MoE decoder and deepstack visual
features, synthetic prompts with the processor's layout, and ``macer.compress`` on them.

Kept sets are compared with an independent staged forward (``staged_reference.staged_kept``) that adds the deepstack
features itself, from a full-length table indexed by the rows still present (not by the adapter's rank arithmetic).
"""

from __future__ import annotations

import macer
import pytest
import torch
from macer.testing import SYNTHETIC_TOKENS
from macer.testing_qwen3 import audio_token_count, build_qwen3_omni_model, build_qwen3_thinker, qwen3_clip_inputs
from staged_reference import AUDIO, VISUAL, staged_kept

TOK = SYNTHETIC_TOKENS


@pytest.fixture(scope="module")
def eager_model():
    return build_qwen3_thinker(num_layers=4, hidden_size=64, attn_implementation="eager", seed=5)


def _rope(model, inputs):
    thinker = getattr(model, "thinker", model)
    fam = inputs.get("feature_attention_mask")
    return thinker.get_rope_index(inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                  inputs["attention_mask"], inputs["use_audio_in_video"],
                                  fam.sum(-1) if fam is not None else None, inputs.get("video_second_per_grid"))[0]


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = torch.zeros_like(ids)
    labels[ids == TOK.audio] = AUDIO
    labels[(ids == TOK.video) | (ids == TOK.image)] = VISUAL
    return labels


def reference_kept(model, inputs, config):
    """Kept (audio, visual) prompt positions and the final hidden states of an independent staged forward."""
    thinker = getattr(model, "thinker", model)
    lm = thinker.model.language_model
    captured = {}
    handle = lm.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        thinker(**inputs)
    handle.remove()
    ids = inputs["input_ids"][0]
    labels = _labels(ids)
    end = int((ids == TOK.im_end).nonzero()[-1])
    question = torch.arange(end - config.query_tokens, end)
    temporal = _rope(model, inputs)[0, 0]  # the temporal M-RoPE row, from the model's own get_rope_index
    mask = captured["visual_pos_masks"]
    tables = []
    for embeds in captured["deepstack_visual_embeds"] or ():
        table = torch.zeros(ids.numel(), embeds.shape[-1], dtype=embeds.dtype)
        table[mask[0]] = embeds
        tables.append(table)

    def deepstack(i, hidden, current):
        return hidden + tables[i][current][None] if i < len(tables) else hidden

    return staged_kept(lm.layers, lm.rotary_emb, captured["inputs_embeds"], captured["position_ids"], labels,
                       temporal, question, config, after_layer=deepstack)


def test_audio_token_count_matches_the_encoder_rule():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    for frames in (1, 7, 99, 100, 101, 250, 799, 800, 1234):
        assert audio_token_count(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames))), frames


@pytest.mark.parametrize("interleaved", [True, False])
def test_clip_layout_matches_get_rope_index(eager_model, interleaved):
    """Audio at 13 positions per second, video at its grid times, interleaved on one time axis as the processor does
    (each video grid at its start time, then the audio up to the next grid)."""
    inputs = qwen3_clip_inputs(eager_model, frames=8, grid_hw=(8, 8), seconds=8.0, use_audio_in_video=interleaved)
    ids = inputs["input_ids"][0]
    audio, video = ids == TOK.audio, ids == TOK.video
    assert int(audio.sum()) == 104 and int(video.sum()) == 64
    rope = _rope(eager_model, inputs)[:, 0]
    assert rope.dtype == torch.float32
    t_audio, t_video = rope[0][audio], rope[0][video]
    assert torch.equal(t_audio - t_audio[0], torch.arange(104).float())
    assert torch.equal(t_video - t_video[0], (torch.arange(4) * 26.0).repeat_interleave(16))
    if interleaved:
        # One time axis: the sequence is sorted by time, video first on ties (the video grid opens its 2 s).
        media = audio | video
        assert torch.equal(t_video[0], t_audio[0])
        assert bool((rope[0][media].diff() >= 0).all())
        runs = torch.unique_consecutive(ids[media], return_counts=True)
        assert runs[0].tolist() == [TOK.video, TOK.audio] * 4 and runs[1].tolist() == [16, 26] * 4
    else:
        assert int(video.nonzero()[-1]) < int(audio.nonzero()[0])


def test_tiny_thinker_has_moe_and_deepstack_and_runs_unpatched(eager_model):
    lm = eager_model.model.language_model
    mlps = [type(layer.mlp).__name__ for layer in lm.layers]
    assert mlps[0].endswith("TextMLP") and all(m.endswith("SparseMoeBlock") for m in mlps[1:])
    inputs = qwen3_clip_inputs(eager_model, seed=1)
    calls = []
    handle = lm.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        with torch.no_grad():
            out = eager_model.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    n = inputs["input_ids"].shape[1]
    assert out.shape == (1, n + 3) and len(calls) == 3
    video = inputs["input_ids"] == TOK.video
    prefill = calls[0]
    assert torch.equal(prefill["visual_pos_masks"], video)
    assert [tuple(e.shape) for e in prefill["deepstack_visual_embeds"]] == [(int(video.sum()), 64)] * 3
    assert prefill["position_ids"].shape == (4, 1, n) and prefill["position_ids"].dtype == torch.float32
    # Decode steps get no deepstack inputs: only a prefill has to shorten them.
    assert all(call.get("deepstack_visual_embeds") is None for call in calls[1:])


@pytest.mark.parametrize("clip", [{}, {"image_grid_hw": (4, 4)}], ids=["video", "image-and-video"])
def test_reference_without_pruning_reproduces_the_model(eager_model, clip):
    """The staged reference (deepstack added from its own table) is the model's forward when nothing is dropped."""
    inputs = qwen3_clip_inputs(eager_model, seed=2, **clip)
    config = macer.MacerConfig(keep_ratio=1.0, audio_layer=1, video_layer=2, end_of_turn_token_id=TOK.im_end)
    audio, video, hidden = reference_kept(eager_model, inputs, config)
    labels = _labels(inputs["input_ids"][0])
    assert audio == (labels == AUDIO).nonzero().reshape(-1).tolist()
    assert video == (labels == VISUAL).nonzero().reshape(-1).tolist()
    lm = eager_model.model.language_model
    with torch.no_grad():
        want = eager_model(**inputs).logits
        got = eager_model.lm_head(lm.norm(hidden))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _config(**kw):
    return macer.MacerConfig(**{"keep_ratio": 0.3, "audio_layer": 1, "video_layer": 2, "coverage_weight": 0.05,
                                "end_of_turn_token_id": TOK.im_end, **kw})


_CASES = [
    # Stages among the deepstack layers (features still added after layers[1], layers[2]) and after them.
    ("audio-1-video-2", (1, 2), {}),
    ("video-1-audio-2", (2, 1), {}),
    ("both-at-1-blocks", (1, 1), {"use_audio_in_video": False}),
    ("image-and-video", (2, 3), {"image_grid_hw": (4, 4)}),
    ("after-deepstack", (3, 3), {}),
    ("audio-only", (1, 2), {"frames": 0, "use_audio_in_video": False}),
    ("video-only", (2, 1), {"audio": False, "use_audio_in_video": False}),
]


@pytest.mark.parametrize(
    ("layers", "clip", "attn"),
    [pytest.param(layers, clip, "eager", id=name) for name, layers, clip in _CASES]
    # sdpa (mask None for batch 1) on the cases where deepstack and stages interleave.
    + [pytest.param(layers, clip, "sdpa", id=f"{name}-sdpa") for name, layers, clip in _CASES[:4]],
)
def test_kept_sets_and_logits_match_independent_reference(eager_model, layers, clip, attn):
    config = _config(audio_layer=layers[0], video_layer=layers[1])
    inputs = qwen3_clip_inputs(eager_model, seed=1, **clip)
    want_audio, want_video, hidden = reference_kept(eager_model, inputs, config)
    model = eager_model if attn == "eager" else build_qwen3_thinker(num_layers=4, hidden_size=64,
                                                                    attn_implementation="sdpa", seed=5)
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**inputs).logits
    labels = _labels(inputs["input_ids"][0])
    assert len(trace.audio_kept) + len(trace.video_kept) == trace.budget.total < int((labels != 0).sum())
    assert trace.audio_kept == want_audio
    assert trace.video_kept == want_video
    # The logits of the kept rows are the reference's: this is what checks the deepstack rows (kept sets alone
    # do not move when a wrong deepstack row is added, on prompts this small).
    with torch.no_grad():
        want = model.lm_head(model.model.language_model.norm(hidden))
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_generate_keep_ratio_one_and_restore(eager_model):
    inputs = qwen3_clip_inputs(eager_model, seed=3)
    with torch.no_grad():
        before = eager_model(**inputs).logits
        full = eager_model.generate(**inputs, max_new_tokens=4, do_sample=False)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad(), macer.compress(eager_model, _config()) as trace:
        out = eager_model.generate(**inputs, max_new_tokens=4, do_sample=False)
    record = trace.history[0]
    assert out.shape == (1, n + 4) and torch.equal(out[:, :n], inputs["input_ids"])
    assert record.cache_lengths[-1] == n - record.n_audio - record.n_video + record.budget.total  # after prefill
    assert "_deepstack_process" not in vars(eager_model.model.language_model)
    with torch.no_grad(), macer.compress(eager_model, _config(keep_ratio=1.0)):
        same = eager_model(**inputs).logits
        same_out = eager_model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(same, before) and torch.equal(same_out, full)
    with torch.no_grad():
        assert torch.equal(eager_model(**inputs).logits, before)


def test_full_model_through_thinker():
    model = build_qwen3_omni_model(num_layers=4, hidden_size=64, attn_implementation="eager", seed=5)
    inputs = qwen3_clip_inputs(model, seed=1)
    config = _config(audio_layer=2, video_layer=1)
    want_audio, want_video, _ = reference_kept(model, inputs, config)
    with torch.no_grad(), macer.compress(model, macer.MacerConfig(
            keep_ratio=0.3, audio_layer=2, video_layer=1, coverage_weight=0.05)) as trace:
        out = model.generate(**inputs, return_audio=False, thinker_max_new_tokens=3, thinker_eos_token_id=TOK.im_end,
                             thinker_do_sample=False)
    n = inputs["input_ids"].shape[1]
    assert out.shape[1] <= n + 3
    assert (trace.audio_kept, trace.video_kept) == (want_audio, want_video)
    model.has_talker = True  # as a model loaded with its talker (enable_audio_output=True)
    with pytest.raises(ValueError, match="disable_talker"), macer.compress(model, config):
        pass


def test_for_model_derives_qwen3_omni_defaults():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    real = Qwen3OmniMoeThinkerConfig(text_config={"num_hidden_layers": 48, "hidden_size": 2048,
                                                  "num_attention_heads": 32, "num_key_value_heads": 4})
    with pytest.warns(UserWarning, match="not the paper's"):
        config = macer.MacerConfig.for_model(real, keep_ratio=0.25)
    assert (config.audio_layer, config.video_layer, config.audio_share, config.coverage_weight) == (5, 9, 0.30, 0.20)
    assert macer.paper_defaults(real) is None
    tiny = build_qwen3_thinker(num_layers=4)
    with pytest.raises(ValueError, match="audio_layer"):
        macer.MacerConfig.for_model(tiny)


def test_input_pruning_shortens_deepstack_from_layer_0(eager_model):
    """RandomConfig drops tokens before the first layer, so every deepstack level runs on the kept rows: the pruned
    prefill's logits equal the unpruned reference forward over exactly those rows (deepstack from its own table)."""
    inputs = qwen3_clip_inputs(eager_model, seed=4)
    with torch.no_grad(), macer.compress(eager_model, macer.RandomConfig(keep_ratio=0.3, seed=2)) as trace:
        logits = eager_model(**inputs).logits
    labels = _labels(inputs["input_ids"][0])
    kept = torch.tensor(sorted((labels == 0).nonzero().reshape(-1).tolist() + trace.audio_kept + trace.video_kept))
    assert len(trace.video_kept) < int((labels == VISUAL).sum())
    lm = eager_model.model.language_model
    captured = {}
    handle = lm.register_forward_pre_hook(lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        eager_model(**inputs)
    handle.remove()
    mask = captured["visual_pos_masks"][0]
    tables = []
    for embeds in captured["deepstack_visual_embeds"]:
        table = torch.zeros(labels.numel(), embeds.shape[-1])
        table[mask] = embeds
        tables.append(table[kept])
    config = _config(keep_ratio=1.0)
    question = torch.arange(kept.numel() - 9 - config.query_tokens, kept.numel() - 9)  # unused: nothing is dropped
    _, _, hidden = staged_kept(lm.layers, lm.rotary_emb, captured["inputs_embeds"][:, kept],
                               captured["position_ids"][..., kept], labels[kept],
                               _rope(eager_model, inputs)[0, 0][kept], question, config,
                               after_layer=lambda i, h, cur: h + tables[i][cur][None] if i < len(tables) else h)
    with torch.no_grad():
        want = eager_model.lm_head(lm.norm(hidden))
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", ["macer", "random"])
def test_repeated_prefills_in_one_context(eager_model, policy):
    """The deepstack rows of one prefill never leak into the next (an audio-only prefill in between, a generate with
    its decode steps): the same prompt gives the same logits each time."""
    config = _config() if policy == "macer" else macer.RandomConfig(keep_ratio=0.3, seed=1)
    clip = qwen3_clip_inputs(eager_model, seed=6)
    audio_only = qwen3_clip_inputs(eager_model, seed=7, frames=0, use_audio_in_video=False)
    with torch.no_grad(), macer.compress(eager_model, config) as trace:
        first = eager_model(**clip).logits
        eager_model(**audio_only)
        eager_model.generate(**clip, max_new_tokens=2, do_sample=False)
        again = eager_model(**clip).logits
    assert len(trace.history) == 4 and trace.history[0].video_kept == trace.history[-1].video_kept
    assert torch.equal(first, again)
