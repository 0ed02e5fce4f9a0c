"""Policies other than MACER (FastV, Random, full, the ablations) against independent references written here.

FastV's reference reads eager attention probabilities from the unpatched model (``output_attentions=True``) and takes
a float64 joint top-K (``topk_indices_ref``); Random's is the documented draw (``randperm`` of the prompt's
audio/visual positions from ``torch.Generator().manual_seed(seed)``) plus a uniformity bound on many seeds.
"""

from __future__ import annotations

import macer
import pytest
import torch
from budget_oracle import exact_budget
from macer import cost
from macer.core.policy import AUDIO, VISUAL, PromptFacts, plan_prefill
from macer.testing import SYNTHETIC_TOKENS, build_thinker, clip_inputs, macer_config_for, thinker_config

from macer_kernels.reference import topk_indices_ref

CLIP = {"frames": 8, "grid_hw": (8, 8), "audio_tokens": 150, "seed": 1}


@pytest.fixture(scope="module")
def eager_model():
    return build_thinker(num_layers=5, hidden_size=64, attn_implementation="eager", seed=6)


def _media(ids: torch.Tensor) -> torch.Tensor:
    tok = SYNTHETIC_TOKENS
    return ((ids == tok.audio) | (ids == tok.video) | (ids == tok.image)).nonzero().reshape(-1)


def fastv_reference(model, inputs, keep_ratio: float, layer: int, rows: list[int]) -> list[int]:
    """Kept audio/visual prompt positions: joint top-K_mm by the eager attention probability of layer ``layer``
    (1-based) averaged over heads and ``rows``, in float64, ties to the lower index."""
    with torch.no_grad():
        probs = model(**inputs, output_attentions=True).attentions[layer - 1][0].double()  # [H, N, N]
    ids = inputs["input_ids"][0]
    media = _media(ids)
    n_a = int((ids == SYNTHETIC_TOKENS.audio).sum())
    k = exact_budget(n_a, media.numel() - n_a, keep_ratio, 0.5).total
    scores = probs[:, rows][..., media].mean(dim=(0, 1))
    return media[topk_indices_ref(scores, k)].tolist()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("layer", "query"), [(2, "last"), (3, "question"), (1, "last")])
def test_fastv_kept_sets_equal_joint_topk_over_eager_attention(eager_model, attn, layer, query):
    inputs = clip_inputs(eager_model, **CLIP)
    n = inputs["input_ids"].shape[1]
    rows = [n - 1] if query == "last" else list(range(n - 9, n - 5))  # 4 rows before <|im_end|> \n <|im_start|> ..
    want = fastv_reference(eager_model, inputs, 0.3, layer, rows)
    model = eager_model if attn == "eager" else build_thinker(num_layers=5, hidden_size=64, attn_implementation=attn,
                                                              seed=6)
    policy = macer.FastVConfig(keep_ratio=0.3, layer=layer, query=query)
    with torch.no_grad(), macer.compress(model, policy) as trace:
        out = model(**inputs, use_cache=True)
    record = trace.last
    assert sorted(record.audio_kept + record.video_kept) == want
    assert record.query_positions == rows and record.policy == "fastv"
    assert record.budget == (len(want), len(record.audio_kept), len(record.video_kept))
    assert 0 < len(record.audio_kept) < record.n_audio or 0 < len(record.video_kept) < record.n_video
    text = n - record.n_audio - record.n_video
    assert record.layer_tokens == [n] * layer + [text + len(want)] * (5 - layer)
    assert out.logits.shape[1] == text + len(want) and trace.cache_lengths == record.layer_tokens
    assert [(s.layer, s.modalities) for s in record.stages] == [(layer, ("audio", "video"))]


def _random_reference(ids: torch.Tensor, keep_ratio: float, seed: int) -> list[int]:
    media = _media(ids)
    n_a = int((ids == SYNTHETIC_TOKENS.audio).sum())
    k = exact_budget(n_a, media.numel() - n_a, keep_ratio, 0.5).total
    order = torch.randperm(media.numel(), generator=torch.Generator().manual_seed(seed))
    return sorted(media[order[:k]].tolist())


def test_random_is_reproducible_documented_and_prunes_before_layer_one(eager_model):
    inputs = clip_inputs(eager_model, **CLIP)
    ids = inputs["input_ids"][0]
    n = ids.numel()
    kept = {}
    with torch.no_grad():
        for seed in (0, 0, 7):
            with macer.compress(eager_model, macer.RandomConfig(keep_ratio=0.25, seed=seed)) as trace:
                out = eager_model.generate(**inputs, max_new_tokens=2, do_sample=False)
            record = trace.history[0]
            kept.setdefault(seed, []).append(sorted(record.audio_kept + record.video_kept))
            assert kept[seed][-1] == _random_reference(ids, 0.25, seed)
            text = n - record.n_audio - record.n_video
            assert record.layer_tokens == [text + record.budget.total] * 5 == trace.cache_lengths
            assert [s.layer for s in record.stages] == [0] and record.query_positions == []
            assert out.shape[1] == n + 2
    assert kept[0][0] == kept[0][1] and kept[0][0] != kept[7][0]


def test_random_draw_is_uniform():
    """Over 4000 seeds each of 40 candidate tokens is kept about K/n = 1/4 of the time: every count lies within
    6 binomial standard deviations (a fixed seed list: the outcome is deterministic, it cannot flake; for a
    uniform draw such a deviation has probability < 1e-7 per token), and the kept sets always have K tokens."""
    labels = torch.tensor([0] * 5 + [AUDIO] * 16 + [VISUAL] * 24 + [0] * 5)
    facts = PromptFacts(labels=labels, temporal=torch.arange(50), input_ids=None, end_of_turn_token_id=None,
                        num_layers=4)
    seeds, counts = 4000, torch.zeros(50)
    for seed in range(seeds):
        plan = plan_prefill(macer.RandomConfig(keep_ratio=0.25, seed=seed), facts)
        picks = plan.stages[0].picks[0]
        assert picks.numel() == 10 and bool((labels[picks] != 0).all())
        counts[picks] += 1
    p = 10 / 40
    mean, sd = seeds * p, (seeds * p * (1 - p)) ** 0.5
    assert counts[labels == 0].sum() == 0
    deviation = (counts[labels != 0] - mean).abs().max() / sd
    assert deviation < 6, f"max deviation {deviation:.2f} sd"
    # Not trivially uniform because of a fixed pattern: the sets differ between seeds.
    first = [tuple(plan_prefill(macer.RandomConfig(0.25, seed=s), facts).stages[0].picks[0].tolist())
             for s in range(50)]
    assert len(set(first)) == 50


POLICIES = {
    "macer": lambda m, r: macer_config_for(m, keep_ratio=r, audio_layer=2, video_layer=3),
    "fastv": lambda m, r: macer.FastVConfig(keep_ratio=r, layer=2),
    "random": lambda m, r: macer.RandomConfig(keep_ratio=r, seed=1),
    "macer_raw": lambda m, r: macer.make_policy("macer_raw", keep_ratio=r, audio_layer=2, video_layer=3),
    "shared_topk": lambda m, r: macer.make_policy("shared_topk", keep_ratio=r, audio_layer=2, video_layer=3),
    "no_coverage": lambda m, r: macer.make_policy("no_coverage", keep_ratio=r, audio_layer=2, video_layer=3),
    "single_readout": lambda m, r: macer.make_policy("single_readout", keep_ratio=r, video_layer=3),
    "full": lambda m, r: macer.make_policy("full"),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_keep_ratio_one_is_bit_identical_and_exit_restores_for_every_policy(attn):
    model = build_thinker(num_layers=5, hidden_size=32, num_heads=2, num_kv_heads=1, attn_implementation=attn, seed=6)
    inputs = clip_inputs(model, frames=4, grid_hw=(4, 4), audio_tokens=40, seed=1)  # 8 video + 40 audio tokens
    with torch.no_grad():
        want = model(**inputs).logits
        for name, make in POLICIES.items():
            with macer.compress(model, make(model, 1.0)) as trace:
                assert torch.equal(model(**inputs).logits, want), name
            assert not trace.last.pruned and trace.last.policy == make(model, 1.0).name, name
            with macer.compress(model, make(model, 0.3)) as trace:
                pruned = model(**inputs).logits
            assert (pruned.shape[1] < want.shape[1]) == (name != "full"), name
            assert torch.equal(model(**inputs).logits, want), name  # restored bit for bit
    assert all(not layer._forward_pre_hooks for layer in model.model.language_model.layers)


def test_make_policy_resolves_names_to_documented_settings(eager_model):
    assert macer.make_policy("macer") == macer.MacerConfig()
    assert macer.make_policy("macer", keep_ratio=0.35) == macer.MacerConfig(keep_ratio=0.35)
    assert macer.make_policy("macer_raw").scoring == "raw"
    assert macer.make_policy("no_coverage").coverage_weight == 0.0
    single = macer.make_policy("single_readout")
    assert (single.audio_layer, single.video_layer) == (5, 5)
    assert macer.make_policy("shared_topk", keep_ratio=0.25) == macer.FastVConfig(keep_ratio=0.25, layer=5,
                                                                                   query="question")
    assert macer.make_policy("fastv", keep_ratio=0.5, layer=2) == macer.FastVConfig(0.5, 2)
    assert macer.make_policy("random", keep_ratio=0.55, seed=3) == macer.RandomConfig(0.55, 3)
    assert isinstance(macer.make_policy("full"), macer.FullConfig)
    three = macer.make_policy("single_readout", model=thinker_config(text_shape="3B"))
    assert (three.audio_layer, three.video_layer, three.audio_share) == (7, 7, 0.32)
    # A model without the paper's layers: the one readout layer given is used for both stages.
    tiny = macer.make_policy("single_readout", model=eager_model, keep_ratio=0.5, video_layer=2)
    assert (tiny.audio_layer, tiny.video_layer, tiny.keep_ratio) == (2, 2, 0.5)
    with pytest.raises(ValueError, match=r"make_policy\('single_readout'\) sets \['audio_layer'\] itself"):
        macer.make_policy("single_readout", audio_layer=2, video_layer=3)
    assert set(macer.POLICY_NAMES) == {"full", "macer", "fastv", "random", *macer.ABLATIONS}
    with pytest.raises(ValueError, match=r"unknown policy 'omnizip'; known: \['full', 'macer'"):
        macer.make_policy("omnizip")
    with pytest.raises(ValueError, match=r"make_policy\('no_coverage'\) sets \['coverage_weight'\] itself"):
        macer.make_policy("no_coverage", coverage_weight=0.3)
    with pytest.raises(TypeError, match="layer"):
        macer.make_policy("fastv", keep_ratio=0.5)
    with pytest.raises(ValueError, match=r"FastVConfig.layer must be in \[1, 4\] for a decoder with 5 layers"):
        with macer.compress(eager_model, macer.FastVConfig(0.5, 5)):
            pass


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: macer.FastVConfig(0.0, 2), r"FastVConfig.keep_ratio must be a finite real number in \(0.0, 1.0\]"),
        (lambda: macer.FastVConfig(0.5, 0), r"FastVConfig.layer must be an integer >= 1"),
        (lambda: macer.FastVConfig(0.5, 2, query="first"), r"FastVConfig.query must be one of \['last', 'question'\]"),
        (lambda: macer.RandomConfig(1.5), r"RandomConfig.keep_ratio must be a finite real number"),
        (lambda: macer.RandomConfig(0.5, seed=-1), r"RandomConfig.seed must be an integer >= 0"),
        (lambda: macer.RandomConfig(0.5, seed=2**63), r"RandomConfig.seed must be an integer in \[0, 2\*\*63\)"),
        (lambda: macer.FullConfig(0.5), r"FullConfig.keep_ratio must be 1.0"),
        # Issue 21.10: True == 1.0 in Python, so FullConfig(keep_ratio=True) was accepted.
        (lambda: macer.FullConfig(keep_ratio=True), r"FullConfig.keep_ratio must be 1.0 \(a real number"),
        (lambda: macer.FullConfig(keep_ratio="1.0"), r"FullConfig.keep_ratio must be 1.0"),
    ],
)
def test_policy_errors_name_field_and_range(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: macer.make_policy("shared_topk", layer=3),
         r"make_policy\('shared_topk'\) got unknown parameters \['layer'\]; it takes the fields of MacerConfig: .*"
         r"its readout layer is video_layer"),
        (lambda: macer.make_policy("fastv"), r"make_policy\('fastv'\) needs \['keep_ratio', 'layer'\] \(FastVConfig "
                                             r"has no default for them\), e.g. make_policy\('fastv', keep_ratio=..., "
                                             r"layer=...\)"),
        (lambda: macer.make_policy("fastv", keep_ratio=0.5), r"make_policy\('fastv'\) needs \['layer'\]"),
        (lambda: macer.make_policy("random", layer=2),
         r"make_policy\('random'\) got unknown parameters \['layer'\]; it takes the fields of RandomConfig: "
         r"\['keep_ratio', 'seed'\]"),
        (lambda: macer.make_policy("macer", keep=0.5), r"make_policy\('macer'\) got unknown parameters \['keep'\]"),
    ],
)
def test_make_policy_names_unknown_and_missing_parameters(call, message):
    """Guards issue 21.10: ``make_policy("shared_topk", layer=3)`` failed with MacerConfig's bare "unexpected keyword
    argument" (a class the caller never named) and ``make_policy("fastv")`` with the dataclass's bare "missing 2
    required positional arguments"; both now name the policy, the parameters and what it takes."""
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize(
    ("model", "policy", "printed"),
    [
        ("qwen2.5-omni-7b", macer.RandomConfig(0.55), "49.2"),
        ("qwen2.5-omni-7b", macer.FastVConfig(0.50, cost.FASTV_PRUNE_LAYER), "54.1"),
        ("qwen2.5-omni-3b", macer.RandomConfig(0.55), "46.1"),
        ("qwen2.5-omni-3b", macer.FastVConfig(0.50, cost.FASTV_PRUNE_LAYER), "49.2"),
        ("qwen2.5-omni-7b", macer.MacerConfig(keep_ratio=0.25), "34.8"),
        ("qwen2.5-omni-3b", macer.MacerConfig(keep_ratio=0.45, audio_layer=4, video_layer=7), "48.5"),
    ],
)
def test_policy_flops_reproduce_main_table_cells(model, policy, printed):
    assert f"{100 * cost.policy_flops_ratio(policy, model):.1f}" == printed


def test_policy_layer_tokens_and_token_layer_cost():
    # 61 text, 1460 audio, 864 video tokens (the paper's clip), 28 layers.
    fastv = cost.policy_layer_tokens(macer.FastVConfig(0.25, 2), 61, 1460, 864, 28)
    k = exact_budget(1460, 864, 0.25, 0.5).total
    assert fastv == [2385] * 2 + [61 + k] * 26
    assert cost.policy_layer_tokens(macer.RandomConfig(0.25), 61, 1460, 864, 28) == [61 + k] * 28
    staged = cost.policy_layer_tokens(macer.MacerConfig(keep_ratio=0.25), 61, 1460, 864, 28)
    assert staged == cost.staged_layer_tokens(61, 1460, 864, 174, 407, 3, 5, 28)
    assert cost.policy_token_layer_proxy(macer.FastVConfig(0.5, 5), 28) == cost.token_layer_proxy(0.5, 28, 5)
    assert cost.policy_token_layer_proxy(macer.RandomConfig(0.5), 28) == 0.5


def test_trace_cost_of_a_random_prefill_counts_the_pruned_first_layer(eager_model):
    inputs = clip_inputs(eager_model, **CLIP)
    with torch.no_grad(), macer.compress(eager_model, macer.RandomConfig(0.25)) as trace:
        eager_model(**inputs)
    run = cost.trace_cost(trace, eager_model)
    n = inputs["input_ids"].shape[1]
    assert run.full_tokens == n and run.prune_layer == 0 and run.kept_multimodal == trace.budget.total
    assert run.token_layer_ratio == trace.layer_tokens[0] / n
