"""Configurations GPU users run, checked on CPU (issue 23): quantised weights (an integer first parameter), offloaded
KV caches (layers on another device than the model after the prefill), decoders split over devices (refused)."""

from __future__ import annotations

from contextlib import nullcontext

import macer
import macer.hf.batch as macer_batch
import pytest
import torch
import torch.nn.functional as F
from macer.testing import batch_inputs, build_thinker, clip_inputs, decoder_parts, macer_config_for
from tiny_models import SMALL_PROMPT, tiny_thinker
from torch import nn
from transformers import DynamicCache

SMALL = SMALL_PROMPT


def _thinker(attn: str = "eager"):
    return tiny_thinker(attn)


def _prompts(model):
    return [clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=100, seed=4, **SMALL),
            clip_inputs(model, frames=2, grid_hw=(8, 8), audio_tokens=60, seed=5, **SMALL)]


class _Int8Linear(nn.Module):
    """A bitsandbytes-style 8-bit linear layer: an int8 weight parameter and a float scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        self.weight = nn.Parameter(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def dequantised(self) -> torch.Tensor:
        return self.weight.float() * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantised().to(x.dtype), self.bias)


def test_quantised_first_layer_decodes_a_pruned_batch():
    """Guards issue 23 item 2: the eager decode of a pruned batch took its mask dtype from the first parameter of
    ``layers[0]`` (``torch.finfo`` of an int8 tensor: TypeError at the first decode step). With the dtype from the
    hidden states the quantised model gives what the same model with the dequantised weights gives."""
    quantised, reference = _thinker(), _thinker()
    attention = decoder_parts(quantised).layers[0].self_attn
    attention.q_proj = _Int8Linear(attention.q_proj)
    assert next(decoder_parts(quantised).layers[0].parameters()).dtype == torch.int8
    with torch.no_grad():
        decoder_parts(reference).layers[0].self_attn.q_proj.weight.copy_(attention.q_proj.dequantised())
    batch = batch_inputs(_prompts(quantised))
    config = macer_config_for(quantised, keep_ratio=0.3, audio_layer=1, video_layer=2)
    out = {}
    for name, model in (("quantised", quantised), ("reference", reference)):
        with torch.no_grad(), macer.compress(model, config) as trace:
            tokens = model.generate(**batch, max_new_tokens=3, do_sample=False)
        out[name] = (tokens, [(s.audio_kept, s.video_kept) for s in trace.samples])
    assert out["quantised"][1] == out["reference"][1]
    assert torch.equal(out["quantised"][0], out["reference"][0])


class _OffloadedCache(DynamicCache):
    """transformers' offloaded ``DynamicCache`` moves each layer off the model's device after its update (to the CPU,
    from a GPU). Here it goes to ``meta``: another device than the model's, which is what the trimming must handle
    (only the prefill runs; meta tensors hold shapes, no values)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        layer.keys, layer.values = layer.keys.to("meta"), layer.values.to("meta")
        return out


@pytest.mark.parametrize("batched", [False, True])
def test_trim_early_cache_on_an_offloaded_cache(batched, monkeypatch):
    """Guards issue 23 item 3: trim_early_cache indexed an offloaded layer (CPU) with rows on the model's device and
    failed in compact_many / gather; the index now goes to the layer's device."""
    gather = macer_batch.gather_tokens

    def strict_gather(t, index, dim):
        # torch.gather lets a CPU index through on meta tensors; real devices refuse the mix.
        assert index.device == t.device, f"index on {index.device}, tensor on {t.device}"
        return gather(t, index, dim)

    monkeypatch.setattr(macer_batch, "gather_tokens", strict_gather)
    model = _thinker("sdpa")
    prompts = _prompts(model)
    inputs = batch_inputs(prompts) if batched else prompts[0]
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2, trim_early_cache=True)
    with torch.no_grad(), macer.compress(model, config) as trace:
        want = [layer.get_seq_length() for layer in model(**inputs, use_cache=True).past_key_values.layers]
        cache = _OffloadedCache()
        model(**inputs, past_key_values=cache, use_cache=True)
    assert len(set(want)) == 1 and want[0] < inputs["input_ids"].shape[1]  # trimmed to the final rows
    assert [layer.keys.shape[-2] for layer in cache.layers] == want
    assert all(layer.keys.device.type == "meta" for layer in cache.layers)
    assert all(s.cache_lengths == [s.layer_tokens[-1]] * 4 for s in trace.samples)


@pytest.mark.parametrize("where", ["layer", "embeddings"])
def test_a_decoder_split_over_devices_is_refused(where):
    """Guards issue 23 item 4: with ``device_map`` over several GPUs the first stage indexed one device's query with
    another's rows (a torch device mismatch inside the prefill); compress now refuses the split model when it starts.
    Here one module's parameters are on ``meta`` (as accelerate's offload leaves them)."""
    model = _thinker("sdpa")
    parts = decoder_parts(model)
    (parts.layers[2] if where == "layer" else parts.decoder.get_input_embeddings()).to("meta")
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\).*device_map"):
        with macer.compress(model, macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2)):
            pass


