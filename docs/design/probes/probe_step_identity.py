"""What the model's forward can know about each row of a step on vLLM 0.32.0's V1 runner (CPU), and how it learns it.

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_step_identity.py

A worker subclass (``--worker-cls``, here ``_common.RecordingWorker``) hands the V1 runner to the model. Steps are
driven by hand (``llm.llm_engine.add_request`` / ``step``) to make a mixed step: one decode + two new prefills, then
an abort. Prints VERIFIED/FAILED per claim of the design document (section "Step identity").
"""

from __future__ import annotations

import _common as c
from _common import check

path = c.checkpoint(num_layers=2)
llm = c.engine(path)
model = llm.apply_model(lambda m: m)[0]
runner = model._probe_runner
engine = llm.llm_engine
import vllm  # noqa: E402

params = vllm.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False,
                             extra_args={"macer": {"keep_ratio": 0.5}})
prompts = {"A": list(range(16, 16 + 40)), "B": list(range(16, 16 + 70)), "C": list(range(20, 20 + 25))}
c.STEPS.clear(), c.BUILDS.clear()
engine.add_request("A", {"prompt_token_ids": prompts["A"]}, params)
engine.step()  # prefill A
engine.step()  # decode A
engine.add_request("B", {"prompt_token_ids": prompts["B"]}, params)
engine.add_request("C", {"prompt_token_ids": prompts["C"]}, params)
engine.step()  # decode A + prefill B + prefill C (max_num_batched_tokens 256 >= 1 + 70 + 25)
engine.step()  # three decodes
engine.abort_request(["B"])
engine.step()  # decodes of A and C; B is in finished_req_ids
while engine.has_unfinished_requests():
    engine.step()

check(runner.__class__.__name__ == "CPUModelRunner" and runner.__class__.__module__.endswith("cpu_model_runner"),
      f"V1 runner on CPU: {runner.__class__.__module__}.{runner.__class__.__name__} (not MRV2)")
check(not llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
      "async scheduling is off on CPU (platforms/cpu.py forces scheduler_config.async_scheduling = False)")

mixed = c.STEPS[2]
fwd = mixed["forwards"][0]
ext = {internal: internal.rsplit("-", 1)[0] for s in c.STEPS for internal in s["num_scheduled_tokens"]}
check(all(len(i) == len(e) + 9 for i, e in ext.items()),
      f"the worker sees vLLM's INTERNAL request ids, '<external id>-<8 random chars>' "
      f"(v1/engine/input_processor.py assign_request_id): {sorted(ext)}")
internal = {e: i for i, e in ext.items()}
check(len(mixed["forwards"]) == 1, "exactly one model forward per execute_model call")
check([ext[r] for r in fwd["req_ids"]] == ["A", "B", "C"],
      f"rows in persistent-batch order (runner.input_batch.req_ids[:num_reqs]) = {fwd['req_ids']}: the running "
      "decode keeps its slot, new requests fill the next free ones; CPU builder has no decode-first reorder")
qsl = fwd["query_start_loc"]
check(qsl == [0, 1, 71, 96], f"metadata query_start_loc {qsl} matches num_scheduled_tokens in req_ids order "
      f"{[mixed['num_scheduled_tokens'][r] for r in fwd['req_ids']]}")
check(fwd["seq_lens"] == [42, 70, 25], f"seq_lens {fwd['seq_lens']}: decode A = 40 prompt + 2 (one decode done + "
      "this token); prefills = prompt lengths")
check(fwd["num_computed"] == [41, 0, 0], f"input_batch.num_computed_tokens_cpu {fwd['num_computed']} (host)")
check(fwd["prompt_ids"][internal["B"]] == prompts["B"] and isinstance(fwd["prompt_ids"][internal["B"]], list),
      "runner.requests[req_id].prompt_token_ids is the prompt as a host list")
check(fwd["extra_args"][internal["A"]] == {"macer": {"keep_ratio": 0.5}},
      "runner.requests[req_id].sampling_params.extra_args carries SamplingParams(extra_args=...) to the worker")
check(fwd["metadata_type"] == "CPUAttentionMetadata", f"layer metadata type {fwd['metadata_type']}")
build = c.BUILDS[[i for i, s in enumerate(c.STEPS) for _ in s["forwards"]].index(2)]
check(build["query_start_loc_cpu"] == qsl and build["seq_lens_cpu_upper_bound"] == fwd["seq_lens"],
      "CommonAttentionMetadata given to the runner's builder: query_start_loc_cpu and seq_lens_cpu_upper_bound are "
      "host tensors equal to the step's values")
check(build["is_prefilling"] == [False, True, True], f"is_prefilling (host) {build['is_prefilling']}")
check(build["req_idx"] is None, "CommonAttentionMetadata.req_idx is None on the V1 runner (MRV2 only)")
check([(ext[r], n, k) for r, n, k in mixed["new"]] == [("B", 70, 0), ("C", 25, 0)],
      f"scheduled_new_reqs {mixed['new']}")
abort_step = c.STEPS[4]
check(abort_step["finished"] == [internal["B"]],
      f"the aborted request comes in finished_req_ids {abort_step['finished']} of the next step's scheduler output "
      "(the worker sees it before the forward)")
check(internal["B"] not in abort_step["forwards"][0]["req_ids"], "and is gone from input_batch.req_ids of that step")
outside = [f for f in c.FORWARDS if not f["in_step"]]
check(all(s["forwards"] for s in c.STEPS), f"every execute_model ran the model; forwards outside execute_model "
      f"during this run: {len(outside)}")
print("block rows of the mixed step (group 0, host numpy):", fwd["block_rows"])
print("steps:", [(s["num_scheduled_tokens"], s["finished"]) for s in c.STEPS])
