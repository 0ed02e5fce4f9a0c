"""Settings refused before an engine starts, all at once, one line each (issue 30 items 2, 4, 6, 7, 8, 10; issue 28
item 4's config-time part).

The settings' checks run on config objects (fast); the ones that must be seen through vLLM's own config path run
``LLM(...)``, which the plugin's hook refuses while vLLM builds the config (no engine starts: the error is pydantic's
``ValidationError`` of ``VllmConfig``). One test starts an engine process that refuses at load, to see the refusal
reach the end of the caller's output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from macer.vllm.checks import check_engine, engine_problems
from macer.vllm.records import RequestRecord
from macer.vllm.settings import (
    LABELLED_ARCHITECTURE,
    MACER_ARCHITECTURES,
    OMNI_THINKER_ARCHITECTURE,
    Refusal,
    misplaced_settings,
    policy_from_settings,
    validate_end_of_turn,
    validate_keep_ratio,
    validate_policy_name,
    validate_token_ids,
)

from macer_kernels import Budget

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3}
LABELS = {"audio_token_ids": [5, 6, 7], "video_token_ids": [8, 9], "end_of_turn_token_id": 2}


def qwen2_config(vocab_size: int = 512, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=1, **extra)


def refused(settings, architecture=LABELLED_ARCHITECTURE, config=None) -> tuple[str, ...]:
    with pytest.raises(Refusal) as caught:
        policy_from_settings(settings, config or qwen2_config(), architecture)
    assert isinstance(caught.value, ValueError)
    return caught.value.problems


# ------------------------------------------------------------------------------------ single values (planted: 6)
def test_token_ids_and_end_of_turn_bounds():
    """Guards the bounds of the ids (issue 30, planted bug 6): a negative id in audio_token_ids / video_token_ids is
    refused, and end_of_turn_token_id equal to the vocabulary size is refused while the last id is accepted."""
    for key in ("audio_token_ids", "video_token_ids"):
        (problem,) = refused({**LAYERS, **LABELS, key: [5, -1] if key == "video_token_ids" else [-1]})
        assert problem.startswith(f'additional_config["macer"]["{key}"] must hold integer token ids in [0, 511]')
        assert problem.endswith("got [-1]")
    (problem,) = refused({**LAYERS, **LABELS, "end_of_turn_token_id": 512})
    assert problem.startswith('additional_config["macer"]["end_of_turn_token_id"]=512 is outside this model\'s '
                              "vocabulary (vocab_size=512)")
    policy, _ = policy_from_settings({**LAYERS, **LABELS, "end_of_turn_token_id": 511}, qwen2_config(),
                                     LABELLED_ARCHITECTURE)
    assert policy.end_of_turn_token_id == 511
    assert validate_token_ids([0, 511, 3, 3], "x", 512) == (0, 3, 511)
    with pytest.raises(ValueError, match=r"^x must hold integer token ids in \[0, 511\]"):
        validate_token_ids([512], "x", 512)
    with pytest.raises(ValueError, match=r"^where=512 is outside"):
        validate_end_of_turn(512, "where", 512)
    with pytest.raises(ValueError, match=r"^where must be a token id \(an integer in \[0, 511\]"):
        validate_end_of_turn(-1, "where", 512)


def test_single_value_validators_name_where_the_value_was_set():
    """The checks the per-request guard reuses: each names where the value came from and the allowed range."""
    assert validate_keep_ratio(0.25, "req") == 0.25 and validate_keep_ratio(1, "req", "full") == 1.0
    for bad in (0.0, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"^req must be a finite real number in \(0.0, 1.0\], got"):
            validate_keep_ratio(bad, "req")
    with pytest.raises(ValueError, match=r"^req must be 1.0 \(a real number: full keeps everything\), got 0.5"):
        validate_keep_ratio(0.5, "req", "full")
    assert validate_policy_name("fastv") == "fastv"
    with pytest.raises(ValueError, match=r"^req: unknown policy 'fastr'; known: \['full', 'macer'"):
        validate_policy_name("fastr", "req")


# ------------------------------------------------------------------------------------ settings that can never prune
@pytest.mark.parametrize(("labels", "message"), [
    ({"audio_token_ids": []}, r"name no token id between them, so no prompt row would be audio or video"),
    ({"audio_token_ids": [], "video_token_ids": []}, r"name no token id between them"),
    ({"audio_token_ids": [5, 2], "video_token_ids": [8]},
     r'\["audio_token_ids"\] holds end_of_turn_token_id=2: .* each would run unpruned'),
    ({"audio_token_ids": [5], "video_token_ids": [8, 2]}, r'\["video_token_ids"\] holds end_of_turn_token_id=2'),
])
def test_settings_that_can_never_prune_are_refused(labels, message):
    """Guards settings accepted although every request would run unpruned (issue 30 item 7): no audio or video id
    at all, or the end-of-turn id among the media ids."""
    (problem,) = refused({**LAYERS, "end_of_turn_token_id": 2, **labels})
    assert problem.startswith('additional_config["macer"]')
    assert re.search(message, problem), problem


# ------------------------------------------------------------------------------------ config time, not load time
def test_policies_the_engine_cannot_serve_are_refused_with_the_settings():
    """Guards trim_early_cache and a missing end-of-turn id being refused only when the model loads (issue 30 item
    4): policy_from_settings, which the config hook runs, refuses both; policies that read no question rows, and the
    Omni thinker (its config names <|im_end|>), need no id."""
    (problem,) = refused({**LAYERS, **LABELS, "trim_early_cache": True})
    assert problem == ('additional_config["macer"]["trim_early_cache"]=true is not supported inside vLLM (the early '
                       "layers' KV pages keep every prompt token); leave it false")
    no_end = {k: v for k, v in LABELS.items() if k != "end_of_turn_token_id"}
    (problem,) = refused({**LAYERS, **no_end})
    assert 'set "end_of_turn_token_id"' in problem and problem.startswith('additional_config["macer"]: ')
    policy_from_settings({**LAYERS, **no_end, "question_span": "prompt_end"}, qwen2_config(), LABELLED_ARCHITECTURE)
    policy_from_settings({"policy": "fastv", "keep_ratio": 0.25, "layer": 2, **no_end}, qwen2_config(),
                         LABELLED_ARCHITECTURE)
    from macer.testing import thinker_config

    policy, _ = policy_from_settings({"keep_ratio": 0.25}, thinker_config(text_shape="7B"),
                                     OMNI_THINKER_ARCHITECTURE)
    assert policy.end_of_turn_token_id is None


def test_every_problem_is_reported_at_once_one_line_each():
    """Guards one refusal per start (issue 30 item 4): an unknown key, bad ids, trim_early_cache and a readout layer
    past the decoder are all listed in one error, each on one line of its own under a header."""
    settings = {"keep_ratio": 0.25, "audio_layer": 2, "video_layer": 9, "audio_token_ids": [-4],
                "video_token_ids": [8], "end_of_turn_token_id": 2, "trim_early_cache": True, "bogus": 1}
    problems = refused(settings)
    assert [p.split(" ")[1 if p.startswith('additional_config["macer"]: ') else 0] for p in problems] == [
        "policy", 'additional_config["macer"]["audio_token_ids"]',
        'additional_config["macer"]["trim_early_cache"]=true', "MacerConfig.video_layer"], problems
    with pytest.raises(Refusal) as caught:
        policy_from_settings(settings, qwen2_config(), LABELLED_ARCHITECTURE)
    lines = str(caught.value).splitlines()
    assert lines[0] == ("MacerQwen2ForCausalLM (macer) cannot start: 4 settings refused (all of them listed, fix "
                        "each):")
    assert lines[1].startswith('  - additional_config["macer"]: policy \'macer\' has no setting \'bogus\'')
    assert lines[4].startswith('  - additional_config["macer"]: MacerConfig.video_layer must be in [1, 5]')
    assert len(lines) == 5


def test_unknown_keys_are_a_valueerror_naming_the_settings_and_every_allowed_key():
    """Guards the unknown key's bare TypeError and a list of allowed keys without the labelling keys (issue 30 item
    8), for MACER's fields (make_policy's TypeError before) as for a baseline's."""
    (problem,) = refused({**LAYERS, **LABELS, "audio_token_id": [5]})
    assert problem.startswith('additional_config["macer"]: policy \'macer\' has no setting \'audio_token_id\' (did '
                              "you mean 'audio_token_ids'?); allowed: ['policy', 'keep_ratio'")
    assert problem.endswith("'audio_token_ids', 'video_token_ids', 'free_kv']")
    from macer.testing import thinker_config

    (problem,) = refused({"keep_ratio": 0.25, "keep_ration": 0.5}, OMNI_THINKER_ARCHITECTURE,
                         thinker_config(text_shape="7B"))
    assert "has no setting 'keep_ration' (did you mean 'keep_ratio'?)" in problem
    assert "audio_token_ids" not in problem  # not settings of the thinker


