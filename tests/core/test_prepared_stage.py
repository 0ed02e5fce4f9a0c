"""The prepared stage (``macer_kernels.prepared``, ``_C.StagePlan``) and the core's stages on it (issue 37 items 1, 4).

* Every backend: a prepared stage equals ``select_stage`` followed by ``compact_many`` on fresh random inputs, call
  after call, with the question rows read in place or given as the query itself, per-sample budgets and padding.
* The CUDA path's host code on CPU, against a recording stand-in for ``_C``: one ``StagePlan.launch`` per stage, no
  aten op at all inside the call (no allocation, no copy, no index kernel), nothing read back; the plan's
  arguments; one plan and one set of buffers per stream; the core's ``PrefillState`` launching one prepared stage per
  fused stage, each reading the tables the previous one gathered.
* The build: every kernel of the chain waits for its predecessor (``griddepcontrol.wait``, SASS ``ACQBULK``) before
  its first global access in the sm_90 code, and carries no wait in the sm_89 code.
* On a GPU: exact against the PyTorch backend, no synchronisation (torch's sync debug mode), 3-4 kernels, and a
  CUDA graph of the prepared stage replayed on fresh inputs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from binding_args import bind
from score_inputs import stage_inputs
from sync_guard import NoAtenOps, no_host_reads

import macer_kernels as mk
from macer_kernels import StageModality as Mod
from macer_kernels import _validate, backend, compact_many, select_stage, use_backend
from macer_kernels.prepared import prepare_stage
from macer_kernels.reference import stage_select_ref


def _fresh_seed() -> int:
    return torch.seed() % 2**31


def _tables(b, n, hidden, seed, device):
    """Row tables of a stage: prompt positions [B, N], hidden states [B, N, H], M-RoPE ids [3, B, N]."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(n).expand(b, n).contiguous()
    states = torch.randn(b, n, hidden, generator=g)
    rope_ids = torch.randint(0, 1000, (3, b, n), generator=g)
    return [t.to(device) for t in (positions, states, rope_ids)], [1, 1, 2]


CASES = {
    "topk+coverage, question rows in place": dict(b=2, n=77, counts={1: 23, 2: 31, 3: 5}, rows=range(70, 73),
                                                  mods=[Mod(1, 23, 9), Mod(2, 31, 12, coverage_weight=0.3)]),
    "last rows as the query": dict(b=1, n=64, counts={1: 20, 2: 30}, rows=None,
                                   mods=[Mod(2, 30, 7, coverage_weight=0.0, num_chunks=4)]),
    "per-sample budgets": dict(b=3, n=50, counts={1: 12, 2: 20}, rows=range(45, 49),
                               mods=[Mod(1, 12, [3, 0, 12]), Mod(2, 20, [5, 20, 1], coverage_weight=1.5)]),
    "per-sample question rows": dict(b=3, n=50, counts={1: 12, 2: 20},
                                     rows=[range(40, 43), range(46, 49), range(21, 24)],
                                     mods=[Mod(1, 12, [3, 0, 12]), Mod(2, 20, 6, coverage_weight=0.4)]),
    "per-sample ranges all equal": dict(b=2, n=40, counts={1: 10}, rows=[range(30, 34)] * 2, mods=[Mod(1, 10, 4)]),
}


def _question(query, rows, b):
    """The question rows of ``query`` and their positions as ``select_stage`` takes them, for ``query_rows``."""
    if rows is None:
        return query, None
    per = [rows] * b if isinstance(rows, range) else rows
    positions = torch.tensor([list(r) for r in per], device=query.device)
    index = positions[:, None, :, None].expand(b, query.shape[1], positions.shape[1], query.shape[3])
    return query.gather(2, index), positions


