"""The public ops as ``torch.library`` custom ops (``macer_kernels.library``, namespace ``macer``).

* Traced callers see one opaque node per op: ``torch.compile(fullgraph=True)`` (no graph break; AOT autograd's fake
  tensors, and Inductor once for the stride contract), ``make_fx`` in real, fake and symbolic mode; every traced
  function equals the eager call on fresh random inputs, and runs again on other inputs of the same shapes.
* ``torch.library.opcheck`` on each op: schema, fake implementation, AOT dispatch (static and dynamic shapes).
* Eager calls do not go through the custom ops (no dispatch cost on the hot path) and still check values; traced
  calls skip the value checks (a graph holds no host read) and never cache a fake tensor.
* The prepared stage as one op: equal to its eager call, into the caller's ``out`` buffers too.
"""

from __future__ import annotations

import pytest
import torch
from score_inputs import stage_inputs
from sync_guard import NoAtenOps
from torch.fx.experimental.proxy_tensor import make_fx

import macer_kernels as mk
from macer_kernels import StageModality as Mod
from macer_kernels import library
from macer_kernels._validate import tracing
from macer_kernels.prepared import prepare_stage

COUNTS = {1: 11, 2: 17}
MODS = [Mod(1, 11, 4), Mod(2, 17, 6, coverage_weight=0.3)]
B, N = 2, 45


def _inputs(seed, device="cpu"):
    q, k, labels, chunks = stage_inputs(seed, B, N, COUNTS, device=device)
    hidden = torch.randn(B, N, 8, generator=torch.Generator().manual_seed(seed)).to(device)
    return q, k, labels, chunks, hidden


def _every_op(q, k, labels, chunks, hidden):
    """Each public op once, each on the previous ones' results."""
    scores = mk.modality_scores(q, k, labels)
    top = mk.topk_indices(scores[0], 5)
    picks = mk.coverage_select(scores[1], chunks[1], 7, 0.3)
    keep, stage_scores, flags = mk.select_stage(q, k, labels, MODS, chunk_ids=chunks, return_scores=True,
                                                return_flags=True)
    kept = mk.compact(hidden, keep, 1)
    kept_many = mk.compact_many([hidden, chunks], keep, [1, 1])
    one_row = mk.compact(hidden[0], top, 0)
    return scores, top, picks, keep, stage_scores, flags, kept, *kept_many, one_row


OPS = {f"{library.NAMESPACE}.{name}" for name in
       ("modality_scores", "topk_indices", "coverage_select", "select_stage", "compact", "compact_many")}


def _macer_nodes(graph_module) -> list[str]:
    return [str(node.target).rsplit(".", 1)[0] for node in graph_module.graph.nodes
            if node.op == "call_function" and str(node.target).startswith(f"{library.NAMESPACE}.")]


def _assert_equal(got, want, seed):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}, seed={seed}"
        assert torch.equal(g, w), f"output {i}, seed={seed}"


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_make_fx_records_each_op_as_one_node_and_the_graph_equals_eager(mode, seed):
    args = _inputs(seed)
    graph = make_fx(_every_op, tracing_mode=mode)(*args)
    assert sorted(set(_macer_nodes(graph))) == sorted(OPS)
    # Nothing of a backend's implementation is traced: the graph holds the ops and the slicing around them only.
    assert not [n for n in graph.graph.nodes if n.op == "call_function" and "sort" in str(n.target)]
    _assert_equal(graph(*args), _every_op(*args), seed)
    fresh = _inputs(seed + 1)
    _assert_equal(graph(*fresh), _every_op(*fresh), seed + 1)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_equals_eager(compiler, seed, device):
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True, backend=compiler)
    for s in (seed, seed + 1):
        args = _inputs(s, device)
        _assert_equal(compiled(*args), _every_op(*args), s)


def test_inductor_compiles_every_op_with_the_strides_of_its_fake(seed):
    """Inductor checks each output's strides against the fake implementation's (a backend's view, e.g. a selection
    returning the last out_len columns of a sort, failed it before the ops made their outputs contiguous)."""
    torch._dynamo.reset()
    compiled = torch.compile(_every_op, fullgraph=True)
    args = _inputs(seed)
    _assert_equal(compiled(*args), _every_op(*args), seed)


