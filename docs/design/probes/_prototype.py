"""The prototype staged forward shared by probe_batched_stage.py and probe_preemption_staged.py (not a probe).

``Prototype(llm, S)`` replaces the model's forward with a layer loop whose layers [S, L) run on each request's kept
rows (toy drops known from the prompt alone), with stage metadata built by copies of the runner's attention groups
from host integers; see probe_batched_stage.py's docstring for what it stands for in the design.
"""

from __future__ import annotations

import dataclasses

import _common as c
import numpy as np
import torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

UNPRUNED = 500  # a prompt starting with this id is served without drops (stands for text-only / a refused plan)


def toy_plan(prompt: list[int]) -> np.ndarray:
    """Kept prompt rows, from the prompt alone (the role of macer.policy.plan_prefill + the stage selection)."""
    n = len(prompt)
    rows = np.arange(n)
    if prompt[0] == UNPRUNED:
        return rows
    return rows[~((rows >= 4) & (rows < n - 6) & (rows % 3 == 1))]


def copy_attn_groups(runner, gid: int = 0):
    """One copy of each of the runner's attention groups of KV cache group ``gid``, with builders of its own, made
    as the runner makes its own (AttentionGroup.create_metadata_builders, under the engine's config)."""
    copies = []
    with set_current_vllm_config(runner.vllm_config):
        for group in runner.attn_groups[gid]:
            copy = dataclasses.replace(group, metadata_builders=[], kernel_block_table=None,
                                       kernel_block_offsets=None)
            copy.create_metadata_builders(runner.vllm_config, runner.device, group.kernel_block_size, 1)
            copies.append(copy)
    return copies


class Prototype:
    def __init__(self, llm, S):
        self.model = llm.apply_model(lambda m: m)[0]
        self.runner = self.model._probe_runner
        self.decoder = self.model.model
        self.S = S
        self.names = [layer.self_attn.attn.layer_name for layer in self.decoder.layers]
        groups = self.runner.kv_cache_config.kv_cache_groups
        self.layer_gid = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
        self.stage_gids = sorted({self.layer_gid[name] for name in self.names[S:]})
        self.stage_groups = {gid: copy_attn_groups(self.runner, gid) for gid in self.stage_gids}
        self.STATE: dict[str, dict] = {}  # request id -> {"kept": kept prompt rows, "drop": D}
        self.STAGE_KV: dict[str, list[int]] = {}  # request id -> its prefill's stage slots (first stage group)
        self.drops = True
        self.vanilla_forward = self.model.forward
        self.model.forward = self.staged_forward

    def step_plan(self, num_tokens: int):
        """Host plan of the step for layers >= S: rows kept, per KV cache group the stage metadata and slots."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        for rid in c.STEPS[-1]["finished"]:
            self.STATE.pop(rid, None)
        qsl = self.runner.query_start_loc.np[: n + 1]
        computed = batch.num_computed_tokens_cpu[:n]
        rows, q_s, seq_s, indices = [], [], [], []
        for i, rid in enumerate(batch.req_ids[:n]):
            q = int(qsl[i + 1] - qsl[i])
            seq = int(computed[i]) + q
            state = self.STATE.get(rid)
            if computed[i] == 0:  # a whole-sequence prefill: new, or a recompute after preemption
                prompt = self.runner.requests[rid].prompt_token_ids
                if state is None:
                    kept = toy_plan(prompt) if self.drops else np.arange(len(prompt))
                    state = self.STATE[rid] = {"kept": kept, "drop": len(prompt) - len(kept)}
                keep = np.concatenate([state["kept"], np.arange(len(prompt), q)])  # generated rows are kept
                assert q == seq, "chunked prefill or prefix caching reached the prototype"
            else:  # decode (one token)
                assert q == 1, "a continuation of several tokens (chunk, speculative decoding) reached the prototype"
                keep = np.arange(1)
            d = state["drop"]
            rows.append(qsl[i] + keep)
            q_s.append(len(keep))
            seq_s.append(seq - d)
            indices.append(seq - d - len(keep) + np.arange(len(keep)))  # compacted indices of the kept rows
        rows = np.concatenate(rows)
        qsl_s = np.concatenate([[0], np.cumsum(q_s)]).astype(np.int32)
        seq_s = np.asarray(seq_s, dtype=np.int32)
        device = self.runner.device
        metadata, slot_mappings = {}, {}
        for gid in self.stage_gids:
            table = batch.block_table[gid]
            bs = table.block_size
            slots = []
            for i, index in enumerate(indices):
                owned = int(table.num_blocks_per_row[i])
                assert int(index[-1]) // bs < owned, "a stage slot outside the blocks the request owns in this group"
                slots.append(table.block_table.np[i, index // bs].astype(np.int64) * bs + index % bs)
            if gid == self.stage_gids[0]:
                for i, rid in enumerate(batch.req_ids[:n]):
                    if computed[i] == 0:
                        self.STAGE_KV[rid] = slots[i].tolist()
            common = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(qsl_s).to(device), query_start_loc_cpu=torch.from_numpy(qsl_s),
                seq_lens=torch.from_numpy(seq_s).to(device), seq_lens_cpu_upper_bound=torch.from_numpy(seq_s),
                num_reqs=n, num_actual_tokens=len(rows), max_query_len=int(max(q_s)), max_seq_len=int(seq_s.max()),
                block_table_tensor=table.get_device_tensor(n),
                slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device), causal=True)
            for group in self.stage_groups[gid]:
                built = group.build_metadata(common)
                for name in group.layer_names:
                    metadata[name], slot_mappings[name] = built, common.slot_mapping
        return torch.from_numpy(rows).to(device), metadata, slot_mappings

    def staged_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        hidden = self.decoder.embed_input_ids(input_ids)
        context = get_forward_context()
        if not c._IN_STEP[0] or not isinstance(context.attn_metadata, dict):
            residual = None  # a dummy/profile run: no plan (never taken for a prefill)
            for layer in self.decoder.layers:
                hidden, residual = layer(positions, hidden, residual)
            return self.decoder.norm(hidden, residual)[0]
        rows, metadata, slot_mappings = self.step_plan(hidden.shape[0])
        total = hidden.shape[0]
        residual = None
        saved = context.attn_metadata, context.slot_mapping
        try:
            for index, layer in enumerate(self.decoder.layers):
                if index == self.S:
                    context.attn_metadata, context.slot_mapping = dict(saved[0]), dict(saved[1])
                    hidden, residual, positions = hidden[rows], residual[rows], positions[..., rows]
                    for name in self.names[self.S:]:
                        context.attn_metadata[name] = metadata[name]
                        context.slot_mapping[name] = slot_mappings[name]
                hidden, residual = layer(positions, hidden, residual)
        finally:
            context.attn_metadata, context.slot_mapping = saved
        hidden, _ = self.decoder.norm(hidden, residual)
        return hidden.new_zeros(total, hidden.shape[-1]).index_copy_(0, rows, hidden)
