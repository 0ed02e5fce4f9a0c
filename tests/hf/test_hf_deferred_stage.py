"""The transformers engine on the prepared stage's deferred path (issue 37 item 1): a prompt alone runs
``PromptPrefill(defer=True)``, whose fused stages keep their readout until the next layer's pre-hook, where one
``PrefillState.apply`` scores, selects and gathers the layer's per-token inputs (hidden states, RoPE tables, position
ids) in the stage's own call, instead of the stage at the readout and a ``compact_many`` before the next layer.

Against the path before it (``defer=False``, still what a batch's samples run) on fresh random prompts of tiny random
Qwen2.5-Omni (eager and sdpa attention) and Qwen3-Omni thinkers and a Qwen2 decoder on the labelled path, eager and
compiled (``compile=...``, aot_eager): the same kept rows and per-layer lengths, bit-equal logits (the gathers copy
rows; the selection is the same), the same greedy tokens; and the engine's prefill really takes the deferred path:
no ``compact_many`` of the layer inputs, one deferred ``_run`` with the engine's tensors per fused stage.
"""

from __future__ import annotations

import macer
import pytest
import torch
from macer.core import prefill as core_prefill
from macer.hf import prefill as hf_prefill

AOT = {"backend": "aot_eager"}


def _run(model, config, inputs, *, compile=False, adapter=None):
    with torch.no_grad(), macer.compress(model, config, compile=compile, adapter=adapter) as trace:
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    return logits, tokens, list(trace.audio_kept), list(trace.video_kept), list(trace.layer_tokens)


def _both(monkeypatch, model, config, inputs, **kwargs):
    """(deferred, before): the prefill as the engine runs it now and with ``defer=False``; the engine-side calls of
    the deferred run are counted."""
    calls = {"compact_many": 0, "deferred_runs": 0}
    original_compact_many, original_run = hf_prefill.compact_many, core_prefill.PrefillState._run

    def compact_many(*args, **kw):
        calls["compact_many"] += 1
        return original_compact_many(*args, **kw)

    def run(self, *args, **kw):
        if kw.get("extra") is not None or len(args) > 6:
            calls["deferred_runs"] += 1
        return original_run(self, *args, **kw)

    with monkeypatch.context() as m:
        m.setattr(hf_prefill, "compact_many", compact_many)
        m.setattr(core_prefill.PrefillState, "_run", run)
        deferred = _run(model, config, inputs, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(hf_prefill.PromptPrefill.__init__, "__kwdefaults__", {"defer": False})
        before = _run(model, config, inputs, **kwargs)
    return deferred, before, calls


def _assert_same(deferred, before, inputs):
    assert torch.equal(deferred[0], before[0])
    assert torch.equal(deferred[1], before[1])
    assert deferred[2:] == before[2:]
    prompt = inputs["input_ids" if "input_ids" in inputs else "inputs_embeds"].shape[1]
    assert deferred[4][-1] < prompt  # the stages pruned


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen2_5_omni_prompt_alone_deferred_equals_the_path_before(attn, monkeypatch):
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    model = build_thinker(num_layers=5, hidden_size=64, num_heads=4, num_kv_heads=2, attn_implementation=attn,
                          seed=11)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=2, video_layer=3)
    seed = int(torch.randint(0, 2**16, ()).item())  # fresh prompts each run (the seed is in the failure message)
    for i, (frames, audio) in enumerate([(4, 100), (6, 70)]):
        inputs = clip_inputs(model, frames=frames, audio_tokens=audio, grid_hw=(8, 8), seed=seed + i)
        deferred, before, calls = _both(monkeypatch, model, config, inputs)
        _assert_same(deferred, before, inputs)
        # Two prefills (the forward and generate's) of two fused stages, each run by apply with the layer inputs;
        # nothing else compacts them.
        assert calls == {"compact_many": 0, "deferred_runs": 4}, (seed, calls)


def test_other_policies_keep_their_paths(monkeypatch):
    """FastV (raw scores: composed ops), Random (a stage before the first layer) and MACER with one joint stage
    give the same outputs with the engine on the deferred path."""
    from macer.testing import SYNTHETIC_TOKENS, build_thinker, clip_inputs

    model = build_thinker(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, seed=12)
    inputs = clip_inputs(model, frames=4, audio_tokens=90, grid_hw=(8, 8), seed=int(torch.randint(0, 999, ())))
    for policy in [macer.FastVConfig(keep_ratio=0.3, layer=2), macer.RandomConfig(keep_ratio=0.3, seed=2),
                   macer.MacerConfig(keep_ratio=0.4, audio_layer=2, video_layer=2,
                                     end_of_turn_token_id=SYNTHETIC_TOKENS.im_end)]:
        deferred, before, _ = _both(monkeypatch, model, policy, inputs)
        _assert_same(deferred, before, inputs)


def test_qwen3_omni_deferred_equals_the_path_before_eager_and_compiled(monkeypatch):
    from macer.testing_qwen3 import build_qwen3_thinker, qwen3_clip_inputs

    model = build_qwen3_thinker(num_layers=4, hidden_size=64, attn_implementation="sdpa", seed=13)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=2, video_layer=3)
    inputs = qwen3_clip_inputs(model, frames=8, grid_hw=(8, 8), seconds=6.0, seed=int(torch.randint(0, 999, ())))
    for compile_ in (False, AOT):
        deferred, before, calls = _both(monkeypatch, model, config, inputs, compile=compile_)
        _assert_same(deferred, before, inputs)
        assert calls == {"compact_many": 0, "deferred_runs": 4}, (compile_, calls)


def test_qwen2_labelled_deferred_equals_the_path_before_compiled(monkeypatch):
    from test_macer_labelled import build_decoder, media_prompt

    model = build_decoder("qwen2", attn="sdpa", seed=14)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=1, video_layer=2, coverage_weight=0.05)
    embeds, labels, times, question_end = media_prompt(model, seed=int(torch.randint(0, 999, ())), frames=5)
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    inputs = {"inputs_embeds": embeds, "attention_mask": torch.ones(1, embeds.shape[1], dtype=torch.long)}
    for compile_ in (False, AOT):
        deferred, before, calls = _both(monkeypatch, model, config, inputs, compile=compile_, adapter=adapter)
        _assert_same(deferred, before, inputs)
        assert calls == {"compact_many": 0, "deferred_runs": 4}, (compile_, calls)
