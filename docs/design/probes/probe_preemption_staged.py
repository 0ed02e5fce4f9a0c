"""Preemption and recompute through the prototype staged forward (issue #28 item 6) on vLLM 0.32.0's V1 runner (CPU).

Run (from the worktree root):
PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_preemption_staged.py

A resumed request reaches the forward as one whole-sequence prefill of prompt + generated tokens
(probe_preemption.py). The prototype keeps its per-request state across the preemption (it is dropped on
finished_req_ids only), re-applies the prompt-only plan to the prompt rows and keeps every generated row: the
request's compacted layers then hold exactly what they held before it was preempted. Checks: preemption happened,
and every request's tokens equal those it gets alone (no preemption).
"""

from __future__ import annotations

import _common as c
from _common import check

path = c.checkpoint(num_layers=4)
llm = c.engine(path, num_gpu_blocks_override=7, max_model_len=128, max_num_batched_tokens=128, block_size=32)
import vllm  # noqa: E402
from _prototype import Prototype  # noqa: E402

proto = Prototype(llm, 2)
prompts = [list(range(16 + 7 * i, 16 + 7 * i + 30)) for i in range(4)]
params = vllm.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False)
alone = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
         for p in prompts]
c.STEPS.clear()
together = [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
resumed = [r for s in c.STEPS for r in s["resumed"]]
check(bool(resumed), f"requests were preempted and recomputed: {resumed}")
check(together == alone, "with drops, every request's tokens under preemption == served alone")
proto.drops = False
plain = [list(o.outputs[0].token_ids)
         for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
check(plain != together, "(and the drops do change the tokens, so the check above is not vacuous)")
