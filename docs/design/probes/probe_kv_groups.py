"""Issue #29 on vLLM 0.32.0 (CPU): compacted layers in KV cache groups of their own, allocated per request
ceil((N - D_r) / block_size) + decode growth, out of tree (a registered spec + manager, a scheduler subclass).

Run (from the worktree root):
    PYTHONPATH=$PWD:$PWD/python:$PWD/tests .venv-vllm/bin/python docs/design/probes/probe_kv_groups.py

Part A (no engine traffic): how vLLM 0.32 groups layers for the real layout (28 layers; compacted layers after the
stage at l_v = 5, and optionally after l_a = 3) and for the 6-layer test layout, through
``kv_cache_utils.get_kv_cache_groups``; the pitfall of a compacted spec that subclasses FullAttentionSpec.
Part B: a 6-layer engine whose layers >= 2 declare ``_kv.MacerCompactedSpec`` (scheduler ``_kv.MacerScheduler``,
worker ``_kv.KVWorker``) and the prototype staged forward (per-group slots from each group's host block table):
block counts per group per request after every schedule() equal the formula; tokens equal the same requests
served alone, and equal an engine without freeing; no block leaks after aborts.
"""

from __future__ import annotations

import gc

import _common as c
import torch
from _common import check

path = c.checkpoint(num_layers=6)
import _kv  # noqa: E402
import vllm  # noqa: E402
from _prototype import Prototype, toy_plan  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

BS = 32
prompts = {f"q{i}": list(range(16 + 5 * i, 16 + 5 * i + 60 + 17 * i)) for i in range(6)}
params = vllm.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)


def generate(llm, names):
    out = llm.generate([{"prompt_token_ids": prompts[n]} for n in names], params, use_tqdm=False)
    return {n: list(o.outputs[0].token_ids) for n, o in zip(names, out, strict=True)}


# ---------------------------------------------------------------- reference: drops, no freeing (one KV group)
llm = c.engine(path, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512, block_size=BS)
config = llm.llm_engine.vllm_config
proto = Prototype(llm, 2)
reference = generate(llm, list(prompts))

# ---------------------------------------------------------------- part A: grouping rules, on this engine's config
full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
comp = {s: _kv.MacerCompactedSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, stage=s)
        for s in (1, 2)}


def groups(layout):
    specs = {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(layout)}
    return [(type(g.kv_cache_spec).__name__, [int(n.split(".")[2]) for n in g.layer_names])
            for g in get_kv_cache_groups(config, specs)]


def layer_pages(gs):
    """Pages per block of each group (group size: every group gets one page per layer slot, padding included)."""
    size = max(len(layers) for _, layers in gs)
    return [(kind, size) for kind, _ in gs]


real_v = groups([full] * 5 + [comp[2]] * 23)
check([k for k, _ in real_v] == ["FullAttentionSpec"] + ["MacerCompactedSpec"] * 5 and
      [len(layers) for _, layers in real_v] == [5, 5, 5, 5, 4, 4],
      f"28 layers, compacted after l_v=5 only: 6 groups of 5 layer slots (23 compacted layers in 5 groups, "
      f"layers[i::5], 2 empty slots): "
      f"{real_v}")
real_av = groups([full] * 3 + [comp[1]] * 2 + [comp[2]] * 23)
check(len(real_av) == 15, f"28 layers, compacted after l_a=3 and l_v=5: {len(real_av)} groups of 2 slots "
      f"(3 full -> 2 groups, 2 after l_a -> 1, 23 after l_v -> 12): {real_av}")
small = groups([full] * 2 + [comp[1]] * 2 + [comp[2]] * 2)
check(len(small) == 3, f"6 layers, stages at 2 and 4, both compacted: {small}")
small_v = groups([full] * 4 + [comp[2]] * 2)
check(len(small_v) == 3, f"6 layers, compacted after l_v=4 only: {small_v}")


def predicted_ratio(layout_groups, layer_tokens, generated, bs):
    """(vanilla pages, MACER pages) per request at prompt + ``generated`` tokens. A block costs the largest group's
    layer slots in pages in every group (kv_cache_utils._get_kv_cache_bytes_per_block), vanilla has one group of
    all layers."""
    slots = max(len(layers) for _, layers in layout_groups)
    macer = slots * sum(cdiv(layer_tokens[layers[0]] + generated, bs) for _, layers in layout_groups)
    vanilla = len(layer_tokens) * cdiv(layer_tokens[0] + generated, bs)
    return vanilla, macer


from macer.policies import make_policy  # noqa: E402

