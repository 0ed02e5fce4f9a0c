"""Per-request settings on vLLM 0.32.0: SamplingParams.extra_args (``vllm_xargs`` in the OpenAI API) is validated in
the frontend by a logits processor's ``validate_params`` (one request fails, the engine goes on) and reaches the
worker in ``runner.requests[req_id].sampling_params.extra_args`` (probe_step_identity.py).

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_request_settings.py
"""

from __future__ import annotations

import _common as c
from _common import check

path = c.checkpoint(num_layers=2)
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

SEEN = []


class XargsGuard(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params):
        args = sampling_params.extra_args or {}
        SEEN.append(dict(args))
        ratio = args.get("macer_keep_ratio", 0.5)
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"macer_keep_ratio must be a finite real number in (0.0, 1.0], got {ratio!r}")

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        return None


llm = c.engine(path, logits_processors=[XargsGuard])
ok = vllm.SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, extra_args={"macer_keep_ratio": 0.25})
bad = vllm.SamplingParams(max_tokens=3, temperature=0.0, detokenize=False, extra_args={"macer_keep_ratio": 2.0})
prompt = {"prompt_token_ids": list(range(16, 48))}
try:
    llm.generate([prompt], bad, use_tqdm=False)
    error = None
except Exception as raised:
    error = raised
check(error is not None and "macer_keep_ratio" in str(error) and type(error).__name__ == "VLLMValidationError",
      f"a bad per-request value is refused at admission in the frontend: {type(error).__name__}: {error}")
out = llm.generate([prompt], ok, use_tqdm=False)
check(len(out[0].outputs[0].token_ids) == 3, "the engine serves the next request")
check({"macer_keep_ratio": 0.25} in SEEN, "validate_params saw SamplingParams.extra_args")
try:
    CompletionRequest(model="m", prompt="x", vllm_xargs={"macer": {"keep_ratio": 0.25}})
    nested = True
except Exception:
    nested = False
check(not nested, "the OpenAI API's vllm_xargs takes flat str/int/float/list values only (a nested "
      "{'macer': {...}} object is a request validation error): per-request keys must be flat, e.g. macer_keep_ratio")
request = CompletionRequest(model="m", prompt="x", vllm_xargs={"macer_keep_ratio": 0.25, "macer_policy": "fastv"})
check(request.vllm_xargs == {"macer_keep_ratio": 0.25, "macer_policy": "fastv"},
      "flat keys pass; CompletionRequest.to_sampling_params copies vllm_xargs into SamplingParams.extra_args "
      "(entrypoints/openai/completion/protocol.py)")
