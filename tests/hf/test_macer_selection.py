"""The kept sets of ``macer.compress`` equal an independent computation.

The reference never touches macer's patch nor the fast ops: the unpatched model runs with eager attention and
``output_attentions``-style probabilities (captured from the attention module's returned weights), ANMS is computed
from those probabilities in float64 (``eq:macer_score``), budgets from the integer oracle ``budget_oracle`` (not
``split_budget``'s own definition) and selections from ``macer_kernels.reference`` (``topk_indices_ref``,
``coverage_select_ref``, ``temporal_chunks_ref``). A later stage is read on a hand-written forward in which the
earlier stage's tokens are already dropped from the next layer on (plain ``index_select`` of hidden states and RoPE
tables, a fresh causal mask).
"""

from __future__ import annotations

import macer
import pytest
import torch
from budget_oracle import exact_budget
from macer.testing import SYNTHETIC_TOKENS, build_thinker, clip_inputs, macer_config_for
from staged_reference import stage_rows
from tiny_models import decoder_of as _decoder

AUDIO, VISUAL = 1, 2


SMALL_CLIP = {"frames": 8, "grid_hw": (8, 8), "audio_tokens": 150}  # 64 video + 150 audio tokens, 6 s


def _labels(ids: torch.Tensor) -> torch.Tensor:
    tok = SYNTHETIC_TOKENS
    labels = torch.zeros_like(ids)
    labels[ids == tok.audio] = AUDIO
    labels[(ids == tok.video) | (ids == tok.image)] = VISUAL
    return labels


def _anms(probs: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, eps: float,
          scoring: str = "anms") -> torch.Tensor:
    """eq:macer_score from attention probabilities [H, n, n] (float64); ``"raw"``: the probability itself, averaged
    over heads and rows (the ablation without per-modality renormalisation)."""
    a = probs[:, rows].double()  # [H, Lq, n]
    if scoring == "raw":
        return a.mean(dim=(0, 1))
    scores = torch.zeros(a.shape[-1], dtype=torch.float64)
    for m in (AUDIO, VISUAL):
        in_m = labels == m
        if in_m.any():
            mass = a[..., in_m].sum(-1, keepdim=True)
            scores[in_m] = (a[..., in_m] / (mass + eps)).mean(dim=(0, 1))
    return scores


def reference_kept(model, inputs, config) -> tuple[list[int], list[int]]:
    """Kept audio and visual prompt positions, computed independently (see module docstring)."""
    lm = _decoder(model)
    captured = {}

    def grab(module, args, kwargs):
        captured.update(kwargs)

    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    embeds, position_ids = captured["inputs_embeds"], captured["position_ids"]
    ids = inputs["input_ids"][0]
    labels = _labels(ids)
    n = ids.numel()
    # Question rows: the last query_tokens before the last end-of-turn token.
    end = int((ids == config.end_of_turn_token_id).nonzero()[-1])
    question = torch.arange(end - config.query_tokens, end)
    n_a, n_v = int((labels == AUDIO).sum()), int((labels == VISUAL).sum())
    budget = exact_budget(n_a, n_v, config.keep_ratio, config.audio_share)
    # Temporal positions straight from the model's get_rope_index.
    rope, _ = model.get_rope_index(
        inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs["attention_mask"],
        inputs["use_audio_in_video"],
        inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None,
        inputs.get("video_second_per_grid"))
    temporal = rope[0, 0]
    stages: dict[int, list[int]] = {}
    for layer, modality, count in ((config.audio_layer, AUDIO, n_a), (config.video_layer, VISUAL, n_v)):
        if count:
            stages.setdefault(layer - 1, []).append(modality)

    weights = {}

    def keep_weights(module, args, output):
        weights["probs"] = output[1]

    current = torch.arange(n)
    hidden = embeds
    cos, sin = lm.rotary_emb(hidden, position_ids)
    kept = {AUDIO: (labels == AUDIO).nonzero().reshape(-1), VISUAL: (labels == VISUAL).nonzero().reshape(-1)}
    with torch.no_grad():
        for i, layer in enumerate(lm.layers):
            length = current.numel()
            mask = torch.full((length, length), torch.finfo(hidden.dtype).min).triu(1)[None, None]
            handle = layer.self_attn.register_forward_hook(keep_weights)
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=None,
                           past_key_values=None, use_cache=False)
            handle.remove()
            if i not in stages:
                continue
            cur_labels = labels[current]
            rows = torch.searchsorted(current, question)
            scores = _anms(weights["probs"][0], rows, cur_labels, config.eps, config.scoring)
            index = stage_rows(scores, cur_labels, current, stages[i], budget, temporal, config, kept)
            hidden, cos, sin = hidden[:, index], cos[:, index], sin[:, index]
            current = current[index]
    return sorted(kept[AUDIO].tolist()), sorted(kept[VISUAL].tolist())


@pytest.fixture(scope="module")
def eager_model():
    return build_thinker(num_layers=6, hidden_size=64, attn_implementation="eager", seed=3)