# ------------------------------------------------------------------------------------ settings that would be ignored
@pytest.mark.parametrize(("additional", "architecture", "model_type", "message"), [
    ({"macer": {"keep_ratio": 0.25}}, "Qwen2ForCausalLM", "qwen2",
     r"""architecture Qwen2ForCausalLM is not a MACER architecture and would serve every prompt unpruned: select """
     r"""MACER's architecture for it with --hf-overrides '\{"architectures": \["MacerQwen2ForCausalLM"\]\}'"""),
    ({"macer": {}}, "Qwen2_5OmniModel", "qwen2_5_omni",
     r"""--hf-overrides '\{"architectures": \["MacerQwen2_5OmniThinkerForConditionalGeneration"\]\}'"""),
    ({"macer": {}}, "LlamaForCausalLM", "llama", r"MACER serves \['MacerQwen2ForCausalLM', .*model_type 'llama'"),
    ({"mcer": {"keep_ratio": 0.25}}, "MacerQwen2ForCausalLM", "qwen2",
     r"""additional_config holds 'mcer', a misspelling of 'macer' that MACER would not read: rename it"""),
    ({"Macer": {}}, "MacerQwen2_5OmniThinkerForConditionalGeneration", "qwen2_5_omni", r"holds 'Macer'"),
    ({"macer": {}, "macre": {}}, "MacerQwen2ForCausalLM", "qwen2", r"holds 'macre'.*drop it"),
    ({"mcer": {}}, "Qwen2ForCausalLM", "qwen2", r"holds 'mcer'"),
])
def test_settings_that_would_be_ignored_are_refused(additional, architecture, model_type, message):
    """Guards MACER settings silently ignored (issue 30 item 2): on an architecture that is not MACER's, or under a
    misspelt top-level key."""
    problems = misplaced_settings(additional, architecture, SimpleNamespace(model_type=model_type))
    assert problems and any(re.search(message, p) for p in problems), problems
    assert not misplaced_settings({"macro": {}, "other": 1}, "Qwen2ForCausalLM", SimpleNamespace(model_type="qwen2"))
    assert not misplaced_settings({"macer": {}}, LABELLED_ARCHITECTURE, SimpleNamespace(model_type="qwen2"))


