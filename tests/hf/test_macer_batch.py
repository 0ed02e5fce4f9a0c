"""Batch size > 1 under ``macer.compress`` (issue #11): a left-padded batch of prompts of different lengths and media
gives, per sample, the kept sets, prefill logits and greedy tokens of running that prompt alone under ``compress``
(itself checked against an independent staged forward in test_macer_selection / test_macer_labelled): Qwen2.5-Omni
thinkers (MACER with and without trim_early_cache, FastV, Random; sdpa and eager; beam search and
num_return_sequences) and the labelled path (``BatchLabelledAdapter`` on Llama / Qwen2 decoders). Right padding, a
batch that mixes layouts under one ``use_audio_in_video`` flag, and the single-prompt trace attributes after a batch
give clear errors."""

from __future__ import annotations

import macer
import pytest
import torch
from macer.testing import batch_inputs, clip_inputs, macer_config_for
from tiny_models import SMALL_PROMPT, tiny_thinker

SMALL = SMALL_PROMPT


def _thinker(attn: str):
    return tiny_thinker(attn)


def _block_prompts(model):
    """Audio-only, video-only and block layout (use_audio_in_video=False), all of different lengths."""
    return [
        clip_inputs(model, frames=0, audio_tokens=70, use_audio_in_video=False, seed=1, **SMALL),
        clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=0, use_audio_in_video=False, seed=2, **SMALL),
        clip_inputs(model, frames=4, grid_hw=(8, 4), audio_tokens=90, use_audio_in_video=False, seed=3, **SMALL),
    ]


def _interleaved_prompts(model):
    """Interleaved clips of two lengths (use_audio_in_video=True), an audio-only and a text-only prompt with their own
    False: they go with either flag, alone with False and in the batch under the interleaved prompts' True."""
    return [
        clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=4, **SMALL),
        clip_inputs(model, frames=0, audio_tokens=40, use_audio_in_video=False, seed=5, **SMALL),
        clip_inputs(model, frames=6, grid_hw=(4, 8), audio_tokens=150, seed=6, **SMALL),
        clip_inputs(model, frames=0, audio_tokens=0, use_audio_in_video=False, seed=8, **SMALL),
    ]


def _alone(model, config, prompt, new_tokens):
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**prompt).logits[0]
        record = trace.last
        tokens = model.generate(**prompt, max_new_tokens=new_tokens, do_sample=False)[0, -new_tokens:]
    return record, logits, tokens


def check_batch_against_each_prompt_alone(model, config, prompts, label: str, *, also=None, new_tokens: int = 4):
    """``prompts`` as one left-padded batch under ``compress``: the prefill, then greedy decoding of ``new_tokens``,
    then ``also(batch, logits)`` in the same context if given; each sample must be its prompt alone
    (``check_each_sample_alone``). Returns the trace, the batch, its samples and its prefill logits."""
    batch = batch_inputs(prompts)
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**batch).logits
        samples = trace.samples
        tokens = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)[:, -new_tokens:]
        if also is not None:
            also(batch, logits)
    check_each_sample_alone(model, config, prompts, batch, samples, logits, tokens, label)
    return trace, batch, samples, logits


def check_each_sample_alone(model, config, prompts, batch, samples, logits, tokens, label: str) -> None:
    """Per sample of a batch run under ``compress``: the record (padding, kept sets, question rows, budget, layer and
    cache lengths), the prefill logits (1e-4) and the greedy tokens equal the prompt run alone under ``compress``,
    indices shifted by the sample's left padding."""
    assert len(samples) == len(prompts)
    width = batch["input_ids"].shape[1]
    for b, prompt in enumerate(prompts):
        record, want_logits, want_tokens = _alone(model, config, prompt, tokens.shape[1])
        pad = width - prompt["input_ids"].shape[1]
        got = samples[b]
        where = f"sample {b} ({label})"
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
    trace, _, samples, _ = check_batch_against_each_prompt_alone(model, POLICIES[policy](model), prompts,
                                                                 f"{attn}, {layout}, {policy}")
    assert any(s.pruned for s in samples)
    with pytest.raises(ValueError, match=r"trace\.samples"):
        _ = trace.audio_kept
    with pytest.raises(ValueError, match=r"trace\.samples"):
        _ = trace.last


