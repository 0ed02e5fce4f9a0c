"""KV cache memory of one request in a paged serving engine, with and without giving back the blocks of the rows a
policy's stages drop (docs/serving.md, "KV memory"). Plain integers, no engine: the vLLM plugin's scheduler and
worker use ``compacted_drop``; the docs' memory table, the admission test's prediction and the admission benchmark
use the rest.

The model (vLLM 0.32's, which ``tests/serving/test_kv.py`` checks against vLLM's own grouping function):

* Decoder layers from ``start`` on (the engine policy's last stage) declare a KV cache spec of their own; the layers
  before keep vLLM's full-attention spec. vLLM then splits both buckets into KV cache groups of one size
  (``kv_groups``): the smaller bucket's layer count, or the larger's when it is under 1.5 times the smaller; a bucket
  of ``n`` layers becomes ``ceil(n / size)`` groups ``layers[i::count]``, the last ones short of a layer (padding).
* A block id spans one page (``block_size`` tokens of one layer's K and V) per layer slot of a group, ``size`` pages
  in all, in every group. A request holds ``ceil(tokens / block_size)`` blocks in each full group and
  ``ceil((tokens - D) / block_size)`` in each compacted group (``D``: ``compacted_drop``).
* vLLM's own model: one group of all ``L`` layers, ``ceil(tokens / block_size)`` blocks of ``L`` pages each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from macer.core.policy import Policy

__all__ = ["choose_start", "compacted_drop", "compacted_start", "kv_groups", "request_blocks", "request_pages",
           "vanilla_pages"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compacted_drop(prompt_len: int, layer_tokens: Sequence[int], start: int | None) -> int:
    """``D``: the prompt rows a request's compacted KV cache groups do not hold, the fewest its stages have dropped in
    any layer from ``start`` on (``layer_tokens``: the prompt rows entering each decoder layer, which for a stage
    before the first layer, the random rule's, is fewer than ``prompt_len`` from layer 0 on; a request that drops more
    in later layers uses fewer of the same blocks there). 0 when ``start`` is None (nothing compacted)."""
    if start is None:
        return 0
    if not 0 <= start < len(layer_tokens):
        raise ValueError(f"compacted_drop: start must be a layer index in [0, {len(layer_tokens) - 1}], got {start}")
    if max(layer_tokens) > prompt_len:
        raise ValueError(f"compacted_drop: layer_tokens must be <= prompt_len ({prompt_len}), got {max(layer_tokens)}")
    return prompt_len - max(layer_tokens[start:])


def kv_groups(num_layers: int, start: int | None) -> list[list[int]]:
    """The decoder layers of each KV cache group (full groups first) when layers ``start..num_layers - 1`` declare a
    spec of their own (None: one group of every layer)."""
    if num_layers < 1:
        raise ValueError(f"kv_groups: num_layers must be >= 1, got {num_layers}")
    if start is None:
        return [list(range(num_layers))]
    if not 0 < start < num_layers:
        raise ValueError(f"kv_groups: start must be in [1, {num_layers - 1}] (or None), got {start}")
    buckets = [list(range(start)), list(range(start, num_layers))]
    smallest, largest = min(map(len, buckets)), max(map(len, buckets))
    size = largest if largest < 1.5 * smallest else smallest
    groups = []
    for layers in buckets:
        count = _cdiv(len(layers), size)
        groups += [layers[i::count] for i in range(count)]
    return groups


def request_blocks(prompt_len: int, layer_tokens: Sequence[int], generated: int, block_size: int,
                   start: int | None) -> list[int]:
    """Blocks a request holds in each KV cache group (``kv_groups`` order) after its prompt of ``prompt_len`` tokens
    (``layer_tokens`` of them entering each layer) and ``generated`` more."""
    if block_size < 1 or generated < 0:
        raise ValueError(f"request_blocks: block_size must be >= 1 and generated >= 0, got {block_size}, {generated}")
    tokens = prompt_len + generated
    drop = compacted_drop(prompt_len, layer_tokens, start)
    return [_cdiv(tokens - (drop if start is not None and layers[0] >= start else 0), block_size)
            for layers in kv_groups(len(layer_tokens), start)]


def request_pages(prompt_len: int, layer_tokens: Sequence[int], generated: int, block_size: int,
                  start: int | None) -> int:
    """Pages (one layer's K and V for ``block_size`` tokens) a request's blocks span: its blocks in every group times
    the layer slots of a group, padding included."""
    size = max(len(layers) for layers in kv_groups(len(layer_tokens), start))
    return size * sum(request_blocks(prompt_len, layer_tokens, generated, block_size, start))


def vanilla_pages(prompt_len: int, num_layers: int, generated: int, block_size: int) -> int:
    """Pages of the same request in vLLM's own model (one group of every layer, the whole sequence)."""
    return num_layers * _cdiv(prompt_len + generated, block_size)


def choose_start(num_layers: int, last_stage: int, keep_ratio: float) -> int | None:
    """The first layer of the compacted KV cache groups for a policy whose last stage drops rows from layer
    ``last_stage`` on: the start in ``[last_stage, num_layers - 1]`` whose layout needs the fewest pages for a
    prompt that is mostly audio/video at ``keep_ratio`` (blocks scale as 1 per full group and ``keep_ratio`` per
    compacted group, times a group's layer slots); among equals the one with the fewest padding slots, then the
    earliest. None when nothing would be freed (``keep_ratio >= 1``, or no layer after the stage).

    On Qwen2.5-Omni-7B (28 layers, ``l_v = 5``) that is layer 5 (6 groups of 5 slots, 2 of them padding); on 3B (36
    layers, ``l_v = 7``) layer 9 (4 groups of 9, no padding) rather than 7 (6 groups of 7 slots, 6 padding): the same
    pages for a pruned prompt, and an unpruned one costs what it costs in vLLM's own model."""
    start = max(last_stage, 1)
    if keep_ratio >= 1 or start >= num_layers:
        return None

    def cost(first: int) -> tuple[float, int, int]:
        groups = kv_groups(num_layers, first)
        size = max(map(len, groups))
        full = sum(1 for layers in groups if layers[0] < first)
        return size * (full + keep_ratio * (len(groups) - full)), size * len(groups), first

    return min(range(start, num_layers), key=cost)


def compacted_start(policy: Policy, num_layers: int) -> int | None:
    """The first decoder layer (0-based) of the compacted KV cache groups of an engine serving ``policy``, or None
    (nothing to compact: the ``full`` policy, a keep ratio of 1, a last stage past the last layer): ``choose_start``
    from the policy's last stage, whose dropped rows are gone from that layer on (``layers[l_v:]`` for MACER). A
    stage before the first layer (the random rule) counts as layer 1: layer 0 stays in a full group. The vLLM
    plugin's model and scheduler, the admission benchmark and the docs' memory table all take it from here."""
    layers = [spec.layer for spec in policy.stage_specs(1, 1)]
    if not layers:
        return None
    return choose_start(num_layers, max(layers), getattr(policy, "keep_ratio", 1.0))
