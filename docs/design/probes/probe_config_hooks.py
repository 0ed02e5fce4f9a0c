"""The plugin's config hook can install the MACER worker and scheduler on vLLM 0.32.0, and when it runs.

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_config_hooks.py

A MODELS_CONFIG_MAP entry (what macer.vllm.register installs for the MACER architectures; here for vLLM's own
Qwen2ForCausalLM) sets ``parallel_config.worker_cls`` and ``scheduler_config.scheduler_cls`` while the config is
built. Checks: the hook runs before async scheduling is resolved (so it cannot pick the scheduler's base itself),
the platform keeps a worker_cls that is not "auto", a callable scheduler_cls is called with the final config.
"""

from __future__ import annotations

import _common as c
from _common import check

path = c.checkpoint(num_layers=2)
import _kv  # noqa: E402
from vllm.model_executor.models.config import MODELS_CONFIG_MAP  # noqa: E402

SEEN = {}


class Hook:
    @staticmethod
    def verify_and_update_config(vllm_config):
        SEEN["async_scheduling"] = vllm_config.scheduler_config.async_scheduling
        SEEN["worker_cls"] = vllm_config.parallel_config.worker_cls
        vllm_config.parallel_config.worker_cls = "_common.RecordingWorker"
        vllm_config.scheduler_config.scheduler_cls = "_kv.make_scheduler"

    @staticmethod
    def verify_and_update_model_config(model_config):
        return None


MODELS_CONFIG_MAP["Qwen2ForCausalLM"] = Hook
llm = c.engine(path, worker_cls="auto")
config = llm.llm_engine.vllm_config
check(SEEN["async_scheduling"] is None, "at hook time scheduler_config.async_scheduling is still None (resolved "
      "later in VllmConfig.__post_init__, then forced False by platforms/cpu.py)")
check(SEEN["worker_cls"] == "auto" and config.parallel_config.worker_cls == "_common.RecordingWorker",
      "the hook sees worker_cls='auto' and the platform keeps the worker the hook set (cpu.py replaces 'auto' only)")
model = llm.apply_model(lambda m: m)[0]
check(hasattr(model, "_probe_runner"), "the engine ran the hook's worker (it bound the runner to the model)")
check(_kv.FACTORY_CALLS == [False], f"the callable scheduler_cls was called once with the final config "
      f"(async_scheduling={_kv.FACTORY_CALLS})")
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
check(type(scheduler).__name__ == "MacerScheduler" and isinstance(scheduler, _kv.MacerSchedulerMixin),
      f"the engine core schedules with {type(scheduler).__mro__[:3]}")
import vllm  # noqa: E402

out = llm.generate([{"prompt_token_ids": list(range(16, 40))}],
                   vllm.SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
check(len(out[0].outputs[0].token_ids) == 4, "and it serves")
