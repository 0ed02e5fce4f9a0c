"""Out-of-tree KV cache pieces of the issue-29 prototype (not a probe): a compacted-layer spec with its own manager,
registered in vLLM 0.32.0's KVCacheSpecRegistry; a scheduler that tells the managers each request's drop D_r when
the request arrives (computed on the host from the prompt, with the same toy plan the model uses); a worker that
makes layers >= S declare the compacted spec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from _common import RecordingWorker
from _prototype import toy_plan
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

S = [2]  # first compacted layer (set by the probe before the engine starts; in-process)


@dataclass(frozen=True, kw_only=True)
class MacerCompactedSpec(AttentionSpec):
    """A layer after a stage: full attention over the request's KEPT tokens. NOT a FullAttentionSpec subclass:
    UniformTypeKVCacheSpecs.is_uniform_type would put it in the full layers' group (isinstance on the first
    layer's registered base)."""

    stage: int = 0  # distinct specs per stage (their layers must not share a group)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    @property
    def prefix_cacheable(self) -> bool:
        return False


class MacerCompactedManager(FullAttentionManager):
    """Blocks for num_tokens - D_r tokens; D_r per request id, set by MacerScheduler before allocation."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drops: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0):
        d = self.drops.get(request_id, 0)
        return super().get_num_blocks_to_allocate(
            request_id, max(num_tokens - d, 0), new_computed_blocks, max(total_computed_tokens - d, 0),
            max(num_local_computed_tokens - d, 0), max(num_tokens_main_model - d, 0), apply_admission_cap,
            prefill_end)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        d = self.drops.get(request_id, 0)
        return super().allocate_new_blocks(request_id, max(num_tokens - d, 0), max(num_tokens_main_model - d, 0))


def register() -> None:
    # Built-ins first: _ensure_registered skips them once the registry is non-empty.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(MacerCompactedSpec, MacerCompactedManager, uniform_type_base_spec=MacerCompactedSpec)


register()


class MacerSchedulerMixin:
    """``--scheduler-cls``: D_r of each request, from its prompt alone, handed to the compacted managers when the
    request arrives (before any allocation); forgotten when the request is freed for good (not on preemption). A
    mixin, so that one body serves over Scheduler and AsyncScheduler (``make_scheduler``)."""

    def compacted(self) -> list[MacerCompactedManager]:
        return [m for m in self.kv_cache_manager.coordinator.single_type_managers
                if isinstance(m, MacerCompactedManager)]

    def add_request(self, request: Any) -> None:
        prompt = request.prompt_token_ids
        drop = len(prompt) - len(toy_plan(prompt)) if DROPS[0] else 0
        for manager in self.compacted():
            manager.drops[request.request_id] = drop
        super().add_request(request)

    def _free_blocks(self, request: Any) -> None:
        super()._free_blocks(request)
        for manager in self.compacted():
            manager.drops.pop(request.request_id, None)


class MacerScheduler(MacerSchedulerMixin, Scheduler):
    """The synchronous-scheduler variant, named directly (probe_kv_groups.py)."""


DROPS = [True]


class KVWorker(RecordingWorker):
    """Layers >= S declare MacerCompactedSpec (the model's Attention subclass would, in the plugin)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        model = self.model_runner.get_model()
        for index, layer in enumerate(model.model.layers):
            if index >= S[0]:
                attn = layer.self_attn.attn
                full = attn.get_kv_cache_spec

                def compacted(vllm_config, _full=full):
                    spec = _full(vllm_config)
                    fields = {f: getattr(spec, f) for f in ("block_size", "num_kv_heads", "head_size", "head_size_v",
                                                             "dtype", "kv_quant_mode")}
                    return MacerCompactedSpec(**fields)

                attn.get_kv_cache_spec = compacted


__all__ = ["KVWorker", "MacerCompactedManager", "MacerCompactedSpec", "MacerScheduler", "replace"]


FACTORY_CALLS: list[bool] = []


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """``--scheduler-cls`` may name a callable: EngineCore calls ``Scheduler(vllm_config=..., ...)`` after the config
    is final, so the base (AsyncScheduler or Scheduler) is picked from the final ``async_scheduling``."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    vllm_config = kwargs["vllm_config"]
    asynchronous = bool(vllm_config.scheduler_config.async_scheduling)
    FACTORY_CALLS.append(asynchronous)
    base = AsyncScheduler if asynchronous else Scheduler
    cls = MacerScheduler if base is Scheduler else type("MacerAsyncScheduler", (MacerSchedulerMixin, base), {})
    return cls(*args, **kwargs)
