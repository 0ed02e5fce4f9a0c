"""MACER's stages inside vLLM's forward, same block table (the b-lite design of docs/serving.md).

One request at a time (``max_num_seqs=1``), eager, V1 model runner. ``StagedDecoder.forward`` replaces the layer loop
of vLLM's ``Qwen2Model`` (the Qwen2 decoder and the Qwen2.5-Omni thinker's language model):

* **Prefill** (the step's query covers the whole sequence): the prompt's ids (and M-RoPE temporal row) come to the
  host in one copy, the host plan is ``macer.core.policy.plan_prefill`` (the transformers engine's own), and the
  stages run through ``macer.core.prefill.PrefillState`` / ``macer.core.stage.run_stage``: one selection code path
  for both engines. Inside the readout layer a forward pre-hook on its ``Attention`` module hands the post-RoPE
  queries and keys to the stage; before the next layer the hidden states, residual and positions keep the stage's
  rows (RoPE positions stay the original ones), and every later layer gets attention metadata rebuilt with the
  backend's own metadata builder (``macer.vllm.backend``): the request's block table, sequence length K, slots of
  positions 0..K-1. So a compacted layer's cache holds exactly
  the kept tokens' K/V in slots 0..K-1 of the request's own blocks (the blocks past K stay allocated, unused).
  The N-row output has the kept rows back at their places (dropped rows zero): the sampler reads the prompt's last
  row, which is text and always kept.
* **Decode**: a layer whose prompt lost D tokens reads sequence length ``seq_len - D`` and writes the new token at
  the slot of compacted index ``position - D`` (slots are recorded per position as the request advances).

An architecture that adds something to the hidden states of some rows after a layer (Qwen3-Omni's deepstack
features) passes ``after_layer`` (``AfterLayer``): it is called after every layer with the rows that layer held, so
it adds exactly the kept rows' own features.

Per-request state lives here, in the model instance; a new prefill replaces it. Everything per step is device work
with host integers from the plan and the metadata (no host read of a device tensor inside a stage or a decode step).
The rows' labels come from ``macer.vllm.prompt``, the per-request record from ``macer.vllm.records``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macer.core.policy import Policy, PromptFacts, plan_prefill
from macer.core.prefill import PrefillState
from macer.core.transfer import to_host
from macer.vllm.backend import CompactedMetadata, attention_modules, own_layer_metadata, readout, step_metadata
from macer.vllm.checks import check_policy
from macer.vllm.prompt import PromptLabels, temporal_row
from macer.vllm.records import record_prefill, record_unpruned

__all__ = ["AfterLayer", "RequestState", "StagedDecoder"]

AfterLayer = Callable[[int, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``after_layer(index, hidden, rows) -> hidden``: called with the hidden states ``[R, hidden]`` that
``layers[index]`` returned (before the residual is added back) and ``rows``, the ``[R]`` indices of those rows among
the step's input rows (None: all of them, in order; a prefill after a stage: its kept rows). Returns the hidden states
that go on to the next layer."""


@dataclass
class RequestState:
    """The request being served: its prefill's plan and stage state, the rows each layer holds, and the slot of
    every position it has written (``slots[p]``), which a compacted layer reuses for compacted index ``p - D``."""

    prefill: PrefillState
    shifts: list[int]  # per layer: prompt tokens the stages dropped before it (0: a full layer)
    layer_rows: list[torch.Tensor]  # per layer: prompt positions of the rows its cache holds, in slot order
    slots: torch.Tensor  # [max_model_len] slot of each position of the request


