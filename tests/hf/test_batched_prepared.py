"""A left-padded batch's MACER stages on the prepared stage (issue 37 items 1 and 4): one ``PreparedStage`` call per
stage for the whole batch scores, selects and gathers the batch's row tables and the layer inputs into the re-packed
layout (``macer.hf.batch``), with each sample's question rows found on the host.

Against the per-sample path of the same engine (each sample's stage on its own unpadded rows, then one
``compact_many``: what a batch with a non-fused stage runs; forced here by making ``batch_stage`` decline) on fresh
random batches of tiny random Qwen2.5-Omni (sdpa and eager), Qwen3-Omni thinkers and a Qwen2 decoder on the labelled
path, eager and compiled (``compile=...``, aot_eager): the same kept rows, layer and cache lengths per sample,
bit-equal prefill logits (the layers run on the same re-packed rows), the same greedy tokens; and the batch really
takes the prepared path (one ``PreparedStage.run`` per stage, no ``compact_many``). Samples of unequal lengths, a
sample without a modality, per-sample budgets, and questions ending at different distances from the prompt's end
(the per-sample question rows) are in the batches.
"""

from __future__ import annotations

import macer
import macer.hf.batch as batch_module
import pytest
import torch
from macer.testing import batch_inputs
from tiny_models import SMALL_PROMPT

from macer_kernels.prepared import PreparedStage

AOT = {"backend": "aot_eager"}


def _fresh() -> int:
    return int(torch.randint(0, 2**16, ()).item())  # fresh inputs each run; the seed is in the failure message


def _run(model, config, inputs, *, compile=False, adapter=None):
    with torch.no_grad(), macer.compress(model, config, compile=compile, adapter=adapter) as trace:
        logits = model(**inputs).logits
        samples = [(s.audio_kept, s.video_kept, s.layer_tokens, s.cache_lengths) for s in trace.samples]
        tokens = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    return logits, tokens, samples


def _both(monkeypatch, model, config, inputs, **kwargs):
    """(prepared, per_sample, calls): the batch as the engine runs it, with its calls counted, and with every stage
    run per sample."""
    calls = {"run": 0, "compact_many": 0}
    original_run, original_compact_many = PreparedStage.run, batch_module.compact_many

    def run(self, *args, **kw):
        calls["run"] += 1
        return original_run(self, *args, **kw)

    def compact_many(*args, **kw):
        calls["compact_many"] += 1
        return original_compact_many(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(PreparedStage, "run", run)
        m.setattr(batch_module, "compact_many", compact_many)
        prepared = _run(model, config, inputs, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(batch_module, "batch_stage", lambda *args: None)
        per_sample = _run(model, config, inputs, **kwargs)
    return prepared, per_sample, calls


def _assert_same(prepared, per_sample, where):
    assert prepared[2] == per_sample[2], where
    assert torch.equal(prepared[0], per_sample[0]), where
    assert torch.equal(prepared[1], per_sample[1]), where
    assert any(s[2][-1] < s[2][0] for s in prepared[2]), where  # the stages pruned


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen2_5_omni_batch_prepared_equals_per_sample(attn, monkeypatch):
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    model = build_thinker(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, attn_implementation=attn,
                          seed=21)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2)
    seed = _fresh()
    prompts = [clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=seed, **SMALL_PROMPT),
               clip_inputs(model, frames=0, audio_tokens=60, use_audio_in_video=False, seed=seed + 1, **SMALL_PROMPT),
               clip_inputs(model, frames=6, grid_hw=(4, 8), audio_tokens=150, seed=seed + 2, **SMALL_PROMPT)]
    prepared, per_sample, calls = _both(monkeypatch, model, config, batch_inputs(prompts))
    _assert_same(prepared, per_sample, f"seed={seed}")
    # Two prefills (the forward and generate's), two stages each: one prepared call per stage, nothing else.
    assert calls == {"run": 4, "compact_many": 0}, (seed, calls)


