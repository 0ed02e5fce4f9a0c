"""MACER's stages inside vLLM's forward, same block table (the b-lite design of docs/serving.md).

One request at a time (``max_num_seqs=1``), eager, V1 model runner. ``StagedDecoder.forward`` replaces the layer loop
of vLLM's ``Qwen2Model`` (the Qwen2 decoder and the Qwen2.5-Omni thinker's language model):

* **Prefill** (the step's query covers the whole sequence): the prompt's ids (and M-RoPE temporal row) come to the
  host in one copy, the host plan is ``macer.policy.plan_prefill`` (the transformers runtime's own), and the stages
  run through ``macer._prefill._Prefill`` / ``macer.policy.run_stage``: one selection code path for both runtimes.
  Inside the readout layer a forward pre-hook on its ``Attention`` module hands the post-RoPE queries and keys to the
  stage; before the next layer the hidden states, residual and positions keep the stage's rows (RoPE positions stay
  the original ones), and every later layer gets attention metadata rebuilt with the backend's own metadata builder:
  the request's block table, sequence length K, slots of positions 0..K-1. So a compacted layer's cache holds exactly
  the kept tokens' K/V in slots 0..K-1 of the request's own blocks (the blocks past K stay allocated, unused).
  The N-row output has the kept rows back at their places (dropped rows zero): the sampler reads the prompt's last
  row, which is text and always kept.
* **Decode**: a layer whose prompt lost D tokens reads sequence length ``seq_len - D`` and writes the new token at
  the slot of compacted index ``position - D`` (slots are recorded per position as the request advances).

Per-request state lives here, in the model instance; a new prefill replaces it. Everything per step is device work
with host integers from the plan and the metadata (no host read of a device tensor inside a stage or a decode step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macer.core.families import QWEN2_5_OMNI
from macer.core.policy import AUDIO, MODALITY_NAMES, VISUAL, Policy, PromptFacts, plan_prefill
from macer.core.prefill import PrefillState, nonfinite_hits
from macer.core.transfer import to_host

__all__ = ["PromptLabels", "RequestState", "StagedDecoder", "check_policy", "kept_counts", "omni_prompt_labels",
           "temporal_row"]


@dataclass(frozen=True)
class PromptLabels:
    """What the engine knows about a prompt's rows, per architecture.

    Attributes:
        labels: host ``[N]`` token ids -> host ``[N]`` int64 modality labels (``macer.AUDIO`` / ``macer.VISUAL``).
        end_of_turn_token_id: the id closing the user's question when the policy names none (None: unknown).
    """

    labels: Callable[[torch.Tensor], torch.Tensor]
    end_of_turn_token_id: int | None = None


def omni_prompt_labels(thinker_config: Any) -> PromptLabels:
    """The Qwen2.5-Omni thinker's rows, read from its config as the transformers adapter reads them
    (``macer.core.families.QWEN2_5_OMNI``): audio = the config's audio token id, visual = its video or image token
    id; the question ends at ``<|im_end|>``."""

    def labels(ids: torch.Tensor) -> torch.Tensor:
        return QWEN2_5_OMNI.labels(thinker_config, ids)

    return PromptLabels(labels, QWEN2_5_OMNI.end_of_turn_token_id(thinker_config))


def check_policy(policy: Policy, end_of_turn_token_id: int | None) -> None:
    """Refuse, when the model loads, a policy the engine cannot serve as the transformers runtime would: an error at
    a prefill would stop the engine, not just the request.

    * ``trim_early_cache=True``: the early layers' pages would have to be compacted after the prefill (not done).
    * question rows read before an unknown end-of-turn token (``question_span="end_of_turn"`` with no
      ``end_of_turn_token_id`` from the settings or the model).
    """
    if policy.trim_early_cache:
        raise ValueError('additional_config["macer"]["trim_early_cache"]=true is not supported inside vLLM (the early '
                         "layers' KV pages keep every prompt token); leave it false")
    reads_question = any(spec.needs_scores and spec.query == "question" for spec in policy.stage_specs(1, 1))
    if reads_question and policy.question_span == "end_of_turn" and end_of_turn_token_id is None:
        raise ValueError('additional_config["macer"]: the question rows end before the end-of-turn token, which this '
                         'model does not name: set "end_of_turn_token_id" (the id closing the user\'s question), or '
                         '"question_span": "prompt_end" to read the prompt\'s last query_tokens tokens')


def temporal_row(positions: torch.Tensor) -> torch.Tensor:
    """Temporal position of each row from vLLM's positions: ``[T]`` (RoPE) as is, ``[3, T]`` (M-RoPE) its first,
    temporal row (the adapter's ``position_ids[-3]`` in transformers' ``[3, B, N]``)."""
    if positions.ndim == 1:
        return positions
    if positions.ndim == 2 and positions.shape[0] == 3:
        return positions[0]
    raise ValueError(f"macer: positions must be [T] or [3, T] (M-RoPE), got shape {tuple(positions.shape)}")


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
    """

    def __init__(self, model: nn.Module, policy: Policy, prompt: PromptLabels, vllm_config: Any):
        self.model, self.prompt, self.vllm_config = model, prompt, vllm_config
        self.layers = list(model.layers)
        self.attns = [layer.self_attn.attn for layer in self.layers]
        self.names = [attn.layer_name for attn in self.attns]
        self.use_policy(policy)
        self.state: RequestState | None = None
        self._builder: Any = None
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
        from vllm.forward_context import get_forward_context, is_forward_context_available

        hidden = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        metadata = get_forward_context().attn_metadata if is_forward_context_available() else None
        if not isinstance(metadata, dict) or metadata.get(self.names[0]) is None:
            return self._layers(hidden, positions)  # a dummy or profiling run: nothing to plan
        context = get_forward_context()
        first = metadata[self.names[0]]
        if first.query_start_loc.shape[0] != 2:
            raise RuntimeError(f"macer: this step schedules {first.query_start_loc.shape[0] - 1} requests; the MACER "
                               "architectures serve one request at a time (max_num_seqs=1)")
        saved = context.attn_metadata, context.slot_mapping
        context.attn_metadata, context.slot_mapping = dict(saved[0]), dict(saved[1])
        try:
            if first.max_query_len == first.max_seq_len:
                return self._prefill(context, first, input_ids, hidden, positions)
            return self._decode(context, first, hidden, positions)
        finally:
            context.attn_metadata, context.slot_mapping = saved

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layers as vLLM runs them, with whatever metadata the forward context holds."""
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
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
            self._record_unpruned(facts, f"served without pruning: {refusal}")
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
        self._record(state)
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
                self._install(context, first, index, prefill=True)
            if hidden.shape[0] != tokens[index]:
                raise RuntimeError(f"macer: layer {index + 1} received {hidden.shape[0]} tokens, the plan says "
                                   f"{tokens[index]} (please report this)")
            state.layer_rows.append(prefill.current)
            self._reading = index if prefill.stage_at(index + 1) is not None else None
            try:
                hidden, residual = layer(positions, hidden, residual)
            finally:
                self._reading = None
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _tap(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._reading != index or self.state is None:
                return
            query, key = args[0], args[1]
            rows = query.shape[0]
            # vLLM's [T, H * D] post-RoPE rows -> the [1, H, T, D] layout the stage reads (a view, no copy).
            query = query.view(rows, -1, module.head_size).transpose(0, 1)[None]
            key = key.view(rows, -1, module.head_size).transpose(0, 1)[None]
            self.state.prefill.run(query, key, module.impl.scale, getattr(self.policy, "eps", 0.0))

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
                self._install(context, first, index, prefill=False)
        return self._layers(hidden, positions)

    # ------------------------------------------------------------------------------------------- metadata
    def _install(self, context: Any, first: Any, start: int, *, prefill: bool) -> None:
        """Metadata and slots of the compacted layers from ``layers[start]`` on (until the next shift change)."""
        shifts = self.state.shifts
        shift = shifts[start]
        metadata, slots = self._rebuild(first, shift, prefill)
        for index in range(start, len(self.layers)):
            if shifts[index] != shift:
                break
            context.attn_metadata[self.names[index]] = metadata
            context.slot_mapping[self.names[index]] = slots

    def _rebuild(self, first: Any, shift: int, prefill: bool) -> tuple[Any, torch.Tensor]:
        """The request's metadata with ``shift`` fewer tokens in its context, built by the backend's own builder."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            if not hasattr(first, field):
                raise RuntimeError(f"macer: the attention backend's metadata ({type(first).__name__}) has no "
                                   f"{field!r}; the MACER architectures support backends with per-request "
                                   "query_start_loc, seq_lens, block_table and slot_mapping (CPU, FlashAttention)")
        seq_len = first.max_seq_len - shift
        if prefill:
            tokens = first.num_actual_tokens - shift
            slot_mapping = first.slot_mapping[:tokens]
            query_start = first.query_start_loc.clone()
            query_start[1:] -= shift
        else:
            tokens, position = first.num_actual_tokens, first.max_seq_len - 1
            slot_mapping = self.state.slots[position - shift: position - shift + 1]
            query_start = first.query_start_loc
        common = CommonAttentionMetadata(
            query_start_loc=query_start, query_start_loc_cpu=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=first.seq_lens - shift, num_reqs=1, num_actual_tokens=tokens,
            max_query_len=tokens if prefill else first.max_query_len, max_seq_len=seq_len,
            block_table_tensor=first.block_table, slot_mapping=slot_mapping, causal=True,
            seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32))
        return self._metadata_builder(slot_mapping.device).build(0, common), slot_mapping

    def _metadata_builder(self, device: torch.device) -> Any:
        if self._builder is None:
            attn = self.attns[0]
            spec = attn.get_kv_cache_spec(self.vllm_config)
            self._builder = attn.attn_backend.get_builder_cls()(spec, self.names, self.vllm_config, device)
        return self._builder

    # ------------------------------------------------------------------------------------------- record
    def _record(self, state: RequestState) -> None:
        from macer.vllm import records

        plan = state.prefill.plan
        # The V1 runner does not tell the model which request a step serves: request_id stays None (one request
        # at a time, so records come in the order the prefills ran).
        records.record(None, plan.budget, kept_counts(state.prefill), list(plan.layer_tokens),
                       policy=self.policy.name, prompt_counts=prompt_counts(plan.facts),
                       note=nonfinite_note(state.prefill))

    def _record_unpruned(self, facts: PromptFacts, note: str) -> None:
        from macer.vllm import records

        counts = prompt_counts(facts)
        records.record(None, None, {"audio": counts["audio"], "video": counts["video"]},
                       [facts.length] * len(self.layers), policy=self.policy.name, prompt_counts=counts, note=note)


