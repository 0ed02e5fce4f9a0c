"""Prototype of the batched staged forward (issue #28's core) on vLLM 0.32.0's V1 runner (CPU): several prefills
that each drop their own rows before layer S, unpruned prefills and shifted decodes in ONE flattened step.

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_batched_stage.py

The selection is a toy (drop prompt rows 4 <= j < N-6 with j % 3 == 1, or none for a prompt marked unpruned): it is
known from the prompt alone, as MACER's counts are, and the point here is everything around it:
* per-step host plan from the runner's host arrays (input_batch.req_ids / num_computed_tokens_cpu /
  query_start_loc.np), per-request state keyed by vLLM's request id, dropped on finished_req_ids;
* stage metadata for the whole step built by a COPY of the runner's own AttentionGroup (builder class, spec,
  kernel block size) from host integers; decode rows at seq_len - D, slots from the host block table at the
  compacted index;
* rows gathered before layer S and scattered back (dropped rows zero) so the sampler's rows stay where vLLM
  expects them.
Checks: (1) with no drops the prototype equals vLLM's own forward bit for bit; (2) a staggered, mixed batch (decodes
of pruned requests + new pruned and unpruned prefills in one step, an abort) gives every request exactly the tokens
it gets when served alone; (3) the stage KV of a pruned request sits at compacted slots 0..K-1 (+ decode tokens
after); (4) no host read of a tensor inside the forward (the plan uses numpy views of the runner's host buffers).
"""

from __future__ import annotations

import _common as c
import torch
from _common import check

S = 2  # layers [S, L) are compacted (the stage reads layer S-1's attention in MACER; here the toy needs none)
path = c.checkpoint(num_layers=4)
llm = c.engine(path, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512, block_size=32)
model = llm.apply_model(lambda m: m)[0]
runner = model._probe_runner
decoder = model.model
import vllm  # noqa: E402
from _prototype import UNPRUNED, Prototype, toy_plan  # noqa: E402

proto = Prototype(llm, S)
stage_groups, STATE, STAGE_KV = proto.stage_groups, proto.STATE, proto.STAGE_KV
check(all(type(s.get_metadata_builder()) is type(g.get_metadata_builder()) and
          s.get_metadata_builder() is not g.get_metadata_builder()
          for s, g in zip(stage_groups[0], runner.attn_groups[0], strict=True)),
      f"stage builders are new instances of the runner's builder class "
      f"({type(stage_groups[0][0].get_metadata_builder()).__name__}), one per stage")
staged_forward = proto.staged_forward

params = vllm.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
prompts = {
    "p0": list(range(16, 16 + 60)), "p1": list(range(30, 30 + 45)), "p2": [UNPRUNED, *range(40, 40 + 33)],
    "p3": list(range(50, 50 + 80)), "p4": list(range(60, 60 + 20)), "p5": [UNPRUNED, *range(70, 70 + 50)],
}


def serve(names_in_order, stagger=True, abort=None):
    engine = llm.llm_engine
    outs: dict[str, list[int]] = {}
    pending = list(names_in_order)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (not stagger or step % 2 == 0):
            for _ in range(2 if stagger else len(pending)):
                if pending:
                    name = pending.pop(0)
                    engine.add_request(name, {"prompt_token_ids": prompts[name]}, params)
        if abort is not None and step == 5:
            engine.abort_request([abort])
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return outs


model.forward = proto.vanilla_forward
vanilla = {}
for name in prompts:
    vanilla[name] = serve([name], stagger=False)[name]
model.forward = staged_forward
proto.drops = False
no_drop = serve(list(prompts), stagger=True)
check(no_drop == vanilla, "no drops, mixed staggered batch through the prototype == vLLM's own forward, each "
      "request alone (bit-identical greedy tokens)")
proto.drops = True
alone = {name: serve([name], stagger=False)[name] for name in prompts}
c.STEPS.clear()
STAGE_KV.clear()
together = serve(list(prompts), stagger=True, abort="p1")
mixed = [s for s in c.STEPS if len(s["num_scheduled_tokens"]) > 2 and
         any(v > 1 for v in s["num_scheduled_tokens"].values()) and
         any(v == 1 for v in s["num_scheduled_tokens"].values())]
check(bool(mixed), f"{len(mixed)} steps mixed decodes of pruned requests with new prefills, e.g. "
      f"{sorted(mixed[0]['num_scheduled_tokens'].values())} rows per request")
check(all(together[k] == alone[k] for k in together) and "p1" not in together and len(together) == 5,
      "with drops: every request served in the mixed batch (one aborted) == served alone, token for token")
check(alone["p0"] != vanilla["p0"] and alone["p2"] == vanilla["p2"] and alone["p5"] == vanilla["p5"],
      "the drops change the pruned requests' tokens; the unpruned prompts equal vLLM's own model")
check(set(STATE) <= set(runner.requests), f"per-request state mirrors the runner's: {sorted(STATE)} (the last "
      "finished requests reach the worker in the NEXT step's finished_req_ids; the runner keeps them until then too)")
bs = runner.input_batch.block_table[0].block_size
rid = next(r for r in STAGE_KV if r.startswith("p3"))
k = len(toy_plan(prompts["p3"]))
check(len(STAGE_KV[rid]) == k and [s % bs for s in STAGE_KV[rid]] == [j % bs for j in range(k)],
      f"p3's stage layers wrote its {k} kept rows to compacted indices 0..{k - 1} of its own blocks")

# (4) host reads inside the forward
from sync_guard import READ_METHODS  # noqa: E402  (tests/helpers/sync_guard.py)

found = []
originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}


def spy(name):
    def read(self, *args, **kwargs):
        found.append(name)
        return originals[name](self, *args, **kwargs)
    return read


def guarded(*args, **kwargs):
    for name in READ_METHODS:
        setattr(torch.Tensor, name, spy(name))
    try:
        return staged_forward(*args, **kwargs)
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


model.forward = guarded
serve(["p0", "p2", "p3"], stagger=True)
check(not any(r.startswith(("p4", "p5", "p1")) for r in STATE),
      f"...and they are dropped at the next step (abort included): state now {sorted(STATE)}")
check(found == [], f"no tensor value read on the host inside the staged forward (prefill and decode steps): {found}")
