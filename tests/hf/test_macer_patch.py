"""``macer.compress`` on tiny random Qwen2.5-Omni thinkers: identity at keep ratio 1, per-layer caches, decoding on
compacted caches, exact restoration, the full model through ``.thinker``, ``trim_early_cache``."""

from __future__ import annotations

import copy

import macer
import pytest
import torch
from macer.testing import (
    SYNTHETIC_TOKENS,
    build_omni_model,
    build_thinker,
    clip_inputs,
    macer_config_for,
)
from tiny_models import decoder_of as _decoder
from tiny_models import root_of as _root
from tiny_models import tiny_thinker

CLIP = {"frames": 8, "grid_hw": (8, 8), "audio_tokens": 150, "seed": 1}  # 64 video + 150 audio tokens


def _thinker(attn: str = "sdpa", layers: int = 6):
    return tiny_thinker(attn, layers=layers, seed=5)


def _counts(inputs) -> tuple[int, int, int]:
    ids = inputs["input_ids"][0]
    return ids.numel(), int((ids == SYNTHETIC_TOKENS.audio).sum()), int((ids == SYNTHETIC_TOKENS.video).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_keep_ratio_one_gives_identical_logits(attn, interleaved):
    model = _thinker(attn)
    inputs = clip_inputs(model, use_audio_in_video=interleaved, **CLIP)
    with torch.no_grad():
        want = model(**inputs).logits
        with macer.compress(model, macer_config_for(model, keep_ratio=1.0)) as trace:
            got = model(**inputs).logits
    assert torch.equal(got, want)
    n, n_a, n_v = _counts(inputs)
    assert trace.budget == (n_a + n_v, n_a, n_v)
    assert trace.layer_tokens == [n] * 6


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("audio_layer", "video_layer"), [(2, 4), (4, 2), (3, 3)])
def test_per_layer_token_and_cache_lengths(attn, audio_layer, video_layer):
    model = _thinker(attn)
    inputs = clip_inputs(model, **CLIP)
    n, n_a, n_v = _counts(inputs)
    config = macer_config_for(model, keep_ratio=0.25, audio_layer=audio_layer, video_layer=video_layer)
    with torch.no_grad(), macer.compress(model, config) as trace:
        out = model(**inputs, use_cache=True)
    k_a, k_v = trace.budget.audio, trace.budget.video
    assert k_a < n_a and k_v < n_v
    text = n - n_a - n_v
    first, second = sorted((audio_layer, video_layer))
    expected = []
    for i in range(6):  # layers[i] is layer i + 1
        if i < first:
            expected.append(n)
        elif i < second:
            expected.append(text + k_a + n_v if audio_layer == first else text + n_a + k_v)
        else:
            expected.append(text + k_a + k_v)
    assert trace.layer_tokens == expected
    assert trace.cache_lengths == expected
    assert [layer.get_seq_length() for layer in out.past_key_values.layers] == expected
    assert out.logits.shape[1] == text + k_a + k_v
    assert [s.layer for s in trace.last.stages] == sorted({audio_layer, video_layer})


@pytest.mark.parametrize(("attn", "do_sample"), [("sdpa", False), ("eager", False), ("eager", True)])
def test_cached_decode_equals_no_cache_forward(attn, do_sample):
    """Each generated token's logits equal a patched forward without cache over prompt + tokens so far (the same
    kept sets are chosen there: the question rows come before the appended tokens); also when sampling."""
    model = _thinker(attn)
    inputs = clip_inputs(model, **CLIP)
    config = macer_config_for(model, keep_ratio=0.25)
    torch.manual_seed(0)
    with torch.no_grad(), macer.compress(model, config) as trace:
        out = model.generate(**inputs, max_new_tokens=4, do_sample=do_sample, output_logits=True,
                             return_dict_in_generate=True, suppress_tokens=[SYNTHETIC_TOKENS.im_end])
        kept = (trace.audio_kept, trace.video_kept)
        prompt_len = inputs["input_ids"].shape[1]
        for step, logits in enumerate(out.logits):
            ids = out.sequences[:, : prompt_len + step]
            extended = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
            want = model(**extended, use_cache=False).logits[:, -1]
            assert (trace.audio_kept, trace.video_kept) == kept
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert len(trace.history) == 1 + len(out.logits)


