"""The dropped rows' KV memory given back to vLLM (docs/serving.md "KV memory").

vLLM's KV cache manager gives every KV cache group of a request the same number of token slots. With
``additional_config["macer"]["free_kv"]`` on (the default) the decoder layers after the engine policy's last stage
(``macer.core.kv_memory.compacted_start``: ``layers[l_v:]`` for MACER) declare a KV cache spec of their own,
``MacerCompactedSpec``, so vLLM puts them in KV cache groups of their own, managed by ``MacerCompactedManager``: it
gives a request ``cdiv(num_tokens - D_r, block_size)`` blocks, where ``D_r`` is the number of prompt rows the
request's stages dropped before the first compacted layer. ``D_r`` comes from the prompt alone, when the request
reaches the scheduler (``SchedulerKV.arrive``, through ``macer.vllm.state.request_layout``, the function the worker
plans the request with), before any block is allocated: admission, the full-sequence gate and preemption all count the
smaller number. The worker already writes those layers' K/V at compacted indices (kept prompt row ``k`` at ``k``,
position ``p >= N`` at ``p - D``; ``macer.core.steps``), so the smaller allocation holds exactly what they write. The
layers before the first compacted one keep the whole prompt's blocks (an earlier stage's compacted layers use the
first part of them).

A request that drops nothing (keep ratio 1, text only, a prompt the plan refuses, the ``full`` policy) has
``D_r = 0`` and gets vLLM's own count in every group. ``D_r`` survives preemption (the recompute writes the same
compacted indices) and is forgotten when the request's blocks are freed for good. A multimodal prompt that the
scheduler cuts before an item (encoder budget) is served unpruned by the worker, so its ``D_r`` becomes 0 at the cut,
before its blocks are allocated (``SchedulerKV.cut``).

vLLM 0.32.0 interfaces used (``TESTED_VLLM_VERSIONS``):

* public, for out-of-tree KV cache specs: ``KVCacheSpecRegistry.register``; ``AttentionSpec`` (subclassed; not
  ``FullAttentionSpec``, whose subclasses vLLM groups with the full layers); ``FullAttentionManager`` (subclassed);
* private: ``KVCacheSpecRegistry._ensure_registered`` (it registers vLLM's built-in specs only while the registry is
  empty, so ours must come after them); the manager methods ``get_num_blocks_to_allocate`` and
  ``allocate_new_blocks`` (their token counts); ``Attention.get_kv_cache_spec`` (replaced on the compacted layers'
  modules); the scheduler's ``add_request``, ``_free_blocks``, ``_try_schedule_encoder_inputs`` and
  ``kv_cache_manager.coordinator.single_type_managers`` (``macer.vllm.scheduler``); the worker's
  ``kv_cache_config.kv_cache_groups``.

The upstream hook that would make all of this public, "a per-request token offset per KV cache group", is written up
in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from macer.core import kv_memory
from macer.core.policy import Policy

__all__ = ["MacerCompactedManager", "MacerCompactedSpec", "SchedulerKV", "check_groups", "declare_compacted",
           "follow_default", "register_kv"]



@dataclasses.dataclass(frozen=True, kw_only=True)
class MacerCompactedSpec(AttentionSpec):
    """A decoder layer after the engine policy's last stage: full attention over the rows the request kept, at
    compacted indices. Derives from ``AttentionSpec``, not ``FullAttentionSpec``: vLLM groups every spec that is an
    instance of the first layer's registered base with it (``UniformTypeKVCacheSpecs``), which would put these layers
    in the full layers' group and give them the whole prompt's blocks."""

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        # A request that drops nothing needs the whole context, as in a full attention layer.
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    @property
    def prefix_cacheable(self) -> bool:
        # A block holds the kept rows of one request's plan, not positions a prefix of another prompt shares.
        return False


class MacerCompactedManager(FullAttentionManager):
    """The blocks of a compacted KV cache group: a request's token counts less its ``D_r`` (``drops``, by request
    id, shared by every compacted group and filled by ``SchedulerKV``; absent: 0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drops: dict[str, int] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Any],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        drop = self.drops.get(request_id, 0)
        return super().get_num_blocks_to_allocate(
            request_id, max(num_tokens - drop, 0), new_computed_blocks, max(total_computed_tokens - drop, 0),
            max(num_local_computed_tokens - drop, 0), max(num_tokens_main_model - drop, 0),
            apply_admission_cap=apply_admission_cap, prefill_end=prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        drop = self.drops.get(request_id, 0)
        return super().allocate_new_blocks(request_id, max(num_tokens - drop, 0),
                                           max(num_tokens_main_model - drop, 0))


def register_kv() -> None:
    """Register ``MacerCompactedSpec`` with its manager in vLLM's KV cache spec registry (every process: the plugin's
    entry point calls this; idempotent)."""
    KVCacheSpecRegistry._ensure_registered()  # the built-ins first: they are skipped once the registry is non-empty
    KVCacheSpecRegistry.register(MacerCompactedSpec, MacerCompactedManager, uniform_type_base_spec=MacerCompactedSpec)


# ----------------------------------------------------------------------------------------- which layers
def declare_compacted(attns: Sequence[Any]) -> None:
    """Make the attention modules ``attns`` declare ``MacerCompactedSpec`` (their KV cache format otherwise as vLLM
    declares it): vLLM asks each module for its spec when it sizes the KV cache."""
    for attn in attns:
        declare = attn.get_kv_cache_spec

        def compacted(vllm_config: Any, _declare: Any = declare) -> Any:
            spec = _declare(vllm_config)
            if not isinstance(spec, AttentionSpec):
                raise RuntimeError(f"macer: vLLM declared a {type(spec).__name__} for a compacted layer, not an "
                                   "attention spec (free_kv cannot compact it)")
            return MacerCompactedSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec)})

        attn.get_kv_cache_spec = compacted