def test_register_guards_every_other_architecture():
    """Every other registered architecture's config hook refuses MACER settings before running its own hook, and
    with none set it runs as before (its own hook is the base class)."""
    import macer.vllm
    from vllm import ModelRegistry
    from vllm.model_executor.models import config as vllm_configs

    assert set(macer.vllm.ARCHITECTURES) == set(MACER_ARCHITECTURES)
    macer.vllm.register()
    hooks = vllm_configs.MODELS_CONFIG_MAP
    others = [a for a in ModelRegistry.get_supported_archs() if a not in macer.vllm.ARCHITECTURES]
    assert "Qwen2ForCausalLM" in others and all(getattr(hooks[a], "_macer_guarded", False) for a in others)
    wrapped = hooks["Qwen2ForRewardModel"]
    assert wrapped.__mro__[1] is vllm_configs.Qwen2ForRewardModelConfig
    macer.vllm.register()
    assert hooks["Qwen2ForRewardModel"] is wrapped  # idempotent
    engine = SimpleNamespace(additional_config={"macer": {}}, model_config=SimpleNamespace(
        architecture="Qwen2ForCausalLM", hf_config=SimpleNamespace(model_type="qwen2")))
    with pytest.raises(Refusal, match="is not a MACER architecture"):
        hooks["Qwen2ForCausalLM"].verify_and_update_config(engine)
    engine.additional_config = {}
    hooks["Qwen2ForCausalLM"].verify_and_update_config(engine)


