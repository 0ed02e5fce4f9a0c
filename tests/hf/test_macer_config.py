"""``MacerConfig`` validation, ``for_model`` defaults, and every unsupported case of ``macer.compress``."""

from __future__ import annotations

from types import SimpleNamespace

import macer
import pytest
import torch
from macer import MacerConfig
from macer.hf.adapters import get_adapter
from macer.testing import (
    SYNTHETIC_TOKENS,
    build_omni_model,
    build_thinker,
    clip_inputs,
    macer_config_for,
    thinker_config,
)
from tiny_models import decoder_of as _decoder
from torch import nn

SMALL = {"frames": 4, "grid_hw": (8, 8), "audio_tokens": 60, "seed": 1}


@pytest.fixture(scope="module")
def model():
    return build_thinker(num_layers=4, hidden_size=64, seed=2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("keep_ratio", 0.0, r"keep_ratio must be a finite real number in \(0.0, 1.0\]"),
        ("keep_ratio", 1.5, r"keep_ratio must be a finite real number in \(0.0, 1.0\]"),
        ("keep_ratio", float("nan"), r"keep_ratio must be"),
        ("keep_ratio", "0.5", r"keep_ratio must be"),
        ("audio_share", -0.1, r"audio_share must be a finite real number in \[0.0, 1.0\]"),
        ("audio_share", True, r"audio_share must be"),
        ("audio_layer", 0, r"audio_layer must be an integer >= 1"),
        ("video_layer", 2.0, r"video_layer must be an integer >= 1"),
        ("coverage_weight", -1.0, r"coverage_weight must be a finite real number in \[0.0, inf\)"),
        ("coverage_weight", float("inf"), r"coverage_weight must be"),
        ("num_chunks", 0, r"num_chunks must be an integer >= 1"),
        ("query_tokens", 0, r"query_tokens must be an integer >= 1"),
        ("eps", -1e-6, r"eps must be a finite real number in \[0.0, inf\)"),
        ("end_of_turn_token_id", -1, r"end_of_turn_token_id must be an integer >= 0"),
        ("trim_early_cache", 1, r"trim_early_cache must be True or False"),
    ],
)
def test_config_errors_name_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        MacerConfig(**{field: value})


def test_config_defaults_and_replace():
    config = MacerConfig()
    assert (config.audio_layer, config.video_layer, config.audio_share, config.coverage_weight) == (3, 5, 0.3, 0.2)
    assert (config.num_chunks, config.query_tokens, config.eps) == (8, 4, 1e-6)
    assert config.end_of_turn_token_id is None and config.trim_early_cache is False
    assert (config.question_span, config.scoring) == ("end_of_turn", "anms")
    assert config.replace(keep_ratio=0.5).keep_ratio == 0.5
    assert MacerConfig(end_of_turn_token_id=7).end_of_turn_token_id == 7
    with pytest.raises(ValueError, match="keep_ratio"):
        config.replace(keep_ratio=2)
    with pytest.raises(ValueError, match=r"MacerConfig.question_span must be one of \['end_of_turn', 'prompt_end'\]"):
        MacerConfig(question_span="last")
    with pytest.raises(ValueError, match=r"MacerConfig.scoring must be one of \['anms', 'raw'\], got 'ANMS'"):
        MacerConfig(scoring="ANMS")


def test_for_model_paper_defaults():
    seven = MacerConfig.for_model(thinker_config(text_shape="7B"), keep_ratio=0.25)
    assert (seven.audio_layer, seven.video_layer, seven.audio_share, seven.coverage_weight) == (3, 5, 0.30, 0.20)
    assert seven.keep_ratio == 0.25
    three = MacerConfig.for_model(thinker_config(text_shape="3B"))
    assert (three.audio_layer, three.video_layer, three.audio_share, three.coverage_weight) == (4, 7, 0.32, 0.30)
    assert MacerConfig.for_model(thinker_config(text_shape="3B"), audio_share=0.5).audio_share == 0.5
    assert macer.paper_defaults(thinker_config(text_shape="7B")) == macer.PAPER_DEFAULTS["qwen2.5-omni-7b"]


def test_for_model_keys_defaults_by_identity_not_depth():
    # 28 layers but not Omni-7B's width: the paper has no layers for it (they used to be given by depth alone).
    narrow = thinker_config(num_layers=28, hidden_size=64)
    assert macer.paper_defaults(narrow) is None
    with pytest.raises(ValueError, match=r"defaults exist for \['qwen2.5-omni-3b', 'qwen2.5-omni-7b'\] only; this "
                                         r"model \(model_type 'qwen2_5_omni_thinker', num_hidden_layers=28, "
                                         r"hidden_size=64.*macer.testing.macer_config_for"):
        MacerConfig.for_model(narrow)
    # Another family with Omni-7B's sizes has no adapter here, so no paper defaults either.
    other = type("Config", (), {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
                                "num_attention_heads": 28, "num_key_value_heads": 4})()
    assert macer.paper_defaults(other) is None
    with pytest.raises(KeyError, match=r"keyed by model name .* not by decoder depth \(28\); use "
                                       r"macer.paper_defaults\(model\)"):
        macer.PAPER_DEFAULTS.get(28, {})


def test_for_model_other_depth_needs_explicit_layers(model):
    with pytest.raises(ValueError, match=r"num_hidden_layers=4.*pass audio_layer= and video_layer= explicitly"):
        MacerConfig.for_model(model)
    config = MacerConfig.for_model(model, audio_layer=1, video_layer=3)
    assert (config.audio_layer, config.video_layer) == (1, 3)
    omni = build_omni_model(num_layers=4, hidden_size=64)
    assert MacerConfig.for_model(omni, audio_layer=2, video_layer=1).stage_layers == (2, 1)
    with pytest.raises(ValueError, match=r"MacerConfig.video_layer must be in \[1, 3\] for a decoder with 4 layers"):
        MacerConfig.for_model(model, audio_layer=1, video_layer=4)
    with pytest.raises(ValueError, match=r"unknown fields \['ratio'\]"):
        MacerConfig.for_model(model, ratio=0.5)
    with pytest.raises(ValueError, match="cannot find the decoder depth"):
        MacerConfig.for_model(object())


def test_compress_rejects_readout_layer_beyond_depth(model):
    with pytest.raises(ValueError, match=r"MacerConfig.audio_layer must be in \[1, 3\] for a decoder with 4 layers"):
        with macer.compress(model, macer_config_for(model, audio_layer=4, video_layer=2)):
            pass


def test_compress_rejects_wrong_config_type(model):
    with pytest.raises(TypeError, match=r"config must be a policy \(macer\.MacerConfig, .*\), got dict"):
        with macer.compress(model, {"keep_ratio": 0.5}):
            pass


def test_unsupported_model_type():
    class Tiny(nn.Module):
        config = type("Config", (), {"model_type": "llama"})()

    with pytest.raises(ValueError, match=r"model_type 'llama' \(Tiny\) is not supported; supported model types: "
                                         r"\['qwen2_5_omni', 'qwen2_5_omni_thinker', 'qwen3_omni_moe', "
                                         r"'qwen3_omni_moe_thinker'\]\. .*adapter=macer.LabelledAdapter"):
        with macer.compress(Tiny(), MacerConfig()):
            pass
    assert macer.supported_model_types() == ["qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_omni_moe",
                                             "qwen3_omni_moe_thinker"]


def test_unsupported_attention_and_sliding_window(model):
    text = _decoder(model).config
    text._attn_implementation = "flex_attention"
    try:
        with pytest.raises(ValueError, match=r"attention implementation 'flex_attention' is not supported; "
                                             r"supported: \['sdpa', 'eager', 'flash_attention_2'\]"):
            with macer.compress(model, macer_config_for(model, audio_layer=1, video_layer=2)):
                pass
    finally:
        text._attn_implementation = "sdpa"
    saved = text.layer_types
    text.layer_types = ["sliding_attention", *saved[1:]]
    try:
        with pytest.raises(ValueError, match="only full-attention decoders are supported"):
            with macer.compress(model, macer_config_for(model, audio_layer=1, video_layer=2)):
                pass
    finally:
        text.layer_types = saved