def test_qwen3_omni_batch_prepared_equals_per_sample_eager_and_compiled(monkeypatch):
    from macer.testing import SYNTHETIC_TOKENS
    from macer.testing_qwen3 import build_qwen3_thinker, qwen3_clip_inputs

    model = build_qwen3_thinker(num_layers=4, hidden_size=64, attn_implementation="sdpa", seed=22)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=2, video_layer=3, coverage_weight=0.05,
                               end_of_turn_token_id=SYNTHETIC_TOKENS.im_end)
    seed = _fresh()
    prompts = [qwen3_clip_inputs(model, frames=4, grid_hw=(8, 8), seconds=4.0, seed=seed, **SMALL_PROMPT),
               qwen3_clip_inputs(model, frames=6, grid_hw=(4, 8), seconds=3.0, seed=seed + 1, **SMALL_PROMPT)]
    for compile_ in (False, AOT):
        prepared, per_sample, calls = _both(monkeypatch, model, config, batch_inputs(prompts), compile=compile_)
        _assert_same(prepared, per_sample, f"seed={seed} compile={compile_}")
        assert calls == {"run": 4, "compact_many": 0}, (seed, compile_, calls)


@pytest.mark.parametrize("shifts", [(0, 0, 0), (2, 0, 5)])
def test_qwen2_labelled_batch_prepared_equals_per_sample_compiled(shifts, monkeypatch):
    """``shifts``: each prompt's question ends that many rows earlier (more text after it): unequal shifts give each
    sample its own question rows (the prepared stage's per-sample ``query_rows``, a gather of the query's rows)."""
    from test_macer_labelled import build_decoder, left_padded, media_prompt

    model = build_decoder("qwen2", attn="sdpa", seed=23)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=1, video_layer=2, coverage_weight=0.05)
    seed = _fresh()
    prompts = [media_prompt(model, seed=seed, frames=3, question=6),
               media_prompt(model, seed=seed + 1, frames=5, question=9),
               media_prompt(model, seed=seed + 2, frames=2, audio_per_segment=0, question=7)]
    embeds, mask, adapter, _ = left_padded([(*p[:3], p[3] - shift) for p, shift in zip(prompts, shifts, strict=True)])
    from collections import OrderedDict

    from macer.core import stage as core_stage

    monkeypatch.setattr(core_stage, "_PREPARED", OrderedDict())  # this test's stages prepared here, not before
    rows_given = []
    prepare = batch_module.prepare_stage
    monkeypatch.setattr(batch_module, "prepare_stage",
                        lambda *a, **k: rows_given.append(k["query_rows"]) or prepare(*a, **k))
    inputs = {"inputs_embeds": embeds, "attention_mask": mask}
    for compile_ in (False, AOT):
        prepared, per_sample, calls = _both(monkeypatch, model, config, inputs, compile=compile_, adapter=adapter)
        _assert_same(prepared, per_sample, f"seed={seed} compile={compile_}")
        assert calls == {"run": 4, "compact_many": 0}, (seed, compile_, calls)
    assert rows_given and all((len(set(r)) > 1) == (len(set(shifts)) > 1) for r in rows_given), rows_given


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_batch_is_one_stage_call_per_stage_and_equals_per_sample(dtype, monkeypatch):
    """On a GPU: each batched stage is one ``StageHandle.launch`` (the prepared stage's one ``_C`` call), and the
    batch keeps the rows, and gives the tokens, of the per-sample path (float32: bit-equal logits; bf16: the same
    kept rows and lengths, logits within bf16 rounding of the per-sample run's)."""
    from macer.testing import build_thinker, clip_inputs, macer_config_for

    from macer_kernels.cuda import stage as cuda_stage

    launches = []
    launch = cuda_stage.StageHandle.launch
    monkeypatch.setattr(cuda_stage.StageHandle, "launch",
                        lambda self, *a, **k: launches.append(self) or launch(self, *a, **k))
    model = build_thinker(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, attn_implementation="sdpa",
                          seed=24, device="cuda", dtype=dtype)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2)
    seed = _fresh()
    prompts = [clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=seed, device="cuda", dtype=dtype,
                           **SMALL_PROMPT),
               clip_inputs(model, frames=6, grid_hw=(4, 8), audio_tokens=150, seed=seed + 1, device="cuda",
                           dtype=dtype, **SMALL_PROMPT)]
    prepared, per_sample, calls = _both(monkeypatch, model, config, batch_inputs(prompts))
    assert prepared[2] == per_sample[2], f"seed={seed}"
    if dtype == torch.float32:
        assert torch.equal(prepared[0], per_sample[0]) and torch.equal(prepared[1], per_sample[1]), f"seed={seed}"
    else:
        torch.testing.assert_close(prepared[0], per_sample[0], rtol=2e-2, atol=2e-2, msg=f"seed={seed}")
    batched = [h for h in launches if h.score_shape[0] == 2]  # the per-sample path's stages have B = 1
    assert calls == {"run": 4, "compact_many": 0} and len(batched) == 4, (seed, calls, len(batched))