@pytest.mark.parametrize("case", list(CASES))
def test_prepared_stage_equals_select_stage_then_compact_many(backend, case):
    name, device = backend
    spec = CASES[case]
    b, n, rows, mods = spec["b"], spec["n"], spec["rows"], spec["mods"]
    seed = _fresh_seed()
    q, k, labels, chunks = stage_inputs(seed, b, n, spec["counts"], device=device)
    coverage = any(m.coverage_weight is not None for m in mods)
    chunks = chunks if coverage else None
    query = torch.randn(b, q.shape[1], n, q.shape[3]).to(device) if rows is not None else q
    tables, dims = _tables(b, n, 6, seed, device)
    prepared = prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=rows, gather=tables,
                             gather_dims=dims)
    out = prepared.allocate()
    for call in range(2):  # the same prepared stage on fresh inputs (the second into the caller's buffers)
        if call:
            q, k, labels, chunks_new = stage_inputs(seed + 1, b, n, spec["counts"], device=device)
            chunks = chunks_new if coverage else None
            query = torch.randn(b, q.shape[1], n, q.shape[3]).to(device) if rows is not None else q
            tables, _ = _tables(b, n, 6, seed + 1, device)
        got = prepared(query, k, labels, chunks, tables, out=out if call else None)
        if call:
            assert all(g is o for g, o in zip(got, out, strict=True))  # written in place
        q_rows, positions = _question(query, rows, b)
        keep, scores, flags = select_stage(q_rows, k, labels, mods, chunk_ids=chunks, query_positions=positions,
                                           return_scores=True, return_flags=True)
        assert torch.equal(got[0], keep), f"seed={seed} call={call} ({name})"
        assert torch.equal(got[1], flags) and not flags.any(), f"seed={seed}"
        torch.testing.assert_close(prepared.last_scores, scores, rtol=0, atol=0)
        with use_backend("torch"):
            expected = compact_many([t.cpu() for t in tables], keep.cpu(), dims)
        for got_t, want in zip(got[2:], expected, strict=True):
            assert torch.equal(got_t.cpu(), want), f"seed={seed} call={call}"


def test_prepare_checks_once_and_a_call_names_what_differs():
    q, k, labels, chunks = stage_inputs(0, 1, 40, {1: 10, 2: 12})
    mods = [Mod(1, 10, 4), Mod(2, 12, 3, coverage_weight=0.2)]
    query = torch.randn(1, 4, 40, 32)
    with pytest.raises(ValueError, match=r"query_rows must be a non-empty range with step 1"):
        prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=range(38, 40, 2))
    with pytest.raises(ValueError, match=r"query_rows must lie in \[0, N=40\)"):
        prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=range(38, 41))
    with pytest.raises(ValueError, match=r"query_rows must lie in .* query must hold N=40 rows"):
        prepare_stage(q, k, labels, mods, chunk_ids=chunks, query_rows=range(0, 3))
    with pytest.raises(ValueError, match=r"query_rows must be one range or B=1 ranges \(one per sample\), got 2"):
        prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=[range(30, 33)] * 2)
    with pytest.raises(ValueError, match=r"query_rows\[0\] must be a non-empty range with step 1, got \[30, 31\]"):
        prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=[[30, 31]])
    _, k2, labels2, chunks2 = stage_inputs(0, 2, 40, {1: 10, 2: 12})
    query2 = torch.randn(2, 4, 40, 32)
    with pytest.raises(ValueError, match=r"query_rows must all have one length .* 3 rows in query_rows\[0\] and 2 "
                                         r"in query_rows\[1\]"):
        prepare_stage(query2, k2, labels2, mods, chunk_ids=chunks2, query_rows=[range(30, 33), range(30, 32)])
    with pytest.raises(ValueError, match=r"query_rows\[1\] must lie in \[0, N=40\)"):
        prepare_stage(query2, k2, labels2, mods, chunk_ids=chunks2, query_rows=[range(30, 33), range(38, 41)])
    with pytest.raises(ValueError, match=r"chunk_ids is required exactly when a modality uses coverage_weight"):
        prepare_stage(q, k, labels, mods)
    with pytest.raises(ValueError, match=r"modalities\[0\].keep must be in \[0, 10\]"):
        prepare_stage(q, k, labels, [Mod(1, 10, 11)])
    with pytest.raises(ValueError, match=r"gather_dims\[0\] must be an int in \[1, 1\]"):
        prepare_stage(q, k, labels, mods, chunk_ids=chunks, gather=[labels], gather_dims=[0])
    with pytest.raises(ValueError, match=r"gather\[0\] must hold N=40 rows along dim 1 after a batch dim of size B=1"):
        prepare_stage(q, k, labels, mods, chunk_ids=chunks, gather=[labels[:, :9]], gather_dims=[1])
    prepared = prepare_stage(q, k, labels, mods, chunk_ids=chunks, gather=[labels], gather_dims=[1])
    assert prepared.out_len == 40 - 6 - 9
    with pytest.raises(ValueError, match=r"^key must have the shape \(1, 2, 40, 32\), strides .* got shape"):
        prepared(q, k[:, :, :39], labels, chunks, [labels])
    with pytest.raises(ValueError, match=r"^labels must have the .* torch.int64"):
        prepared(q, k, labels.int(), chunks, [labels])
    with pytest.raises(ValueError, match=r"^gather must hold the 1 tensors"):
        prepared(q, k, labels, chunks, [])
    with pytest.raises(ValueError, match=r"^gather\[0\] must have the shape \(1, 40\)"):
        prepared(q, k, labels, chunks, [labels[:, :39]])
    keep, flags, table = prepared.allocate()
    with pytest.raises(ValueError, match=r"^out\[0\] must be a contiguous torch.int64 tensor of shape \(1, 25\)"):
        prepared(q, k, labels, chunks, [labels], out=(keep[:, :5], flags, table))
    with pytest.raises(ValueError, match=r"^out must hold \(keep, flags, \*gathered\): 3 tensors, got 2"):
        prepared(q, k, labels, chunks, [labels], out=(keep, flags))
    wrong = labels.clone()
    wrong[0, :3] = 1  # more tokens of label 1 than the count the stage was prepared with: a value check (CPU)
    with pytest.raises(ValueError, match=r"modalities\[0\].count says sample 0 holds 10 tokens of label 1"):
        prepared(q, k, wrong, chunks, [labels])