# ------------------------------------------------------------------------------------ engine settings
def engine(**changes):
    """A config object with every attribute ``engine_problems`` reads, set to what the plugin accepts."""
    model = SimpleNamespace(architecture=LABELLED_ARCHITECTURE, enforce_eager=True, enable_prompt_embeds=False,
                            hf_text_config=SimpleNamespace(layer_types=["full_attention"] * 4),
                            get_sliding_window=lambda: changes.pop("_window", None))
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                               decode_context_parallel_size=1, data_parallel_size=1, enable_dbo=False, ubatch_size=0)
    config = SimpleNamespace(
        model_config=model, scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=1),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        compilation_config=SimpleNamespace(mode=None, cudagraph_mode=None), parallel_config=parallel,
        speculative_config=None, use_v2_model_runner=False, lora_config=None, kv_transfer_config=None)
    for path, value in changes.items():
        owner, _, name = path.rpartition(".")
        setattr(getattr(config, owner) if owner else config, name, value)
    return config


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_config.enable_prompt_embeds": True}, r"prompt embeddings carry no token ids.*drop --enable-prompt-embeds"),
    ({"parallel_config.prefill_context_parallel_size": 2},
     r"--prefill-context-parallel-size=2 is not supported \(each rank holds a shard of the prompt.*use "
     r"--prefill-context-parallel-size 1"),
    ({"parallel_config.decode_context_parallel_size": 2}, r"--decode-context-parallel-size=2 is not supported"),
    ({"parallel_config.data_parallel_size": 2, "model_config.is_moe": True},
     r"--data-parallel-size=2 with a MoE model is not supported \(its ranks step together.*no all_gatherv.*use "
     r"--tensor-parallel-size, or run independent engines"),
    ({"parallel_config.enable_dbo": True}, r"micro-batching \(--enable-dbo / --ubatch-size 0\) is not supported"),
    ({"parallel_config.ubatch_size": 2}, r"micro-batching .*--ubatch-size 2\) is not supported"),
    ({"model_config.hf_text_config": SimpleNamespace(layer_types=["full_attention", "sliding_attention"])},
     r"sliding-window attention layers \(layer_types \['sliding_attention'\]\) are not supported.*use_sliding_window"),
    ({"model_config.get_sliding_window": lambda: 4096}, r"sliding-window attention layers \(sliding_window=4096\)"),
    ({"scheduler_config.long_prefill_token_threshold": 32},
     r"needs the whole prompt in one prefill step, and --long-prefill-token-threshold=32 gives a prompt at most 32 "
     r"tokens a step .*drop --long-prefill-token-threshold"),
    ({"cache_config.kv_sharing_fast_prefill": True},
     r"--kv-sharing-fast-prefill is not supported \(.*logits_indices_padded.*\): drop --kv-sharing-fast-prefill"),
    ({"cache_config.use_replayssm": True}, r"--use-replayssm is not supported .*replayssm_decode_base_cpu"),
    ({"model_config.is_encoder_decoder": True}, r"an encoder-decoder model is not supported .*encoder_seq_lens"),
    ({"model_config.is_mm_prefix_lm": True}, r"bidirectionally \(is_mm_prefix_lm\) is not supported .*mm_req_doc"),
    ({"model_config.rswa_window": 128}, r"reference sliding-window attention \(rswa_window=128\) .*rswa_prefix_lens"),
    ({"model_config.runner_type": "pooling", "model_config.convert_type": "embed"},
     r"a pooling runner \(--runner pooling / --convert embed\) is not supported \(a pooler reads the hidden states"),
    ({"aux_output_config": SimpleNamespace(enable_return_routed_experts=True)},
     r"--enable-return-routed-experts is not supported \(it records the experts of the rows each layer holds"),
    ({"model_config.enforce_eager": False, "compilation_config": SimpleNamespace(
        mode=None, cudagraph_mode=None, splitting_ops=["vllm::unified_attention_with_output"])},
     r"piecewise CUDA graphs \(cudagraph mode DEFAULT\) with --compilation-config splitting_ops "
     r"\['vllm::unified_attention_with_output'\] capture the KV-cache writes .*add vllm::unified_kv_cache_update "
     r"to splitting_ops, or leave splitting_ops unset"),
    ({"scheduler_config.disable_hybrid_kv_cache_manager": True},
     r'freeing the dropped rows\' KV memory \(additional_config\["macer"\]\["free_kv"\], on by default\) needs '
     r"vLLM's hybrid KV cache manager .*drop that flag, or set additional_config\[\"macer\"\]\[\"free_kv\"\] to false"),
])
def test_engine_settings_refused_by_name(changes, message):
    """Guards the engine settings that killed the engine or silently skipped MACER (issue 28 item 4): prompt
    embeddings, context parallel, data parallel of a MoE model, micro-batching, sliding-window layers; each names
    its flag. (A dense model's data parallel and tensor parallel run: issue 38, tests/serving/test_parallel.py.)"""
    assert engine_problems(engine()) == []
    assert engine_problems(engine(**{"parallel_config.data_parallel_size": 2,
                                     "parallel_config.tensor_parallel_size": 2})) == []
    problems = engine_problems(engine(**changes))
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_splitting_ops_that_keep_the_kv_cache_writes_between_the_pieces_are_served():
    """Only piecewise CUDA graphs whose pieces would hold the KV-cache writes are refused: vLLM's default splitting
    ops (unset: it adds the writes' op), a list naming ``vllm::unified_kv_cache_update``, an empty list (no pieces),
    FULL-only graphs, or no graphs at all are served."""
    attention = ["vllm::unified_attention_with_output"]
    for ops, mode, eager in ((None, None, False), ([*attention, "vllm::unified_kv_cache_update"], None, False),
                             ([], None, False), (attention, "FULL_DECODE_ONLY", False), (attention, "FULL", False),
                             (attention, "NONE", False), (attention, None, True)):
        compilation = SimpleNamespace(mode=None, cudagraph_mode=mode, splitting_ops=ops)
        assert engine_problems(engine(**{"model_config.enforce_eager": eager, "compilation_config": compilation})) \
            == [], (ops, mode, eager)
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        compilation = SimpleNamespace(mode=None, cudagraph_mode=mode, splitting_ops=attention)
        (problem,) = engine_problems(engine(**{"model_config.enforce_eager": False, "compilation_config": compilation}))
        assert f"piecewise CUDA graphs (cudagraph mode {mode})" in problem


