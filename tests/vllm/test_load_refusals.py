"""A refusal raised when the model loads, in vLLM's engine core process, reaches the user's terminal (issue 28 item
4): ``LLM(...)`` started as a user starts it (multiprocessing on: the engine core and its worker are processes of
their own) fails, and the refusal's text is in what the user's process printed, not only in a log file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_a_load_time_refusal_is_printed_to_the_users_terminal(tmp_path):
    from macer.vllm.testing import MACER_SETTINGS, write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "ckpt", num_layers=4)
    # trim_early_cache parses as a MacerConfig field and is refused by the model when it loads (check_policy).
    settings = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3, "trim_early_cache": True,
                **MACER_SETTINGS}
    code = ("import vllm\n"
            f"vllm.LLM(model={str(checkpoint)!r}, skip_tokenizer_init=True, enforce_eager=True, dtype='float32', "
            "max_model_len=256, max_num_batched_tokens=256, enable_chunked_prefill=False, "
            "enable_prefix_caching=False, kv_cache_memory_bytes=16 << 20, "
            f"additional_config={{'macer': {json.dumps(settings)}}})\n")
    env_code = "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '1'\n"
    done = subprocess.run([sys.executable, "-c", env_code + code.replace("true", "True")], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    printed = done.stdout + done.stderr
    assert done.returncode != 0 and "Engine core initialization failed" in printed, printed[-4000:]
    # Printed by the worker process (vLLM's CPU build runs it under its multiprocess executor) on the same terminal.
    refusal = [line for line in printed.splitlines()
               if "ValueError: additional_config[\"macer\"][\"trim_early_cache\"]=true is not supported" in line]
    assert refusal and refusal[0].startswith("(Worker pid="), printed[-4000:]