# ---- the CUDA path's host code, against a recording stand-in for _C ---------------------------------------------


class _Plan:
    def __init__(self, calls: list, args: tuple):
        self.calls, self.args, self.chain = calls, args, args[-3]
        calls.append(("StagePlan", args))

    def launch(self, *args, **kwargs):
        self.calls.append(("launch", bind("launch", args, kwargs)))  # the binding's py::arg names, in its order


class StageExt:
    """Stands in for ``macer_kernels._C``: records the prepared stage's plans and launches."""

    MAX_STAGE_MODALITIES = 8

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        names = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64")
        self.DTYPE_CODES = {name: code for code, name in enumerate(names)}

    def StagePlan(self, *args, **kwargs):
        assert kwargs.get("counters")  # the scoring kernels' zeroed counter buffer of the stream (score-37)
        return _Plan(self.calls, bind("StagePlan", args, kwargs)[:-1])  # in the declared order, counters last

    def __getattr__(self, name):
        values = {"modality_scores_max_head_dim": 256, "modality_scores_workspace_bytes": 4096,
                  "modality_scores_counter_count": 72,
                  "stage_chain_supported": True, "select_cta_max_n": 1 << 15}
        if name not in values:
            raise AttributeError(name)

        def query(*args):
            self.calls.append((name, args))
            return values[name]

        return query

    def launches(self):
        return [args for name, args in self.calls if name == "launch"]

    def plans(self):
        return [args for name, args in self.calls if name == "StagePlan"]


@pytest.fixture
def recording_stage(monkeypatch):
    """The ``cuda`` backend made to run the prepared stage's host code on CPU tensors: ``_C`` replaced by
    ``StageExt``, the device / stream queries and the "is a CUDA tensor" check stubbed (they read metadata only), and
    CPU tensors treated as device tensors by the value checks (validation off, as in serving)."""
    import macer_kernels.cuda  # noqa: F401  (registers the cuda implementations)
    from macer_kernels.cuda import _ext
    from macer_kernels.cuda import stage as cuda_stage

    fake = StageExt()
    fake.stream = 7
    monkeypatch.setattr(_ext, "_ext_module", fake)
    monkeypatch.setattr(_ext, "IMPORT_ERROR", None)
    monkeypatch.setattr(cuda_stage, "prepared_on_cuda", lambda labels, coverage: True)
    monkeypatch.setattr(cuda_stage, "launch_args", lambda t: (0, fake.stream))
    monkeypatch.setattr(cuda_stage, "_raw_stream", lambda index: fake.stream)
    monkeypatch.setattr(cuda_stage, "check_cuda_tensor", lambda *args: None)
    monkeypatch.setitem(backend._status_cache, "cuda", None)
    monkeypatch.setattr(backend, "_runs_on", lambda name, device: True)
    monkeypatch.setattr(_validate, "HOST_DEVICE_TYPES", ())
    monkeypatch.delenv("MACER_VALIDATE", raising=False)
    with use_backend("cuda"), mk.validation(False):
        yield fake


