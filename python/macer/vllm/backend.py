"""Everything the MACER architectures need of vLLM's attention backends and their metadata (vLLM 0.32, V1 model
runner). The layer loop (``macer.vllm.staged``) reaches them through this module:

* ``attention_modules`` / ``readout``: the ``Attention`` module of each decoder layer (a forward pre-hook there taps
  a stage's readout) and the post-RoPE queries and keys it receives, as the ``[1, H, T, D]`` views a stage reads;
* ``check_backends``: the backends the compacted layers' metadata is built for: ``CPU_ATTN`` (tested),
  ``FLASH_ATTN`` and ``TRITON_ATTN`` (written for, never run); anything else (FlashInfer: its metadata holds the
  builder's planned wrappers, which a stage's build would re-plan) is refused when the model loads;
* ``StageMetadata``: the attention metadata of every compacted layer group for a whole step, built **before** the
  step's forward from host integers (``macer.core.steps``) by copies of the runner's own attention groups (same
  builder class, spec, kernel block size; one copy per segment and KV cache group, so a builder's persistent state
  never serves two segments), on persistent buffers, with slots from the runner's host block table
  (``block * block_size + index % block_size`` at each row's compacted index: no slot history); the zero-KV writes of
  a prefill's unused tail slots; the load-time self-test of the metadata layout;
* ``step_context``: per-layer copies of the forward context's metadata and slot-mapping dicts for one forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from macer.core.steps import DECODE, Segment, StepPlan

__all__ = ["BACKENDS", "StageMetadata", "attention_modules", "check_backends", "readout", "slots_at", "step_context",
           "zero_tail"]

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")
"""Attention backends whose metadata the compacted layers build (CPU_ATTN ran; the others are written for, unrun)."""

# CommonAttentionMetadata fields the stage metadata does not carry; the configurations that set them are refused
# (context parallel, KV-sharing fast prefill, PrefixLM ranges, R-SWA, ReplaySSM, encoder-decoder), so a new source of
# one fails loudly here instead of being dropped.
_DROPPED = ("logits_indices_padded", "encoder_seq_lens", "dcp_local_seq_lens", "mm_req_doc_ranges",
            "rswa_prefix_lens", "replayssm_decode_base_cpu")
_BASE = -2  # buffers key of the layers before the first segment (they keep the runner's metadata)


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


def check_backends(attns: list[nn.Module], architecture: str) -> None:
    """``ValueError`` naming ``--attention-backend`` for a layer whose backend the compacted metadata is not built
    for (called when the model loads)."""
    from macer.vllm.checks import refuse

    names = sorted({attn.attn_backend.get_name() for attn in attns} - set(BACKENDS))
    if names:
        # Through refuse: raised in the engine's process, it is also printed last in the user's (macer.vllm.checks).
        refuse([f"{architecture} (macer): attention backend {', '.join(names)} is not supported (the compacted "
                "layers' metadata is built for backends with per-request query_start_loc, seq_lens, block_table and "
                f"slot_mapping): select one of {list(BACKENDS)} with --attention-backend (LLM(..., "
                "attention_backend=...)); only CPU_ATTN has run"], f"{architecture} (macer)")


@contextlib.contextmanager
def step_context(context: Any) -> Iterator[None]:
    """Inside the block the forward context's per-layer metadata and slot mapping are this forward's own copies (the
    compacted layers' entries replace the runner's there); the originals are back after it."""
    saved = context.attn_metadata, context.slot_mapping
    context.attn_metadata, context.slot_mapping = dict(saved[0]), dict(saved[1])
    try:
        yield
    finally:
        context.attn_metadata, context.slot_mapping = saved


class _Buffers:
    """Persistent host/device buffers of one (segment start, KV group): query starts, sequence lengths, slots and
    tail slots. Refilled in place every step, so a decode step's metadata always points at the same memory (what a
    captured decode graph would read)."""

    def __init__(self, max_reqs: int, max_tokens: int, max_tail: int, device: torch.device):
        from vllm.v1.utils import CpuGpuBuffer

        def buffer(size: int, dtype: torch.dtype) -> Any:
            made = CpuGpuBuffer(size, dtype=dtype, device=device)
            if device.type == "cpu":
                made.gpu = made.cpu  # one tensor on CPU, as the CPU runner does with its own buffers
            return made

        self.query_start = buffer(max_reqs + 1, torch.int32)
        self.seq_lens = buffer(max_reqs, torch.int32)
        self.slots = buffer(max_tokens, torch.int64)
        self.tails = buffer(max_tail, torch.int64)

    @staticmethod
    def fill(buffer: Any, values: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device, host)`` views of ``buffer`` holding ``values``."""
        count = len(values)
        buffer.np[:count] = values
        return buffer.copy_to_gpu(count) if buffer.gpu is not buffer.cpu else buffer.gpu[:count], buffer.cpu[:count]