class StagedDecoder:
    """Runs the layers of one vLLM ``Qwen2Model`` with a policy's stages (see the module docstring).

    Args:
        model: vLLM's ``Qwen2Model`` (``embed_input_ids``, ``layers``, ``norm``).
        policy: the policy (``macer.vllm.settings.policy_from_config``).
        prompt: labels and end-of-turn id of the architecture.
        vllm_config: the engine's config (metadata builder, ``max_model_len``).
        after_layer: what the architecture adds to the hidden states after each layer (``AfterLayer``), or None.
    """

    def __init__(self, model: nn.Module, policy: Policy, prompt: PromptLabels, vllm_config: Any,
                 after_layer: AfterLayer | None = None):
        self.model, self.prompt, self.vllm_config = model, prompt, vllm_config
        self.after_layer = after_layer
        self.layers = list(model.layers)
        self.attns = attention_modules(self.layers)
        self.names = [attn.layer_name for attn in self.attns]
        self.metadata = CompactedMetadata(self.attns, self.names, vllm_config)
        self.use_policy(policy)
        self.state: RequestState | None = None
        self._reading: int | None = None  # index of the layer whose attention a stage reads in this forward
        for index, attn in enumerate(self.attns):
            attn.register_forward_pre_hook(self._tap(index))

    def use_policy(self, policy: Policy) -> None:
        """Serve the next prefills with ``policy`` (the engine's comes from its settings; the conformance tests
        switch policies in-process between requests to run them all on one engine)."""
        policy.check_depth(len(self.layers))
        end_of_turn = (policy.end_of_turn_token_id if policy.end_of_turn_token_id is not None
                       else self.prompt.end_of_turn_token_id)
        check_policy(policy, end_of_turn)
        self.policy, self.end_of_turn = policy, end_of_turn

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's ``Qwen2Model.forward`` (first and last pipeline rank) with the stages; ``[T, hidden]`` rows."""
        hidden = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        step = step_metadata(self.names[0])
        if step is None:
            return self._layers(hidden, positions)  # a dummy or profiling run: nothing to plan
        context, first = step
        if first.query_start_loc.shape[0] != 2:
            raise RuntimeError(f"macer: this step schedules {first.query_start_loc.shape[0] - 1} requests; the MACER "
                               "architectures serve one request at a time (max_num_seqs=1)")
        with own_layer_metadata(context):
            if first.max_query_len == first.max_seq_len:
                return self._prefill(context, first, input_ids, hidden, positions)
            return self._decode(context, first, hidden, positions)

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layers as vLLM runs them, with whatever metadata the forward context holds."""
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual)
            if self.after_layer is not None:
                hidden = self.after_layer(index, hidden, None)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    # ------------------------------------------------------------------------------------------- prefill
    def _prefill(self, context: Any, first: Any, input_ids: torch.Tensor | None, hidden: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        self.state = None
        n = first.num_actual_tokens
        if hidden.shape[0] != n:
            raise RuntimeError(f"macer: the prefill has {hidden.shape[0]} rows for {n} tokens (padded batch); run "
                               "the MACER architectures with enforce_eager=True")
        if input_ids is None:
            raise ValueError("macer: the prompt came without token ids (prompt embeddings); MACER labels audio/video "
                             "rows by their token ids")
        ids, temporal = to_host(input_ids[:n], temporal_row(positions)[:n])  # the prefill's one device read
        facts = PromptFacts(labels=self.prompt.labels(ids).long(), temporal=temporal, input_ids=ids,
                            end_of_turn_token_id=self.end_of_turn, num_layers=len(self.layers))
        try:
            plan = plan_prefill(self.policy, facts)
        except ValueError as refusal:
            # The prompt does not fit the policy (e.g. no end-of-turn token, question rows not after the media). An
            # error here would stop the engine, not just this request: serve it unpruned, said in a WARNING record.
            record_unpruned(facts, len(self.layers), self.policy.name, f"served without pruning: {refusal}")
            return self._layers(hidden, positions)
        prefill = PrefillState(plan, hidden.device)
        slots = torch.empty(self.vllm_config.model_config.max_model_len, dtype=first.slot_mapping.dtype,
                            device=first.slot_mapping.device)
        slots[:n] = first.slot_mapping[:n]
        state = RequestState(prefill, [n - tokens for tokens in plan.layer_tokens], [], slots)
        self.state = state
        try:
            hidden = self._staged_layers(context, first, state, hidden, positions)
        except BaseException:
            self.state = None
            raise
        record_prefill(prefill, self.policy.name)
        if prefill.current is prefill.full:
            return hidden
        out = hidden.new_zeros(n, hidden.shape[-1])
        return out.index_copy_(0, prefill.current, hidden)

    def _staged_layers(self, context: Any, first: Any, state: RequestState, hidden: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        prefill, tokens = state.prefill, state.prefill.plan.layer_tokens
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            if index == 0 and prefill.stage_at(0) is not None:
                prefill.run(None, None, None, 0.0)  # a stage before the first layer (no readout)
            if prefill.has_pending():
                keep, prefill.pending = prefill.pending, None
                hidden, positions = hidden[keep], positions[..., keep]
                residual = None if residual is None else residual[keep]
                prefill.current = prefill.current[keep]
                self.metadata.install(context, first, state.shifts, index, state.slots, prefill=True)
            if hidden.shape[0] != tokens[index]:
                raise RuntimeError(f"macer: layer {index + 1} received {hidden.shape[0]} tokens, the plan says "
                                   f"{tokens[index]} (please report this)")
            state.layer_rows.append(prefill.current)
            self._reading = index if prefill.stage_at(index + 1) is not None else None
            try:
                hidden, residual = layer(positions, hidden, residual)
            finally:
                self._reading = None
            if self.after_layer is not None:
                hidden = self.after_layer(index, hidden, None if prefill.current is prefill.full else prefill.current)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _tap(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._reading != index or self.state is None:
                return
            query, key, scale = readout(module, args[0], args[1])
            self.state.prefill.run(query, key, scale, getattr(self.policy, "eps", 0.0))

        return hook

    # ------------------------------------------------------------------------------------------- decode
    def _decode(self, context: Any, first: Any, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        state = self.state
        if first.max_query_len != 1:
            raise RuntimeError(f"macer: a step continues a prompt with {first.max_query_len} tokens after "
                               f"{first.max_seq_len - first.max_query_len} cached ones (chunked prefill, prefix "
                               "caching or speculative decoding); the MACER architectures need the whole prompt in "
                               "one step and one token per decode step")
        if state is None:
            return self._layers(hidden, positions)
        position = first.max_seq_len - 1
        if position >= state.slots.shape[0]:
            raise RuntimeError(f"macer: decode position {position} is beyond max_model_len")
        state.slots[position: position + 1] = first.slot_mapping[:1]
        if not any(state.shifts):
            return self._layers(hidden, positions)
        start = next(i for i, shift in enumerate(state.shifts) if shift)
        for index in range(start, len(self.layers)):
            if index == start or state.shifts[index] != state.shifts[index - 1]:
                self.metadata.install(context, first, state.shifts, index, state.slots, prefill=False)
        return self._layers(hidden, positions)