clip = (25, 128, 256)  # text, audio, video rows: clip_prompt(n_audio=128, n_video=256, question=8), N = 409
for name, layers, (la, lv), gs in (("28 layers, l_v only", 28, (3, 5), real_v),
                                   ("28 layers, l_a and l_v", 28, (3, 5), real_av),
                                   ("6 layers, l_v only", 6, (2, 4), small_v),
                                   ("6 layers, l_a and l_v", 6, (2, 4), small)):
    tokens = make_policy("macer", keep_ratio=0.25, audio_layer=la, video_layer=lv,
                         end_of_turn_token_id=2).layer_tokens(*clip, layers)
    for bs in (16, 32):
        vanilla, macer = predicted_ratio(gs, tokens, 16, bs)
        print(f"predicted admission ratio, {name}, keep 0.25, N={tokens[0]} (+16 generated), block {bs}: "
              f"{vanilla} / {macer} pages per request = {vanilla / macer:.2f}x")


@__import__("dataclasses").dataclass(frozen=True, kw_only=True)
class WrongSpec(FullAttentionSpec):
    stage: int = 0


from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

KVCacheSpecRegistry.register(WrongSpec, _kv.MacerCompactedManager, uniform_type_base_spec=WrongSpec)
wrong = groups([full] * 5 + [WrongSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)] * 23)
check(len(wrong) == 1, f"pitfall: a compacted spec that subclasses FullAttentionSpec lands in ONE group with the "
      f"full layers (UniformTypeKVCacheSpecs.is_uniform_type tests isinstance against the first layer's base): "
      f"{[(k, len(v)) for k, v in wrong]}")
del llm, proto
gc.collect()

# ---------------------------------------------------------------- part B: freeing on
_kv.S[0] = 2
llm = c.engine(path, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512, block_size=BS,
               worker_cls="_kv.KVWorker", scheduler_cls="_kv.MacerScheduler")
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
kv_groups = llm.llm_engine.vllm_config
managers = scheduler.kv_cache_manager.coordinator.single_type_managers
kinds = [type(m).__name__ for m in managers]
check(kinds == ["FullAttentionManager", "MacerCompactedManager", "MacerCompactedManager"],
      f"the engine built one manager per group from the registry: {kinds}")
proto = Prototype(llm, 2)
check(proto.stage_gids == [1, 2], f"layers 2..5 sit in KV cache groups {proto.stage_gids} "
      f"({[[n.split('.')[2] for n in g.layer_names] for g in proto.runner.kv_cache_config.kv_cache_groups]})")

MISMATCH: list = []
original_schedule = scheduler.schedule


def checked_schedule(*args, **kwargs):
    out = original_schedule(*args, **kwargs)
    for request in scheduler.running:
        n = request.num_computed_tokens  # already advanced by this step's tokens (_update_after_schedule)
        d = len(request.prompt_token_ids) - len(toy_plan(request.prompt_token_ids))
        want = [cdiv(n, BS), cdiv(n - d, BS), cdiv(n - d, BS)]
        got = [len(m.req_to_blocks.get(request.request_id, ())) for m in managers]
        if got != want:
            MISMATCH.append((request.request_id, n, d, got, want))
    return out


scheduler.schedule = checked_schedule
free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
alone = {n: generate(llm, [n])[n] for n in prompts}
together = generate(llm, list(prompts))
check(not MISMATCH, f"after every schedule(): blocks per group == [ceil(n/bs), ceil((n-D)/bs) x2] for every "
      f"running request (prefill and decode steps); mismatches: {MISMATCH[:3]}")
check(together == alone, "freeing on: the mixed batch == each request alone")
check(together == reference, "freeing on == the same drops without freeing (one KV group)")
n0 = len(prompts["q5"])
d0 = n0 - len(toy_plan(prompts["q5"]))
print(f"q5: N={n0}, D={d0}: blocks per group after prefill {cdiv(n0, BS)} / {cdiv(n0 - d0, BS)} / "
      f"{cdiv(n0 - d0, BS)} (a vanilla engine: {cdiv(n0, BS)} in one group of 6 layers)")

engine = llm.llm_engine
for round_ in range(3):
    for name in prompts:
        engine.add_request(f"{name}-{round_}", {"prompt_token_ids": prompts[name]}, params)
    for _ in range(6):
        engine.step()
    engine.abort_request([f"q{i}-{round_}" for i in range(0, 6, 2)])
    while engine.has_unfinished_requests():
        engine.step()
engine.add_request("last", {"prompt_token_ids": prompts["q0"]}, params)  # one more step delivers the last frees
while engine.has_unfinished_requests():
    engine.step()
check(scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start,
      f"no block leaks after {3 * len(prompts) + len(prompts) * 2 + 1} requests, 9 aborted mid-decode "
      f"(free blocks back to {free_at_start})")
check(all(not m.drops for m in managers if isinstance(m, _kv.MacerCompactedManager)),
      "the managers' D_r entries are gone once the requests are freed")
