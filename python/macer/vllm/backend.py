"""Everything the MACER architectures need of vLLM's attention backends and their metadata (vLLM 0.32, V1 model
runner; backends with per-request ``query_start_loc``, ``seq_lens``, ``block_table`` and ``slot_mapping``: CPU,
FlashAttention). The layer loop (``macer.vllm.staged``) reaches them through this module:

* ``attention_modules``: the ``Attention`` module of each decoder layer (a forward pre-hook there taps a readout);
* ``readout``: the post-RoPE queries and keys such a module receives, as the ``[1, H, T, D]`` views a stage reads;
* ``step_metadata`` / ``own_layer_metadata``: the forward context's metadata of a step, and per-layer copies of its
  metadata and slot-mapping dicts for the duration of one forward;
* ``CompactedMetadata``: metadata for the layers after a stage, whose caches hold fewer tokens than the request's
  sequence, rebuilt with the backend's own builder: the request's block table, sequence length ``K``, slots of
  positions ``0..K-1`` (prefill) or of compacted index ``position - D`` (decode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CompactedMetadata", "attention_modules", "own_layer_metadata", "readout", "step_metadata"]


def attention_modules(layers: list[nn.Module]) -> list[nn.Module]:
    """The ``Attention`` module of each of vLLM's Qwen2 decoder layers (``self_attn.attn``)."""
    return [layer.self_attn.attn for layer in layers]


def readout(module: nn.Module, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The queries and keys an ``Attention`` module receives, as ``[1, H, T, D]`` views, and its softmax scale."""
    rows = query.shape[0]
    # vLLM's [T, H * D] post-RoPE rows -> the [1, H, T, D] layout the stage reads (a view, no copy).
    query = query.view(rows, -1, module.head_size).transpose(0, 1)[None]
    key = key.view(rows, -1, module.head_size).transpose(0, 1)[None]
    return query, key, module.impl.scale


def step_metadata(name: str) -> tuple[Any, Any] | None:
    """``(forward context, metadata of the layer called name)`` of this step, or None in a dummy or profiling run
    (no metadata)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    metadata = get_forward_context().attn_metadata if is_forward_context_available() else None
    if not isinstance(metadata, dict) or metadata.get(name) is None:
        return None
    return get_forward_context(), metadata[name]


@contextlib.contextmanager
def own_layer_metadata(context: Any) -> Iterator[None]:
    """Inside the block the forward context's per-layer metadata and slot mapping are this forward's own copies (a
    compacted layer's entries replace the shared ones there); the originals are back after it."""
    saved = context.attn_metadata, context.slot_mapping
    context.attn_metadata, context.slot_mapping = dict(saved[0]), dict(saved[1])
    try:
        yield
    finally:
        context.attn_metadata, context.slot_mapping = saved


class CompactedMetadata:
    """Metadata of the layers whose caches hold fewer tokens than the request's sequence, built by the backend's own
    metadata builder (made once, on first use).

    Args:
        attns: the layers' ``Attention`` modules (``attention_modules``).
        names: their layer names (the forward context's keys).
        vllm_config: the engine's config.
    """

    def __init__(self, attns: list[nn.Module], names: list[str], vllm_config: Any):
        self.attns, self.names, self.vllm_config = attns, names, vllm_config
        self._builder: Any = None

    def install(self, context: Any, first: Any, shifts: list[int], start: int, slots: torch.Tensor, *,
                prefill: bool) -> None:
        """Metadata and slots of the compacted layers from ``layers[start]`` on (until the next shift change).
        ``shifts[i]``: prompt tokens the stages dropped before layer ``i``; ``slots``: the slot of every position the
        request has written."""
        shift = shifts[start]
        metadata, slot_mapping = self._rebuild(first, shift, prefill, slots)
        for index in range(start, len(self.names)):
            if shifts[index] != shift:
                break
            context.attn_metadata[self.names[index]] = metadata
            context.slot_mapping[self.names[index]] = slot_mapping

    def _rebuild(self, first: Any, shift: int, prefill: bool, slots: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The request's metadata with ``shift`` fewer tokens in its context, built by the backend's own builder."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        for field in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            if not hasattr(first, field):
                raise RuntimeError(f"macer: the attention backend's metadata ({type(first).__name__}) has no "
                                   f"{field!r}; the MACER architectures support backends with per-request "
                                   "query_start_loc, seq_lens, block_table and slot_mapping (CPU, FlashAttention)")
        seq_len = first.max_seq_len - shift
        if prefill:
            tokens = first.num_actual_tokens - shift
            slot_mapping = first.slot_mapping[:tokens]
            query_start = first.query_start_loc.clone()
            query_start[1:] -= shift
        else:
            tokens, position = first.num_actual_tokens, first.max_seq_len - 1
            slot_mapping = slots[position - shift: position - shift + 1]
            query_start = first.query_start_loc
        common = CommonAttentionMetadata(
            query_start_loc=query_start, query_start_loc_cpu=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=first.seq_lens - shift, num_reqs=1, num_actual_tokens=tokens,
            max_query_len=tokens if prefill else first.max_query_len, max_seq_len=seq_len,
            block_table_tensor=first.block_table, slot_mapping=slot_mapping, causal=True,
            seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32))
        return self._metadata_builder(slot_mapping.device).build(0, common), slot_mapping

    def _metadata_builder(self, device: torch.device) -> Any:
        if self._builder is None:
            attn = self.attns[0]
            spec = attn.get_kv_cache_spec(self.vllm_config)
            self._builder = attn.attn_backend.get_builder_cls()(spec, self.names, self.vllm_config, device)
        return self._builder
