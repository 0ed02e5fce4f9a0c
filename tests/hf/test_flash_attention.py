"""``macer.compress`` and ``macer.diagnose`` under ``attn_implementation="flash_attention_2"``, through transformers'
real FlashAttention-2 integration (its lazy import, unpadding and varlen path) with the stand-in kernel of
``tests/helpers/flash_attn_standin.py`` (the ``flash_attn`` fixture): the same kept sets, logits and ``generate``
output as
SDPA, keep ratio 1 identical to the model without ``compress``, a left-padded batch through FA2's varlen path. On a
GPU with flash-attn installed the last test runs the real kernel."""

from __future__ import annotations

import functools
import importlib.util

import macer
import pytest
import torch
from flash_attn_standin import use_flash_attention_2
from macer.diagnostics import diagnose
from macer.testing import SYNTHETIC_TOKENS, batch_inputs, build_thinker, clip_inputs, decoder_parts, macer_config_for

CLIP = {"frames": 4, "grid_hw": (8, 8), "audio_tokens": 80, "seed": 1}  # 16 video + 80 audio tokens


def _pair(layers: int = 4, dtype: torch.dtype = torch.float32):
    """The same random thinker twice: one on SDPA, one switched to FlashAttention-2."""
    sdpa = build_thinker(num_layers=layers, hidden_size=64, attn_implementation="sdpa", seed=5, dtype=dtype)
    flash = build_thinker(num_layers=layers, hidden_size=64, attn_implementation="sdpa", seed=5, dtype=dtype)
    use_flash_attention_2(flash)
    return sdpa, flash


def _count_calls(flash_attn, monkeypatch) -> dict[str, int]:
    """Count the stand-in's kernel calls (proof that transformers' FA2 path ran, not a fallback)."""
    calls = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}
    for name in calls:
        inner = getattr(flash_attn, name)

        # wraps: transformers reads the kernel's signature to decide which arguments to pass
        @functools.wraps(inner)
        def counted(*args, _inner=inner, _name=name, **kwargs):
            calls[_name] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(flash_attn, name, counted)
    return calls


def test_keep_ratio_one_is_identical_to_the_model_without_compress(flash_attn, monkeypatch):
    """Guards issue 23: every prefill that reads attention under compress failed with FA2 ('Could not find the
    currently requested flash attention implementation at macer_flash_attention_2')."""
    calls = _count_calls(flash_attn, monkeypatch)
    _, model = _pair()
    inputs = clip_inputs(model, **CLIP)
    with torch.no_grad():
        want = model(**inputs).logits
        with macer.compress(model, macer_config_for(model, keep_ratio=1.0, audio_layer=1, video_layer=2)) as trace:
            got = model(**inputs).logits
    assert torch.equal(got, want)
    assert trace.layer_tokens == [inputs["input_ids"].shape[1]] * 4
    assert calls["flash_attn_func"] + calls["flash_attn_varlen_func"] >= 2 * 4  # + the encoders' own calls
    assert decoder_parts(model).decoder.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("trim", [False, True])
def test_pruned_prefill_and_generate_equal_sdpa(flash_attn, monkeypatch, trim):
    """Kept sets, the pruned prefill's logits and greedy tokens under FA2 equal SDPA's (the stand-in runs SDPA on
    the same views, so bit for bit); the decode steps run FA2 on the compacted caches."""
    calls = _count_calls(flash_attn, monkeypatch)
    sdpa, flash = _pair()
    inputs = clip_inputs(sdpa, **CLIP)
    config = macer_config_for(sdpa, keep_ratio=0.25, audio_layer=1, video_layer=2, trim_early_cache=trim)
    out = {}
    for name, model in (("sdpa", sdpa), ("flash", flash)):
        with torch.no_grad(), macer.compress(model, config) as trace:
            logits = model(**inputs).logits
            generated = model.generate(**inputs, max_new_tokens=4, do_sample=False,
                                       suppress_tokens=[SYNTHETIC_TOKENS.im_end])
        out[name] = (trace.audio_kept, trace.video_kept, trace.cache_lengths, logits, generated)
    (a_s, v_s, c_s, l_s, g_s), (a_f, v_f, c_f, l_f, g_f) = out["sdpa"], out["flash"]
    assert (a_f, v_f, c_f) == (a_s, v_s, c_s)
    assert l_f.shape[1] < inputs["input_ids"].shape[1]
    assert torch.equal(l_f, l_s)
    assert torch.equal(g_f, g_s)
    assert calls["flash_attn_func"] + calls["flash_attn_varlen_func"] >= 4 * (2 + 4)


def test_diagnose_under_flash_attention_equals_sdpa(flash_attn):
    """``macer.diagnose`` renamed the attention the same way and failed under FA2; its report must equal SDPA's."""
    sdpa, flash = _pair(dtype=torch.float64)
    inputs = clip_inputs(sdpa, **CLIP)
    config = macer_config_for(sdpa, keep_ratio=0.3, audio_layer=1, video_layer=2)
    want, got = diagnose(sdpa, inputs, config).to_dict(), diagnose(flash, inputs, config).to_dict()
    assert got == want
    assert decoder_parts(flash).decoder.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("trim", [False, True])