@pytest.mark.parametrize(
    ("layers", "clip"),
    [
        pytest.param((2, 4), {**SMALL_CLIP, "use_audio_in_video": True}, id="audio-first-interleaved"),
        pytest.param((2, 4), {**SMALL_CLIP, "use_audio_in_video": False}, id="audio-first-blocks"),
        pytest.param((4, 2), {**SMALL_CLIP, "use_audio_in_video": True}, id="video-first-interleaved"),
        pytest.param((3, 3), {**SMALL_CLIP, "use_audio_in_video": True}, id="equal-layers"),
        pytest.param((1, 5), {**SMALL_CLIP, "use_audio_in_video": True}, id="readout-layer-1-and-last"),
        pytest.param((1, 1), {**SMALL_CLIP, "use_audio_in_video": False}, id="both-at-layer-1"),
        # The 4 question rows are <|audio_eos|><|vision_eos|> and 2 question tokens, right after the last media token.
        pytest.param((2, 4), {**SMALL_CLIP, "use_audio_in_video": True, "question_tokens": 2},
                     id="question-right-after-media"),
        pytest.param((2, 4), {"frames": 0, "audio_tokens": 150, "use_audio_in_video": False}, id="audio-only"),
        pytest.param((2, 4), {"frames": 8, "grid_hw": (8, 8), "audio_tokens": 0, "use_audio_in_video": False},
                     id="video-only"),
    ],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_kept_sets_match_independent_reference(eager_model, layers, clip, attn):
    config = macer_config_for(eager_model, keep_ratio=0.3, audio_layer=layers[0], video_layer=layers[1],
                              coverage_weight=0.05)
    inputs = clip_inputs(eager_model, seed=1, **clip)
    want_audio, want_video = reference_kept(eager_model, inputs, config)
    model = eager_model if attn == "eager" else build_thinker(num_layers=6, hidden_size=64, attn_implementation="sdpa",
                                                              seed=3)
    with torch.no_grad(), macer.compress(model, config) as trace:
        model(**inputs)
    ids = inputs["input_ids"][0]
    n_a, n_v = int((ids == SYNTHETIC_TOKENS.audio).sum()), int((ids == SYNTHETIC_TOKENS.video).sum())
    assert trace.budget == exact_budget(n_a, n_v, 0.3, config.audio_share)
    # The test is not vacuous: something of each present modality was dropped or reassigned.
    assert len(trace.audio_kept) + len(trace.video_kept) == trace.budget.total < n_a + n_v
    assert trace.audio_kept == want_audio
    assert trace.video_kept == want_video
    assert all(ids[i] == SYNTHETIC_TOKENS.audio for i in trace.audio_kept)
    assert all(ids[i] == SYNTHETIC_TOKENS.video for i in trace.video_kept)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_raw_scoring_ablation_matches_reference(eager_model, attn):
    """``MacerConfig(scoring="raw")`` (the ``macer_raw`` ablation) ranks by the raw attention probability."""
    config = macer_config_for(eager_model, keep_ratio=0.3, audio_layer=2, video_layer=4, scoring="raw")
    inputs = clip_inputs(eager_model, seed=1, **SMALL_CLIP)
    want = reference_kept(eager_model, inputs, config)
    anms = reference_kept(eager_model, inputs, config.replace(scoring="anms"))
    model = eager_model if attn == "eager" else build_thinker(num_layers=6, hidden_size=64, attn_implementation="sdpa",
                                                              seed=3)
    with torch.no_grad(), macer.compress(model, config) as trace:
        model(**inputs)
    assert (trace.audio_kept, trace.video_kept) == want
    assert want != anms  # the two scorings pick different tokens here, so the test tells them apart


@pytest.mark.parametrize(("audio_share", "keep_ratio"), [(0.0, 0.3), (1.0, 0.3), (0.3, 0.005)],
                         ids=["no-audio-kept", "no-video-kept", "almost-nothing-kept"])
def test_a_modality_fully_dropped_matches_reference(eager_model, audio_share, keep_ratio):
    """K_a = 0 or K_v = 0 (a modality is dropped entirely at its stage); the later stage then runs on a sequence
    without that modality, and generate still decodes on the compacted caches."""
    config = macer_config_for(eager_model, keep_ratio=keep_ratio, audio_share=audio_share, audio_layer=2,
                              video_layer=4)
    inputs = clip_inputs(eager_model, seed=1, **SMALL_CLIP)
    want_audio, want_video = reference_kept(eager_model, inputs, config)
    with torch.no_grad(), macer.compress(eager_model, config) as trace:
        out = eager_model.generate(**inputs, max_new_tokens=2, do_sample=False)
    record = trace.history[0]
    assert 0 in (record.budget.audio, record.budget.video)
    assert (record.audio_kept, record.video_kept) == (want_audio, want_video)
    assert len(record.audio_kept) == record.budget.audio and len(record.video_kept) == record.budget.video
    n = inputs["input_ids"].shape[1]
    text = n - record.n_audio - record.n_video
    assert record.layer_tokens[-1] == record.cache_lengths[-1] == text + record.budget.total
    assert out.shape[1] == n + 2
