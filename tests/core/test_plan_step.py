"""``macer.core.steps.plan_step`` against a brute-force reference: every request of a random mixed step expanded to
the explicit (request, position) rows of every decoder layer, with concrete kept sets; the plan's gathers applied to
the step's rows must give exactly those rows in every segment, and its query starts, sequence lengths and compacted
indices must be those of the rows each layer's cache holds (issue 28: the per-step host plan)."""

from __future__ import annotations

import random

import pytest
from macer.core.steps import CHUNK, DECODE, PREFILL, Row, layer_bounds, plan_step, row_kind


def random_layout(rng: random.Random, prompt_len: int, num_layers: int) -> tuple[tuple[int, ...], dict[int, list]]:
    """Per-layer prompt rows and, per layer where they shrink, the kept positions (nested, the last row kept)."""
    if rng.random() < 0.3:
        return (prompt_len,) * num_layers, {}
    stages = sorted(rng.sample(range(num_layers), k=rng.randint(1, min(2, num_layers))))
    kept = list(range(prompt_len))
    tokens, keeps = [], {}
    for layer in range(num_layers):
        if layer in stages and len(kept) > 2:
            k = rng.randint(1, len(kept) - 1)
            body = sorted(rng.sample(kept[:-1], k - 1))
            kept = [*body, kept[-1]]  # the last prompt row (text) is always kept
            keeps[layer] = list(kept)
        tokens.append(len(kept))
    return tuple(tokens), keeps


def random_step(rng: random.Random, num_layers: int):
    rows, keeps = [], []
    for _ in range(rng.randint(1, 6)):
        prompt_len = rng.randint(3, 30)
        layer_tokens, kept = random_layout(rng, prompt_len, num_layers)
        kind = rng.choice([PREFILL, PREFILL, DECODE, DECODE, CHUNK])
        if kind == CHUNK and kept:
            kind = DECODE
        if kind == PREFILL:
            computed, query = 0, prompt_len + rng.choice([0, 0, rng.randint(1, 9)])  # a recompute has G > 0
        elif kind == DECODE:
            computed, query = prompt_len + rng.randint(0, 20), 1
        else:
            computed = rng.randint(0, prompt_len - 1)
            query = rng.randint(1, prompt_len - computed + 3)
            if computed == 0 and query >= prompt_len:
                query = prompt_len - 1 if prompt_len > 1 else 1
        rows.append(Row(prompt_len, layer_tokens, computed, query))
        keeps.append(kept)
    return rows, keeps


def reference(row: Row, kind: str, kept: dict[int, list], layer: int) -> tuple[list[int], list[int], int]:
    """(positions of the request's rows in ``layer``, their compacted cache indices, the sequence length)."""
    if kind != PREFILL or not kept:
        if kind == DECODE:
            positions = [row.computed]
        else:
            positions = list(range(row.computed, row.computed + row.query))
    else:
        prompt = list(range(row.prompt_len))
        for stage in sorted(kept):
            if stage <= layer:
                prompt = kept[stage]
        positions = prompt + list(range(row.prompt_len, row.query))
    cache = list(range(row.prompt_len))
    for stage in sorted(kept):
        if stage <= layer:
            cache = kept[stage]
    drop = row.prompt_len - len(cache)
    indices = [cache.index(p) if p < row.prompt_len else p - drop for p in positions]
    return positions, indices, indices[-1] + 1