def test_opcheck_every_op(seed):
    q, k, labels, chunks, hidden = _inputs(seed)
    scores = mk.modality_scores(q, k, labels)
    keep = mk.select_stage(q, k, labels, MODS, chunk_ids=chunks)
    positions = torch.arange(N - q.shape[2], N).expand(B, q.shape[2])
    cases = {
        "modality_scores": (q, k, labels, positions, 0.25, 1e-6),
        "topk_indices": (scores[0], 5),
        "coverage_select": (scores[1], chunks[1], 7, 0.3),
        "compact": (hidden, keep, 1),
        "compact_many": ([hidden, chunks], keep, [1, 1]),
        "select_stage": (q, k, labels, positions, chunks, [1, 2], [4, 6], [-1.0, 0.3], [0, 4], keep.shape[1], None,
                         0.25, 1e-6),
    }
    for name, args in cases.items():
        op = getattr(torch.ops.macer, name).default
        torch.library.opcheck(op, args)


def test_eager_calls_skip_the_custom_ops_and_check_values(seed):
    """The eager path calls the backend directly (no custom-op dispatch recorded) and still checks values."""
    args = _inputs(seed)
    with NoAtenOps() as ops:  # records every op dispatched (a custom op's call too)
        assert not tracing()
        _every_op(*args)
    assert ops.ops and not [f for f in ops.ops if f.startswith(f"{library.NAMESPACE}.")]
    scores = mk.modality_scores(*args[:3])[0].clone()
    scores[3] = float("nan")
    with pytest.raises(ValueError, match="scores contains NaN"):
        mk.topk_indices(scores, 2)


def test_traced_calls_skip_value_checks_and_cache_no_fake_tensor(seed):
    """Traced, a NaN score is not read back (the graph holds the op); the default query positions made while
    tracing with fake tensors are not cached for later eager calls."""
    seen = []

    def top(scores):
        seen.append(tracing())
        return mk.topk_indices(scores, 2)

    scores = torch.randn(9)
    scores[3] = float("nan")
    graph = make_fx(top, tracing_mode="fake")(scores)
    assert seen == [True] and _macer_nodes(graph) == [f"{library.NAMESPACE}.topk_indices"]
    q, k, labels, _, _ = _inputs(seed)
    make_fx(lambda q, k, m: mk.modality_scores(q, k, m), tracing_mode="fake")(q, k, labels)
    want = mk.modality_scores(q.double(), k.double(), labels)  # eager after the fake trace: real positions
    torch.testing.assert_close(mk.modality_scores(q, k, labels), want.float(), rtol=1e-5, atol=1e-6)


def test_the_prepared_stage_is_one_op_equal_to_its_eager_call(seed):
    q, k, labels, chunks, hidden = _inputs(seed)
    prepared = prepare_stage(q, k, labels, MODS, chunk_ids=chunks, gather=[hidden, chunks], gather_dims=[1, 1])

    def run(q, k, labels, chunks, hidden):
        return prepared(q, k, labels, chunks, [hidden, chunks])

    def into(q, k, labels, chunks, hidden, keep, flags, kept_hidden, kept_chunks):
        return prepared(q, k, labels, chunks, [hidden, chunks], out=(keep, flags, kept_hidden, kept_chunks))

    graph = make_fx(run, tracing_mode="fake")(q, k, labels, chunks, hidden)
    assert _macer_nodes(graph) == [f"{library.NAMESPACE}.prepared_stage"]
    torch._dynamo.reset()
    compiled, compiled_into = torch.compile(run, fullgraph=True), torch.compile(into, fullgraph=True)
    for s in (seed, seed + 1):
        args = _inputs(s)
        want = run(*args)
        _assert_equal(graph(*args), want, s)
        _assert_equal(compiled(*args), want, s)
        out = prepared.allocate()
        got = compiled_into(*args, *out)
        _assert_equal(got, want, s)
        _assert_equal(out, want, s)  # written into the caller's buffers


def test_a_dropped_prepared_stage_is_named_when_a_graph_calls_it(seed):
    q, k, labels, chunks, _ = _inputs(seed)
    number = prepare_stage(q, k, labels, MODS, chunk_ids=chunks)._number  # the stage itself is dropped at once
    with pytest.raises(RuntimeError, match=f"prepared stage {number} no longer exists"):
        torch.ops.macer.prepared_stage(number, q, k, labels, chunks, [])