def test_generate_twice_prunes_each_prefill_and_restores():
    model = _thinker("eager")
    first, second = clip_inputs(model, **CLIP), clip_inputs(model, **{**CLIP, "seed": 2, "audio_tokens": 100})
    with torch.no_grad():
        want = model(**first).logits
        config = macer_config_for(model, keep_ratio=0.25)
        with macer.compress(model, config) as trace:
            a = model.generate(**first, max_new_tokens=3, do_sample=False)
            record_a = trace.last
            b = model.generate(**second, max_new_tokens=3, do_sample=False)
            record_b = trace.last
            again = model.generate(**first, max_new_tokens=3, do_sample=False)
        assert len(trace.history) == 3
        assert record_a.n_audio == 150 and record_b.n_audio == 100
        assert trace.last.audio_kept == record_a.audio_kept and trace.last.video_kept == record_a.video_kept
        assert torch.equal(a, again) and b.shape[1] == second["input_ids"].shape[1] + 3
        assert torch.equal(model(**first).logits, want)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exit_restores_bit_identical_logits_even_after_exception(attn):
    model = _thinker(attn)
    inputs = clip_inputs(model, **CLIP)
    attn_config = _decoder(model).config
    with torch.no_grad():
        want = model(**inputs).logits
        seen = []
        spy = _decoder(model).layers[0].register_forward_pre_hook(
            lambda *_: seen.append(attn_config._attn_implementation))
        with pytest.raises(RuntimeError, match="boom"), macer.compress(model, macer_config_for(model)):
            # The attention wrapper is switched on only while a prefill runs (decode steps run the model's own).
            assert attn_config._attn_implementation == attn
            pruned = model(**inputs).logits
            assert pruned.shape[1] < want.shape[1]
            assert seen == [f"macer_{attn}"] and attn_config._attn_implementation == attn
            raise RuntimeError("boom")
        spy.remove()
        assert attn_config._attn_implementation == attn
        assert all(not layer._forward_pre_hooks for layer in _decoder(model).layers)
        assert not _root(model)._forward_pre_hooks and not _decoder(model)._forward_hooks
        assert torch.equal(model(**inputs).logits, want)


def test_profile_records_overhead():
    model = _thinker()
    inputs = clip_inputs(model, **CLIP)
    with torch.no_grad():
        with macer.compress(model, macer_config_for(model), profile=True) as profiled:
            model(**inputs)
        with macer.compress(model, macer_config_for(model)) as plain:
            model(**inputs)
    assert isinstance(profiled.last.overhead_s, float) and profiled.last.overhead_s > 0
    assert plain.last.overhead_s is None
    assert profiled.audio_kept == plain.audio_kept and profiled.video_kept == plain.video_kept


def test_text_only_prompt_runs_unpruned():
    model = _thinker()
    inputs = clip_inputs(model, frames=0, audio_tokens=0, use_audio_in_video=False)
    with torch.no_grad():
        want = model(**inputs).logits
        with macer.compress(model, macer_config_for(model)) as trace:
            got = model(**inputs).logits
    assert torch.equal(got, want)
    assert trace.budget is None and not trace.last.stages and not trace.last.pruned


