"""KV layout descriptors: sizes, slot offsets, description, inference from tensors."""

import json

import pytest
import torch

from kvtiers import Namespace
from kvtiers.engine.layout import KVGroup, KVLayout


def test_flat_mla_multi_chunk_bytes():
    assert KVLayout.flat(32, 16384).chunk_bytes(1) == 32 * 2 * 16384
    assert KVLayout.flat(32, 16384).chunk_bytes(4) == 4 << 20
    assert KVLayout.mla(61, 1152).chunk_bytes(16) == 61 * 1152 * 16
    multi = KVLayout.multi([KVGroup("target", 4, 2, 1024), KVGroup("draft", 1, 2, 256)])
    assert multi.chunk_bytes(2) == 4 * 2 * 1024 * 2 + 1 * 2 * 256 * 2
    assert multi.group_offsets(2) == [0, 4 * 2 * 1024 * 2]


def test_segments_tile_the_chunk_in_slot_order():
    layout = KVLayout.multi([KVGroup("a", 2, 2, 100), KVGroup("b", 3, 1, 60)])
    bpc = 3
    segs = list(layout.segments(bpc))
    assert [(s.group, s.layer, s.tensor) for s in segs] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 1, 0), (1, 2, 0)]
    off = 0
    for s in segs:
        assert s.offset == off
        off += bpc * s.block_bytes
    assert off == layout.chunk_bytes(bpc)


def test_describe_is_json_and_feeds_a_namespace():
    a = KVLayout.multi([KVGroup("target", 4, 2, 1024), KVGroup("draft", 1, 2, 256)])
    b = KVLayout.multi([KVGroup("target", 4, 2, 1024), KVGroup("draft", 1, 2, 512)])
    d = json.loads(json.dumps(a.describe()))
    assert d["groups"][1] == {"name": "draft", "num_layers": 1, "tensors_per_layer": 2, "block_bytes": 256}
    assert Namespace({"layout": a.describe()}).digest != Namespace({"layout": b.describe()}).digest


def test_from_tensors_infers_each_layout():
    kv = {"kv": [[torch.zeros(5, 16, 8, 4, dtype=torch.bfloat16) for _ in range(2)] for _ in range(3)]}
    assert KVLayout.from_tensors(kv) == KVLayout.flat(3, 16 * 8 * 4 * 2)
    mla = {"mla": [[torch.zeros(7, 16, 576, dtype=torch.float16)] for _ in range(2)]}
    assert KVLayout.from_tensors(mla, kinds={"mla": "mla"}) == KVLayout.mla(2, 16 * 576 * 2)
    multi = {"t": [[torch.zeros(4, 64, dtype=torch.int8)] * 2] * 3, "d": [[torch.zeros(4, 8, dtype=torch.float32)] * 2]}
    assert KVLayout.from_tensors(multi) == KVLayout.multi([KVGroup("t", 3, 2, 64), KVGroup("d", 1, 2, 32)])


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        ({"kv": [[torch.zeros(4, 8)[:, ::2], torch.zeros(4, 4)]]}, "contiguous"),
        ({"kv": [[torch.zeros(4, 8), torch.zeros(4, 4)]]}, "block of 16 bytes, expected 32"),
        ({"kv": [[torch.zeros(4, 8)] * 2, [torch.zeros(4, 8)]]}, "1 tensors, layer 0 has 2"),
        ({"kv": []}, "no layers"),
        ({}, "non-empty"),
        ({"kv": [[torch.zeros(0, 8)]]}, "num_blocks >= 1"),
    ],
)
def test_from_tensors_rejects_unusable_tensors(kv, match):
    with pytest.raises(ValueError, match=match):
        KVLayout.from_tensors(kv)


def test_group_and_layout_validation():
    with pytest.raises(ValueError, match="num_layers must be positive"):
        KVGroup("x", 0, 2, 64)
    with pytest.raises(TypeError, match="block_bytes must be an int"):
        KVGroup("x", 1, 2, 64.0)
    with pytest.raises(ValueError, match="distinct"):
        KVLayout.multi([KVGroup("x", 1, 2, 64), KVGroup("x", 1, 1, 64)])
    with pytest.raises(ValueError, match="blocks_per_chunk must be positive"):
        KVLayout.flat(1, 64).chunk_bytes(0)