def test_prepared_cuda_stage_is_one_launch_and_nothing_else(recording_stage):
    fake = recording_stage
    _, k, labels, chunks = stage_inputs(3, 2, 90, {1: 30, 2: 40}, dtype=torch.bfloat16)
    query = torch.randn(2, 4, 90, 32).to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)  # a bnhd view
    mods = [Mod(1, 30, 10), Mod(2, 40, [12, 7], coverage_weight=0.25, num_chunks=4)]
    tables, dims = _tables(2, 90, 8, 3, "cpu")
    prepared = prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=range(84, 88), gather=tables,
                             gather_dims=dims)
    ((plan_args),) = fake.plans()
    sizes, row0, chain = plan_args[2], plan_args[-4], plan_args[-3]
    assert sizes == (2, 4, 4, 32, 2, 90) and row0 == 84 and chain is True
    handle = prepared.cuda
    assert plan_args[4] == handle.positions.data_ptr() and handle.positions.tolist() == [[84, 85, 86, 87]] * 2
    assert plan_args[5:7] == (handle.streams[7][1].data_ptr(), handle.streams[7][2].data_ptr())  # scores, workspace
    assert plan_args[10] == [(1, 10, 0.0, False), (2, 12, 0.25, True)]  # the spec keeps the largest budget
    assert plan_args[13] == handle.keeps.data_ptr() and handle.keeps.tolist() == [[10, 12], [10, 7]]
    assert plan_args[14] == [(list(t.shape), list(t.stride()), t.element_size(), d) for t, d in zip(tables, dims)]
    out = prepared.allocate()
    for seed in (4, 5):  # two calls: one launch each, the plan made once
        _, k, labels, chunks = stage_inputs(seed, 2, 90, {1: 30, 2: 40}, dtype=torch.bfloat16)
        with no_host_reads(), NoAtenOps() as ops:
            got = prepared(query, k, labels, chunks, tables, out=out)
        assert ops.ops == [] and all(g is o for g, o in zip(got, out, strict=True))
        launch = fake.launches()[-1]
        assert launch == (query.data_ptr(), query.stride(), k.data_ptr(), k.stride()[:3], labels.data_ptr(),
                          chunks.data_ptr(), out[0].data_ptr(), out[1].data_ptr(), [t.data_ptr() for t in tables],
                          [t.data_ptr() for t in out[2:]], 7)
    assert len(fake.launches()) == 2 and len(fake.plans()) == 1
    assert prepared.last_scores is handle.streams[7][1]
    fake.stream = 9  # another stream: its own plan and buffers, made at its first call
    prepared(query, k, labels, chunks, tables, out=out)
    assert len(fake.plans()) == 2 and set(handle.streams) == {7, 9}
    assert fake.plans()[-1][5] == handle.streams[9][1].data_ptr() != handle.streams[7][1].data_ptr()
    assert fake.launches()[-1][-1] == 9


def test_without_out_the_call_allocates_only_its_outputs(recording_stage):
    q, k, labels, _ = stage_inputs(1, 1, 30, {1: 10})
    prepared = prepare_stage(q, k, labels, [Mod(1, 10, 4)], gather=[labels], gather_dims=[1])
    with NoAtenOps() as ops:
        keep, flags, table = prepared(q, k, labels, None, [labels])
    assert ops.ops == ["aten.empty.memory_format"] * 3
    assert keep.shape == (1, 24) and flags.shape == (1,) and table.shape == (1, 24)


