"""The vLLM plugin's entry point, settings and engine-setting refusals (issue 19, items 1, 3, 4; the records:
``test_records.py``).

The refusals go through vLLM's own config path (``LLM(...)``): the hook the plugin installs refuses while the engine's
config is built, so no engine starts. ``prompt_logprobs`` (a per-request setting) is refused in ``test_server.py``.
"""

from __future__ import annotations

import logging

import macer
import pytest
from macer.vllm import ARCHITECTURES
from macer.vllm.checks import GUARD, TESTED_VLLM_VERSIONS, check_request, version_problem
from macer.vllm.settings import LABELLED_ARCHITECTURE, OMNI_THINKER_ARCHITECTURE, LabelSpec, policy_from_settings

pytestmark = pytest.mark.vllm

LABELS = {"audio_token_ids": [5, 6, 7], "video_token_ids": [8, 9]}
EOT = {"end_of_turn_token_id": 2}  # MACER's question rows end before it: the labelled path has no model default


def qwen2_config(num_layers: int = 6, vocab_size: int = 512):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=2, num_key_value_heads=1)


def test_entry_point_found_by_vllms_plugin_loader():
    """vLLM's own loader finds `macer` in `vllm.general_plugins` (the installed entry point, not an import here), and
    calling it registers both architectures and their config hook; a second call changes nothing."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert "macer" in plugins, f"vLLM found no `macer` entry point in {DEFAULT_PLUGINS_GROUP}: {sorted(plugins)}"
    assert plugins["macer"] is macer.vllm.register
    for _ in range(2):
        plugins["macer"]()
        supported = ModelRegistry.get_supported_archs()
        for architecture in ARCHITECTURES:
            assert list(supported).count(architecture) == 1
            assert MODELS_CONFIG_MAP[architecture].__name__ == "MacerEngineHook"


@pytest.mark.parametrize("name", macer.POLICY_NAMES)
def test_settings_give_make_policys_objects(name):
    """Every policy of the README's table parses into the object `macer.make_policy` builds from the same fields."""
    fields = {"full": {}, "fastv": {"keep_ratio": 0.25, "layer": 2}, "random": {"keep_ratio": 0.5, "seed": 3}}.get(
        name, {"keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3})
    if name == "single_readout":
        fields = {"keep_ratio": 0.25, "video_layer": 3}
    if name not in ("full", "random"):
        fields = {**fields, **EOT}
    config = qwen2_config()
    policy, labels = policy_from_settings({"policy": name, **fields, **LABELS}, config, LABELLED_ARCHITECTURE)
    model = None if name in ("full", "fastv", "random") else config
    assert policy == macer.make_policy(name, model, **fields)
    assert labels == LabelSpec((5, 6, 7), (8, 9))


def test_paper_defaults_where_the_model_is_recognised():
    """On a Qwen2.5-Omni-7B config (as vLLM's hf_config: the full Omni config, or the thinker's), `macer` gets the
    paper's (l_a, l_v, alpha, lambda_c) with only keep_ratio given."""
    from macer.testing import thinker_config
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniConfig

    thinker = thinker_config(text_shape="7B")
    for hf_config in (thinker, Qwen2_5OmniConfig(thinker_config=thinker.to_dict())):
        policy, labels = policy_from_settings({"keep_ratio": 0.25}, hf_config, OMNI_THINKER_ARCHITECTURE)
        assert labels is None
        assert policy == macer.MacerConfig.for_model(thinker, keep_ratio=0.25)
        assert (policy.audio_layer, policy.video_layer) == (3, 5)


@pytest.mark.parametrize("settings", [
    {"keep_ratio": 1.5, "audio_layer": 2, "video_layer": 3},
    {"keep_ratio": 0.25, "audio_layer": 2, "video_layer": 9},
    {"keep_ratio": 0.25},
    {"policy": "fastv", "keep_ratio": 0.25},
    {"policy": "fastv", "keep_ratio": 0.25, "layer": 7},
    {"policy": "macer_raw", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3, "scoring": "anms"},
    {"policy": "random", "keep_ratio": 0.0},
])
def test_bad_values_give_make_policys_errors(settings):
    """A bad value gives the error `make_policy` (and the policy's depth check) gives for it, as a ValueError that
    names `additional_config["macer"]` (make_policy's TypeError for a missing field included)."""
    config = qwen2_config()
    params = dict(settings)
    name = params.pop("policy", "macer")
    with pytest.raises((ValueError, TypeError)) as direct:
        policy = macer.make_policy(name, None if name in ("fastv", "random") else config, **params)
        policy.check_depth(6)
    extra = EOT if name in ("macer", "macer_raw", "fastv") else {}
    with pytest.raises(ValueError) as parsed:
        policy_from_settings({**settings, **LABELS, **extra}, config, LABELLED_ARCHITECTURE)
    assert str(parsed.value) == f'additional_config["macer"]: {direct.value}'


@pytest.mark.parametrize(("settings", "architecture", "message"), [
    ({"policy": "fastr"}, LABELLED_ARCHITECTURE, r"unknown policy 'fastr'; known: \['full', 'macer'"),
    ([0.25], LABELLED_ARCHITECTURE, r'additional_config\["macer"\] must be a JSON object'),
    ({"policy": "full"}, LABELLED_ARCHITECTURE, r"must name at least one of \['audio_token_ids', 'video_token_ids'\]"),
    ({"policy": "full", "audio_token_ids": 5}, LABELLED_ARCHITECTURE, r"\"audio_token_ids\"\] must be a list"),
    ({"policy": "full", "audio_token_ids": [5, 512]}, LABELLED_ARCHITECTURE, r"in \[0, 511\] \(vocab_size=512\)"),
    ({"policy": "full", "audio_token_ids": [5, True]}, LABELLED_ARCHITECTURE, r"integer token ids"),
    ({"policy": "full", "audio_token_ids": [5, 6], "video_token_ids": [6]}, LABELLED_ARCHITECTURE, r"disjoint"),
    ({"policy": "full", **LABELS}, OMNI_THINKER_ARCHITECTURE, r"are settings of MacerQwen2ForCausalLM"),
    ({"policy": "random", "keep_ratio": 0.5, "end_of_turn_token_id": 2, **LABELS}, LABELLED_ARCHITECTURE,
     r"policy 'random' has no setting 'end_of_turn_token_id'; allowed: \['policy', 'keep_ratio', 'seed', "
     r"'audio_token_ids', 'video_token_ids', 'free_kv'\]"),
    ({"keep_ratio": 0.5, "audio_layer": 2, "video_layer": 3, "end_of_turn_token_id": 600, **LABELS},
     LABELLED_ARCHITECTURE, r"end_of_turn_token_id\"\]=600 is outside this model's vocabulary \(vocab_size=512\)"),
])
def test_bad_settings_are_refused_by_name(settings, architecture, message):
    with pytest.raises(ValueError, match=message):
        policy_from_settings(settings, qwen2_config(), architecture)


def test_label_spec_labels_rows_by_token_id():
    import torch
    from macer.vllm.testing import MACER_SETTINGS, clip_prompt, label_ids

    ids_only = {k: MACER_SETTINGS[k] for k in ("audio_token_ids", "video_token_ids")}
    _, labels = policy_from_settings({"policy": "full", **ids_only}, qwen2_config(), LABELLED_ARCHITECTURE)
    ids = torch.tensor(clip_prompt(n_audio=12, n_video=20))
    assert torch.equal(labels.labels(ids), label_ids(ids))
    assert int((labels.labels(ids) == macer.AUDIO).sum()) == 12


def _llm_refusal(checkpoint, **engine):
    from vllm import LLM

    settings = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3, **LABELS, **EOT}
    arguments = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 256,
                 "enforce_eager": True, "enable_chunked_prefill": False, "enable_prefix_caching": False,
                 "max_num_seqs": 1, "kv_cache_memory_bytes": 32 << 20, "additional_config": {"macer": settings},
                 **engine}
    return LLM(model=str(checkpoint), **arguments)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from macer.vllm.testing import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), num_layers=4)


