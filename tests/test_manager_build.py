"""TieringManager.from_config, the checks an integrator tripped on: a block shape that cannot
hold tokens_per_block tokens is an error, an arena too small for one slot says how the slot size
was computed, and a DMA engine of one's own (``dma=``) over the arena from_config builds.
CPU tensors, the CPU DMA engine, the memory tier."""

from __future__ import annotations

import pytest
import torch

from kvtiers import ConfigError, TieringManager
from kvtiers.engine.dma import DmaEngine
from kvtiers.engine.layout import KVLayout


def test_a_block_shape_without_tokens_per_block_is_an_error() -> None:
    # a transformers cache tensor [batch, heads, seq, head_dim] is not [num_blocks, 16, ...]
    kv = {"kv": [[torch.zeros(1, 4, 2048, 64, dtype=torch.float16) for _ in "KV"] for _ in range(2)]}
    with pytest.raises(ValueError, match=r"block of shape \[4, 2048, 64\].*no dimension of tokens_per_block=16"):
        TieringManager.from_config({"host_bytes": 1 << 30}, kv, tokens_per_block=16)
    ok = {"kv": [[torch.zeros(8, 16, 4, 64, dtype=torch.float16) for _ in "KV"] for _ in range(2)]}
    with TieringManager.from_config({"host_bytes": 1 << 20}, ok, tokens_per_block=16) as mgr:
        assert mgr.tokens_per_chunk == 16


def test_an_arena_smaller_than_a_slot_says_how_the_slot_was_sized() -> None:
    kv = {"kv": [[torch.zeros(8, 16, 4, 64, dtype=torch.float16) for _ in "KV"] for _ in range(2)]}
    with pytest.raises(ConfigError) as e:
        TieringManager.from_config({"host_bytes": 100_000, "blocks_per_chunk": 4}, kv, tokens_per_block=16)
    msg = str(e.value)
    assert "less than one slot of 131072 bytes" in msg
    assert "blocks_per_chunk=4" in msg and "2 layers x 2 tensors x 4 blocks x 8192 bytes" in msg
    assert "[16, 4, 64] float16" in msg


class CountingDma:
    """A DMA engine of one's own: the CPU DmaEngine, counting its calls."""

    def __init__(self, layout, host, blocks_per_chunk, kv) -> None:
        self.inner = DmaEngine(layout, kv, host, blocks_per_chunk)
        self.calls = []
        self.closed = False

    def submit_store(self, tid, chunks):
        self.calls.append(("store", len(chunks)))
        self.inner.submit_store(tid, chunks)

    def submit_load(self, tid, chunks):
        self.calls.append(("load", len(chunks)))
        self.inner.submit_load(tid, chunks)

    def poll(self):
        return self.inner.poll()

    def close(self):
        self.closed = True


def test_from_config_with_a_dma_engine_of_ones_own() -> None:
    kv = {"kv": [[torch.randn(16, 16, 2, 8) for _ in "KV"] for _ in range(2)]}
    made = []

    def make(layout, host, blocks_per_chunk):
        made.append(CountingDma(layout, host, blocks_per_chunk, kv))
        return made[-1]

    layout = KVLayout.from_tensors(kv)
    cfg = {"host_bytes": 1 << 20, "blocks_per_chunk": 2, "tiers": [{"type": "memory"}]}
    with TieringManager.from_config(cfg, None, layout=layout, dma=make, tokens_per_block=16) as mgr:
        (dma,) = made
        (stored,) = mgr.wait([mgr.store([b"a", b"b"], [0, 1, 2, 3])])
        (loaded,) = mgr.wait([mgr.load([b"a", b"b"], [8, 9, 10, 11])])
        assert stored.ok and loaded.ok and dma.calls == [("store", 2), ("load", 2)]
        assert all(torch.equal(t[8:12], t[0:4]) for layer in kv["kv"] for t in layer)
        assert mgr.namespace.fields["layout"] == layout.describe()
    assert dma.closed
    with pytest.raises(ValueError, match="kv_caches may be None only with both layout= and dma="):
        TieringManager.from_config(cfg, None, layout=layout)