def test_per_sample_question_rows_are_one_gather_and_one_launch(recording_stage):
    """Per-sample question rows on the (recorded) CUDA path: the plan reads a ``[B, Lq]`` positions table uploaded
    at prepare (``positions_stride`` = Lq, query row 0), and a call is one ``torch.gather`` of each sample's rows
    into the stream's persistent query buffer (no allocation) and one ``StagePlan.launch`` reading that buffer.
    Ranges equal in every sample are the shared path (no table, no gather)."""
    fake = recording_stage
    _, k, labels, chunks = stage_inputs(6, 3, 60, {1: 20, 2: 15})
    query = torch.randn(3, 4, 60, 32)
    mods = [Mod(1, 20, [5, 9, 2]), Mod(2, 15, 4, coverage_weight=0.3, num_chunks=4)]
    rows = [range(50, 53), range(56, 59), range(41, 44)]
    prepared = prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=rows, gather=[labels],
                             gather_dims=[1])
    ((plan_args),) = fake.plans()
    handle = prepared.cuda
    assert plan_args[2] == (3, 4, 3, 32, 2, 60) and plan_args[-4] == 0  # Lq = 3 rows, read from row 0
    assert plan_args[-1] == 3  # positions_stride: one row of the table per sample
    assert plan_args[4] == handle.positions.data_ptr() and handle.positions.tolist() == [list(r) for r in rows]
    buffer = handle.streams[7][4]
    assert tuple(buffer.shape) == (3, 4, 3, 32) and buffer.dtype == query.dtype
    out = prepared.allocate()
    for seed in (7, 8):
        query = torch.randn(3, 4, 60, 32, generator=torch.Generator().manual_seed(seed))
        with no_host_reads(), NoAtenOps() as ops:
            prepared(query, k, labels, chunks, [labels], out=out)
        assert ops.ops == ["aten.gather.out"], ops.ops
        launch = fake.launches()[-1]
        assert launch[:2] == (buffer.data_ptr(), buffer.stride())  # the plan reads the gathered rows
        want, _ = _question(query, rows, 3)
        assert torch.equal(buffer, want)
    assert len(fake.plans()) == 1
    shared = prepare_stage(query, k, labels, mods, chunk_ids=chunks, query_rows=[range(50, 53)] * 3)
    assert fake.plans()[-1][-1] == 0 and fake.plans()[-1][-4] == 50 and shared.cuda.streams[7][4] is None


def _core_prefill(keep_ratio=0.3):
    import macer
    from macer.core.policy import AUDIO, TEXT, VISUAL, PromptFacts, plan_prefill

    layout = [TEXT] * 3 + [AUDIO] * 17 + [VISUAL] * 23 + [AUDIO, VISUAL, VISUAL] * 9 + [TEXT] * 7
    facts = PromptFacts(labels=torch.tensor(layout), temporal=torch.arange(len(layout)) // 3, input_ids=None,
                        end_of_turn_token_id=None, num_layers=6, question_end=len(layout) - 1)
    return plan_prefill(macer.MacerConfig(keep_ratio=keep_ratio, audio_layer=2, video_layer=4), facts)


def _readout(n, i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)