def test_full_model_through_thinker_matches_thinker():
    omni = build_omni_model(num_layers=6, hidden_size=64, seed=5)
    thinker = _thinker()
    inputs = clip_inputs(thinker, **CLIP)
    config = macer_config_for(thinker, keep_ratio=0.25)
    with torch.no_grad():
        with macer.compress(thinker, config) as want:
            want_logits = thinker(**inputs).logits
        with macer.compress(omni, config) as got:
            got_logits = omni.thinker(**inputs).logits
            generated = omni.thinker.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert torch.equal(got_logits, want_logits)
    assert got.history[0].audio_kept == want.audio_kept and got.history[0].video_kept == want.video_kept
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 2
    assert _decoder(omni).config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_trim_early_cache(attn):
    model = _thinker(attn)
    inputs = clip_inputs(model, **CLIP)
    with torch.no_grad():
        with macer.compress(model, macer_config_for(model, keep_ratio=0.25)) as trace:
            full = model(**inputs, use_cache=True)
        n = inputs["input_ids"].shape[1]
        final = torch.tensor(sorted(trace.audio_kept + trace.video_kept
                                    + [i for i, t in enumerate(inputs["input_ids"][0].tolist())
                                       if t not in (SYNTHETIC_TOKENS.audio, SYNTHETIC_TOKENS.video)]))
        # Prompt rows held by each layer of the untrimmed cache (None: between the stages, not checked here).
        rows = [torch.arange(n) if length == n else final if length == final.numel() else None
                for length in trace.cache_lengths]
        assert rows[0] is not None and rows[-1] is final
        with macer.compress(model, macer_config_for(model, keep_ratio=0.25, trim_early_cache=True)) as trimmed:
            out = model(**inputs, use_cache=True)
        assert trimmed.cache_lengths == [final.numel()] * 6
        assert torch.equal(out.logits, full.logits)
        for i, layer in enumerate(out.past_key_values.layers):
            if rows[i] is not None:  # layers before the last stage: kept rows of the full cache
                keep = torch.searchsorted(rows[i], final)
                assert torch.equal(layer.keys, full.past_key_values.layers[i].keys[:, :, keep])
        # Decoding on the trimmed cache: every layer holds the same rows, so the unpatched model can decode on a copy
        # and must agree with the patched decode, which also gets a 2-D mask over the original prompt length.
        step = torch.tensor([[SYNTHETIC_TOKENS.first_ordinary]])
        positions = torch.full((3, 1, 1), int(_root(model).rope_deltas) + n)
        config = macer_config_for(model, keep_ratio=0.25, trim_early_cache=True)
        with macer.compress(model, config):
            prefill = model(**inputs, use_cache=True)
            reference_cache = copy.deepcopy(prefill.past_key_values)
            got = model(input_ids=step, past_key_values=prefill.past_key_values, position_ids=positions,
                        attention_mask=torch.ones(1, n + 1, dtype=torch.long)).logits
        want = model(input_ids=step, past_key_values=reference_cache, position_ids=positions).logits
        torch.testing.assert_close(got, want)
        with macer.compress(model, config) as trace:
            generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert generated.shape[1] == n + 3 and trace.cache_lengths == [final.numel()] * 6


