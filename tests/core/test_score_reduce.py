"""The score reduce of ``macer.core.stage.run_stage`` (issue 38): a tensor-parallel engine's stage scores with its
own heads only and passes a ``reduce`` that makes those scores the scores of all heads before the selection.

Two "ranks" run in two threads of this process, each with half of the query heads and its KV head (vLLM's split for
``Hq = 4, Hkv = 2`` at ``tp = 2``); their reduce exchanges the local score vectors through a barrier (what an
all-gather does) and takes the rank-order mean (``macer.vllm.parallel.fixed_order_mean``'s rule, written here again:
the core must not import the plugin). On fresh random prompts and queries/keys, for every policy that scores, each
rank keeps exactly the rows of the stage run with all heads and no reduce (the fused ``select_stage`` where MACER
uses it), and the two ranks keep the same rows.
"""

from __future__ import annotations

import threading

import macer
import macer.core.stage as stage_module
import pytest
import torch
from macer.core.policy import AUDIO, TEXT, VISUAL, PromptFacts, plan_prefill
from macer.core.prefill import PrefillState

EOT = 2
LAYERS = 6
HEADS, KV_HEADS, DIM = 4, 2, 16


def policies() -> dict:
    base = {"audio_layer": 2, "video_layer": 4, "end_of_turn_token_id": EOT}
    out = {name: macer.make_policy(name, keep_ratio=0.3, **base)
           for name in ("macer", "macer_raw", "shared_topk", "no_coverage")}
    out["single_readout"] = macer.make_policy("single_readout", keep_ratio=0.3, video_layer=3, end_of_turn_token_id=EOT)
    out["fastv"] = macer.FastVConfig(keep_ratio=0.3, layer=2)
    return out


def prompt(generator: torch.Generator) -> PromptFacts:
    n_audio, n_video = (int(torch.randint(8, 40, (1,), generator=generator)) for _ in range(2))
    labels = [TEXT] * 4 + [AUDIO] * n_audio + [VISUAL] * n_video + [TEXT] * 6 + [EOT] + [TEXT] * 3
    ids = [EOT if label == EOT else (17 if label == TEXT else 300) for label in labels]
    labels = [TEXT if label == EOT else label for label in labels]
    return PromptFacts(labels=torch.tensor(labels), temporal=torch.arange(len(labels)), input_ids=torch.tensor(ids),
                       end_of_turn_token_id=EOT, num_layers=LAYERS)


def run_ranks(plan, draws: list[tuple[torch.Tensor, torch.Tensor]], world: int = 2) -> list[list[torch.Tensor]]:
    """Every stage of ``plan`` on ``world`` ranks at once (threads); each rank's kept rows per stage."""
    barrier = threading.Barrier(world)
    shared: list[torch.Tensor | None] = [None] * world
    kept: list[list[torch.Tensor]] = [[] for _ in range(world)]
    errors: list[BaseException] = []
    per_q, per_kv = HEADS // world, KV_HEADS // world

    def rank(r: int) -> None:
        def reduce(local: torch.Tensor) -> torch.Tensor:
            shared[r] = local
            barrier.wait()
            parts = torch.stack(list(shared))
            barrier.wait()
            total = parts[0].clone()
            for row in parts[1:]:
                total += row
            return total * (1.0 / world)

        try:
            state = PrefillState(plan, torch.device("cpu"))
            for query, key in draws:
                n = state.current.numel()
                q = query[:, r * per_q:(r + 1) * per_q, :n]
                k = key[:, r * per_kv:(r + 1) * per_kv, :n]
                state.run(q, k, None, 1e-6, reduce=reduce)
                if state.pending is not None:
                    state.take_pending()
                kept[r].append(state.current.clone())
        except BaseException as error:  # reported by the test, after both threads stop
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return kept