def test_beam_search_and_several_sequences_share_their_prompt_selection():
    """num_beams and num_return_sequences expand each prompt into rows of the batch: each row is planned like its
    prompt alone."""
    model = _thinker("sdpa")
    check_expanded_rows(model, POLICIES["macer"](model), _block_prompts(model)[1:])


def check_expanded_rows(model, config, prompts) -> None:
    """Two prompts under ``compress``: beam search (2 beams) and ``num_return_sequences=2`` on the batch give each
    expanded row its prompt's own answer, and the two rows of a prompt share its selection."""
    with torch.no_grad(), macer.compress(model, config) as trace:
        got = model.generate(**batch_inputs(prompts), max_new_tokens=3, num_beams=2, do_sample=False)[:, -3:]
        assert len(trace.samples) == 4 and trace.samples[0].video_kept == trace.samples[1].video_kept
        want = [model.generate(**p, max_new_tokens=3, num_beams=2, do_sample=False)[0, -3:].tolist()
                for p in prompts]
        # num_return_sequences expands the rows the same way (top_k=1 sampling: each row is the greedy answer)
        several = model.generate(**batch_inputs(prompts), max_new_tokens=3, do_sample=True, top_k=1,
                                 num_return_sequences=2)[:, -3:]
        greedy = [model.generate(**p, max_new_tokens=3, do_sample=False)[0, -3:].tolist() for p in prompts]
    assert got.tolist() == want
    assert several.tolist() == [greedy[0], greedy[0], greedy[1], greedy[1]]


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
    check_mixed_layouts_refused(model, POLICIES["macer"](model), interleaved, video_only, flag)


def check_mixed_layouts_refused(model, config, interleaved, block, flag: bool) -> None:
    """An interleaved and a block-layout prompt in one batch under one ``use_audio_in_video=flag``: refused, naming
    the sample whose layout the flag does not describe."""
    batch = batch_inputs([dict(interleaved, use_audio_in_video=flag), dict(block, use_audio_in_video=flag)])
    sample = 1 if flag else 0
    with macer.compress(model, config), torch.no_grad(), \
            pytest.raises(ValueError, match=f"sample {sample} of the batch.*use_audio_in_video={flag}"):
        model(**batch)


@pytest.mark.parametrize(("family", "attn", "policy", "shifts"), [
    ("llama", "eager", "macer", (0, 0, 0)), ("qwen2", "sdpa", "macer-trim", (0, 0, 0)),
    ("qwen2", "eager", "macer", (0, 3, 1))])