def test_the_core_runs_one_prepared_launch_per_fused_stage_on_the_tables_the_last_gathered(recording_stage,
                                                                                          monkeypatch):
    """A MACER prefill's two stages through ``PrefillState``: one ``StagePlan.launch`` each and, once the layout's
    stages are prepared (a second prefill of it), no aten op inside ``run`` (the outputs were carved before the first
    layer); the second stage reads the labels and chunk ids the first one gathered and gathers from its positions;
    ``take_pending`` gives the gathered positions as ``current``."""
    from collections import OrderedDict

    from macer.core import stage as core_stage
    from macer.core.prefill import PrefillState

    monkeypatch.setattr(core_stage, "_PREPARED", OrderedDict())
    fake = recording_stage
    plan = _core_prefill()
    length = plan.facts.length
    for prefill in range(2):
        state = PrefillState(plan, torch.device("cpu"))
        for i, stage in enumerate(plan.stages):
            n = stage.tokens_before
            query, key = _readout(n, i)
            with no_host_reads(), NoAtenOps() as ops:
                state.run(query, key, None, 1e-6)
            if prefill:
                assert ops.ops == [], ops.ops
            launch = fake.launches()[-1]
            assert len(fake.launches()) == 2 * prefill + i + 1  # one launch per stage
            assert len(fake.plans()) == (2 if prefill else i + 1)  # each stage prepared once
            plan_args = fake.plans()[i]
            assert plan_args[2][5] == n and plan_args[-4] == stage.query.tolist()[0] - (length - n)
            buffers = state._outs[i][0]
            assert launch[6:8] == (buffers[0].data_ptr(), buffers[1].data_ptr())
            assert launch[9] == [t.data_ptr() for t in buffers[2:]]
            if i == 1:  # the second stage reads what the first gathered (labels, chunk ids) and gathers from it
                gathered = state._outs[0][0][2:]
                assert launch[4:6] == (gathered[1].data_ptr(), gathered[2].data_ptr())
                assert launch[8] == [t.data_ptr() for t in gathered]
            else:
                assert launch[4:6] == (state.labels.data_ptr(), 0)  # the prompt's labels; top-K reads no chunk ids
            keep = state.pending
            assert keep.shape == (stage.tokens_after,) and keep.data_ptr() == buffers[0].data_ptr()
            assert state.take_pending() is keep and state.current.data_ptr() == buffers[2].data_ptr()
        assert len(state.nonfinite) == 2


def test_the_core_stage_tables_chain_on_the_cpu_backend():
    """The same prefill on CPU tensors (PyTorch backend): each stage's gathered positions are ``current[keep]``, its
    labels and chunk ids those of the prompt there; a stage that a batch ran itself (``macer.hf.batch`` advances
    ``next`` and sets ``current``) makes the next one rebuild its tables from ``current``, with the same result."""
    from macer.core.prefill import PrefillState

    plan = _core_prefill(keep_ratio=0.4)
    state = PrefillState(plan, torch.device("cpu"))
    keeps = []
    for i, stage in enumerate(plan.stages):
        before = state.current
        state.run(*_readout(stage.tokens_before, i), None, 1e-6)
        rows, keep = state._rows, state.pending
        assert torch.equal(rows.current[0], before[keep])
        assert torch.equal(rows.labels[0], state.labels[before[keep]])
        assert torch.equal(rows.chunks[0], state.chunks[before[keep]])
        keeps.append(keep.clone())
        state.take_pending()
        assert torch.equal(state.current, before[keep])
    batch = PrefillState(plan, torch.device("cpu"))
    batch.next, batch.current = 1, batch.full[keeps[0]]  # the first stage ran elsewhere
    batch.run(*_readout(plan.stages[1].tokens_before, 1), None, 1e-6)
    assert torch.equal(batch.pending, keeps[1]) and torch.equal(batch._rows.current, state._rows.current)


# ---- the build: the chain's kernels wait before they touch global memory ---------------------------------------

CHAIN_KERNELS = ("scores_tile_kernel", "scores_reduce_kernel", "select_cta_kernel", "compact_kernel")
# (S-B, the sm_90a scoring kernel, is checked the same way in tests/kernels/test_cuda_scores_sass.py.)
# SASS instructions that access global (or generic) memory.
GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LD|ST|ATOM|ATOMG|RED|LDGSTS|LDGDEPBAR|UBLKCP|UTMALDG)\b")


def _sass_by_arch() -> dict[str, dict[str, list[str]]]:
    spec = importlib.util.find_spec("macer_kernels._C")
    if spec is None or spec.origin is None:
        pytest.skip("the CUDA extension is not built")
    tools = {}
    for tool in ("cuobjdump", "nvdisasm"):
        found = shutil.which(tool)
        if found is None:
            import triton

            candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
            found = str(candidate) if candidate.exists() else None
        if found is None:
            pytest.skip(f"{tool} not found")
        tools[tool] = found
    env = {**os.environ, "PATH": f"{Path(tools['nvdisasm']).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    sass = subprocess.run([tools["cuobjdump"], "-sass", spec.origin], capture_output=True, text=True, check=True,
                          env=env).stdout
    out: dict[str, dict[str, list[str]]] = {}
    arch = function = None
    for line in sass.splitlines():
        if m := re.search(r"code for (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            function = m.group(1)
            out.setdefault(arch, {})[function] = []
        elif function is not None and (m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)):
            out[arch][function].append(m.group(1))
    return out


