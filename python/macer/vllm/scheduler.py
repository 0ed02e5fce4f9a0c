"""The MACER scheduler: vLLM's own scheduler (``Scheduler``, or ``AsyncScheduler`` where the final config schedules
asynchronously) that attaches each finished request's MACER record to its output, as
``kv_transfer_params["macer"]`` (``macer.vllm.records`` says where a user reads it).

``make_scheduler`` is what the config hook names as ``scheduler_cls``: vLLM's engine core calls it with the final
config (asynchronous scheduling is resolved after the hook runs), and it builds the class over the right base. The
records are made by the model in the worker, which may run in a process of its own (vLLM's CPU build always uses its
multiprocess executor): they arrive with the step's output (``ModelRunnerOutput.macer_records``, an attribute the
MACER worker adds; the output crosses processes pickled). A request without a record (one that never reached its
prefill) finishes without one.

It overrides ``update_from_output`` and one private method, ``Scheduler._connector_finished`` (vLLM 0.32): it returns
the KV connector's parameters of a finishing request, and no MACER engine has a KV connector.

Where the engine frees the dropped rows' KV memory (``additional_config["macer"]["free_kv"]``, ``macer.vllm.kv``) it
also tells the compacted KV cache groups' managers each request's ``D_r`` when the request arrives
(``add_request``), before any of its blocks is allocated, forgets it when the request's blocks are freed for good
(``_free_blocks``, private; not on preemption: the recompute needs the same count).

A multimodal prompt that vLLM's scheduler would cut before an item because the encoder cache or the step's encoder
budget is full (``_try_schedule_encoder_inputs``, private) is **deferred** instead when the worker would prune it (a
new prompt, or a pruned request's recompute after preemption) and its items fit the cache and the budget at once: it
is scheduled 0 tokens this step and comes whole in a later one, once earlier steps have released their entries
(under asynchronous scheduling, vLLM's GPU default, a step is scheduled before the previous step's entries are freed,
so without this a steady stream of clips would lose MACER for many requests). A prompt whose items can never fit at
once is cut as vLLM cuts it, and the worker serves it unpruned: its ``D_r`` becomes 0 before its blocks are
allocated.

A turn of a streaming-input session (vLLM's ``resumable`` requests) gets parameters marked for serving unpruned when
it arrives (``add_request``; ``macer.vllm.request_settings.session_params``): its prompt grows under one request id,
and MACER prunes a whole prompt once.
"""

from __future__ import annotations

from typing import Any

from macer.vllm import records
from macer.vllm.request_settings import session_params

__all__ = ["MacerSchedulerMixin", "make_scheduler"]


class MacerSchedulerMixin:
    """Adds the request's record to what a finishing request returns; sizes the compacted KV cache groups per request
    (module docstring)."""

    # Typing: a mixin over vLLM's Scheduler or AsyncScheduler (``make_scheduler`` picks the base at run time), so mypy
    # sees neither its ``super()`` nor the scheduler's attributes; each ``# type: ignore[misc]`` / ``[attr-defined]``
    # below is one of those.

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from macer.vllm.kv import SchedulerKV

        self.macer_kv = SchedulerKV.attach(self)  # None: no compacted KV cache group in this engine
        self._macer_plans: SchedulerKV | None = self.macer_kv  # which requests prune (``_macer_planner``)

    def add_request(self, request: Any) -> None:
        if getattr(request, "resumable", False):
            # A turn of a streaming-input session (the first or a later one: vLLM copies a later turn's parameters
            # into the session): served unpruned, said in its record (macer.vllm.request_settings.session_params).
            request.sampling_params = session_params(request.sampling_params)
        if self.macer_kv is not None and request.request_id not in self.requests:  # type: ignore[attr-defined]
            self.macer_kv.arrive(request)
        super().add_request(request)  # type: ignore[misc]

    def _free_blocks(self, request: Any) -> None:
        super()._free_blocks(request)  # type: ignore[misc]
        if self._macer_plans is not None:
            self._macer_plans.forget(request.request_id)

    def _macer_planner(self) -> Any:
        """The scheduler's plans of its requests: the KV side's where the engine frees KV memory, else one made on
        first use (it plans only requests the scheduler would cut)."""
        if self._macer_plans is None:
            from macer.vllm.kv import SchedulerKV

            self._macer_plans = SchedulerKV(self.vllm_config, [])  # type: ignore[attr-defined]
        return self._macer_plans

    def _try_schedule_encoder_inputs(self, request: Any, num_computed_tokens: int, num_new_tokens: int,
                                     encoder_compute_budget: int, *args: Any, **kwargs: Any) -> Any:
        out = super()._try_schedule_encoder_inputs(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget, *args, **kwargs)
        scheduled = out[1]
        if 0 < scheduled and num_computed_tokens + scheduled < request.num_tokens:  # cut before a multimodal item
            if num_computed_tokens == 0 and self._macer_fits(request) and self._macer_planner().prunes(request):
                # Deferred a step, not served unpruned: a new prompt, or a pruned request's recompute after
                # preemption, whose items the encoder cache can hold once earlier steps release theirs (under
                # asynchronous scheduling the previous step still holds its entries when this one is scheduled).
                # vLLM's waiting loop stops at a request scheduled 0 tokens, as for its own encoder-cache waits.
                return [], 0, encoder_compute_budget, [], []
            self._macer_planner().cut(request.request_id)
        return out

    def _macer_fits(self, request: Any) -> bool:
        """Whether every multimodal item of ``request`` fits the encoder cache and one step's encoder budget at once
        (else deferring it would never serve it whole, and it is cut and served unpruned)."""
        capacity = getattr(self.encoder_cache_manager, "cache_size", None)  # type: ignore[attr-defined]
        budget = getattr(self, "max_num_encoder_input_tokens", None)
        if capacity is None or budget is None:
            return False
        items = {feature.identifier: feature.mm_position.get_num_embeds() for feature in request.mm_features or ()}
        return sum(items.values()) <= min(capacity, budget)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        # The records the worker made in this step, sent with its output (macer.vllm.worker).
        records.receive(getattr(model_runner_output, "macer_records", None))
        return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]

    def _connector_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super()._connector_finished(request)  # type: ignore[misc]
        record = records.take(request.request_id)
        if record is not None:
            params = {**(params or {}), "macer": record}
        return delay, params


_CLASSES: dict[bool, type] = {}


def make_scheduler(*args: Any, **kwargs: Any) -> Any:
    """The scheduler of a MACER engine (``scheduler_config.scheduler_cls``): the mixin over ``AsyncScheduler`` or
    ``Scheduler``, chosen from the final ``async_scheduling``."""
    vllm_config: Any = kwargs.get("vllm_config", args[0] if args else None)
    asynchronous = bool(vllm_config.scheduler_config.async_scheduling)
    if asynchronous not in _CLASSES:
        base: type
        if asynchronous:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            base = AsyncScheduler
        else:
            from vllm.v1.core.sched.scheduler import Scheduler

            base = Scheduler
        name = "MacerAsyncScheduler" if asynchronous else "MacerScheduler"
        _CLASSES[asynchronous] = type(name, (MacerSchedulerMixin, base), {"__module__": __name__})
    return _CLASSES[asynchronous](*args, **kwargs)