def test_nested_compress_is_refused(model):
    config = macer_config_for(model, audio_layer=1, video_layer=2)
    with macer.compress(model, config) as trace:
        assert trace.budget is None and trace.audio_kept == [] and trace.layer_tokens == []
        assert repr(trace) == "Trace(no prefill yet)"
    with macer.compress(model, config), pytest.raises(ValueError, match=r"already inside a macer\.compress context"):
        with macer.compress(model, config):
            pass
    assert _decoder(model).config._attn_implementation == "sdpa"


def test_a_used_compress_object_cannot_be_entered_again(model):
    """Guards issue 21.10: entering a used ``compress(...)`` object again raised contextlib's AttributeError ("args");
    it is a RuntimeError that says the object is single use, and the model is left as it was."""
    config = macer_config_for(model, audio_layer=1, video_layer=2)
    context = macer.compress(model, config)
    with context as trace:
        assert trace.budget is None
    with pytest.raises(RuntimeError, match=r"already used in a with block \(it is single use\); call "
                                           r"macer\.compress\(model, config\) again"):
        with context:
            pass
    assert _decoder(model).config._attn_implementation == "sdpa"
    assert all(not layer._forward_pre_hooks for layer in _decoder(model).layers)
    with macer.compress(model, config):  # a fresh object works as usual
        pass