@pytest.mark.cuda
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cuda_matches_cpu_and_generates(attn):
    """On a GPU (scoring/selection then run the fastest backend present): keep ratio 1 is exact, float32 kept sets
    equal the CPU ones, bf16 prefill and generate run with the expected per-layer lengths."""
    config = macer_config_for(_thinker(), keep_ratio=0.25)
    cpu = _thinker(attn)
    inputs = clip_inputs(cpu, **CLIP)
    with torch.no_grad(), macer.compress(cpu, config) as want:
        cpu(**inputs)
    gpu = build_thinker(num_layers=6, hidden_size=64, attn_implementation=attn, seed=5, device="cuda")
    gpu_inputs = clip_inputs(gpu, device="cuda", **CLIP)
    with torch.no_grad():
        reference = gpu(**gpu_inputs).logits
        with macer.compress(gpu, config.replace(keep_ratio=1.0)):
            assert torch.equal(gpu(**gpu_inputs).logits, reference)
        with macer.compress(gpu, config) as got:
            gpu(**gpu_inputs)
        assert (got.audio_kept, got.video_kept) == (want.audio_kept, want.video_kept)
        half = build_thinker(num_layers=6, hidden_size=64, attn_implementation=attn, seed=5, device="cuda",
                             dtype=torch.bfloat16)
        half_inputs = clip_inputs(half, device="cuda", dtype=torch.bfloat16, **CLIP)
        with macer.compress(half, config) as trace:
            out = half.generate(**half_inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == half_inputs["input_ids"].shape[1] + 3
    assert trace.layer_tokens == want.layer_tokens


def test_decode_positions_after_trim_early_cache_follow_the_prompt():
    """With trim_early_cache every layer's cache (layer 0's too, from which get_seq_length reads) is shorter than the
    prompt; decode steps must still get the unpruned model's M-RoPE positions (prompt length + step + rope delta),
    and a no-cache run of the same generate must pick the same kept sets and tokens."""
    model = _thinker("eager")
    inputs = clip_inputs(model, **CLIP)
    seen: list[list[int]] = []

    def grab(module, args, kwargs):
        seen.append(kwargs["position_ids"][:, 0, -1].tolist())

    handle = _decoder(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, do_sample=False)
            unpruned, seen[:] = list(seen), []
            config = macer_config_for(model, keep_ratio=0.25, trim_early_cache=True)
            with macer.compress(model, config) as trace:
                cached = model.generate(**inputs, max_new_tokens=3, do_sample=False)
            assert trace.cache_lengths[0] < inputs["input_ids"].shape[1]
            assert seen == unpruned
            with macer.compress(model, config):
                uncached = model.generate(**inputs, max_new_tokens=3, do_sample=False, use_cache=False)
    finally:
        handle.remove()
    assert torch.equal(cached[:, : inputs["input_ids"].shape[1] + 1], uncached[:, : inputs["input_ids"].shape[1] + 1])


def test_image_tokens_count_as_visual():
    """An image block (``<|IMAGE|>`` tokens, one temporal position) with an audio block: the image tokens are scored
    and selected as the visual modality, and the kept sets equal the independent reference of
    tests/hf/test_macer_selection.py (eager attention probabilities, float64 ANMS, the literal greedy); keep ratio 1 is
    exact."""
    from budget_oracle import exact_budget
    from test_macer_selection import reference_kept

    model = _thinker("eager")
    base = clip_inputs(model, frames=0, audio_tokens=60, use_audio_in_video=False, seed=1)
    ids = base["input_ids"][0].tolist()
    at = ids.index(SYNTHETIC_TOKENS.audio_start)
    ids = [*ids[:at], SYNTHETIC_TOKENS.vision_start, *[SYNTHETIC_TOKENS.image] * 16, SYNTHETIC_TOKENS.vision_end,
           *ids[at:]]
    vision = model.config.vision_config
    inputs = {**base, "input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
              "pixel_values": torch.randn(64, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
                                          generator=torch.Generator().manual_seed(1)),
              "image_grid_thw": torch.tensor([[1, 8, 8]])}
    image_positions = [i for i, t in enumerate(ids) if t == SYNTHETIC_TOKENS.image]
    config = macer_config_for(model, keep_ratio=0.25)
    want_audio, want_video = reference_kept(model, inputs, config)
    with torch.no_grad():
        want = model(**inputs).logits
        with macer.compress(model, macer_config_for(model, keep_ratio=1.0)):
            assert torch.equal(model(**inputs).logits, want)
        with macer.compress(model, config) as trace:
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    record = trace.history[0]
    assert record.n_video == 16 and record.budget == exact_budget(60, 16, 0.25, config.audio_share)
    assert 0 < record.budget.video < 16 and set(want_video) <= set(image_positions)
    assert (record.audio_kept, record.video_kept) == (want_audio, want_video)
    assert out.shape[1] == len(ids) + 2


def test_prompt_without_attention_mask():
    """No attention_mask: transformers then cannot build M-RoPE positions and the text model uses 0..N-1 (the
    unpatched model does the same); MACER reads its temporal chunks from those same positions. Keep ratio 1 is exact
    and a pruned prefill keeps the budget."""
    model = _thinker("eager")
    inputs = {k: v for k, v in clip_inputs(model, **CLIP).items() if k != "attention_mask"}
    with torch.no_grad():
        want = model(**inputs).logits
        with macer.compress(model, macer_config_for(model, keep_ratio=1.0)):
            assert torch.equal(model(**inputs).logits, want)
        with macer.compress(model, macer_config_for(model, keep_ratio=0.25)) as trace:
            out = model(**inputs, use_cache=True)
    n, n_a, n_v = _counts(inputs)
    assert len(trace.audio_kept) == trace.budget.audio < n_a and len(trace.video_kept) == trace.budget.video < n_v
    assert out.logits.shape[1] == n - n_a - n_v + trace.budget.total


def test_full_model_generate_points_to_thinker_generate():
    """#13 item 7: inside compress, the full model's generate says to call .thinker.generate; leaving the context
    removes the guard (the instance has no own attribute again)."""
    omni = build_omni_model(num_layers=4, hidden_size=64, seed=5)
    inputs = clip_inputs(omni, **CLIP)
    with macer.compress(omni, macer_config_for(omni, audio_layer=1, video_layer=2)):
        with pytest.raises(RuntimeError, match=r"call model\.thinker\.generate\(\.\.\.\) for text answers.*"
                                               r"'Chelsie is not available'"):
            omni.generate(**inputs)
    assert "generate" not in omni.__dict__
    with macer.compress(omni.thinker, macer_config_for(omni, audio_layer=1, video_layer=2)):
        assert "generate" not in omni.thinker.__dict__  # the thinker's own generate is the supported path


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decode_steps_run_without_prefill_hooks_or_the_attention_wrapper(attn):
    """Layer hooks and the attention wrapper exist only during a prefill; SDPA decode steps get no MACER hook at
    all, eager ones only the mask hooks on layers whose cache differs from layer 0's (registered at the first step)."""
    model = _thinker(attn)
    inputs = clip_inputs(model, **CLIP)
    decoder, seen = _decoder(model), []
    with torch.no_grad(), macer.compress(model, macer_config_for(model, keep_ratio=0.25)) as trace:
        spy = decoder.register_forward_pre_hook(  # runs after MACER's own decoder pre-hook
            lambda *_: seen.append((decoder.config._attn_implementation,
                                    [len(layer._forward_pre_hooks) for layer in decoder.layers])))
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        spy.remove()
    first = trace.last.stages[0].layer
    assert seen[0] == (f"macer_{attn}", [0] * first + [1] * (6 - first))
    changed = [0 if n == trace.cache_lengths[0] else 1 for n in trace.cache_lengths]
    assert seen[1:] == [(attn, [0] * 6 if attn == "sdpa" else changed)] * 2


def test_cache_is_read_under_either_argument_name():
    """transformers 5.24's generate passes the KV cache as ``cache=`` instead of ``past_key_values=``; the runtime read
    only the old name, so on 5.24 every decode step looked like a new prompt and nothing was pruned (found by the
    eval install test). CI pins 5.23, so the name lookup itself is checked here (the model tests passed on 5.24.0
    with it, run by hand)."""
    from macer.hf.cache import cache_argument

    new, old = object(), object()
    assert cache_argument({"cache": new}) is new
    assert cache_argument({"past_key_values": old}) is old
    assert cache_argument({"cache": new, "past_key_values": old}) is new
    assert cache_argument({"cache": None, "past_key_values": old}) is old
    assert cache_argument({}) is None
    from types import SimpleNamespace

    from macer.hf.cache import output_cache

    assert output_cache(SimpleNamespace(cache=new, past_key_values=None)) is new
    assert output_cache(SimpleNamespace(past_key_values=old)) is old


def _cache_passed_as_cache(decoder) -> list[str]:
    """transformers 5.24's calling convention on the pinned 5.23: ``generate`` hands the decoder its KV cache as
    ``cache=`` (no ``past_key_values=``). A pre-hook registered before ``compress`` renames the argument, so that
    every later hook (the runtime's) sees the call as 5.24 makes it, and the decoder's forward takes ``cache=`` and
    passes it on under 5.23's name. Returns the argument names the decoder's forward received its cache under."""
    received: list[str] = []
    forward = decoder.forward

    def rename(module, args, kwargs):
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        return args, kwargs

    def forward_5_24(*args, cache=None, **kwargs):
        assert "past_key_values" not in kwargs
        received.append("cache")
        return forward(*args, past_key_values=cache, **kwargs)

    decoder.register_forward_pre_hook(rename, with_kwargs=True)
    decoder.forward = forward_5_24
    return received


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("batched", [False, True])
def test_pruned_generate_when_the_cache_comes_as_cache(attn, batched):
    """A pruned ``generate`` on a model whose decoder receives the cache as ``cache=`` (transformers 5.24) equals the
    same run with ``past_key_values=`` (5.23): one prefill record per prompt (a decode step read as a new prompt would
    add records), the same per-step decode logits and tokens, the caches pruned. Eager attention and a left-padded
    batch make every decode step depend on the runtime finding the pruned cache (per-layer masks)."""
    from macer.testing import batch_inputs

    prompts = [clip_inputs(_thinker(attn), **CLIP)]
    if batched:
        prompts.append(clip_inputs(_thinker(attn), frames=4, grid_hw=(8, 4), audio_tokens=60, seed=2))
    runs = {}
    for convention in ("past_key_values", "cache"):
        model = _thinker(attn)
        received = _cache_passed_as_cache(_decoder(model)) if convention == "cache" else None
        inputs = batch_inputs(prompts) if batched else prompts[0]
        config = macer_config_for(model, keep_ratio=0.25, audio_layer=2, video_layer=4)
        with torch.no_grad(), macer.compress(model, config) as trace:
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert received is None or received == ["cache"] * 4  # the prefill and 3 decode steps, all by the new name
        assert len(trace.history) == len(prompts), convention  # one prefill per prompt, no decode step as a prompt
        assert all(record.pruned and record.cache_lengths[-1] < record.prompt_length for record in trace.history)
        runs[convention] = out, [(r.audio_kept, r.video_kept, r.cache_lengths) for r in trace.history]
    (want, want_records), (got, got_records) = runs["past_key_values"], runs["cache"]
    assert got_records == want_records
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"decode step {step}")