def test_labelled_batch_matches_each_prompt_alone(monkeypatch, family, attn, policy, shifts):
    """The labelled path (``BatchLabelledAdapter`` on a decoder called with left-padded ``inputs_embeds``): per
    prompt the kept sets, prefill logits and greedy tokens of ``LabelledAdapter`` on that prompt alone. ``shifts``:
    each prompt's question ends that many rows earlier (more text after it), so the samples' question rows lie at
    different distances from the batch's last row and the batched stage reads each sample's own rows (the prepared
    stage's per-sample ``query_rows``, checked to be taken); with no shift they are one shared range."""
    from collections import OrderedDict

    import macer.hf.batch as batch_module
    from macer.core import stage as core_stage
    from test_macer_labelled import build_decoder, left_padded, media_prompt

    monkeypatch.setattr(core_stage, "_PREPARED", OrderedDict())  # this test's stages prepared here, not before
    rows_given = []
    prepare = batch_module.prepare_stage
    monkeypatch.setattr(batch_module, "prepare_stage",
                        lambda *a, **k: rows_given.append(k["query_rows"]) or prepare(*a, **k))
    model = build_decoder(family, attn=attn, seed=3)
    config = POLICIES[policy](model)
    prompts = [media_prompt(model, seed=1, frames=3, question=6), media_prompt(model, seed=2, frames=5, question=9),
               media_prompt(model, seed=3, frames=2, audio_per_segment=0, question=7)]
    prompts = [(*p[:3], p[3] - shift) for p, shift in zip(prompts, shifts, strict=True)]
    embeds, mask, adapter, pads = left_padded(prompts)
    new_tokens = 3
    with torch.no_grad(), macer.compress(model, config, adapter=adapter) as trace:
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        samples = trace.samples
        tokens = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=new_tokens,
                                do_sample=False)
    for b, (prompt, pad) in enumerate(zip(prompts, pads, strict=True)):
        alone = macer.LabelledAdapter(prompt[1], prompt[2], prompt[3])
        with torch.no_grad(), macer.compress(model, config, adapter=alone) as trace_alone:
            want = model(inputs_embeds=prompt[0]).logits[0]
            want_tokens = model.generate(inputs_embeds=prompt[0], attention_mask=torch.ones(1, prompt[0].shape[1],
                                         dtype=torch.long), max_new_tokens=new_tokens, do_sample=False)[0]
        record = trace_alone.history[0]
        where = f"sample {b} ({family}, {attn}, {policy})"
        assert samples[b].audio_kept == [i + pad for i in record.audio_kept], where
        assert samples[b].video_kept == [i + pad for i in record.video_kept], where
        assert samples[b].layer_tokens == record.layer_tokens, where
        torch.testing.assert_close(logits[b, -want.shape[0]:], want, rtol=1e-4, atol=1e-4, msg=where)
        assert tokens[b].tolist() == want_tokens.tolist(), where
    assert all(s.pruned for s in samples)
    assert rows_given and all((len(set(rows)) > 1) == (len(set(shifts)) > 1) for rows in rows_given), rows_given


def test_batch_labelled_adapter_checks_its_rows():
    from test_macer_labelled import build_decoder

    model = build_decoder("llama", seed=3)
    labels = torch.zeros(2, 12, dtype=torch.long)
    labels[:, 2:6] = macer.VISUAL
    with pytest.raises(ValueError, match=r"labels must be 0 \(text\), 1 \(audio\) or 2"):
        macer.BatchLabelledAdapter(labels + 3)
    with pytest.raises(ValueError, match="question_ends must be a sequence of B=2"):
        macer.BatchLabelledAdapter(labels, question_ends=[10])
    adapter = macer.BatchLabelledAdapter(labels, question_ends=[10, 10])
    embeds = torch.randn(3, 12, 64)
    with macer.compress(model, POLICIES["macer"](model), adapter=adapter), torch.no_grad(), \
            pytest.raises(ValueError, match="3 rows but BatchLabelledAdapter was given labels for 2"):
        model(inputs_embeds=embeds, attention_mask=torch.ones(3, 12, dtype=torch.long))