def test_every_metadata_field_the_compacted_layers_drop_has_its_refusal():
    """Guards the load-time refusals and the runtime guard drifting apart (review finding 4: --kv-sharing-fast-prefill
    was accepted, then the guard stopped the engine at the first pruned step): the fields ``DROPPED_FIELDS`` refuses
    the settings of are exactly the ones ``macer.vllm.backend`` raises on, each a field of vLLM's
    ``CommonAttentionMetadata``, and each check refuses its setting alone, naming the field or its flag."""
    import dataclasses

    from macer.vllm import backend
    from macer.vllm.checks import DROPPED_FIELDS
    from vllm.v1.attention.backend import CommonAttentionMetadata

    assert tuple(DROPPED_FIELDS) == backend._DROPPED
    assert set(DROPPED_FIELDS) <= {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    off = engine()
    assert all(check(off, "who") is None for check in DROPPED_FIELDS.values())
    on = {"logits_indices_padded": {"cache_config.kv_sharing_fast_prefill": True},
          "encoder_seq_lens": {"model_config.is_encoder_decoder": True},
          "dcp_local_seq_lens": {"parallel_config.decode_context_parallel_size": 2},
          "mm_req_doc_ranges": {"model_config.is_mm_prefix_lm": True},
          "rswa_prefix_lens": {"model_config.rswa_window": 64},
          "replayssm_decode_base_cpu": {"cache_config.use_replayssm": True}}
    assert set(on) == set(DROPPED_FIELDS)
    for field, changes in on.items():
        (problem,) = engine_problems(engine(**changes))
        assert field in problem and problem == DROPPED_FIELDS[field](engine(**changes), problem.split(":")[0])


@pytest.mark.parametrize("kind", ["XPU", "TPU", "OOT"])
def test_platforms_other_than_cpu_and_cuda_are_refused_with_the_settings(kind, monkeypatch):
    """Guards a platform without a MACER worker crashing at start (review finding 11: every non-CPU platform got the
    CUDA worker): an XPU, TPU or out-of-tree platform (vLLM's ``Platform`` with that enum; none can run here) is
    refused while the config is built, by name; CPU, CUDA and ROCm are not."""
    import vllm.platforms
    from macer.vllm.checks import platform_problem
    from vllm.platforms.interface import Platform, PlatformEnum

    def platform(name: str):
        fields = {"_enum": PlatformEnum[name], "device_name": name.lower()}
        return type(f"{name.title()}Platform", (Platform,), fields)()

    for ok in ("CPU", "CUDA", "ROCM"):
        assert platform_problem(platform(ok), "who") is None
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform(kind))
    (problem,) = engine_problems(engine())
    assert problem.startswith(f"MacerQwen2ForCausalLM (macer): the {kind.lower()} platform ({kind.title()}Platform) "
                              "is not supported: the MACER worker is vLLM's CPU worker or its GPU worker")


def test_free_kv_is_a_bool_and_needs_the_hybrid_kv_cache_manager():
    """``free_kv`` is an engine key beside the policy's fields: a bool (default true), refused otherwise by name;
    off, vLLM's hybrid KV cache manager may be off too."""
    policy, _ = policy_from_settings({**LAYERS, **LABELS, "free_kv": False}, qwen2_config(), LABELLED_ARCHITECTURE)
    assert policy.keep_ratio == 0.25
    assert refused({**LAYERS, **LABELS, "free_kv": "yes"}) == (
        'additional_config["macer"]["free_kv"] must be true or false (free the KV cache blocks of the rows the stages '
        "drop), got 'yes'",)
    off = engine(**{"scheduler_config.disable_hybrid_kv_cache_manager": True,
                    "additional_config": {"macer": {"free_kv": False}}})
    assert engine_problems(off) == []


def test_engine_settings_all_refused_at_once():
    """Guards one refusal per start: three bad flags give one error listing the three, one line each."""
    with pytest.raises(Refusal) as caught:
        check_engine(engine(**{"scheduler_config.enable_chunked_prefill": True, "parallel_config.data_parallel_size": 2,
                               "model_config.is_moe": True, "model_config.enable_prompt_embeds": True}))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("MacerQwen2ForCausalLM (macer) cannot start: 3 settings refused")
    assert [line.split(" ")[5] for line in lines[1:]] == ["needs", "prompt", "--data-parallel-size=2"]


# ------------------------------------------------------------------------------------ through vLLM's config path
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from macer.vllm.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=4)


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory):
    from macer.vllm.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("plain"), num_layers=4, architecture="Qwen2ForCausalLM")


def build(checkpoint, additional_config, **engine_args):
    from vllm import LLM

    arguments = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256,
                 "enforce_eager": True, "enable_chunked_prefill": False, "enable_prefix_caching": False,
                 "max_num_seqs": 1, "kv_cache_memory_bytes": 32 << 20, "additional_config": additional_config,
                 **engine_args}
    return LLM(model=str(checkpoint), **arguments)


def errors_logged(monkeypatch) -> list[str]:
    """The messages logged at ERROR on ``vllm.macer`` from now on, as logged (the call itself is recorded: vLLM may
    reconfigure logging, which drops handlers attached to its child loggers)."""
    target, seen = logging.getLogger("vllm.macer"), []
    original = target.error

    def error(message, *args, **kwargs):
        seen.append(message % args if args else message)
        original(message, *args, **kwargs)

    monkeypatch.setattr(target, "error", error)
    return seen


def logged_refusal(call, monkeypatch) -> tuple[BaseException, list[str]]:
    """``call()``'s exception (pydantic's ValidationError of VllmConfig: raised while the config is built) and the
    ERROR lines logged on ``vllm.macer`` before it."""
    seen = errors_logged(monkeypatch)
    with pytest.raises(ValueError) as caught:
        call()
    assert type(caught.value).__name__ == "ValidationError", caught.value  # from VllmConfig: no engine started
    return caught.value, list(seen)