def test_chain_kernels_wait_for_their_predecessor_before_any_global_access():
    """In the sm_90 code each kernel of the stage's chain starts with the wait (``griddepcontrol.wait`` is SASS
    ``ACQBULK``) before its first global load or store, and lets its successor launch (``PREEXIT``); the sm_89 code
    has neither (the wait compiles to nothing below sm_90, where the chain is launched without PDL)."""
    sass = _sass_by_arch()
    if "sm_90" not in sass:
        pytest.skip("the extension has no sm_90 code (MACER_CUDA_ARCHS)")
    for arch, functions in sass.items():
        chain = {name: body for name, body in functions.items() if any(k in name for k in CHAIN_KERNELS)}
        assert {k for k in CHAIN_KERNELS if any(k in name for name in chain)} == set(CHAIN_KERNELS), arch
        for name, body in chain.items():
            waits = [i for i, ins in enumerate(body) if ins.split()[0] == "ACQBULK"]
            if arch == "sm_90":
                accesses = [i for i, ins in enumerate(body) if GLOBAL_ACCESS.search(ins.split()[0])]
                assert waits and accesses and waits[0] < accesses[0], (arch, name, body[: max([*accesses[:1], 5])])
                assert any(ins.split()[0] == "PREEXIT" for ins in body), (arch, name)
            elif arch == "sm_89":
                assert not waits, (arch, name)


# ---- on a GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_prepared_stage_exact_no_sync_five_kernels_and_graph_replay():
    """The prepared stage on a GPU: bitwise equal to the same kernels run op by op (the selection exact against the
    float64 oracle on its scores), no synchronisation (torch's sync debug mode raises
    on one), its kernels (scoring: two for S-A, one for S-B; one selection; one gather), chained with PDL on sm_90,
    and a CUDA graph of it replayed on fresh inputs equal to eager."""
    seed = _fresh_seed()
    counts = {1: 400, 2: 600}
    mods = [Mod(1, 400, 120), Mod(2, 600, 150, coverage_weight=0.2, num_chunks=8)]

    def inputs(s):
        _, k, labels, chunks = stage_inputs(s, 1, 1200, counts, hq=28, hkv=4, lq=4, d=128, dtype=torch.bfloat16,
                                            device="cuda", chunks=8)
        query = torch.randn(1, 28, 1200, 128, generator=torch.Generator().manual_seed(s)).to("cuda", torch.bfloat16)
        hidden = torch.randn(1, 1200, 512, generator=torch.Generator().manual_seed(s)).to("cuda", torch.bfloat16)
        return [query, k, labels, chunks, [torch.arange(1200, device="cuda")[None], labels, chunks, hidden]]

    rows = range(1190, 1194)
    x = inputs(seed)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), mk.validation(False):
        prepared = prepare_stage(x[0], x[1], x[2], mods, chunk_ids=x[3], query_rows=rows, gather=x[4],
                                 gather_dims=[1, 1, 1, 1])
        assert prepared.cuda is not None
        out = prepared.allocate()
        prepared(*x, out=out)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            prepared(*x, out=out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            prepared(*x, out=out)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    from macer_kernels.cuda.modality_scores import scores_path

    scoring = 1 if scores_path(x[0][:, :, rows.start:rows.stop], x[1])[0] == "sb" else 2
    assert len(kernels) == scoring + 2, kernels
    major = torch.cuda.get_device_capability()[0]
    assert prepared.cuda.chained == (major >= 9)

    def reference(x):
        """The same kernels launched one op at a time (bitwise the same results), and the selection's exactness on
        the scores against the float64 oracle."""
        with use_backend("cuda"):
            keep, scores, flags = select_stage(x[0][:, :, rows.start:rows.stop], x[1], x[2], mods, chunk_ids=x[3],
                                               query_positions=torch.arange(1190, 1194, device="cuda")[None],
                                               return_scores=True, return_flags=True)
            assert torch.equal(prepared.last_scores, scores), f"seed={seed}"
            assert torch.equal(keep.cpu(), stage_select_ref(scores.cpu(), x[2].cpu(), mods, x[3].cpu()))
            return [keep, flags, *compact_many(x[4], keep, [1, 1, 1, 1])]

    for got, want in zip(out, reference(x), strict=True):
        assert torch.equal(got, want), f"seed={seed}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), mk.validation(False):
        prepared(*x, out=out)
    fresh = inputs(seed + 1)
    for dst, src in zip(x[:4] + x[4], fresh[:4] + fresh[4], strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(out, reference(x), strict=True):
        assert torch.equal(got, want), f"seed={seed} (graph replay)"


def _engine_tensors(n, seed):
    """A transformers layer's per-token inputs: hidden states, RoPE cos, M-RoPE position ids, cache positions."""
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(1, n, 12, generator=g), torch.randn(1, n, 16, generator=g),
             torch.randint(0, 99, (3, 1, n), generator=g), torch.arange(n)], [1, 1, 2, 0])


