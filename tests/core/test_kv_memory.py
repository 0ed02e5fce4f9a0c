"""The KV memory arithmetic of issue 29 (``macer.core.kv_memory``): how vLLM 0.32 groups the decoder layers when the
layers after the last stage declare their own KV cache spec, the blocks and pages one request holds with and without
freeing, and the choice of the first compacted layer. ``tests/serving/test_kv.py`` checks the grouping against vLLM's
own function and the block counts against a running engine."""

from __future__ import annotations

import pytest
from macer.core.kv_memory import (
    choose_start,
    compacted_drop,
    compacted_start,
    kv_groups,
    request_blocks,
    request_pages,
    vanilla_pages,
)
from macer.core.policies import make_policy


def _macer(keep: float = 0.25, audio: int = 3, video: int = 5):
    return make_policy("macer", keep_ratio=keep, audio_layer=audio, video_layer=video, end_of_turn_token_id=2)


def test_groups_of_the_paper_layouts():
    """7B (28 layers, compacted from l_v = 5): 5 full layers, the 23 others in 5 groups of at most 5 (2 padding
    slots); 3B from layer 9: 4 groups of 9, no padding; the 6-layer test model: 3 groups of 2."""
    assert kv_groups(28, 5) == [[0, 1, 2, 3, 4], [5, 10, 15, 20, 25], [6, 11, 16, 21, 26], [7, 12, 17, 22, 27],
                                [8, 13, 18, 23], [9, 14, 19, 24]]
    assert [len(g) for g in kv_groups(36, 9)] == [9, 9, 9, 9]
    assert kv_groups(6, 4) == [[0, 2], [1, 3], [4, 5]]
    assert kv_groups(6, None) == [list(range(6))]
    every = sorted(layer for group in kv_groups(36, 7) for layer in group)
    assert every == list(range(36))
    with pytest.raises(ValueError, match=r"start must be in \[1, 27\]"):
        kv_groups(28, 28)


def test_the_designs_worked_numbers():
    """docs/design/vllm-batched-serving.md section 4.4: a 409-token clip (25 text, 128 audio, 256 video) at keep
    0.25 on the 28-layer layout, 16 generated tokens: 756 / 360 pages at block 16, 392 / 195 at block 32."""
    tokens = _macer().layer_tokens(25, 128, 256, 28)
    assert tokens[0] == 409 and tokens[5] == 121
    assert (vanilla_pages(409, 28, 16, 16), request_pages(409, tokens, 16, 16, 5)) == (756, 360)
    assert (vanilla_pages(409, 28, 16, 32), request_pages(409, tokens, 16, 32, 5)) == (392, 195)
    assert request_blocks(409, tokens, 16, 32, 5) == [14, 5, 5, 5, 5, 5]


def test_a_request_that_drops_nothing_holds_vllms_count_in_every_group():
    unpruned = [300] * 28
    assert compacted_drop(300, unpruned, 5) == 0
    assert request_blocks(300, unpruned, 7, 32, 5) == [10] * 6
    # In pages the padding slots cost: 6 groups x 5 slots against 28 layers.
    assert request_pages(300, unpruned, 7, 32, 5) * 28 == vanilla_pages(300, 28, 7, 32) * 30
    assert request_pages(300, [300] * 36, 7, 32, 9) == vanilla_pages(300, 36, 7, 32)  # 3B from layer 9: no padding


def test_compacted_drop_is_the_fewest_dropped_from_the_start_on():
    assert compacted_drop(100, [100, 100, 80, 80, 40, 40], 2) == 20  # a later stage drops more: those layers use less
    assert compacted_drop(100, [100, 100, 80, 80, 40, 40], 4) == 60
    assert compacted_drop(100, [100] * 6, None) == 0
    # A stage before the first layer (the random rule): every layer holds fewer rows than the prompt.
    assert compacted_drop(100, [70] * 6, 4) == 30
    assert request_blocks(100, [70] * 6, 0, 10, 4) == [10, 10, 7]
    with pytest.raises(ValueError, match=r"layer_tokens must be <= prompt_len \(100\), got 120"):
        compacted_drop(100, [120] * 6, 4)
    with pytest.raises(ValueError, match=r"start must be a layer index in \[0, 5\], got 6"):
        compacted_drop(100, [100] * 6, 6)


def test_the_first_compacted_layer():
    """The paper's layouts: 7B keeps l_v = 5; 3B moves from l_v = 7 to 9 (the same pages for a pruned prompt,
    no padding for an unpruned one); nothing is compacted at keep ratio 1 or past the last layer."""
    assert choose_start(28, 5, 0.25) == 5
    assert choose_start(36, 7, 0.25) == 9
    assert choose_start(6, 4, 0.25) == 4
    assert choose_start(4, 2, 0.25) == 2
    assert choose_start(28, 0, 0.25) == 1  # a stage before the first layer: layer 0 stays full
    assert choose_start(28, 5, 1.0) is None and choose_start(6, 6, 0.25) is None
    for layers, stage in ((28, 5), (36, 7), (48, 9)):
        for keep in (0.1, 0.25, 0.5):
            start = choose_start(layers, stage, keep)
            groups = kv_groups(layers, start)
            size = max(map(len, groups))
            full = sum(1 for g in groups if g[0] < start)
            cost = size * (full + keep * (len(groups) - full))
            for other in range(stage, layers):  # no other start needs fewer pages at this keep ratio
                others = kv_groups(layers, other)
                other_size = max(map(len, others))
                other_full = sum(1 for g in others if g[0] < other)
                assert cost <= other_size * (other_full + keep * (len(others) - other_full)) + 1e-9


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="block_size must be >= 1 and generated >= 0"):
        request_blocks(10, [10] * 6, -1, 32, 4)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        kv_groups(0, None)


def test_the_first_compacted_layer_of_a_policy():
    """``compacted_start``: from the policy's last stage (MACER's video layer, FastV's layer), layer 1 for a stage
    before the first layer (the random rule), None where nothing is dropped."""
    assert compacted_start(_macer(), 28) == 5
    assert compacted_start(make_policy("macer", keep_ratio=0.25, audio_layer=4, video_layer=7,
                                       end_of_turn_token_id=2), 36) == 9
    assert compacted_start(make_policy("fastv", keep_ratio=0.25, layer=2), 6) == 2
    assert compacted_start(make_policy("random", keep_ratio=0.25), 6) == 1
    assert compacted_start(make_policy("full"), 28) is None
    assert compacted_start(_macer(keep=1.0), 28) is None
