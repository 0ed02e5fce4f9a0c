"""``macer.compress(model, config, compile=...)``: the decoder layers through ``torch.compile`` (regional, the sequence
length dynamic, MACER's stages between the compiled regions; ``macer.hf.compiled``), against the same context without
it, on tiny random Qwen2.5-Omni and Qwen3-Omni thinkers and a Qwen2 decoder on the labelled path.

For each: the kept rows, the per-layer lengths and the greedy tokens equal eager's, the logits agree within fp32
rounding (``aot_eager``: Dynamo's capture and AOTAutograd's graphs run by eager kernels; one test runs Inductor's
generated CPU code); prompts of other lengths and the compacted layers after each stage compile nothing new (Dynamo's
frame counter), and the decoder's layers share their graphs; leaving the context restores the model bit for bit.
"""

from __future__ import annotations

import dataclasses

import macer
import pytest
import torch
from torch._dynamo.utils import counters

AOT = {"backend": "aot_eager"}


def frames() -> int:
    """Frames Dynamo has compiled in this process (a recompile counts as one more)."""
    return counters["frames"]["total"]


def run(model, config, inputs: dict, *, compile, adapter=None, new_tokens: int = 4):
    with torch.no_grad(), macer.compress(model, config, compile=compile, adapter=adapter) as trace:
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return logits, tokens, list(trace.audio_kept), list(trace.video_kept), list(trace.layer_tokens)


def assert_same(eager, compiled, atol: float = 1e-6):
    logits, tokens, audio, video, layers = eager
    torch.testing.assert_close(compiled[0], logits, rtol=1e-5, atol=atol)
    assert torch.equal(compiled[1], tokens)
    assert list(compiled[2:]) == [audio, video, layers]
    assert layers[-1] < layers[0]  # the stages pruned


@pytest.fixture(scope="module")
def thinker():
    from macer.testing import build_thinker

    return build_thinker(num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, seed=3)


def _clips(model, sizes):
    from macer.testing import clip_inputs

    return [clip_inputs(model, frames=f, audio_tokens=a, grid_hw=(8, 8), seed=i) for i, (f, a) in enumerate(sizes)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen2_5_omni_compiled_equals_eager_and_compiles_once(attn):
    from macer.testing import build_thinker, macer_config_for

    model = build_thinker(num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, attn_implementation=attn,
                          seed=1)
    config = macer_config_for(model, keep_ratio=0.25, audio_layer=2, video_layer=3)
    clips = _clips(model, [(4, 100), (6, 150), (4, 121), (2, 60)])
    start = frames()
    assert_same(run(model, config, clips[0], compile=False), run(model, config, clips[0], compile=AOT))
    warm = frames()
    # One graph for a prefill and one per decode state, shared by the six layers (eager attention: the 4-D masks'
    # shapes are symbols too).
    assert 1 <= warm - start <= 4
    for inputs in clips[1:]:  # other prompt lengths, other compacted lengths and cache lengths: nothing compiles
        assert_same(run(model, config, inputs, compile=False), run(model, config, inputs, compile=AOT))
    assert frames() == warm


def test_other_policies_and_the_full_model_compiled(thinker):
    """The full model (no stage: every layer compiled in the prefill too), FastV (one raw-score readout) and Random
    (a stage before the first layer, no readout) give eager's outputs through the same graphs."""
    from macer.testing import SYNTHETIC_TOKENS

    clips = _clips(thinker, [(4, 90), (6, 130)])
    policies = [macer.FullConfig(), macer.FastVConfig(keep_ratio=0.3, layer=2),
                macer.RandomConfig(keep_ratio=0.3, seed=2),
                macer.MacerConfig(keep_ratio=0.4, audio_layer=3, video_layer=3,
                                  end_of_turn_token_id=SYNTHETIC_TOKENS.im_end)]
    for policy in policies:
        for inputs in clips:
            eager, compiled = run(thinker, policy, inputs, compile=False), run(thinker, policy, inputs, compile=AOT)
            torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
            assert torch.equal(compiled[1], eager[1]) and compiled[2:] == eager[2:]
    warm = frames()
    for policy in policies:
        run(thinker, policy, clips[0], compile=AOT)
    assert frames() == warm  # every later context on this model reuses the graphs


def test_qwen3_omni_compiled_equals_eager():
    """Dense and MoE layers (two layer shapes: a graph each per state), deepstack features sliced between layers."""
    from macer.testing_qwen3 import build_qwen3_thinker, qwen3_clip_inputs

    model = build_qwen3_thinker(num_layers=5, hidden_size=64, attn_implementation="sdpa", seed=5)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=2, video_layer=3)
    clips = [qwen3_clip_inputs(model, frames=f, grid_hw=(8, 8), seconds=s, seed=i)
             for i, (f, s) in enumerate([(8, 8.0), (4, 6.0), (8, 5.0)])]
    start = frames()
    assert_same(run(model, config, clips[0], compile=False), run(model, config, clips[0], compile=AOT))
    warm = frames()
    assert 1 <= warm - start <= 6
    for inputs in clips[1:]:
        assert_same(run(model, config, inputs, compile=False), run(model, config, inputs, compile=AOT))
    assert frames() == warm