def test_settings_refused_when_vllm_builds_the_config(checkpoint, plain_checkpoint, monkeypatch):
    """Through LLM(...): MACER settings on vLLM's own Qwen2 architecture, a misspelt top-level key, and
    trim_early_cache with a missing end-of-turn id and chunked prefill (all three in one error) are refused while
    vLLM builds the config, each first logged as a readable ERROR."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    settings = {**LAYERS, **LABELS}
    error, seen = logged_refusal(lambda: build(plain_checkpoint, {"macer": settings}), monkeypatch)
    assert "architecture Qwen2ForCausalLM is not a MACER architecture" in str(error)
    assert seen and seen[0].startswith('additional_config["macer"] is set, but this engine\'s architecture '
                                       "Qwen2ForCausalLM")
    error, _ = logged_refusal(lambda: build(checkpoint, {"mcer": settings}), monkeypatch)
    assert "additional_config holds 'mcer', a misspelling of 'macer'" in str(error)
    no_end = {k: v for k, v in settings.items() if k != "end_of_turn_token_id"}
    error, seen = logged_refusal(lambda: build(checkpoint, {"macer": {**no_end, "trim_early_cache": True}},
                                               enable_chunked_prefill=True), monkeypatch)
    assert seen[0].startswith("MacerQwen2ForCausalLM (macer) cannot start: 3 settings refused")
    for needle in ("--no-enable-chunked-prefill", '["trim_early_cache"]=true is not supported',
                   'set "end_of_turn_token_id"'):
        assert needle in str(error) and needle in seen[0]


def test_flags_that_split_a_prompt_or_fill_dropped_metadata_are_refused_through_llm(checkpoint, monkeypatch):
    """Guards two flags that started an engine which then died at its first pruned step (review findings 1 and 4):
    ``long_prefill_token_threshold`` (vLLM cut a prompt the KV side had sized as pruned; ``check_owned`` stopped the
    engine) and ``kv_sharing_fast_prefill`` (the runtime guard on ``logits_indices_padded`` stopped it). Through
    ``LLM(...)`` both are refused while vLLM builds the config, in one error."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    error, seen = logged_refusal(lambda: build(checkpoint, {"macer": {**LAYERS, **LABELS}},
                                               long_prefill_token_threshold=32, kv_sharing_fast_prefill=True),
                                 monkeypatch)
    assert seen[0].startswith("MacerQwen2ForCausalLM (macer) cannot start: 2 settings refused")
    for needle in ("--long-prefill-token-threshold=32 gives a prompt at most 32 tokens a step",
                   "drop --kv-sharing-fast-prefill"):
        assert needle in str(error) and needle in seen[0]


@pytest.mark.parametrize(("engine_args", "flags"), [
    ({"runner": "pooling", "convert": "embed"}, "--runner pooling / --convert embed"),
    ({"convert": "classify"}, "--runner pooling / --convert classify")])
def test_pooling_runners_are_refused_through_llm(checkpoint, monkeypatch, engine_args, flags):
    """Guards a pooling runner serving MACER's zeroed dropped rows to its pooler (review finding 9: vLLM accepted
    ``--runner pooling --convert embed`` on the MACER architecture, and MEAN/ALL pooling read zeros): refused while the
    config is built, naming the flags."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    error, seen = logged_refusal(lambda: build(checkpoint, {"macer": {**LAYERS, **LABELS}}, **engine_args),
                                 monkeypatch)
    assert f"a pooling runner ({flags}) is not supported" in str(error) and seen


def test_the_servers_command_line_refuses_them_too(checkpoint, tmp_path):
    """The same two flags on the OpenAI-compatible server's command line: it exits before any engine starts, its
    output naming both flags."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens",
               "256", "--enforce-eager", "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
               "--kv-cache-memory-bytes", str(32 << 20), "--long-prefill-token-threshold", "32",
               "--kv-sharing-fast-prefill", "--additional-config", json.dumps({"macer": {**LAYERS, **LABELS}})]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "MacerQwen2ForCausalLM (macer) cannot start: 2 settings refused" in output, output[-4000:]
    assert "--long-prefill-token-threshold=32" in output and "drop --kv-sharing-fast-prefill" in output
    assert "Starting vLLM" not in output and "EngineCore" not in output  # refused before any engine process


LOAD_REFUSAL = textwrap.dedent("""
    import os, sys
    import macer.vllm.checks as checks

    original = checks.engine_problems
    # A refusal only an engine process makes (as a check on the final config would). At the top level: vLLM spawns
    # the engine core, which imports this file as its main module.
    checks.engine_problems = lambda config: original(config) + (
        ["simulated load-time refusal: drop --simulated-flag"]
        if os.environ.get("FRONTEND_PID", str(os.getpid())) != str(os.getpid()) else [])

    if __name__ == "__main__":
        from vllm import LLM

        os.environ["FRONTEND_PID"] = str(os.getpid())
        LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256,
            max_num_batched_tokens=256, enforce_eager=True, enable_chunked_prefill=False, enable_prefix_caching=False,
            max_num_seqs=1, kv_cache_memory_bytes=32 << 20, additional_config={"macer": json_settings})
""")