@pytest.mark.parametrize("seed", range(300))
def test_plan_step_equals_the_brute_force_rows(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(1, 6)
    rows, keeps = random_step(rng, num_layers)
    plan = plan_step(rows)
    kinds = [row_kind(r.computed, r.query, r.prompt_len) for r in rows]
    assert plan.kinds == kinds
    # The step's rows: (request, position).
    current = [(i, row.computed + k) for i, row in enumerate(rows) for k in range(row.query)]
    assert plan.num_tokens == len(current)
    first_layer = plan.segments[0].start if plan.segments else num_layers
    for layer in range(first_layer):
        for i, (row, kind) in enumerate(zip(rows, kinds, strict=True)):
            want, _, _ = reference(row, kind, keeps[i], layer)
            assert [p for r, p in current if r == i] == want
    if plan.plain:
        assert all(not row.pruned for row in rows)
        return
    covered = []
    for segment in plan.segments:
        if segment.gather is not None:
            gathered = []
            for piece in segment.gather:
                if piece.request is None:
                    gathered += current[piece.start: piece.stop]
                    continue
                i, row = piece.request, rows[piece.request]
                mine = [entry for entry in current if entry[0] == i]
                prompt = [entry for entry in mine if entry[1] < row.prompt_len]
                assert current[piece.start: piece.stop] == mine and piece.before == len(prompt)
                kept_positions = keeps[i][segment.start]
                keep = [k for k, (_, p) in enumerate(prompt) if p in kept_positions]  # the stage's device keep
                gathered += [prompt[k] for k in keep] + current[piece.start + piece.before: piece.stop]
            current = gathered
        assert segment.num_tokens == len(current)
        for layer in range(segment.start, segment.stop):
            covered.append(layer)
            for i, (row, kind) in enumerate(zip(rows, kinds, strict=True)):
                positions, indices, seq_len = reference(row, kind, keeps[i], layer)
                mine = current[segment.query_start[i]: segment.query_start[i + 1]]
                assert [r for r, _ in mine] == [i] * len(positions)
                assert [p for _, p in mine] == positions, (i, kind, layer)
                assert segment.first_index[i] + len(positions) - 1 == indices[-1]
                assert indices == list(range(segment.first_index[i], segment.first_index[i] + len(positions)))
                assert segment.seq_lens[i] == seq_len
        assert segment.max_query_len == max(segment.query_lens)
        assert segment.max_seq_len == max(segment.seq_lens)
    assert covered == list(range(first_layer, num_layers))
    assert plan.final_tokens == len(current)


def test_segments_split_where_any_request_changes_and_a_layer_zero_stage_counts():
    """Two pruned requests with stages at different layers, one before the first layer; a decode whose shift
    changes at a layer where nothing is staged needs new metadata but no gather."""
    prefill = Row(10, (6, 6, 4, 4), computed=0, query=10)  # random rule at layer 0, then a stage at 2
    decode = Row(8, (8, 8, 8, 5), computed=12, query=1)  # its own stage at 3, decoding
    plan = plan_step([prefill, decode])
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 2), (2, 3), (3, 4)]
    assert [s.staged for s in plan.segments] == [[0], [0], []]
    assert plan.segments[2].gather is None
    assert [s.seq_lens for s in plan.segments] == [[6, 13], [4, 13], [4, 10]]
    assert plan.segments[2].first_index == [0, 9]


def test_unpruned_steps_are_plain_and_bad_rows_are_refused():
    assert plan_step([Row(5, (5, 5), 0, 5), Row(7, (7, 7), 9, 1), Row(9, (9, 9), 3, 4)]).plain
    with pytest.raises(ValueError, match="a chunk of a pruned prompt"):
        plan_step([Row(10, (10, 4), 2, 5)])
    with pytest.raises(ValueError, match="speculative decoding is not"):
        plan_step([Row(10, (10, 4), 12, 3)])


def test_forced_boundaries_repeat_the_rows_before_them_and_layer_bounds_are_the_rows_own():
    """A CUDA graph captured with one metadata per segment of a fixed layout needs those segments in every step it
    serves, also where no request changes (``boundaries``): such a segment gathers nothing and repeats the rows,
    lengths and indices of the one before; a plain step gets them too. ``Row.bounds`` (given, or computed) are the
    layers where the request's own rows change."""
    decode = Row(8, (8, 8, 5, 5), computed=12, query=1)
    other = Row(6, (6, 6, 6, 6), computed=9, query=1)
    assert decode.bounds == layer_bounds(8, (8, 8, 5, 5)) == (2,) and other.bounds == () and not other.pruned
    natural = plan_step([decode, other])
    forced = plan_step([decode, other], boundaries=(1, 2, 3))
    assert [(s.start, s.stop) for s in natural.segments] == [(2, 4)]
    assert [(s.start, s.stop) for s in forced.segments] == [(1, 2), (2, 3), (3, 4)]
    assert all(s.gather is None for s in forced.segments)
    assert forced.segments[0].seq_lens == [13, 10] and forced.segments[1].seq_lens == forced.segments[2].seq_lens
    assert forced.segments[2].seq_lens == natural.segments[0].seq_lens == [10, 10]
    assert [s.start for s in plan_step([other], boundaries=(2,)).segments] == [2]
    assert Row(8, (8, 8, 5, 5), 12, 1, bounds=(2,)) == decode
    with pytest.raises(ValueError, match=r"boundaries must be layer indices in \[0, 3\], got \(4,\)"):
        plan_step([decode], boundaries=(4,))