@pytest.mark.parametrize(("engine", "message"), [
    ({"enable_chunked_prefill": True}, r"--no-enable-chunked-prefill"),
    ({"enable_prefix_caching": True}, r"--no-enable-prefix-caching"),
    ({"enforce_eager": False, "compilation_config": {"use_inductor_graph_partition": True,
                                                     "cudagraph_mode": "FULL_AND_PIECEWISE"}},
     r"Inductor graph partition with CUDA graphs .* drop use_inductor_graph_partition from --compilation-config"),
    ({"enforce_eager": False, "compilation_config": {"splitting_ops": ["vllm::unified_attention_with_output"],
                                                     "cudagraph_mode": "FULL_AND_PIECEWISE"}},
     r"piecewise CUDA graphs \(cudagraph mode FULL_AND_PIECEWISE\) with --compilation-config splitting_ops .*"
     r"add vllm::unified_kv_cache_update to splitting_ops"),
    ({"additional_config": {"macer": {"keep_ratio": 2.0, "audio_layer": 2, "video_layer": 3, **LABELS, **EOT}}},
     r"additional_config\[\"macer\"\]: MacerConfig.keep_ratio must be a finite real number in \(0.0, 1.0\], "
     r"got 2.0"),
])
def test_engine_settings_refused_when_vllm_builds_the_config(checkpoint, engine, message, monkeypatch):
    """`LLM(...)` with a setting the compacted forward cannot run under fails while vLLM builds its config, with the
    flag and the fix named (the hook the plugin installed for the architecture: nothing is started)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match=message):
        _llm_refusal(checkpoint, **engine)


def test_parallel_speculative_and_runner_refusals_name_the_flag():
    """Tensor/pipeline parallel > 1, speculative decoding, Model Runner V2, LoRA and KV connectors are refused by name
    (checked on a config object: this machine cannot start two ranks, a draft model would be a second engine start,
    and MRV2 needs Triton on a GPU)."""
    from types import SimpleNamespace

    from macer.vllm.checks import check_engine

    def config(tp=1, pp=1, speculative=None, runner_v2=False, lora=None, kv_transfer=None):
        return SimpleNamespace(
            model_config=SimpleNamespace(architecture=LABELLED_ARCHITECTURE, enforce_eager=True),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_seqs=1),
            cache_config=SimpleNamespace(enable_prefix_caching=False),
            compilation_config=SimpleNamespace(mode=None, cudagraph_mode=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            speculative_config=speculative, use_v2_model_runner=runner_v2, lora_config=lora,
            kv_transfer_config=kv_transfer)

    check_engine(config())
    check_engine(config(tp=2))  # tensor and pipeline parallel run (issue 38: tests/serving/test_parallel_*.py)
    check_engine(config(pp=4))
    omni = config(pp=4)
    omni.model_config.architecture = "MacerQwen2_5OmniThinkerForConditionalGeneration"
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size=4 is not supported for this architecture .*only "
                                         r"MacerQwen2ForCausalLM is built for it"):
        check_engine(omni)
    with pytest.raises(ValueError, match=r"speculative decoding is not supported .* drop --speculative-config"):
        check_engine(config(speculative=SimpleNamespace(method="ngram")))
    with pytest.raises(ValueError, match=r"runs on vLLM's V1 model runner .* asks for Model Runner V2 "
                                         r"\(VLLM_USE_V2_MODEL_RUNNER=1, .*: unset VLLM_USE_V2_MODEL_RUNNER"):
        check_engine(config(runner_v2=True))
    with pytest.raises(ValueError, match=r"LoRA is not supported .* drop --enable-lora"):
        check_engine(config(lora=SimpleNamespace(max_loras=1)))
    with pytest.raises(ValueError, match=r"KV transfer connectors are not supported .* drop --kv-transfer-config"):
        check_engine(config(kv_transfer=SimpleNamespace(kv_connector="OffloadingConnector")))


def test_version_gate_refuses_untested_releases_unless_overridden(monkeypatch):
    """Guards an untested vLLM release being served with a mere warning (its metadata layout may differ): refused,
    naming the tested releases and the override; with MACER_VLLM_ALLOW_UNTESTED=1 it runs, with a WARNING log line."""
    import vllm

    assert vllm.__version__ in TESTED_VLLM_VERSIONS
    assert version_problem(vllm.__version__) is None
    monkeypatch.delenv("MACER_VLLM_ALLOW_UNTESTED", raising=False)
    refusal = version_problem("0.31.1")
    assert refusal is not None and "tested with vLLM ['0.32.0'] only; this is vLLM 0.31.1" in refusal
    assert "set MACER_VLLM_ALLOW_UNTESTED=1 to run it anyway" in refusal
    seen = _logged(lambda: version_problem("0.31.1"), monkeypatch, MACER_VLLM_ALLOW_UNTESTED="1")
    assert seen[0] is None
    assert len(seen[1]) == 1 and "this is vLLM 0.31.1" in seen[1][0] and "running anyway" in seen[1][0]


def _logged(call, monkeypatch, **env):
    """``(call(), [WARNING+ messages on vllm.macer])`` with ``env`` set (vLLM's logger does not propagate)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda entry: seen.append(entry.getMessage())
    target = logging.getLogger("vllm.macer")
    target.addHandler(handler)
    try:
        return call(), seen
    finally:
        target.removeHandler(handler)


def test_prompt_logprobs_refused_per_request():
    from macer.vllm.guard import MacerRequestGuard
    from vllm import SamplingParams

    assert GUARD == f"{MacerRequestGuard.__module__}:{MacerRequestGuard.__name__}"
    MacerRequestGuard.validate_params(SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt logprobs are not supported .* asked for by prompt_logprobs, or in "
                                         r"the completions API by echo=true together with logprobs"):
        check_request(SamplingParams(max_tokens=4, prompt_logprobs=1))