def test_load_time_refusal_ends_the_callers_output(checkpoint, tmp_path):
    """Guards a load-time refusal showing only as "Engine core initialization failed" with its cause far above (issue
    28 item 4): the process that built the config prints the engine process's refusal when it exits, last."""
    script = tmp_path / "load_refusal.py"
    script.write_text(LOAD_REFUSAL.replace("json_settings", json.dumps({**LAYERS, **LABELS})))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([sys.executable, str(script), str(checkpoint)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert done.returncode != 0
    assert "Engine core initialization failed" in done.stderr, done.stderr[-3000:]
    tail = done.stderr.rstrip().splitlines()[-2:]
    assert tail == ["macer: the engine process refused to load the model (its traceback is above):",
                    "simulated load-time refusal: drop --simulated-flag"], done.stderr[-3000:]


# ------------------------------------------------------------------------------------ the Omni thinker's import
def test_omni_thinker_import_failure_names_torchvision(tmp_path, monkeypatch):
    """Guards the Omni thinker reporting only "failed to be inspected" (issue 30 item 10): without torchvision (hidden
    in vLLM's inspection subprocess by a sitecustomize, so the test does not depend on what is installed), one ERROR
    line names torchvision right before vLLM's refusal."""
    from macer.testing import build_thinker

    build_thinker(num_layers=2, hidden_size=64).save_pretrained(tmp_path / "thinker")
    hide = tmp_path / "hide"
    hide.mkdir()
    # None in sys.modules: importlib.util.find_spec says "not installed", an import raises ModuleNotFoundError.
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchvision'] = None\n")
    monkeypatch.setenv("PYTHONPATH", f"{hide}:{ROOT}:{ROOT / 'python'}")  # the inspection subprocess's path
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Fresh caches of vLLM's model inspections: one that another test's engine left (with torchvision present), on
    # disk or in this process (vLLM's private lru_cache of _try_inspect_model_cls), would skip the inspection
    # subprocess and the hidden torchvision with it; this test's failed inspection must not stay cached either.
    from vllm.model_executor.models import registry

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    registry._try_inspect_model_cls.cache_clear()
    seen = errors_logged(monkeypatch)
    try:
        with pytest.raises(ValueError, match="failed to be inspected"):
            build(tmp_path / "thinker", {"macer": {"keep_ratio": 0.25}},
                  hf_overrides={"architectures": [OMNI_THINKER_ARCHITECTURE]})
    finally:
        registry._try_inspect_model_cls.cache_clear()
    assert seen == ["macer: MacerQwen2_5OmniThinkerForConditionalGeneration cannot be loaded: vLLM's Qwen2.5-Omni "
                    "thinker module imports torchvision (through transformers' image processors), and "
                    "torchvision is not installed: install the torchvision release built for torch "
                    f"{torch.__version__}"]


def test_omni_import_problem_says_what_is_missing():
    from macer.vllm.model import omni_import_problem

    missing = ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    assert "and torchvision is not installed: install the torchvision release" in omni_import_problem(missing)
    other = omni_import_problem(ImportError("cannot import name 'X' from 'vllm.foo'"))
    assert "torchvision" not in other and "importing vLLM's Qwen2.5-Omni thinker module failed (ImportError" in other
    qwen3 = omni_import_problem(missing, "MacerQwen3OmniMoeThinkerForConditionalGeneration", "Qwen3-Omni")
    assert qwen3.startswith("macer: MacerQwen3OmniMoeThinkerForConditionalGeneration cannot be loaded: vLLM's "
                            "Qwen3-Omni thinker module imports torchvision")


def test_both_omni_thinkers_load_the_same_way():
    """Every architecture is registered as ``macer.vllm.model:<class>``; the two thinkers are ``model``'s lazy
    ``THINKERS`` and resolve to the classes of their own modules (qwen2_5_omni, qwen3_omni)."""
    import importlib

    from macer.vllm import ARCHITECTURES, model

    assert {target.split(":")[0] for target in ARCHITECTURES.values()} == {"macer.vllm.model"}
    assert set(model.THINKERS) == set(ARCHITECTURES) - {"MacerQwen2ForCausalLM"}
    for name, (module, _) in model.THINKERS.items():
        assert getattr(model, name) is getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------ messages
def test_record_lines_say_what_happened():
    """Guards an unpruned prompt with media logging "budget=none (no audio/video)" and a joint selection (FastV)
    logging "(audio None, video None)" (issue 30 item 8)."""
    unpruned = RequestRecord("1-aaaaaaaa", "1", "macer", 0.25, None, {"audio": 24, "video": 64, "text": 15},
                             {"audio": 24, "video": 64}, {}, (103, 103), "served without pruning: no end-of-turn token")
    assert "budget=none (served unpruned) kept audio 24/24" in unpruned.line()
    fastv = RequestRecord("2-aaaaaaaa", "2", "fastv", 0.25, Budget(22, None, None),
                          {"audio": 24, "video": 64, "text": 15}, {"audio": 5, "video": 17}, {}, (103, 37))
    assert "keep_ratio=0.25 budget=22 (audio and video jointly) kept audio 5/24 video 17/64" in fastv.line()
    text_only = RequestRecord("3-aaaaaaaa", "3", "macer", 0.25, None, {"audio": 0, "video": 0, "text": 9}, {}, {},
                              (9, 9))
    assert "budget=none (no audio/video)" in text_only.line()


def test_a_full_engine_takes_macers_fields_for_the_requests_that_opt_in():
    """An engine whose own policy is ``full`` accepts MACER's fields (for requests with ``macer_policy``), checks each
    value as MACER does, and serves ``FullConfig`` itself; the policy is named as asked."""
    from macer.core.policies import FullConfig

    policy, _ = policy_from_settings({"policy": "full", "audio_layer": 2, "video_layer": 4, **LABELS}, qwen2_config(),
                                     LABELLED_ARCHITECTURE)
    assert policy == FullConfig() and policy.name == "full"
    (problem,) = refused({"policy": "full", "audio_layer": 9, "video_layer": 4, **LABELS})
    assert problem.startswith('additional_config["macer"]: MacerConfig.audio_layer must be in [1, 5]')
    assert problem.endswith("(a setting for the requests that opt in to MACER on this engine)")
    (problem,) = refused({"policy": "full", "coverage_weigth": 0.1, **LABELS})
    assert "has no setting 'coverage_weigth' (did you mean 'coverage_weight'?)" in problem
    ablation, _ = policy_from_settings({"policy": "no_coverage", **LAYERS, **LABELS}, qwen2_config(),
                                       LABELLED_ARCHITECTURE)
    assert ablation.name == "no_coverage" and ablation.coverage_weight == 0.0


def test_the_start_up_line_says_which_layers_free_kv_memory():
    """The trial's start-up line named the policy only: it now says which layers hold only the kept rows, that vLLM's
    "Maximum concurrency" line does not count that, or why nothing is freed."""
    from macer.core.policies import make_policy
    from macer.vllm.checks import kv_summary

    policy = make_policy("macer", keep_ratio=0.25, audio_layer=2, video_layer=4)
    config = SimpleNamespace(additional_config={"macer": {}}, model_config=SimpleNamespace(hf_config=qwen2_config()))
    assert kv_summary(config, policy).startswith("decoder layers 4-5 hold only each request's kept rows (free_kv): "
                                                 "vLLM's KV cache size and 'Maximum concurrency' lines count")
    config.additional_config = {"macer": {"free_kv": False}}
    assert kv_summary(config, policy) == "no KV memory is freed (free_kv is off)"
    config.additional_config = {}
    assert kv_summary(config, make_policy("full")) == "no KV memory is freed (its policy drops nothing)"


def test_a_thinker_checkpoint_whose_tie_flags_disagree_is_refused(tmp_path, monkeypatch):
    """Guards a Qwen-Omni checkpoint whose ``thinker_config`` and ``thinker_config.text_config`` disagree on
    ``tie_word_embeddings`` (issue 35 item 5): vLLM builds the language model from the text config and would tie
    ``lm_head`` to the embeddings, ignoring the checkpoint's (transformers uses it): the engine and transformers
    would disagree from the first token. A tiny Qwen2.5-Omni checkpoint whose config.json leaves the text config's
    flag out (transformers' text default: tied; its thinker default: untied) is refused through ``LLM(...)`` while
    the config is built, naming both flags and the fix; agreeing flags pass."""
    import json as jsonlib

    from macer.testing_omni import write_qwen25_omni
    from macer.vllm.checks import tied_embeddings_problem

    def config(outer, inner):
        return SimpleNamespace(thinker_config=SimpleNamespace(tie_word_embeddings=outer,
                                                              text_config=SimpleNamespace(tie_word_embeddings=inner)))

    assert tied_embeddings_problem(config(False, False), "who") is None
    assert tied_embeddings_problem(config(True, True), "who") is None
    assert tied_embeddings_problem(qwen2_config(), "who") is None  # not a thinker
    problem = tied_embeddings_problem(config(False, True), "who")
    assert problem.startswith("who: the checkpoint's thinker_config.tie_word_embeddings=False and "
                              "thinker_config.text_config.tie_word_embeddings=True disagree: vLLM builds the language "
                              "model from the text config (it ties lm_head to the embeddings and ignores the")
    assert problem.endswith('"thinker_config": {"text_config": {"tie_word_embeddings": false}} to --hf-overrides '
                            '(beside "architectures")')
    path = write_qwen25_omni(tmp_path / "thinker", num_layers=2)
    written = jsonlib.loads((path / "config.json").read_text())
    del written["thinker_config"]["text_config"]["tie_word_embeddings"]
    (path / "config.json").write_text(jsonlib.dumps(written))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    error, seen = logged_refusal(lambda: build(path, {"macer": {"keep_ratio": 0.25, "audio_layer": 1,
                                                                 "video_layer": 1}},
                                               hf_overrides={"architectures": [OMNI_THINKER_ARCHITECTURE]},
                                               skip_tokenizer_init=False), monkeypatch)
    assert "thinker_config.tie_word_embeddings=False and thinker_config.text_config.tie_word_embeddings=True" in str(
        error)
    assert seen