def slots_at(table: np.ndarray, owned: np.ndarray, block_size: int, request: np.ndarray,
             index: np.ndarray) -> np.ndarray:
    """Slot of compacted cache index ``index[k]`` of request row ``request[k]``: vLLM's own rule
    (``block_table[row, index // block_size] * block_size + index % block_size``) on the host block table. Raises if
    an index lies outside the blocks the request owns (a wrong shift would write another request's block)."""
    if len(index) and bool((index // block_size >= owned[request]).any()):
        bad = int(np.argmax(index // block_size >= owned[request]))
        raise RuntimeError(f"macer: compacted index {int(index[bad])} of request row {int(request[bad])} lies outside "
                           f"its {int(owned[request[bad]])} blocks of {block_size} (please report this)")
    return table[request, index // block_size].astype(np.int64) * block_size + index % block_size


class StageMetadata:
    """The compacted layers' attention metadata of one engine (see the module docstring).

    Args:
        runner: vLLM's V1 GPU/CPU model runner (``attn_groups``, ``input_batch``, ``kv_cache_config``).
        names: the decoder layers' attention layer names, in layer order.
    """

    def __init__(self, runner: Any, names: list[str]):
        self.runner, self.names = runner, names
        groups = runner.kv_cache_config.kv_cache_groups
        self.group_of = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
        missing = [name for name in names if name not in self.group_of]
        if missing:
            raise RuntimeError(f"macer: layers {missing[:3]} have no KV cache group (KV sharing is not supported)")
        scheduler = runner.vllm_config.scheduler_config
        self.max_reqs, self.max_tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        self._copies: dict[tuple[int, int], list[Any]] = {}
        self._buffers: dict[tuple[int, int], _Buffers] = {}

    # --------------------------------------------------------------------------------------- builder copies
    def copies(self, start: int, gid: int) -> list[Any]:
        """Copies of KV group ``gid``'s attention groups for the segment starting at layer ``start``, made as the
        runner makes its own (``AttentionGroup.create_metadata_builders`` under the engine's config)."""
        key = (start, gid)
        if key not in self._copies:
            from vllm.config import set_current_vllm_config

            made = []
            with set_current_vllm_config(self.runner.vllm_config):
                for group in self.runner.attn_groups[gid]:
                    copy = dataclasses.replace(group, metadata_builders=[], kernel_block_table=None,
                                               kernel_block_offsets=None)
                    copy.create_metadata_builders(self.runner.vllm_config, self.runner.device,
                                                  group.kernel_block_size, 1)
                    _share_scratch(group.get_metadata_builder(), copy.get_metadata_builder())
                    made.append(copy)
            self._copies[key] = made
        return self._copies[key]

    def buffers(self, start: int, gid: int) -> _Buffers:
        key = (start, gid)
        if key not in self._buffers:
            block = self.runner.input_batch.block_table[gid].block_size
            self._buffers[key] = _Buffers(self.max_reqs, self.max_tokens, self.max_reqs * block, self.runner.device)
        return self._buffers[key]

    # --------------------------------------------------------------------------------------- one step
    def build(self, plan: StepPlan, common: Any) -> dict[str, tuple[Any, torch.Tensor]]:
        """``{layer name: (metadata, slot mapping)}`` of every layer of the plan's segments. ``common``: the runner's
        ``CommonAttentionMetadata`` of KV group 0 (its ``is_prefilling``)."""
        for name in _DROPPED:
            if getattr(common, name, None) is not None:
                raise RuntimeError(f"macer: the step's attention metadata sets {name!r}, which the compacted layers' "
                                   "metadata does not carry (a configuration the plugin should have refused)")
        batch = self.runner.input_batch
        n = len(plan.kinds)
        installed: dict[str, tuple[Any, torch.Tensor]] = {}
        for segment in plan.segments:
            layers = self.names[segment.start: segment.stop]
            for gid in sorted({self.group_of[name] for name in layers}):
                metadata, slots = self._segment(segment, n, batch.block_table[gid], self.buffers(segment.start, gid),
                                                common.is_prefilling)
                for copy in self.copies(segment.start, gid):
                    built = None
                    for name in copy.layer_names:
                        if name in layers:
                            built = built if built is not None else copy.build_metadata(metadata)
                            installed[name] = (built, slots)
        return installed

    def tails(self, plan: StepPlan, seq_lens: list[int]) -> dict[str, torch.Tensor]:
        """``{layer name: slots}`` to zero after the layer writes its KV (``zero_tail``): the rest of the last block
        holding a prefilled request's rows, and of a block a decode row starts. ``seq_lens``: the step's sequence
        lengths (of the layers before the first segment, or of every layer in a plain step)."""
        batch = self.runner.input_batch
        regions = [(0, plan.segments[0].start if plan.segments else len(self.names), seq_lens, _BASE)]
        regions += [(s.start, s.stop, s.seq_lens, s.start) for s in plan.segments]
        out: dict[str, torch.Tensor] = {}
        for start, stop, lens, key in regions:
            layers = self.names[start:stop]
            for gid in sorted({self.group_of[name] for name in layers}):
                slots = self._tails(plan.kinds, lens, batch.block_table[gid], self.buffers(key, gid))
                if slots is not None:
                    out.update({name: slots for name in layers if self.group_of[name] == gid})
        return out

    def check_owned(self, plan: StepPlan, seq_lens: list[int]) -> None:
        """Raise unless every request owns, in every KV cache group of the layers before the first segment (all of
        them in a plain step), the blocks the runner's own slots write there (``seq_lens``: the step's sequence
        lengths). A compacted group (``macer.vllm.kv``) sized for fewer rows than the layout writes would otherwise
        write another request's block; the segments' slots are checked by ``slots_at``."""
        batch = self.runner.input_batch
        stop = plan.segments[0].start if plan.segments else len(self.names)
        lens = np.asarray(seq_lens, dtype=np.int64)
        for gid in sorted({self.group_of[name] for name in self.names[:stop]}):
            table = batch.block_table[gid]
            owned = table.num_blocks_per_row[: len(lens)].astype(np.int64) * table.block_size
            if bool((owned < lens).any()):
                row = int(np.argmax(owned < lens))
                raise RuntimeError(f"macer: request row {row} writes {int(lens[row])} slots in KV cache group {gid} "
                                   f"but owns {int(owned[row])} (the scheduler and the worker planned it "
                                   "differently; please report this)")

    def _segment(self, segment: Segment, n: int, table: Any, buffers: _Buffers,
                 is_prefilling: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
        lens = np.asarray(segment.query_lens, dtype=np.int64)
        request = np.repeat(np.arange(n), lens)
        starts = np.asarray(segment.query_start[:-1], dtype=np.int64)
        index = np.repeat(np.asarray(segment.first_index, dtype=np.int64), lens) + (
            np.arange(segment.num_tokens) - np.repeat(starts, lens))
        slots = slots_at(table.block_table.np, table.num_blocks_per_row, table.block_size, request, index)
        return self.common(segment.query_start, segment.seq_lens, slots, table.get_device_tensor(n), buffers,
                           is_prefilling)

    def common(self, query_start: list[int], seq_lens: list[int], slots: np.ndarray, block_table: torch.Tensor,
               buffers: _Buffers, is_prefilling: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
        """The stage's ``CommonAttentionMetadata`` on ``buffers`` and its slot mapping (host integers in)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl, qsl_cpu = buffers.fill(buffers.query_start, np.asarray(query_start, dtype=np.int32))
        seq, seq_cpu = buffers.fill(buffers.seq_lens, np.asarray(seq_lens, dtype=np.int32))
        slot_mapping, _ = buffers.fill(buffers.slots, slots)
        lens = [b - a for a, b in itertools.pairwise(query_start)]
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq, seq_lens_cpu_upper_bound=seq_cpu,
            num_reqs=len(seq_lens), num_actual_tokens=query_start[-1], max_query_len=max(lens),
            max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=slot_mapping, causal=True,
            is_prefilling=is_prefilling)
        return common, slot_mapping

    @staticmethod
    def _tails(kinds: list[str], seq_lens: list[int], table: Any, buffers: _Buffers) -> torch.Tensor | None:
        bs = table.block_size
        request: list[int] = []
        index: list[int] = []
        for i, (kind, end) in enumerate(zip(kinds, seq_lens, strict=True)):
            if kind == DECODE and (end - 1) % bs:
                continue  # the rest of its block was zeroed when a prefill or an earlier decode first wrote there
            stop = -(-end // bs) * bs
            request += [i] * (stop - end)
            index += range(end, stop)
        if not index:
            return None
        slots = slots_at(table.block_table.np, table.num_blocks_per_row, bs, np.asarray(request),
                         np.asarray(index, dtype=np.int64))
        return buffers.fill(buffers.tails, slots)[0]

    # --------------------------------------------------------------------------------------- load-time self-test
    def self_test(self, version: str) -> None:
        """Build stage metadata for a made-up step (a prefill keeping 3 of its 5 rows, a decode shifted by 2) with
        every builder copy of the first layer's KV group and check the fields the compacted layers rely on; a changed
        metadata layout (another vLLM release) fails here, naming the field, before any request is served."""
        gid = self.group_of[self.names[0]]
        table = self.runner.input_batch.block_table[gid]
        bs = table.block_size
        blocks = torch.zeros(2, table.block_table.gpu.shape[1], dtype=table.block_table.gpu.dtype,
                             device=self.runner.device)
        buffers = _Buffers(2, 8, 2 * bs, self.runner.device)
        query_start, seq_lens = [0, 3, 4], [3, 10]
        slots = np.asarray([0, 1, 2, 9], dtype=np.int64)
        common, _ = self.common(query_start, seq_lens, slots, blocks, buffers)
        want = {"query_start_loc": query_start, "seq_lens": seq_lens, "slot_mapping": slots.tolist(),
                "max_query_len": 3, "max_seq_len": 10, "num_actual_tokens": 4}
        for copy in self.copies(-1, gid):
            built = copy.build_metadata(common)
            for field, value in want.items():
                got = getattr(built, field, None)
                got = got.tolist() if isinstance(got, torch.Tensor) else got
                if got != value:
                    raise RuntimeError(f"macer: the load-time self-test of vLLM {version}'s attention metadata failed: "
                                       f"{type(built).__name__}.{field} is {got!r} where the stage metadata set "
                                       f"{value!r}; the compacted layers cannot run on this vLLM release")
            if not isinstance(getattr(built, "block_table", None), torch.Tensor):
                raise RuntimeError(f"macer: the load-time self-test of vLLM {version}'s attention metadata failed: "
                                   f"{type(built).__name__} has no block_table tensor")
        self._copies.pop((-1, gid), None)


def _share_scratch(runner_builder: Any, copy_builder: Any) -> None:
    """Triton's builders own softmax-segment scratch allocated after vLLM's memory profile; layers run one after
    another on one stream, so a copy uses the runner builder's scratch instead of holding its own."""
    for name in ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"):
        if hasattr(runner_builder, name) and hasattr(copy_builder, name):
            setattr(copy_builder, name, getattr(runner_builder, name))


def zero_tail(attn: nn.Module, slots: torch.Tensor, dtype: torch.dtype) -> None:
    """Write zero K and V (``dtype``: the layer's activations') at ``slots`` of ``attn``'s KV cache with the
    backend's own cache writer."""
    zeros = torch.zeros(slots.shape[0], attn.num_kv_heads, attn.head_size, dtype=dtype, device=slots.device)
    attn.impl.do_kv_cache_update(attn, zeros, zeros, attn.kv_cache, slots)