def test_a_padded_batch_runs_the_varlen_path_and_equals_sdpa(flash_attn, monkeypatch, trim):
    """A left-padded batch under FA2 (refused before): the layers get the layout's 2-D padding mask, which FA2 runs
    through its varlen path (unpadding each sample), in the prefill after every re-pack and in the decode steps;
    each sample's kept sets, cache lengths and greedy tokens equal SDPA's batch, and the prefill logits and every
    decode step's logits agree to fp32 rounding (SDPA's batch takes a 4-D mask: another kernel). Greedy tokens alone
    would miss a decode mask that lets a layer read the wrong cache rows: random weights keep the argmax."""
    calls = _count_calls(flash_attn, monkeypatch)
    sdpa, flash = _pair()
    prompts = [clip_inputs(sdpa, **CLIP), clip_inputs(sdpa, **{**CLIP, "audio_tokens": 50, "seed": 2})]
    batch = batch_inputs(prompts)
    assert bool((batch["attention_mask"] == 0).any())
    config = macer_config_for(sdpa, keep_ratio=0.3, audio_layer=1, video_layer=2, trim_early_cache=trim)
    out = {}
    for name, model in (("sdpa", sdpa), ("flash", flash)):
        with torch.no_grad(), macer.compress(model, config) as trace:
            logits = model(**batch).logits
            generated = model.generate(**batch, max_new_tokens=4, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True, suppress_tokens=[SYNTHETIC_TOKENS.im_end])
        out[name] = ([(s.audio_kept, s.video_kept, s.cache_lengths) for s in trace.samples], logits, generated)
    assert out["flash"][0] == out["sdpa"][0]
    assert all(s[0] and len(s[0]) < 80 for s in out["sdpa"][0])  # audio was pruned in both samples
    # The last rows (the question's end: real text in every sample) of the re-packed batch.
    torch.testing.assert_close(out["flash"][1][:, -4:], out["sdpa"][1][:, -4:], rtol=1e-4, atol=1e-4)
    flash_out, sdpa_out = out["flash"][2], out["sdpa"][2]
    assert torch.equal(flash_out.sequences, sdpa_out.sequences)
    # Step 0 is the prefill's last row; steps 1-3 are decode steps on the re-packed caches (varlen, 2-D masks).
    assert len(flash_out.logits) == len(sdpa_out.logits) == 4
    for step, (got, want) in enumerate(zip(flash_out.logits, sdpa_out.logits, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
    assert calls["flash_attn_varlen_func"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn 2 installed")
def test_real_flash_attention_2_on_gpu_matches_sdpa():
    """The real kernel (FA2 runs bf16/fp16 only): keep ratio 1 identical to the model without compress, and compress
    + generate run with the per-layer lengths and output shape of SDPA (kept sets may differ by bf16 rounding)."""
    config_model = build_thinker(num_layers=6, hidden_size=64, attn_implementation="sdpa", seed=5)
    config = macer_config_for(config_model, keep_ratio=0.25)
    models = {attn: build_thinker(num_layers=6, hidden_size=64, attn_implementation=attn, seed=5, device="cuda",
                                  dtype=torch.bfloat16) for attn in ("sdpa", "flash_attention_2")}
    inputs = clip_inputs(models["sdpa"], device="cuda", dtype=torch.bfloat16, **CLIP)
    out = {}
    with torch.no_grad():
        flash = models["flash_attention_2"]
        reference = flash(**inputs).logits
        with macer.compress(flash, config.replace(keep_ratio=1.0)):
            assert torch.equal(flash(**inputs).logits, reference)
        for attn, model in models.items():
            with macer.compress(model, config) as trace:
                generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
            out[attn] = (trace.layer_tokens, generated.shape)
    assert out["flash_attention_2"] == out["sdpa"]


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn 2 installed")
def test_real_flash_attention_2_runs_a_padded_batch():
    """The real kernel's varlen path on a left-padded, re-packed batch (bf16): prefill and generate run, and each
    sample's per-layer lengths are those of SDPA's batch."""
    models = {attn: build_thinker(num_layers=6, hidden_size=64, attn_implementation=attn, seed=5, device="cuda",
                                  dtype=torch.bfloat16) for attn in ("sdpa", "flash_attention_2")}
    prompts = [clip_inputs(models["sdpa"], device="cuda", dtype=torch.bfloat16, **CLIP),
               clip_inputs(models["sdpa"], device="cuda", dtype=torch.bfloat16, **{**CLIP, "audio_tokens": 50})]
    batch = batch_inputs(prompts)
    config = macer_config_for(build_thinker(num_layers=6, hidden_size=64, seed=5), keep_ratio=0.25)
    out = {}
    with torch.no_grad():
        for attn, model in models.items():
            with macer.compress(model, config) as trace:
                generated = model.generate(**batch, max_new_tokens=4, do_sample=False)
            out[attn] = ([s.layer_tokens for s in trace.samples], generated.shape)
    assert out["flash_attention_2"] == out["sdpa"]