def test_submodules_cited_by_the_docs_after_a_plain_import():
    """Guards issue 21.10: after ``import macer``, ``macer.cost.policy_flops_ratio`` (as the README writes it),
    ``macer.testing`` and ``macer.batching`` (cited by error messages) raised AttributeError. They load on first use:
    in a fresh interpreter ``import macer`` loads none of them (nor transformers), and naming one works."""
    import subprocess
    import sys

    code = ("import sys, macer\n"
            "lazy = ['macer.cost', 'macer.testing', 'macer.batching', 'macer.testing_qwen3', 'transformers']\n"
            "assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]\n"
            "r = macer.cost.policy_flops_ratio(macer.MacerConfig(), 'qwen2.5-omni-7b')\n"
            "assert 0 < r < 1, r\n"
            "assert macer.batching.batch_inputs is macer.testing.batch_inputs\n"
            "assert macer.testing_qwen3.qwen3_clip_inputs\n"
            "assert {'cost', 'testing', 'batching'} <= set(dir(macer))\n"
            "try:\n    macer.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise AssertionError('macer.no_such_name resolved')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _run(model, config, **inputs):
    with torch.no_grad(), macer.compress(model, config):
        return model(**inputs)


def test_batch_needs_a_batch_ready_adapter(model, monkeypatch):
    # Batches (issue #11, tests/hf/test_macer_batch.py) run only where the adapter says its per-token state follows a
    # re-packed batch; others refuse with a message naming the adapter.
    from macer.hf.adapters.qwen2_5_omni import Qwen25OmniAdapter

    monkeypatch.setattr(Qwen25OmniAdapter, "batch_ready", False)
    inputs = clip_inputs(model, frames=0, audio_tokens=20, use_audio_in_video=False)
    ids = inputs["input_ids"].repeat(2, 1)
    with pytest.raises(ValueError, match="Qwen25OmniAdapter adapter does not support a batch of 2 prompts"):
        _run(model, macer_config_for(model, audio_layer=1, video_layer=2), input_ids=ids,
             attention_mask=torch.ones_like(ids))


def test_padding_mask_and_embeds_only_and_labels(model):
    config = macer_config_for(model, audio_layer=1, video_layer=2)
    inputs = clip_inputs(model, **SMALL)
    padded = inputs["attention_mask"].clone()
    padded[0, 0] = 0
    with pytest.raises(ValueError, match=r"attention_mask has padding \(zeros\)"):
        _run(model, config, **{**inputs, "attention_mask": padded})
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    with pytest.raises(ValueError, match=r"needs the prompt's input_ids .* inputs_embeds alone is not supported"):
        _run(model, config, inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
    with pytest.raises(ValueError, match=r"labels \(a training loss\) are not supported"):
        _run(model, config, **inputs, labels=inputs["input_ids"])
    with pytest.raises(ValueError, match="precomputed attention-mask dicts are not supported"):
        with torch.no_grad(), macer.compress(model, config):
            _decoder(model)(inputs_embeds=embeds[:, :5], attention_mask={"full_attention": None})
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D \[1, N\], got shape \(1, 1, 5, 5\)"):
        with torch.no_grad(), macer.compress(model, config):
            _decoder(model)(inputs_embeds=embeds[:, :5], attention_mask=torch.zeros(1, 1, 5, 5))


def test_question_span_errors(model):
    inputs = clip_inputs(model, **SMALL)
    # The last <|vision_bos|> comes before the media: the question rows would precede the audio/video tokens.
    config = macer_config_for(model, audio_layer=1, video_layer=2, end_of_turn_token_id=SYNTHETIC_TOKENS.vision_start)
    with pytest.raises(ValueError, match=r"question rows .* must come after every audio/video token"):
        _run(model, config, **inputs)
    # "system" sits at position 1: fewer than query_tokens tokens before it.
    config = macer_config_for(model, audio_layer=1, video_layer=2, end_of_turn_token_id=SYNTHETIC_TOKENS.system)
    with pytest.raises(ValueError, match=r"needs query_tokens=4 tokens before the last end-of-turn token 11 "
                                         r"\(position 1\)"):
        _run(model, config, **inputs)
    # A question of one token: the 4 rows before <|im_end|> reach back into the media (last audio token).
    short = clip_inputs(model, **SMALL, question_tokens=1)
    with pytest.raises(ValueError, match=r"question rows .* must come after every audio/video token"):
        _run(model, macer_config_for(model, audio_layer=1, video_layer=2), **short)


def test_end_of_turn_token_defaults_from_the_model_and_never_falls_back(model):
    """#13 item 1: the id defaults from the adapter (the synthetic <|im_end|> here, 151645 for the Qwen2 vocabulary);
    a prompt without it, or an id outside the vocabulary, is a clear error; question_span='prompt_end' is the
    explicit way to read the prompt's last tokens."""
    inputs = clip_inputs(model, **SMALL)
    n = inputs["input_ids"].shape[1]
    layers = {"audio_layer": 1, "video_layer": 2}
    with torch.no_grad(), macer.compress(model, MacerConfig(**layers)) as trace:  # no id given: the model's own
        model(**inputs)
    eot = n - 5  # <|im_end|> \n <|im_start|> assistant \n closes the prompt
    assert trace.last.query_positions == list(range(eot - 4, eot))
    with pytest.raises(ValueError, match=r"end_of_turn_token_id=151645 is outside this model's vocabulary "
                                         r"\(vocab_size=512\).* or leave it None for the model's own \(2\)"):
        _run(model, MacerConfig(**layers, end_of_turn_token_id=151645), **inputs)
    no_eot = inputs["input_ids"].clone()
    no_eot[no_eot == SYNTHETIC_TOKENS.im_end] = SYNTHETIC_TOKENS.first_ordinary
    with pytest.raises(ValueError, match=r"end_of_turn_token_id=2 does not occur in the prompt \(searched all "
                                         rf"{n} input_ids.*question_span='prompt_end'"):
        _run(model, MacerConfig(**layers), **{**inputs, "input_ids": no_eot})
    with torch.no_grad(), macer.compress(model, MacerConfig(**layers, question_span="prompt_end")) as trace:
        model(**{**inputs, "input_ids": no_eot})
    assert trace.last.query_positions == list(range(n - 4, n))
    # A config without a named <|im_end|> and the published vocabulary size (152064): the Qwen2 id.
    real = thinker_config()
    del real.im_end_token_id
    real.text_config.vocab_size = 152064
    assert get_adapter(model).end_of_turn_token_id(SimpleNamespace(config=real)) == 151645
    real.text_config.vocab_size = 512
    assert get_adapter(model).end_of_turn_token_id(SimpleNamespace(config=real)) is None


def test_static_cache_is_refused(model):
    inputs = clip_inputs(model, **SMALL)
    with pytest.raises(ValueError, match="StaticCache is not supported"):
        with torch.no_grad(), macer.compress(model, macer_config_for(model, audio_layer=1, video_layer=2)):
            model.generate(**inputs, max_new_tokens=1, cache_implementation="static")