class _DecodeSteps:
    """Counts, during the decode steps of ``generate`` only (the decoder called with a non-empty cache), the forward
    pre-hooks registered and the aten ops that are not views (views launch nothing)."""

    def __init__(self, decoder, monkeypatch):
        self.active, self.hooks, self.ops, self.steps = False, 0, 0, 0
        # Registered before compress's own hooks, so it runs first and sees the step as compress does.
        decoder.register_forward_pre_hook(self._begin, with_kwargs=True)
        decoder.register_forward_hook(self._end)
        register = nn.Module.register_forward_pre_hook

        def counted(module, *args, **kwargs):
            self.hooks += self.active
            return register(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, "register_forward_pre_hook", counted)

    def _begin(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        self.active = cache is not None and cache.get_seq_length() > 0
        self.steps += self.active

    def _end(self, *_):
        self.active = False

    def count(self, func) -> None:
        self.ops += self.active and not func.is_view


def _count_ops(steps: _DecodeSteps):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            steps.count(func)
            return func(*args, **(kwargs or {}))

    return Mode()


@pytest.mark.parametrize("trim", [False, True])
def test_decode_steps_do_no_per_step_work_for_a_prompt(monkeypatch, trim):
    """Guards issue 23 item 5: with eager attention every decode step registered and removed a forward pre-hook per
    layer after the first stage and re-ran searchsorted / arange / cat / compact for every distinct row set, although
    the compacted columns are the same at every step. Now the hooks are registered once (at the first step) and a
    decode step under compress runs exactly the non-view ops of the same step without compress (its masks are
    views). With trim_early_cache every
    layer holds the same rows: nothing per step, before and after."""
    model = build_thinker(num_layers=6, hidden_size=64, attn_implementation="eager", seed=5)
    inputs = clip_inputs(model, frames=4, grid_hw=(8, 8), audio_tokens=80, seed=1)
    config = macer_config_for(model, keep_ratio=0.25, audio_layer=2, video_layer=4, trim_early_cache=trim)
    steps = _DecodeSteps(decoder_parts(model).decoder, monkeypatch)
    counts = {}
    for name, patch in (("full", None), ("macer", config)):
        steps.ops = steps.hooks = steps.steps = 0
        with torch.no_grad(), _count_ops(steps), \
                (macer.compress(model, patch) if patch else nullcontext()) as trace:
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
        counts[name] = (steps.steps, steps.hooks, steps.ops)
    lengths = trace.cache_lengths
    assert counts["macer"][0] == counts["full"][0] == 3
    # One hook per layer holding fewer rows than layer 0, registered at the first step (before: one per step).
    assert counts["macer"][1] == sum(n != lengths[0] for n in lengths)
    assert counts["macer"][2] == counts["full"][2]


def test_batch_decode_steps_register_hooks_once(monkeypatch):
    """Guards issue 23 item 5 for a pruned batch: each decode step registered a pre-hook per layer with another
    layout and rebuilt its whole layout mask; now the hooks live from the prefill's end and only the columns after
    the prompt are built per step. The tokens stay those of each prompt alone (tests/hf/test_macer_batch.py)."""
    model = _thinker("eager")
    batch = batch_inputs(_prompts(model))
    steps = _DecodeSteps(decoder_parts(model).decoder, monkeypatch)
    config = macer_config_for(model, keep_ratio=0.3, audio_layer=1, video_layer=2)
    with torch.no_grad(), macer.compress(model, config) as trace:
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    lengths = [s.cache_lengths for s in trace.samples]
    other_layout = sum(any(n[i] != n[0] for n in lengths) for i in range(4))
    assert other_layout > 0
    assert steps.steps == 3 and steps.hooks == other_layout  # once, at the first step (before: at every step)
    assert out.shape[1] == batch["input_ids"].shape[1] + 4


def test_a_2d_decode_mask_over_a_trimmed_prompt():
    """A decode step given a 2-D mask over the whole prompt while the caches hold only the kept rows
    (trim_early_cache): the mask loses the dropped columns (now a view of its last columns; the prompt has no
    padding) and the step equals the same step without a mask."""
    from test_macer_labelled import build_decoder, media_prompt

    model = build_decoder("llama", attn="eager", seed=3, num_layers=4)
    embeds, labels, times, question_end = media_prompt(model, seed=2)
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=1, video_layer=2, trim_early_cache=True)
    n = embeds.shape[1]
    step = embeds[:, -1:]
    position = torch.tensor([[n]])
    out = []
    with torch.no_grad(), macer.compress(model, config, adapter=adapter):
        for mask in (None, torch.ones(1, n + 1, dtype=torch.long)):
            cache = model(inputs_embeds=embeds, use_cache=True).past_key_values
            assert cache.get_seq_length() < n
            out.append(model(inputs_embeds=step, past_key_values=cache, attention_mask=mask,
                             position_ids=position).logits)
    assert torch.equal(out[0], out[1])


def test_a_4d_decode_mask_given_by_the_caller():
    """A decode step given a 4-D mask over layer 0's keys: each layer holding fewer rows gets its own columns of it
    (compacted once per step and row set). All-visible equals no mask (coverage for the precomputed row positions;
    this path existed before); hiding the first prompt row (text, kept in every layer) changes the step."""
    from test_macer_labelled import build_decoder, media_prompt

    model = build_decoder("llama", attn="sdpa", seed=3, num_layers=4)
    embeds, labels, times, question_end = media_prompt(model, seed=2)
    adapter = macer.LabelledAdapter(labels, temporal_positions=times, question_end=question_end)
    config = macer.MacerConfig(keep_ratio=0.3, audio_layer=1, video_layer=2)
    n = embeds.shape[1]
    visible = torch.ones(1, 1, 1, n + 1, dtype=torch.bool)
    hidden = visible.clone()
    hidden[..., 0] = False
    out = []
    with torch.no_grad(), macer.compress(model, config, adapter=adapter) as trace:
        for mask in (None, visible, hidden):
            cache = model(inputs_embeds=embeds, use_cache=True).past_key_values
            out.append(model(inputs_embeds=embeds[:, -1:], past_key_values=cache, attention_mask=mask,
                             position_ids=torch.tensor([[n]])).logits)
    assert len(set(trace.cache_lengths)) > 1  # layers hold different rows
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-6)  # SDPA with a mask: another kernel's rounding
    assert not torch.allclose(out[0], out[2], rtol=1e-3, atol=1e-4)
