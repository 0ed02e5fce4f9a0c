"""Per-request state of the MACER architectures, keyed by vLLM's request id (``RequestStates``).

A request is planned once, at the first step that serves it (``plan_request``), from what the runner holds on the
host: its prompt ids, its M-RoPE temporal row (the Omni thinker) and its per-request settings. Its ``RequestLayout``
(prompt rows entering every layer) then sizes the compacted layers' metadata of every step it is in. A pruned request
also gets the core's ``PrefillState`` (the stages' device tables), and the keep indices each stage chose, which a
recompute after preemption re-applies: the same rows by construction. The state is dropped when vLLM finishes or
aborts the request (``finished_req_ids``) or no longer holds it (``runner.requests``); it survives preemption.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from macer.core.layout import RequestLayout, plan_layout, unpruned_layout
from macer.core.policy import Policy, PromptFacts, plan_prefill
from macer.core.prefill import PrefillState
from macer.core.steps import layer_bounds
from macer.vllm import records
from macer.vllm.prompt import PromptLabels
from macer.vllm.request_settings import RequestPolicies
from macer.vllm.settings import policy_problems

__all__ = ["RequestState", "RequestStates", "plan_request", "request_layout"]


@dataclass
class RequestState:
    """One request: its layout, policy and host facts; the stages' device state (pruned requests only); the keep
    indices of its stages by first compacted layer (set at its first prefill); the layers where its rows change
    (``macer.core.steps.layer_bounds`` of its layout, computed once)."""

    request_id: str
    layout: RequestLayout
    policy: Policy
    facts: PromptFacts
    prefill: PrefillState | None = None
    keeps: dict[int, torch.Tensor] = field(default_factory=dict)
    prefilled: bool = False  # its first whole prefill ran (a later whole prefill is a recompute)
    recorded: bool = False
    bounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.bounds = layer_bounds(self.layout.prompt_len, self.layout.layer_tokens)

    def record_unpruned(self) -> None:
        """The record of a request served unpruned (host values only)."""
        if self.recorded:
            return
        self.recorded = True
        everything = range(self.facts.length)
        records.record(self.request_id, self.layout.budget, records.kept_rows(self.facts.labels, everything),
                       self.layout.layer_tokens, policy=self.policy.name, keep_ratio=self.policy.keep_ratio,
                       prompt=records.prompt_counts(self.facts), note=self.layout.note)

    def start_record(self) -> None:
        """Start the record of a pruned request after its first prefill: one non-blocking copy of the kept rows and
        the stages' non-finite flags (``macer.vllm.records.start_pending``)."""
        if self.recorded or self.prefill is None:
            return
        self.recorded = True
        prefill, kept = self.prefill, self.layout.layer_tokens[-1]
        flagged = [layer for layer, _, _ in prefill.nonfinite]
        labels, facts, layout, policy = self.facts.labels, self.facts, self.layout, self.policy

        def build(values: list[int]) -> records.RequestRecord:
            hits = [layer for layer, value in zip(flagged, values[kept:], strict=True) if value]
            return records.record(self.request_id, layout.budget, records.kept_rows(labels, values[:kept]),
                                  layout.layer_tokens, policy=policy.name, keep_ratio=policy.keep_ratio,
                                  prompt=records.prompt_counts(facts), note=records.nonfinite_note(hits))

        records.start_pending(self.request_id, [prefill.current, *(flag for _, _, flag in prefill.nonfinite)], build)


class RequestStates:
    """The states of the requests vLLM holds, by internal request id."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def add(self, state: RequestState) -> RequestState:
        self._states[state.request_id] = state
        return state

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def keep_only(self, alive: Any) -> None:
        """Forget every request the runner no longer holds (``alive``: a container of request ids)."""
        for request_id in [r for r in self._states if r not in alive]:
            del self._states[request_id]

    def ids(self) -> list[str]:
        return list(self._states)


def request_layout(prompt_ids: list[int], temporal: torch.Tensor | None, extra_args: Any, policies: RequestPolicies,
                   prompt: PromptLabels, num_layers: int, *, whole: bool = True) -> tuple[Policy, PromptFacts,
                                                                                           RequestLayout]:
    """A request's policy, host facts and layout, from its prompt ids, its temporal row (None: the row index; the
    layout does not read it) and its per-request settings. The MACER worker plans every request with it, and the
    scheduler of an engine that frees KV memory sizes the request's compacted blocks with it when the request
    arrives (``macer.vllm.kv``): the same function of the same inputs, so the two agree. A request the engine cannot
    prune (a setting refused here, a prompt the plan refuses, ``whole=False``: its first step does not hold its whole
    prompt) gets ``unpruned_layout`` with a note saying why."""
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    n = ids.numel()
    note = None
    try:
        policy = policies.for_request(extra_args)
        end_of_turn = (policy.end_of_turn_token_id if policy.end_of_turn_token_id is not None
                       else prompt.end_of_turn_token_id)
        problems = policy_problems(policy, end_of_turn)
        if problems:
            raise ValueError("; ".join(problems))
    except ValueError as error:
        policy, end_of_turn, note = policies.default, prompt.end_of_turn_token_id, f"served without pruning: {error}"
    temporal = torch.arange(n) if temporal is None else temporal.reshape(-1)[:n].cpu()
    facts = PromptFacts(labels=prompt.labels(ids).long(), temporal=temporal, input_ids=ids,
                        end_of_turn_token_id=end_of_turn, num_layers=num_layers)
    if note is None and not whole:
        note = ("served without pruning: the scheduler split the prompt over several steps (an encoder budget cut "
                "before a multimodal item); MACER needs the whole prompt in one step")
    if note is not None:
        return policy, facts, unpruned_layout(n, num_layers, note)
    try:
        return policy, facts, plan_layout(policy, facts)
    except ValueError as refusal:
        # The prompt does not fit the policy (e.g. no end-of-turn token after the question): an error would stop the
        # engine, not just this request, so it is served unpruned, said in a WARNING record.
        return policy, facts, unpruned_layout(n, num_layers, f"served without pruning: {refusal}")


def plan_request(request_id: str, prompt_ids: list[int], temporal: torch.Tensor | None, extra_args: Any,
                 policies: RequestPolicies, prompt: PromptLabels, num_layers: int, device: torch.device, *,
                 whole: bool = True) -> RequestState:
    """The state of a request at its first step (``request_layout``), with the stages' device tables of a pruned
    one."""
    policy, facts, layout = request_layout(prompt_ids, temporal, extra_args, policies, prompt, num_layers,
                                           whole=whole)
    prefill = PrefillState(plan_prefill(policy, facts), device) if layout.pruned else None
    return RequestState(request_id, layout, policy, facts, prefill)