def test_a_deferred_stage_compacts_the_engines_tensors_in_its_own_call():
    """``PrefillState(defer=True)``: the readout is kept until the next layer, where ``apply`` scores, selects and
    compacts the engine's tensors (a 1-D ``cache_position`` included) in the stage's call; keep, tables, flags and
    tensors equal those of an eager prefill followed by ``compact_many``."""
    from macer.core.prefill import PrefillState

    plan = _core_prefill(keep_ratio=0.35)
    eager, deferred = PrefillState(plan, torch.device("cpu")), PrefillState(plan, torch.device("cpu"), defer=True)
    for i, stage in enumerate(plan.stages):
        readout = _readout(stage.tokens_before, i)
        tensors, dims = _engine_tensors(stage.tokens_before, i)
        eager.run(*readout, None, 1e-6)
        before = eager.current
        keep, want = eager.apply(tensors, dims)
        assert torch.equal(eager.current, before[keep])
        for got, t, d in zip(want, tensors, dims, strict=True):
            assert torch.equal(got, t.index_select(d, keep))
        deferred.run(*readout, None, 1e-6)
        assert deferred.pending is None and deferred.has_pending() and len(deferred.nonfinite) == i
        got_keep, got = deferred.apply(tensors, dims)
        assert not deferred.has_pending() and torch.equal(got_keep, keep)
        assert torch.equal(deferred.current, eager.current) and len(deferred.nonfinite) == i + 1
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(g, w)


def test_a_deferred_stage_is_one_launch_with_the_engines_tensors(recording_stage, monkeypatch):
    """On the (recorded) CUDA path a deferred stage's ``apply`` is one ``StagePlan.launch`` gathering the tables and
    the engine's tensors; inside it only the compacted tensors are allocated (model activations) and views made."""
    from collections import OrderedDict

    from macer.core import stage as core_stage
    from macer.core.prefill import PrefillState

    monkeypatch.setattr(core_stage, "_PREPARED", OrderedDict())
    fake = recording_stage
    plan = _core_prefill()
    for prefill in range(2):
        state = PrefillState(plan, torch.device("cpu"), defer=True)
        for i, stage in enumerate(plan.stages):
            tensors, dims = _engine_tensors(stage.tokens_before, i)
            launches = len(fake.launches())
            state.run(*_readout(stage.tokens_before, i), None, 1e-6)
            assert len(fake.launches()) == launches  # deferred: nothing launched at the readout
            with no_host_reads(), NoAtenOps() as ops:
                keep, compacted = state.apply(tensors, dims)
            assert len(fake.launches()) == launches + 1
            launch = fake.launches()[-1]
            assert launch[8][3:] == [t.data_ptr() for t in tensors]  # after the three tables
            assert launch[9][3:] == [t.data_ptr() for t in compacted]
            assert [tuple(t.shape) for t in compacted] == [(1, stage.tokens_after, 12), (1, stage.tokens_after, 16),
                                                            (3, 1, stage.tokens_after), (stage.tokens_after,)]
            if prefill:
                allocations = [op for op in ops.ops if "empty" in op]
                assert len(allocations) == 4, ops.ops
                assert set(ops.ops) - set(allocations) <= {"aten.unsqueeze.default", "aten.squeeze.dim"}, ops.ops
            assert keep.data_ptr() == state._outs[i][0][0].data_ptr()