def prompt_counts(facts: PromptFacts) -> dict[str, int]:
    """``{"audio": n_a, "video": n_v, "text": n_t}`` of a prompt."""
    counts = {"audio": facts.count(AUDIO), "video": facts.count(VISUAL)}
    counts["text"] = facts.length - counts["audio"] - counts["video"]
    return counts


def nonfinite_note(prefill: PrefillState) -> str | None:
    """The record's note when a stage ranked non-finite scores (``run_stage``'s device flags, read in one copy after
    the prefill's last layer, as the transformers runtime reads them). The transformers runtime raises there; inside
    the engine an error would stop every request, so the request goes on and its record is a WARNING that names the
    layer: its selection is the non-finite rule's (NaN ranks last), not a ranking by attention."""
    hits = nonfinite_hits(prefill.nonfinite_flags())
    if not hits:
        return None
    return (f"the attention scores of the stage reading layer {hits[0][0]} are not finite (NaN or inf in that layer's "
            "queries or keys: its weights or the hidden states entering it); the stage kept tokens by the non-finite "
            "rule, not by attention, and the outputs are likely NaN too")


def kept_counts(prefill: PrefillState) -> dict[str, int]:
    """Audio and video tokens the prefill kept. From the host plan where it fixes them (one selection per modality,
    the random rule's host picks); a joint selection's split (FastV) is data-dependent and read from the device
    once, after the prefill's last layer."""
    plan, counts = prefill.plan, {}
    for label, name in MODALITY_NAMES.items():
        count = prefill.label_count(label)
        if count is None:
            kept = prefill.current.cpu()  # joint top-k only: its split is known on the device alone
            count = int((plan.facts.labels[kept] == label).sum())
        counts[name] = count
    return counts
