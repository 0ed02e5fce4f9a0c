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
  never serves two segments; the segment's other KV cache groups reuse its first build through the builder's
  ``update_block_table`` where the backend has it, as the runner does), with slots from the runner's host block table
  (``block * block_size + index % block_size`` at each row's compacted index: no slot history). A step's small arrays
  (query starts, sequence lengths, slots, tail slots) are written into one pinned host buffer and reach the device in
  one copy (``macer.vllm.buffers``), before any builder runs (a build may launch device work that reads them). A
  step that replays a FULL CUDA graph writes them in place into the buffers the graph was captured with (one set per
  segment of the engine's layout, ``capture``), padded as the runner pads its own: query starts repeat the last,
  sequence lengths 0, slots -1;
* the zero-KV writes of a prefill's unused tail slots, for the backends whose kernels read whole blocks past a
  sequence's end (``needs_tails``);
* ``installed``: the forward context's metadata and slot mapping with a step's entries, for one forward;
* the load-time self-test of the metadata layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from macer.core.steps import DECODE, Segment, StepPlan
from macer.vllm.buffers import Arena, ArenaFull, CaptureBuffers

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention.attention import Attention

__all__ = ["BACKENDS", "StageMetadata", "attention_modules", "check_backends", "installed", "needs_tails",
           "readout", "self_test", "slots_at"]

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")
"""Attention backends whose metadata the compacted layers build (CPU_ATTN ran; the others are written for, unrun)."""

# CommonAttentionMetadata fields the stage metadata does not carry; the configurations that set them are refused
# (context parallel, KV-sharing fast prefill, PrefixLM ranges, R-SWA, ReplaySSM, encoder-decoder), so a new source of
# one fails loudly here instead of being dropped.
_DROPPED = ("logits_indices_padded", "encoder_seq_lens", "dcp_local_seq_lens", "mm_req_doc_ranges",
            "rswa_prefix_lens", "replayssm_decode_base_cpu")
_PAD_SLOT = -1  # vLLM's PAD_SLOT_ID: the cache writers skip such a slot


def attention_modules(layers: list[Any]) -> list[Attention]:
    """The ``Attention`` module of each of vLLM's Qwen2 decoder layers (``self_attn.attn``)."""
    return [layer.self_attn.attn for layer in layers]


def readout(module: Attention, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The queries and keys an ``Attention`` module receives, as ``[1, H, T, D]`` views, and its softmax scale."""
    rows = query.shape[0]
    # vLLM's [T, H * D] post-RoPE rows -> the [1, H, T, D] layout the stage reads (a view, no copy).
    query = query.view(rows, -1, module.head_size).transpose(0, 1)[None]
    key = key.view(rows, -1, module.head_size).transpose(0, 1)[None]
    return query, key, module.impl.scale


def check_backends(attns: list[Attention], architecture: str) -> None:
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


def needs_tails(backend: str, flash_attn_version: int | None, block_size: int) -> bool:
    """Whether a layer's attention kernel reads a block's key/value rows past the sequence's end (then a stale,
    possibly non-finite tail from a freed block's earlier owner reaches the output as 0 * NaN), so the unwritten rest
    of a sequence's last block must hold zeros:

    * ``CPU_ATTN``: yes (it multiplies the masked rows of a whole block by zero; this is how the NaN was found);
    * ``TRITON_ATTN``: no (``kernel_unified_attention_*`` loads keys and values with ``mask=tile_mask, other=0.0``);
    * ``FLASH_ATTN`` 2: no (the last key tile's scores are masked by assignment, the value tile's rows past
      ``seqlen_k`` are cleared in shared memory, ``Clear_OOB_MN``);
    * ``FLASH_ATTN`` 3: only on its paged-TMA path, which loads whole tiles; FA3 takes it when the block size is a
      multiple of the key tile (``page_size % kBlockN == 0``; its Hopper tiles have ``kBlockN >= 64``), else the
      cp.async path with zero fill: yes for blocks of 64 or more;
    * ``FLASH_ATTN`` 4 and later: yes (whole tiles, Dao-AILab/flash-attention#2374).

    Unknown: yes (zeroing is always correct)."""
    if backend == "TRITON_ATTN":
        return False
    if backend == "FLASH_ATTN" and flash_attn_version is not None:
        if flash_attn_version == 2:
            return False
        if flash_attn_version == 3:
            return block_size >= 64
    return True


@contextlib.contextmanager
def installed(context: Any, metadata: dict[str, tuple[Any, torch.Tensor]]) -> Iterator[None]:
    """Inside the block the forward context's per-layer metadata and slot mapping are this forward's own copies, with
    ``metadata`` (``{layer name: (attention metadata, slot mapping)}``) replacing the runner's entries; the originals
    are back after it. The attention op and the cache writer read them by layer name at run time (they are opaque,
    graph-splitting custom ops), so a compiled forward serves any step's metadata unchanged."""
    saved = context.attn_metadata, context.slot_mapping
    if metadata:
        context.attn_metadata, context.slot_mapping = dict(saved[0]), dict(saved[1])
        for name, (built, slots) in metadata.items():
            context.attn_metadata[name], context.slot_mapping[name] = built, slots
    try:
        yield
    finally:
        context.attn_metadata, context.slot_mapping = saved


def slots_at(table: np.ndarray, owned: np.ndarray, block_size: int, request: np.ndarray,
             index: np.ndarray) -> np.ndarray:
    """Slot of compacted cache index ``index[k]`` of request row ``request[k]``: vLLM's own rule
    (``block_table[row, index // block_size] * block_size + index % block_size``) on the host block table. Raises if
    an index lies outside the blocks the request owns (a wrong shift would write another request's block)."""
    blocks = index // block_size
    if len(index) and bool((blocks >= owned[request]).any()):
        bad = int(np.argmax(blocks >= owned[request]))
        raise RuntimeError(f"macer: compacted index {int(index[bad])} of request row {int(request[bad])} lies outside "
                           f"its {int(owned[request[bad]])} blocks of {block_size} (please report this)")
    return table[request, blocks].astype(np.int64) * block_size + index % block_size


class StageMetadata:
    """The compacted layers' attention metadata of one engine (see the module docstring).

    Args:
        runner: vLLM's V1 GPU/CPU model runner (``attn_groups``, ``input_batch``, ``kv_cache_config``).
        names: the decoder layers' attention layer names, in layer order.
        attns: their ``Attention`` modules (the backend and cache writer of each).
        capture_bounds: where the segments of the captured CUDA graphs' layout start (``StepPlanner``).
    """

    def __init__(self, runner: Any, names: list[str], attns: list[Attention], capture_bounds: tuple[int, ...] = ()):
        self.runner, self.names, self.attns = runner, names, attns
        groups = runner.kv_cache_config.kv_cache_groups
        self.group_of = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
        missing = [name for name in names if name not in self.group_of]
        if missing:
            raise RuntimeError(f"macer: layers {missing[:3]} have no KV cache group (KV sharing is not supported)")
        self.spec_of = {gid: group.kv_cache_spec for gid, group in enumerate(groups)}
        self.capture_bounds = tuple(capture_bounds)
        scheduler = runner.vllm_config.scheduler_config
        self.max_reqs = scheduler.max_num_seqs
        self.tails_of = [needs_tails(attn.attn_backend.get_name(), getattr(attn.impl, "vllm_flash_attn_version", None),
                                     runner.input_batch.block_table[self.group_of[name]].block_size)
                         for name, attn in zip(names, attns, strict=True)]
        self.index_of = {name: i for i, name in enumerate(names)}
        self._copies: dict[tuple[int, int], list[Any]] = {}
        self.arena = Arena(1 << 16, runner.device)
        self.graphs: CaptureBuffers | None = None  # made at the first FULL capture
        self._zeros: torch.Tensor | None = None

    # --------------------------------------------------------------------------------------- builder copies
    def copies(self, start: int, gid: int) -> list[Any]:
        """Copies of KV group ``gid``'s attention groups for the segment starting at layer ``start``, made as the
        runner makes its own (``AttentionGroup.create_metadata_builders`` under the engine's config)."""
        key = (start, gid)
        if key not in self._copies:
            from vllm.config import set_current_vllm_config

            made = []
            with set_current_vllm_config(self.runner.vllm_config), torch.inference_mode(False):
                for group in self.runner.attn_groups[gid]:
                    copy = dataclasses.replace(group, metadata_builders=[], kernel_block_table=None,
                                               kernel_block_offsets=None)
                    copy.create_metadata_builders(self.runner.vllm_config, self.runner.device,
                                                  group.kernel_block_size, 1)
                    _share_scratch(group.get_metadata_builder(), copy.get_metadata_builder())
                    made.append(copy)
            self._copies[key] = made
        return self._copies[key]

    # --------------------------------------------------------------------------------------- one step
    def build(self, step: Any, common: Any) -> None:
        """Fill ``step.metadata`` (every layer of the plan's segments) and ``step.tails``, send the step's arrays to
        the device in one copy and zero the tails. ``step``: a ``macer.vllm.plan.PreparedStep``; ``common``: the
        runner's ``CommonAttentionMetadata`` of KV group 0 (its ``is_prefilling``, and the padded request count).

        The copy goes out before any builder runs: a build may launch device work that reads the step's query starts
        and sequence lengths (FlashAttention 3's AOT scheduler metadata, CPU_ATTN's scheduler), which must find this
        step's values there, as the runner's own builders find theirs (``query_start_loc.copy_to_gpu`` before
        ``_build_attention_metadata``)."""
        for name in _DROPPED:
            if getattr(common, name, None) is not None:
                raise RuntimeError(f"macer: the step's attention metadata sets {name!r}, which the compacted layers' "
                                   "metadata does not carry (a configuration the plugin should have refused)")
        # A FULL step refills the captured buffers; one without segments (an engine whose policy prunes nothing: no
        # captured layout) has only tails, zeroed before the replay from any buffer.
        arena = self.graphs.arena if step.graph and self.graphs is not None else self.arena
        if step.graph and step.plan.segments and self.graphs is None:
            raise RuntimeError("macer: a step replays a CUDA graph that was captured without the compacted layers' "
                               "buffers (please report this)")
        while True:
            try:
                filled = self._fill_step(arena, step, common)
                break
            except ArenaFull as full:  # a step larger than any before: a bigger arena, and fill again
                arena.grow(full.needed)
        arena.upload()
        step.metadata = self._build_filled(filled)
        self.zero_tails(step.tails)

    def _fill_step(self, arena: Arena, step: Any, common: Any) -> list[tuple[list[str], int, Any]]:
        """Write the step's arrays on the host (``step.tails`` too); ``(layers, KV group, CommonAttentionMetadata)``
        of every (segment, KV group), in order, for ``_build_filled`` once they are on the device."""
        plan: StepPlan = step.plan
        arena.begin()
        # Padding (CUDA graphs): the runner's request count and the forward's rows; a staged step is never padded.
        n_pad = max(common.num_reqs, len(plan.kinds))
        rows_pad = plan.num_tokens if step.staged else max(step.num_tokens_padded, plan.num_tokens)
        filled = []
        for segment in plan.segments:
            layers = self.names[segment.start: segment.stop]
            for gid in sorted({self.group_of[name] for name in layers}):
                table = self.runner.input_batch.block_table[gid]
                arrays = self._arrays(arena, (segment.start, gid) if step.graph else None, n_pad, rows_pad)
                # A staged step's segments have fewer rows than the step: its slots are exactly the segment's.
                filled.append((layers, gid, self._fill(arrays, segment, table, n_pad, common.is_prefilling,
                                                       graph=step.graph, padded_rows=0 if step.staged else rows_pad)))
        step.tails = _tail_slots(self, arena, plan, step.seq_lens)
        return filled

    def _build_filled(self, filled: list[tuple[list[str], int, Any]], *,
                      capture: bool = False) -> dict[str, tuple[Any, torch.Tensor]]:
        """``{layer name: (metadata, slots)}`` built by each segment's builder copies (``_fill_step``'s list, or
        ``capture``'s), its arrays already on the device."""
        out: dict[str, tuple[Any, torch.Tensor]] = {}
        cached: dict[tuple[Any, type], Any] = {}
        for i, (layers, gid, common_s) in enumerate(filled):
            start = self.index_of[layers[0]]
            if i and layers[0] != filled[i - 1][0][0]:  # a later KV group reuses a build of its own segment only
                cached = {}
            for copy in self.copies(start, gid):
                names = [name for name in copy.layer_names if name in layers]
                if names:
                    built = self._build(copy, common_s, cached, gid, capture=capture)
                    out.update({name: (built, common_s.slot_mapping) for name in names})
        return out

    def capture(self, common: Any) -> dict[str, tuple[Any, torch.Tensor]]:
        """The compacted layers' metadata of a FULL CUDA-graph capture (or a FULL dummy run), on the fixed buffers
        of the captured layout's segments, with the runner's dummy contents (no request drops anything) and every slot
        -1 (nothing is written). Every later FULL step rewrites those buffers in place (``build``)."""
        if not self.capture_bounds:
            return {}
        graphs = self._graph_buffers()
        arena = graphs.arena
        arena.begin()
        n_pad, rows_pad = common.num_reqs, common.num_actual_tokens
        filled = []
        starts = [*self.capture_bounds, len(self.names)]
        for start, stop in itertools.pairwise(starts):
            layers = self.names[start:stop]
            for gid in sorted({self.group_of[name] for name in layers}):
                pair = graphs.pair((start, gid))
                qsl = pair.query_start[0][: n_pad + 1]
                qsl[:] = common.query_start_loc_cpu[: n_pad + 1].numpy()
                pair.seq_lens[0][:n_pad] = common.seq_lens_cpu_upper_bound[:n_pad].numpy()
                pair.slots[0][:rows_pad] = _PAD_SLOT
                filled.append((layers, gid, _common(pair.query_start, pair.seq_lens, pair.slots, n_pad, rows_pad,
                                                    rows_pad, common.max_query_len, common.max_seq_len,
                                                    self.runner.input_batch.block_table[gid].get_device_tensor(n_pad),
                                                    common.is_prefilling)))
        arena.upload()  # before the builds, as in ``build``
        out = self._build_filled(filled, capture=True)
        graphs.captured = out
        return out

    def _graph_buffers(self) -> CaptureBuffers:
        """The fixed buffers FULL CUDA graphs read (made on first use)."""
        if self.graphs is None:
            self._make_graph_buffers()
        assert self.graphs is not None
        return self.graphs

    def _make_graph_buffers(self) -> None:
        compilation = self.runner.vllm_config.compilation_config
        reqs = max(self.max_reqs, compilation.max_cudagraph_capture_size or 0)
        starts = [*self.capture_bounds, len(self.names)]
        pairs = [(start, gid) for start, stop in itertools.pairwise(starts)
                 for gid in sorted({self.group_of[name] for name in self.names[start:stop]})]
        block = max(self.runner.input_batch.block_table[gid].block_size for _, gid in pairs)
        # A FULL step's tails: at most the rest of a block per decode row, per region and KV cache group.
        tails = (len(pairs) + len(self.spec_of)) * reqs * block * 8
        self.graphs = CaptureBuffers(pairs, reqs, tails, self.runner.device)

    def _arrays(self, arena: Arena, key: tuple[int, int] | None, n_pad: int, rows: int) -> tuple[Any, Any, Any]:
        if key is not None:
            pair = self._graph_buffers().pair(key)
            return pair.query_start, pair.seq_lens, pair.slots
        return arena.take(torch.int32, n_pad + 1), arena.take(torch.int32, n_pad), arena.take(torch.int64, rows)

    def _fill(self, arrays: tuple[Any, Any, Any], segment: Segment, table: Any, n_pad: int,
              is_prefilling: torch.Tensor | None, *, graph: bool, padded_rows: int) -> Any:
        """Write one segment's query starts, sequence lengths and slots (in KV group ``table``) into ``arrays``,
        padded to ``n_pad`` requests (query starts repeat the last, lengths 0) and the slots to the forward's rows
        (-1); its ``CommonAttentionMetadata``."""
        query_start, seq_lens, slots = arrays
        n = len(segment.seq_lens)
        qsl = query_start[0]
        qsl[: n + 1] = segment.query_start
        qsl[n + 1: n_pad + 1] = segment.query_start[-1]
        lens = seq_lens[0]
        lens[:n] = segment.seq_lens
        lens[n:n_pad] = 0
        count = segment.num_tokens
        written = _segment_slots(segment, table)
        out = slots[0]
        out[:count] = written
        rows = max(padded_rows, count)
        out[count:rows] = _PAD_SLOT
        # Under a FULL graph the runner's own metadata counts the padded rows too (its pad_attn).
        return _common(query_start, seq_lens, slots, n_pad, rows if graph else count, rows,
                            segment.max_query_len, segment.max_seq_len, table.get_device_tensor(n_pad), is_prefilling)

    def _build(self, copy: Any, common: Any, cached: dict[tuple[Any, type], Any], gid: int, *,
               capture: bool = False) -> Any:
        """``copy``'s metadata for ``common``: built, or, for a later KV group of the segment whose builder has
        ``update_block_table`` (FlashAttention), the segment's first build with this group's block table and slots
        (as the runner does across its own groups; a captured graph then reads the first build's scheduler metadata,
        which every step refreshes)."""
        builder = copy.get_metadata_builder()
        key = (self.spec_of[gid], type(builder))
        if key in cached and builder.supports_update_block_table:
            return builder.update_block_table(cached[key], copy.map_to_kernel_block_table(common.block_table_tensor),
                                              common.slot_mapping)
        built = copy.build_metadata_for_cudagraph_capture(common) if capture else copy.build_metadata(common)
        if builder.supports_update_block_table:
            cached[key] = built
        return built

    # --------------------------------------------------------------------------------------- tails
    def zero_tails(self, tails: dict[str, torch.Tensor]) -> None:
        """Write zero keys and values at each layer's tail slots with the backend's own cache writer."""
        if not tails:
            return
        count = max(slots.shape[0] for slots in tails.values())
        first = self.attns[self.index_of[next(iter(tails))]]
        if self._zeros is None or self._zeros.shape[0] < count:
            # The activations' dtype: the writer casts or quantizes them into the cache as it does the layer's own.
            with torch.inference_mode(False):
                self._zeros = torch.zeros(max(count, 64), first.num_kv_heads, first.head_size,
                                          dtype=self.runner.model_config.dtype, device=self.runner.device)
        for name, slots in tails.items():
            attn = self.attns[self.index_of[name]]
            zeros = self._zeros[: slots.shape[0]]
            impl: Any = attn.impl  # the backend's own writer (AttentionImpl does not declare it; CPU_ATTN's has it)
            impl.do_kv_cache_update(attn, zeros, zeros, attn.kv_cache, slots)

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

def self_test(metadata: StageMetadata, version: str) -> None:
    """Build stage metadata for a made-up step (a decode shifted by 2, then a prefill keeping 3 of its 5 rows: the
    longer query second, so a maximum taken from the first request shows) with every builder copy of the first
    layer's KV group and check the fields the compacted layers rely on; a changed metadata layout (another vLLM
    release) fails here, naming the field, before any request is served."""
    gid = metadata.group_of[metadata.names[0]]
    table = metadata.runner.input_batch.block_table[gid]
    width = table.block_table.gpu.shape[1]
    arena = Arena(1 << 12, metadata.runner.device)
    query_start, seq_lens = [0, 1, 4], [10, 3]
    slots = np.asarray([9, 0, 1, 2], dtype=np.int64)
    views = arena.take(torch.int32, 3), arena.take(torch.int32, 2), arena.take(torch.int64, 4)
    views[0][0][:], views[1][0][:], views[2][0][:] = query_start, seq_lens, slots
    arena.upload()
    with torch.inference_mode(False):
        blocks = torch.zeros(2, width, dtype=table.block_table.gpu.dtype, device=metadata.runner.device)
    common = _common(*views, 2, 4, 4, 3, 10, blocks, None)
    want = {"query_start_loc": query_start, "seq_lens": seq_lens, "slot_mapping": slots.tolist(),
            "max_query_len": 3, "max_seq_len": 10, "num_actual_tokens": 4}
    for copy in metadata.copies(-1, gid):
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
    metadata._copies.pop((-1, gid), None)


def _common(query_start: Any, seq_lens: Any, slots: Any, n_pad: int, num_tokens: int, slot_rows: int,
            max_query_len: int, max_seq_len: int, block_table: torch.Tensor,
            is_prefilling: torch.Tensor | None) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=query_start[2][: n_pad + 1], query_start_loc_cpu=query_start[1][: n_pad + 1],
        seq_lens=seq_lens[2][:n_pad], seq_lens_cpu_upper_bound=seq_lens[1][:n_pad], num_reqs=n_pad,
        num_actual_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
        block_table_tensor=block_table, slot_mapping=slots[2][:slot_rows], causal=True, is_prefilling=is_prefilling)


def _segment_slots(segment: Segment, table: Any) -> np.ndarray:
    """The slots of a segment's rows in one KV cache group: row ``k`` of request ``i`` at compacted index
    ``first_index[i] + k``."""
    first = np.asarray(segment.first_index, dtype=np.int64)
    starts = np.asarray(segment.query_start, dtype=np.int64)
    lens = starts[1:] - starts[:-1]
    n = len(first)
    if segment.num_tokens == n:  # one row per request (a decode segment)
        request, index = np.arange(n), first
    else:
        request = np.repeat(np.arange(n), lens)
        index = np.repeat(first - starts[:-1], lens) + np.arange(segment.num_tokens)
    return slots_at(table.block_table.np, table.num_blocks_per_row, table.block_size, request, index)


def _tail_slots(metadata: StageMetadata, arena: Arena, plan: StepPlan,
                seq_lens: list[int]) -> dict[str, torch.Tensor]:
    """``{layer name: slots}`` to zero before the forward (``StageMetadata.zero_tails``), for the layers whose
    backend reads past a sequence's end (``needs_tails``): the rest of the last block holding a prefilled request's
    rows, and of a block a decode row starts. ``seq_lens``: the step's sequence lengths (of the layers before the
    first segment, or of every layer in a plain step)."""
    batch = metadata.runner.input_batch
    regions = [(0, plan.segments[0].start if plan.segments else len(metadata.names), seq_lens)]
    regions += [(s.start, s.stop, s.seq_lens) for s in plan.segments]
    kinds = np.asarray([kind == DECODE for kind in plan.kinds])
    out: dict[str, torch.Tensor] = {}
    for start, stop, lens in regions:
        layers = [i for i in range(start, stop) if metadata.tails_of[i]]
        if not layers:
            continue
        ends, found = np.asarray(lens, dtype=np.int64), {}
        for gid in sorted({metadata.group_of[metadata.names[i]] for i in layers}):
            table = batch.block_table[gid]
            if table.block_size not in found:  # the same rows in every group of one block size
                found[table.block_size] = _tail_index(kinds, ends, table.block_size)
            index, request = found[table.block_size]
            if not len(index):
                continue
            view = arena.take(torch.int64, len(index))
            view[0][:] = slots_at(table.block_table.np, table.num_blocks_per_row, table.block_size, request, index)
            out.update({metadata.names[i]: view[2] for i in layers if metadata.group_of[metadata.names[i]] == gid})
    return out


def _tail_index(decode: np.ndarray, ends: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Compacted indices (and their request rows) of the unwritten rest of each request's last block: every
    prefill's, and a decode's whose row starts a block (the rest of its block was zeroed when a prefill or an earlier
    decode first wrote there)."""
    stops = -(-ends // block_size) * block_size
    counts = np.where(decode & ((ends - 1) % block_size != 0), 0, stops - ends)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    request = np.repeat(np.arange(len(ends)), counts)
    offsets = np.cumsum(counts) - counts
    index = np.repeat(ends - offsets, counts) + np.arange(total)
    return index, request


def _share_scratch(runner_builder: Any, copy_builder: Any) -> None:
    """Triton's builders own softmax-segment scratch allocated after vLLM's memory profile; layers run one after
    another on one stream, so a copy uses the runner builder's scratch instead of holding its own."""
    for name in ("softmax_segm_output", "softmax_segm_max", "softmax_segm_expsum"):
        if hasattr(runner_builder, name) and hasattr(copy_builder, name):
            setattr(copy_builder, name, getattr(runner_builder, name))