@pytest.mark.parametrize("policy", ["macer", "macer-trim"])
def test_a_macer_stage_is_one_call_for_the_whole_batch(monkeypatch, policy):
    """Issue #11 item 3, issue #37 items 1 and 4: a MACER stage runs one prepared stage for the whole batch (scoring,
    selection and the re-pack of every per-token input in one call, so a fixed number of kernel launches whatever
    B, and one host call on CUDA) and no ``compact_many``; a repeated batch layout prepares nothing again; and the
    result is still each prompt alone (checked above on the same prompts). FastV's raw scores run per sample and
    re-pack with one ``compact_many``."""
    from collections import OrderedDict

    import macer.hf.batch as batch_module
    from macer.core import stage as core_stage

    from macer_kernels.prepared import PreparedStage

    monkeypatch.setattr(core_stage, "_PREPARED", OrderedDict())  # no stage prepared by an earlier test
    calls = {"prepare_stage": 0, "compact_many": 0, "run": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    for name in ("prepare_stage", "compact_many"):
        monkeypatch.setattr(batch_module, name, counting(name, getattr(batch_module, name)))
    monkeypatch.setattr(PreparedStage, "run", counting("run", PreparedStage.run))
    runs = []
    original_run = batch_module.BatchPrefill.run
    monkeypatch.setattr(batch_module.BatchPrefill, "run",
                        lambda self, *args: runs.append(args[-1]) or original_run(self, *args))
    model = _thinker("sdpa")
    prompts = _interleaved_prompts(model)
    for size in (2, 4):
        config = POLICIES[policy](model)
        for repeat in range(2):
            calls.update(prepare_stage=0, compact_many=0, run=0)
            with torch.no_grad(), macer.compress(model, config) as trace:
                model(**batch_inputs(prompts[:size]))
            stages = {s.layer for sample in trace.samples for s in sample.stages}
            prepared = 0 if repeat else len(stages)  # the second run of the layout: every stage from the cache
            assert calls == {"prepare_stage": prepared, "compact_many": 0, "run": len(stages)}, (size, calls)
            assert sorted(runs) == sorted(stages), runs  # the stage machinery runs at stage layers only
            runs.clear()
    calls.update(prepare_stage=0, compact_many=0, run=0)
    with torch.no_grad(), macer.compress(model, POLICIES["fastv"](model)):
        model(**batch_inputs(prompts[:2]))
    assert calls == {"prepare_stage": 0, "compact_many": 1, "run": 0}, calls
    # Keep ratio 1: the plans drop nothing, so the batch does no selection and no compaction, and is the model itself.
    calls.update(prepare_stage=0, compact_many=0, run=0)
    batch = batch_inputs(prompts[:3])
    with torch.no_grad():
        plain = model(**batch).logits
        with macer.compress(model, macer_config_for(model, keep_ratio=1.0, audio_layer=1, video_layer=2)):
            same = model(**batch).logits
    assert calls == {"prepare_stage": 0, "compact_many": 0, "run": 0}, calls
    assert torch.equal(same, plain)


def test_samples_with_different_stage_rules_at_one_layer():
    """A policy whose stages differ per prompt (video-only prompts: coverage at layer 1; others: top-k at layer 2):
    at layer 1 the block prompt has no stage but holds video tokens without planned chunk ids. The batch still
    equals each prompt alone (found in review: it raised a chunk-id error)."""
    import dataclasses

    from macer.core.config import MacerConfig
    from macer.core.policy import AUDIO, VISUAL, Selection, StageSpec

    @dataclasses.dataclass(frozen=True)
    class PerPrompt(MacerConfig):
        def stage_specs(self, n_audio, n_video):
            if not n_audio + n_video:
                return []
            if n_audio == 0:
                return [StageSpec(1, (Selection((VISUAL,), n_video // 3, "coverage", 0.2, 8),))]
            selections = [Selection((AUDIO,), n_audio // 3)]
            if n_video:
                selections.append(Selection((VISUAL,), n_video // 3))
            return [StageSpec(2, tuple(selections))]

    model = _thinker("sdpa")
    base = POLICIES["macer"](model)
    config = PerPrompt(**{f.name: getattr(base, f.name) for f in dataclasses.fields(MacerConfig)})
    prompts = _block_prompts(model)[1:]
    batch = batch_inputs(prompts)
    with torch.no_grad(), macer.compress(model, config) as trace:
        logits = model(**batch).logits
        samples = trace.samples
        tokens = model.generate(**batch, max_new_tokens=3, do_sample=False)[:, -3:]
    check_each_sample_alone(model, config, prompts, batch, samples, logits, tokens, "per-prompt stage rules")
    assert [s.layer for s in samples[0].stages] == [1] and [s.layer for s in samples[1].stages] == [2]
