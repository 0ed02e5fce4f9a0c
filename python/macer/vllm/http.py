"""``MacerRequestCheck``: an ASGI middleware for vLLM's OpenAI-compatible server that checks a request's MACER
settings on its raw JSON body, before vLLM's handler runs, and answers HTTP 400 for what MACER refuses::

    python -m vllm.entrypoints.openai.api_server ... --middleware macer.vllm.http.MacerRequestCheck

The engine's own check (``macer.vllm.guard.MacerRequestGuard``, a logits processor's ``validate_params``) refuses
the same settings, but two things are out of its reach on the server:

* **a streamed request** (``"stream": true``): vLLM validates it inside the stream's generator, after the response
  has started, so the client gets HTTP 200, an error event and the server's log a traceback, where vLLM's own bad
  parameters get 400;
* **JSON ``true`` for ``macer_keep_ratio``**: vLLM's request schema types ``vllm_xargs`` as ``str | int | float |
  list``, and pydantic turns ``true`` into ``1`` before any check sees it, so it was served at keep ratio 1.

The middleware reads the body of ``POST`` requests to the completions, chat completions and responses endpoints,
runs ``check_request_settings`` on its ``vllm_xargs`` as sent (a bool stays a bool) and on the prompt logprobs it
asks for (``prompt_logprobs``, or ``echo`` with ``logprobs`` / ``top_logprobs``), and answers a refusal with vLLM's
error body (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``); anything else (other
endpoints, a body that is not a JSON object, a request it does not refuse) goes to vLLM unchanged, body included.
vLLM installs it from ``--middleware`` (``app.add_middleware``): a plugin cannot add one by itself, so without the
flag the two cases above behave as described.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from types import SimpleNamespace
from typing import Any

__all__ = ["CHECKED_PATHS", "MacerRequestCheck", "request_problem"]

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
"""The endpoints whose requests carry sampling parameters (matched at the end of the path, after ``--root-path``)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def request_problem(body: Any, path: str) -> tuple[str, str] | None:
    """``(message, parameter)`` of the refusal of a request body (parsed JSON) sent to ``path``, or None."""
    from macer.vllm.guard import check_request_settings

    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None and body.get("echo"):
        prompt_logprobs = body.get("top_logprobs" if path.endswith("/chat/completions") else "logprobs")
    params = SimpleNamespace(prompt_logprobs=prompt_logprobs, extra_args=xargs if isinstance(xargs, dict) else None)
    try:
        check_request_settings(params)
    except ValueError as error:
        return str(error), "prompt_logprobs" if prompt_logprobs is not None and "prompt logprobs" in str(error) \
            else "vllm_xargs"
    return None


class MacerRequestCheck:
    """The ASGI middleware (module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or not str(scope.get("path", "")).endswith(
                CHECKED_PATHS):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to check
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # vLLM answers a malformed body itself
        problem = request_problem(body, str(scope["path"]))
        if problem is None:
            await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)
            return
        text, parameter = problem
        payload = json.dumps({"error": {"message": text, "type": "BadRequestError", "param": parameter,
                                        "code": 400}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` (the body already read), then what the client sends next (``receive``:
    a streamed response listens there for the client leaving)."""
    queue = list(messages)

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay
