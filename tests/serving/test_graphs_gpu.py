"""FULL decode CUDA graphs of a MACER engine on a GPU (issue 36 item 2; runs where a CUDA build of vLLM 0.32 and a GPU
are present: ``benchmarks/gpu_check.sh``'s ``vllm_graphs`` step; skipped elsewhere; it has not run yet).

Per attention backend (FLASH_ATTN: FA2 or FA3, whichever vLLM picks on the card; TRITON_ATTN), one compiled engine with
vLLM's default CUDA graphs (FULL_AND_PIECEWISE) on the tests' tiny checkpoint in bf16, batch-invariant kernels
(``VLLM_BATCH_INVARIANT=1``: FlashAttention then splits no decode, so a FULL graph and a piecewise step compute alike):

* the engine's load-time check passed (``macer.vllm.graphcheck``: FULL graphs stay on) after capturing with the
  compacted layers' buffers;
* a batch mixing pruned, unpruned, per-request keep-ratio and text-only requests decodes in FULL graphs, and gives
  the tokens, records and logits (within 1e-2 after log-softmax) of the same engine with FULL graphs turned off for
  its compacted layers' steps (piecewise graphs, the metadata built per step).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.cuda]
pytest.importorskip("vllm.config", reason="needs vLLM: a CUDA build of vLLM 0.32")
from macer.vllm.testing import clip_prompt  # noqa: E402
from vllm_cases import ENGINE_ARGS, engine_settings, generate, make_engine  # noqa: E402

REQUESTS = [
    (clip_prompt(n_audio=24, n_video=64, question=8, seed=41), None),
    (clip_prompt(n_audio=0, n_video=64, question=8, seed=42), {"macer_keep_ratio": 0.5}),
    (clip_prompt(n_audio=0, n_video=0, question=12, seed=43), None),
    (clip_prompt(n_audio=96, n_video=200, question=8, seed=44), None),
    (clip_prompt(n_audio=24, n_video=0, question=8, seed=45), {"macer_keep_ratio": 1.0}),
]


@pytest.fixture(scope="module", params=["FLASH_ATTN", "TRITON_ATTN"])
def graphed(request, tiny_checkpoint, monkeypatch_module):
    monkeypatch_module.setenv("VLLM_BATCH_INVARIANT", "1")
    engine = make_engine(tiny_checkpoint, engine_settings(), **{**ENGINE_ARGS, "enforce_eager": False,
                                                                "dtype": "bfloat16",
                                                                "attention_backend": request.param})
    return engine


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_full_decode_graphs_pass_the_load_time_check_and_serve_what_piecewise_steps_serve(graphed):
    macer = graphed.model.macer
    assert graphed.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert macer.metadata.graphs is not None and macer.binding.full_graphs
    full = generate(graphed, REQUESTS)
    logits = list(graphed.logits)
    assert any(step["step"].graph for step in graphed.steps)
    macer.binding.full_graphs = False
    try:
        piecewise = generate(graphed, REQUESTS)
    finally:
        macer.binding.full_graphs = True
    assert not any(step["step"].graph for step in graphed.steps)
    for a, b in zip(full, piecewise, strict=True):
        assert a.tokens == b.tokens
        assert (a.record.kept_rows, a.record.layer_tokens) == (b.record.kept_rows, b.record.layer_tokens)
    for a, b in zip(logits, graphed.logits, strict=True):
        torch.testing.assert_close(torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1), rtol=0,
                                   atol=1e-2)
