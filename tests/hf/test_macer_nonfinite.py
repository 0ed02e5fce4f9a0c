"""Non-finite attention under ``macer.compress``: every scored policy stops the prefill with one clear error naming
the layer, the sample and the cause, and leaves the model as it was (issue 21 item 1).

Before, ``"macer"`` kept the first tokens of each modality without a word while ``"macer_raw"``, ``"fastv"`` and
``"shared_topk"`` raised the selection op's "scores contains NaN" (on CPU tensors only). The flags are read once, at
the prefill's end (``tests/hf/test_macer_sync.py`` counts that read).
"""

from __future__ import annotations

import re

import macer
import pytest
import torch
from macer.testing import SYNTHETIC_TOKENS, batch_inputs, build_thinker, clip_inputs, decoder_parts

CLIP = {"frames": 4, "grid_hw": (8, 8), "audio_tokens": 60, "seed": 1}
EOT = SYNTHETIC_TOKENS.im_end

# policy name -> (its policy, the readout layer of its first scored stage)
POLICIES = {
    "macer": (lambda: macer.make_policy("macer", keep_ratio=0.3, audio_layer=1, video_layer=3,
                                        end_of_turn_token_id=EOT), 1),
    "macer_raw": (lambda: macer.make_policy("macer_raw", keep_ratio=0.3, audio_layer=2, video_layer=3,
                                            end_of_turn_token_id=EOT), 2),
    "no_coverage": (lambda: macer.make_policy("no_coverage", keep_ratio=0.3, audio_layer=1, video_layer=3,
                                              end_of_turn_token_id=EOT), 1),
    "single_readout": (lambda: macer.make_policy("single_readout", keep_ratio=0.3, video_layer=2,
                                                 end_of_turn_token_id=EOT), 2),
    "shared_topk": (lambda: macer.make_policy("shared_topk", keep_ratio=0.3, audio_layer=1, video_layer=3,
                                              end_of_turn_token_id=EOT), 3),
    "fastv": (lambda: macer.FastVConfig(keep_ratio=0.3, layer=2), 2),
}


@pytest.fixture(scope="module")
def model():
    return build_thinker(num_layers=5, hidden_size=64, attn_implementation="sdpa", seed=4)


def _message(layer: int, sample: int) -> str:
    return (rf"the attention scores of the stage reading layer {layer} are not finite for sample {sample} "
            rf"\(batch index\): NaN or inf in that layer's queries or keys")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_nan_in_k_proj_weights_raises_for_every_policy_and_leaves_the_model_working(model, name):
    make, layer = POLICIES[name]
    inputs = clip_inputs(model, **CLIP)
    with torch.no_grad():
        before = model(**inputs).logits
    weight = decoder_parts(model).layers[layer - 1].self_attn.k_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[3, 5] = float("nan")
        with pytest.raises(RuntimeError, match=_message(layer, 0)), torch.no_grad(), \
                macer.compress(model, make()) as trace:
            model(**inputs)
        assert trace.history == []  # no record of the stopped prefill
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)  # compress exited cleanly: no hook, no attention wrapper
        with macer.compress(model, make()) as trace:
            model(**inputs)
    assert trace.last.pruned


def test_random_reads_no_scores_and_raises_nothing(model):
    inputs = clip_inputs(model, **CLIP)
    weight = decoder_parts(model).layers[0].self_attn.k_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] = float("nan")
            with macer.compress(model, macer.RandomConfig(keep_ratio=0.3, seed=1)) as trace:
                model(**inputs)
        assert trace.last.pruned
    finally:
        with torch.no_grad():
            weight.copy_(saved)


@pytest.mark.parametrize("name", ["macer", "fastv"])
def test_a_batch_names_the_broken_sample(model, name):
    """NaN in the first real token's embedding of sample 1 of a left-padded batch: every later row of that sample
    sees it, the other sample is untouched. MACER runs its stage once for the batch, FastV per sample."""
    make, layer = POLICIES[name]
    batch = batch_inputs([clip_inputs(model, frames=0, audio_tokens=50, use_audio_in_video=False, seed=2),
                          clip_inputs(model, **CLIP, use_audio_in_video=False)])
    first = int(torch.argmax(batch["attention_mask"][1]))
    embed = decoder_parts(model).decoder.embed_tokens

    def poison(module, args, output):
        output = output.clone()
        output[1, first] = float("nan")
        return output

    handle = embed.register_forward_hook(poison)
    try:
        with pytest.raises(RuntimeError, match=_message(layer, 1)), torch.no_grad(), macer.compress(model, make()):
            model(**batch)
    finally:
        handle.remove()
    with torch.no_grad(), macer.compress(model, make()) as trace:
        model(**batch)
    assert all(s.pruned for s in trace.samples)


def test_the_error_names_the_earliest_stage():
    """With NaN from layer 1 on, every stage is flagged; the error names the first one (the layer to inspect)."""
    from macer.hf.prefill import raise_if_nonfinite

    t, f = torch.tensor([True]), torch.tensor([False])
    entries = [(3, [0], t), (1, [None, 1], torch.tensor([True, True])), (1, [0], f)]
    with pytest.raises(RuntimeError, match=re.escape("stage reading layer 1 are not finite for sample 1")):
        raise_if_nonfinite(entries)
    raise_if_nonfinite([(2, [None], t), (1, [0], f)])  # a sample the stage did not select for is not an error
    raise_if_nonfinite([])


def test_a_batch_reports_what_each_prompt_alone_reports(model):
    """Sample 1 has 2 audio tokens, inside its audio budget: alone, its audio stage drops nothing and does no device
    work, so NaN rows are first reported at its video stage (layer 3). In a batch its audio stage runs inside the
    batch's one select_stage (sample 0 drops audio there); its flag was counted too, so the batch named layer 1
    (found in review). Now the batch names the layer the prompt alone names."""
    make, _ = POLICIES["macer"]
    prompts = [clip_inputs(model, frames=0, audio_tokens=50, use_audio_in_video=False, seed=2),
               clip_inputs(model, **{**CLIP, "audio_tokens": 2}, use_audio_in_video=False)]
    embed = decoder_parts(model).decoder.embed_tokens

    def run(inputs, sample):
        first = int(torch.argmax(inputs["attention_mask"][sample]))

        def poison(module, args, output):
            output = output.clone()
            output[sample, first:] = float("nan")
            return output

        handle = embed.register_forward_hook(poison)
        try:
            with pytest.raises(RuntimeError) as error, torch.no_grad(), macer.compress(model, make()):
                model(**inputs)
        finally:
            handle.remove()
        return str(error.value)

    alone = run(prompts[1], 0)
    assert "stage reading layer 3 are not finite for sample 0" in alone, alone
    batched = run(batch_inputs(prompts), 1)
    assert "stage reading layer 3 are not finite for sample 1" in batched, batched