def check_groups(kv_cache_config: Any, names: Sequence[str], start: int | None) -> None:
    """Raise unless exactly the layers ``names[start:]`` sit in compacted KV cache groups (the worker, when it binds
    to the runner: a layout vLLM grouped otherwise would give the scheduler's block counts to the wrong layers)."""
    compacted = sorted(name for group in kv_cache_config.kv_cache_groups
                       if isinstance(group.kv_cache_spec, MacerCompactedSpec) for name in group.layer_names)
    want = sorted(names[start:]) if start is not None else []
    if compacted != want:
        raise RuntimeError(f"macer: the compacted KV cache groups hold layers {compacted[:4]}... ({len(compacted)}), "
                           f"not the {len(want)} layers from the engine policy's last stage on (please report this)")


# ----------------------------------------------------------------------------------------- the scheduler's side
_LIVE: weakref.WeakSet[SchedulerKV] = weakref.WeakSet()


class SchedulerKV:
    """What a MACER scheduler adds when its engine has compacted KV cache groups: each request's ``D_r``, planned
    from its prompt when it arrives, in the ``drops`` shared by the compacted managers.

    Args:
        vllm_config: the engine's final config.
        managers: the scheduler's ``MacerCompactedManager`` instances (one per compacted KV cache group).
    """

    def __init__(self, vllm_config: Any, managers: Sequence[MacerCompactedManager]):
        from macer.core.config import decoder_depth
        from macer.vllm.prompt import engine_prompt_labels
        from macer.vllm.request_settings import RequestPolicies
        from macer.vllm.settings import SETTINGS_KEY, policy_from_config

        model_config = vllm_config.model_config
        policy, labels = policy_from_config(vllm_config)
        settings = (vllm_config.additional_config or {}).get(SETTINGS_KEY)
        self.vllm_config = vllm_config
        self.policies = RequestPolicies(settings, model_config.hf_config, model_config.architecture, policy)
        self.prompt = engine_prompt_labels(vllm_config, labels)
        self.num_layers = decoder_depth(model_config.hf_config)
        self.start = kv_memory.compacted_start(policy, self.num_layers)
        self.drops: dict[str, int] = {}
        self.pruned: dict[str, bool] = {}  # whether the worker will prune the request (``prunes``), by request id
        for manager in managers:
            manager.drops = self.drops
        _LIVE.add(self)

    @classmethod
    def attach(cls, scheduler: Any) -> SchedulerKV | None:
        """The KV side of ``scheduler`` (a vLLM ``Scheduler``), or None when its engine has no compacted group."""
        managers = [manager for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
                    if isinstance(manager, MacerCompactedManager)]
        return cls(scheduler.vllm_config, managers) if managers else None

    def layout(self, prompt_ids: Sequence[int], extra_args: Any) -> Any:
        """The ``RequestLayout`` the worker plans a request with these prompt ids and per-request settings by."""
        from macer.vllm.state import request_layout

        return request_layout(list(prompt_ids), None, extra_args, self.policies, self.prompt, self.num_layers)[2]

    def drop(self, prompt_ids: Sequence[int], extra_args: Any) -> int:
        """``D_r`` of a request with these prompt ids and per-request settings."""
        layout = self.layout(prompt_ids, extra_args)
        return kv_memory.compacted_drop(layout.prompt_len, layout.layer_tokens, self.start)  # 0 if unpruned

    def arrive(self, request: Any) -> None:
        """A new request (vLLM's ``Request``), before any of its blocks is allocated."""
        if getattr(request, "resumable", False) or request.prompt_token_ids is None:
            return  # a streaming-input session's prompt grows: served unpruned (D_r = 0)
        params = getattr(request, "sampling_params", None)
        layout = self.layout(request.prompt_token_ids, getattr(params, "extra_args", None))
        self.pruned[request.request_id] = layout.pruned
        drop = kv_memory.compacted_drop(layout.prompt_len, layout.layer_tokens, self.start)  # 0 if unpruned
        if drop:
            self.drops[request.request_id] = drop

    def prunes(self, request: Any) -> bool:
        """Whether the worker prunes ``request`` (vLLM's ``Request``) when its whole prompt is in one step: planned
        when it arrived, or now (an engine without compacted groups plans only the requests its scheduler would
        otherwise cut: ``macer.vllm.scheduler``)."""
        if request.request_id not in self.pruned:
            if getattr(request, "resumable", False) or request.prompt_token_ids is None:
                return False
            params = getattr(request, "sampling_params", None)
            self.pruned[request.request_id] = self.layout(request.prompt_token_ids,
                                                          getattr(params, "extra_args", None)).pruned
        return self.pruned[request.request_id]

    def cut(self, request_id: str) -> None:
        """The scheduler split the request's prompt (an encoder budget cut): the worker serves it unpruned."""
        self.drops.pop(request_id, None)
        self.pruned[request_id] = False

    def forget(self, request_id: str) -> None:
        """The request's blocks were freed for good (finished or aborted; not a preemption)."""
        self.drops.pop(request_id, None)
        self.pruned.pop(request_id, None)


def follow_default(vllm_config: Any, policy: Policy) -> int:
    """Serve the requests that set no policy of their own with ``policy`` in the schedulers of this process whose
    engine config is ``vllm_config`` (``StagedDecoder.use_policy``, test-only: the worker and the scheduler must plan
    requests alike); returns how many there were."""
    found = [kv for kv in _LIVE if kv.vllm_config is vllm_config]
    for kv in found:
        kv.policies.use_default(policy)
    return len(found)