def test_qwen2_labelled_path_compiled_equals_eager():
    from test_macer_labelled import build_decoder, media_prompt

    model = build_decoder("qwen2", attn="sdpa", seed=4)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=1, video_layer=2, coverage_weight=0.05)
    results, warm = [], None
    for seed, frames_ in ((1, 6), (2, 4), (3, 7)):
        embeds, labels, times, question_end = media_prompt(model, seed=seed, frames=frames_)
        adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
        inputs = {"inputs_embeds": embeds, "attention_mask": torch.ones(1, embeds.shape[1], dtype=torch.long)}
        eager = run(model, config, inputs, compile=False, adapter=adapter)
        results.append((eager, run(model, config, inputs, compile=AOT, adapter=adapter)))
        warm = frames() if warm is None else warm
    for eager, compiled in results:
        assert_same(eager, compiled)
    assert frames() == warm


def test_inductor_compiled_equals_eager_within_fp32_rounding(thinker):
    """The path users run: Inductor's generated code (C++ on CPU), whose fused reductions round differently."""
    from macer.testing import macer_config_for

    config = macer_config_for(thinker, keep_ratio=0.25, audio_layer=2, video_layer=3)
    clips = _clips(thinker, [(4, 100), (6, 140)])
    eager = [run(thinker, config, inputs, compile=False) for inputs in clips]
    compiled = [run(thinker, config, clips[0], compile=True)]
    warm = frames()
    compiled.append(run(thinker, config, clips[1], compile=True))
    assert frames() == warm
    for e, c in zip(eager, compiled):
        assert_same(e, c, atol=1e-4)


def test_leaving_restores_the_model_bit_for_bit(thinker):
    from macer.testing import macer_config_for

    inputs = _clips(thinker, [(4, 80)])[0]
    layers = thinker.model.language_model.layers
    with torch.no_grad():
        before = thinker(**inputs).logits
    config = macer_config_for(thinker, keep_ratio=0.25, audio_layer=2, video_layer=3)
    with torch.no_grad(), macer.compress(thinker, config, compile=AOT):
        assert all("forward" in layer.__dict__ for layer in layers)
        thinker(**inputs)
    assert not any("forward" in layer.__dict__ for layer in layers)
    with pytest.raises(RuntimeError, match="boom"), macer.compress(thinker, config, compile=AOT):
        raise RuntimeError("boom")
    assert not any("forward" in layer.__dict__ for layer in layers)
    with torch.no_grad():
        after = thinker(**inputs).logits
    assert torch.equal(after, before)
    assert thinker.config.text_config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("yes", TypeError, "compile must be True, False or a dict"),
        ({"dynamic": False}, ValueError, r"unknown torch.compile arguments \['dynamic'\].*dynamic is always True"),
        ({"mode": "reduce-overhead"}, ValueError, "records CUDA graphs"),
        ({"bakend": "inductor"}, ValueError, r"allowed: \['backend', 'mode', 'options', 'fullgraph'\]"),
    ],
)
def test_bad_compile_arguments_are_refused_by_name(thinker, value, error, message):
    from macer.testing import macer_config_for

    with pytest.raises(error, match=message):
        macer.compress(thinker, macer_config_for(thinker, audio_layer=2, video_layer=3), compile=value)


def test_a_cache_other_than_dynamic_cache_is_refused(thinker):
    from macer.testing import macer_config_for
    from transformers.cache_utils import DynamicCache

    inputs = _clips(thinker, [(4, 80)])[0]
    config = macer_config_for(thinker, audio_layer=2, video_layer=3)

    class OtherCache(DynamicCache):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    with torch.no_grad(), macer.compress(thinker, config, compile=AOT), \
            pytest.raises(ValueError, match=r"compile=True\) supports transformers' DynamicCache.*got OtherCache"):
        thinker(**inputs, past_key_values=OtherCache(config=thinker.config.text_config), use_cache=True)


def test_layer_cache_appends_to_its_own_layer():
    """``LayerCache`` on a ``DynamicCache`` made without a config (layers created on demand)."""
    from macer.hf.compiled import LayerCache
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    k = torch.randn(1, 2, 3, 4)
    keys, _ = LayerCache(cache, 2).update(k, k + 1, layer_idx=7)
    assert len(cache.layers) == 3 and torch.equal(keys, k) and cache.layers[2].get_seq_length() == 3
    assert cache.layers[0].get_seq_length() == 0
    assert LayerCache(cache, 2).get_seq_length(2) == 3  # everything else reads the whole cache
    assert dataclasses.is_dataclass(macer.MacerConfig)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_left_padded_batch_compiled_equals_eager(attn):
    """A batch of prompts of different lengths (left padding, re-packed after every stage: the batch's masks and
    shapes change between layers) and its decode steps, compiled and eager."""
    from macer.testing import batch_inputs, build_thinker, clip_inputs, macer_config_for

    model = build_thinker(num_layers=4, hidden_size=64, attn_implementation=attn, seed=7)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2)
    prompts = [clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=4),
               clip_inputs(model, frames=6, grid_hw=(4, 8), audio_tokens=150, seed=6)]
    batch = batch_inputs(prompts)
    outcomes = []
    for compile in (False, AOT):
        with torch.no_grad(), macer.compress(model, config, compile=compile) as trace:
            logits = model(**batch).logits
            kept = [(list(s.audio_kept), list(s.video_kept), list(s.layer_tokens)) for s in trace.samples]
            tokens = model.generate(**batch, max_new_tokens=4, do_sample=False)
        outcomes.append((logits, kept, tokens))
    (logits, kept, tokens), (c_logits, c_kept, c_tokens) = outcomes
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-6)
    assert c_kept == kept and torch.equal(c_tokens, tokens)