@pytest.mark.parametrize("name", sorted(policies()))
def test_ranks_with_a_share_of_the_heads_keep_the_rows_of_all_heads(name, seed):
    """Guards the tensor-parallel stage (issue 38 item 1): scores from half the heads, reduced, select exactly what
    the stage selects with every head, on both ranks (checked on 6 random prompts per policy)."""
    generator = torch.Generator().manual_seed(seed)
    policy = policies()[name]
    for _ in range(6):
        facts = prompt(generator)
        plan = plan_prefill(policy, facts)
        n = facts.length
        draws = [(torch.randn(1, HEADS, n, DIM, generator=generator), torch.randn(1, KV_HEADS, n, DIM,
                                                                                   generator=generator))
                 for _ in plan.stages]
        alone = PrefillState(plan, torch.device("cpu"))
        want = []
        for query, key in draws:
            m = alone.current.numel()
            alone.run(query[:, :, :m], key[:, :, :m], None, 1e-6)
            if alone.pending is not None:
                alone.take_pending()
            want.append(alone.current.clone())
        ranks = run_ranks(plan, draws)
        for got in ranks:
            assert [g.tolist() for g in got] == [w.tolist() for w in want], name
        assert want[-1].numel() == plan.layer_tokens[-1] < n


def test_a_reduce_that_differs_between_ranks_makes_them_select_differently(seed):
    """The reduce is what makes the ranks agree: without it (each rank selecting from its own heads) the ranks keep
    different rows on these random scores, so the test above could see a broken reduce."""
    generator = torch.Generator().manual_seed(seed)
    facts = prompt(generator)
    plan = plan_prefill(policies()["macer"], facts)
    n = facts.length
    query, key = torch.randn(1, HEADS, n, DIM, generator=generator), torch.randn(1, KV_HEADS, n, DIM,
                                                                                  generator=generator)
    kept = []
    for r in range(2):
        state = PrefillState(plan, torch.device("cpu"))
        state.run(query[:, 2 * r:2 * r + 2], key[:, r:r + 1], None, 1e-6, reduce=lambda local: local)
        kept.append(state.pending.tolist())
    assert kept[0] != kept[1]


def test_one_device_stays_fused_and_a_reduce_composes_the_same_rows(monkeypatch, seed):
    """Guards the split between the two paths (issue 38): without a reduce MACER's stages run the prepared stage (one
    host call on the CUDA backend); with a reduce (here the identity, every head in one process) no stage is
    prepared, the stage runs at once even in a deferring prefill, and it keeps the same rows; ``apply`` then compacts
    the engine's tensors to them."""
    calls: list[int] = []
    prepare = stage_module.prepared_stage
    monkeypatch.setattr(stage_module, "prepared_stage", lambda *args, **kwargs: calls.append(1) or prepare(*args,
                                                                                                          **kwargs))
    generator = torch.Generator().manual_seed(seed)
    facts = prompt(generator)
    plan = plan_prefill(policies()["macer"], facts)
    n = facts.length
    draws = [(torch.randn(1, HEADS, n, DIM, generator=generator), torch.randn(1, KV_HEADS, n, DIM,
                                                                               generator=generator))
             for _ in plan.stages]
    kept = {}
    for reduce in (None, lambda local: local):
        calls.clear()
        state = PrefillState(plan, torch.device("cpu"), defer=True)
        hidden = torch.randn(n, 8, generator=generator)
        rows = []
        for query, key in draws:
            m = state.current.numel()
            state.run(query[:, :, :m], key[:, :, :m], None, 1e-6, reduce=reduce)
            assert (state.pending is not None) == (reduce is not None)  # a fused stage is deferred to apply
            before = hidden
            keep, (hidden,) = state.apply([hidden], [0])
            assert torch.equal(hidden, before[keep])
            rows.append(state.current.tolist())
        assert len(calls) == (len(plan.stages) if reduce is None else 0)
        kept[reduce is None] = rows
    assert kept[True] == kept[False]
