"""How a preempted request comes back on vLLM 0.32.0's V1 runner (CPU): what the worker and the model see.

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_preemption.py

A KV cache of a few blocks (num_gpu_blocks_override) and four concurrent requests that outgrow it force the
scheduler to preempt (recompute mode). Prints VERIFIED/FAILED per claim of the design document (section
"Preemption and recompute").
"""

from __future__ import annotations

import _common as c
from _common import check

path = c.checkpoint(num_layers=2)
llm = c.engine(path, num_gpu_blocks_override=7, max_model_len=128, max_num_batched_tokens=128, block_size=32)
import vllm  # noqa: E402

config = llm.llm_engine.vllm_config
check(config.cache_config.block_size == 32, f"block size {config.cache_config.block_size} "
      "(CPU attention supports MultipleOf(32) kernel blocks)")
prompts = [list(range(16 + i, 16 + i + 30)) for i in range(4)]
params = vllm.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False)
alone = [list(o.outputs[0].token_ids) for o in (llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                                                 for p in prompts)]
c.STEPS.clear()
together = [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

preempted = [s for s in c.STEPS if s["preempted"]]
resumed = [s for s in c.STEPS if s["resumed"]]
check(bool(preempted), f"preemption happened: {sum(len(s['preempted']) for s in preempted)} preemptions in "
      f"{len(c.STEPS)} steps (scheduler_output.preempted_req_ids)")
check(bool(resumed), "a preempted request came back in scheduled_cached_reqs.resumed_req_ids (not as a new request)")
step = resumed[0]
rid = step["resumed"][0]
cached = {r: (computed, outputs) for r, computed, outputs in step["cached"]}
computed, outputs = cached[rid]
fwd = step["forwards"][0]
index = fwd["req_ids"].index(rid)
prompt = fwd["prompt_ids"][rid]
check(computed == 0, f"the resumed request restarts with num_computed_tokens = {computed} (recompute)")
check(step["num_scheduled_tokens"][rid] == len(prompt) + outputs,
      f"its step schedules prompt + outputs so far = {len(prompt)} + {outputs} = "
      f"{step['num_scheduled_tokens'][rid]} rows in one piece (chunked prefill off)")
check(fwd["num_prompt"][index] == len(prompt) == 30,
      "runner.requests[rid].prompt_token_ids / input_batch.num_prompt_tokens stay the PROMPT only (30), so a plan "
      "made from them is the first run's plan")
check(fwd["outputs"][rid] == outputs, f"runner.requests[rid].output_token_ids holds the {outputs} generated tokens")
qsl = fwd["query_start_loc"]
check(qsl[index + 1] - qsl[index] == fwd["seq_lens"][index] == len(prompt) + outputs,
      "in the forward it looks like a whole-sequence prefill: query length == seq_len == prompt + outputs")
check(together == alone, "tokens under preemption equal each request served alone (vLLM's own model)")
