"""obj tier: object names, the trailer format, the read target and capacity bookkeeping
(no server needed), and the plugin importing without aiobotocore."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
import xxhash
from kvtiers_obj import layout
from kvtiers_obj.capacity import LruBytes
from kvtiers_obj.tier import _slices, _Target

DIGEST = "0123456789abcdef"


def test_object_name_is_documented_layout():
    key = b"\x00/../a"
    h = hashlib.sha256(key).hexdigest()
    assert layout.object_name("kv/cache", DIGEST, key) == f"kv/cache/{DIGEST}/{h[:2]}/{h[2:4]}/{key.hex()}.bin"
    assert layout.object_name("", DIGEST, key) == f"{DIGEST}/{h[:2]}/{h[2:4]}/{key.hex()}.bin"
    assert layout.config_name("kv", DIGEST) == f"kv/{DIGEST}/config.json"


def test_hostile_keys_never_alias_or_escape():
    keys = [bytes([b]) for b in range(256)] + [b"a/b", b"ab", b"..", b"../..", b"a\x00", b"a\x00\x00", b"\xff" * 64]
    names = [layout.object_name("p", DIGEST, k) for k in keys]
    assert len(set(names)) == len(keys)
    for k, n in zip(keys, names, strict=True):
        parts = n.split("/")
        assert len(parts) == 5 and parts[:2] == ["p", DIGEST]
        assert all(seg not in ("", ".", "..") for seg in parts)
        assert layout.key_from_name(n) == k


def test_key_from_name_rejects_other_objects():
    assert layout.key_from_name(f"p/{DIGEST}/config.json") is None
    assert layout.key_from_name(f"p/{DIGEST}/00/00/zz.bin") is None
    good = layout.object_name("p", DIGEST, b"k")
    parts = good.split("/")
    parts[2] = "00" if parts[2] != "00" else "01"  # right name, wrong hash directory
    assert layout.key_from_name("/".join(parts)) is None


@pytest.mark.parametrize("prefix,want", [("kv", "kv"), ("/kv/a/", "kv/a"), ("", "")])
def test_normalise_prefix(prefix, want):
    assert layout.normalise_prefix(prefix) == want


@pytest.mark.parametrize("prefix", ["a//b", "a/../b", "./a"])
def test_normalise_prefix_rejects(prefix):
    with pytest.raises(ValueError):
        layout.normalise_prefix(prefix)


def test_trailer_fields_and_checks():
    payload = bytes(range(256)) * 16
    ns = "0123456789abcdef"
    t = layout.make_trailer(b"key", payload, ns)
    assert len(t) == layout.TRAILER_BYTES == 40
    assert t[:8] == b"KVTOBJ02"
    assert int.from_bytes(t[8:16], "little") == len(payload)
    assert int.from_bytes(t[16:24], "little") == xxhash.xxh3_64_intdigest(payload)
    assert int.from_bytes(t[24:32], "little") == xxhash.xxh3_64_intdigest(b"key")
    assert t[32:40] == bytes.fromhex(ns)
    layout.check_trailer(b"key", payload, t, ns)
    assert layout.tail_payload_length(b"key", t, ns) == len(payload)
    assert layout.tail_payload_length(b"kez", t, ns) is None
    assert layout.tail_payload_length(b"key", t, "fedcba9876543210") is None
    with pytest.raises(layout.CorruptObject, match="namespace 0123456789abcdef, not fedcba9876543210"):
        layout.check_trailer(b"key", payload, t, "fedcba9876543210")
    flipped = bytearray(payload)
    flipped[1000] ^= 1
    with pytest.raises(layout.CorruptObject, match="checksum"):
        layout.check_trailer(b"key", flipped, t, ns)
    with pytest.raises(layout.CorruptObject, match="another key"):
        layout.check_trailer(b"kez", payload, t, ns)
    with pytest.raises(layout.CorruptObject, match="magic"):
        layout.check_trailer(b"key", payload, b"X" + t[1:], ns)
    with pytest.raises(layout.CorruptObject, match="payload bytes"):
        layout.check_trailer(b"key", payload[:-1], t, ns)
    with pytest.raises(layout.CorruptObject):
        layout.check_trailer(b"key", payload, t[:-1], ns)


def test_target_splits_payload_and_trailer():
    out = memoryview(bytearray(10))
    tg = _Target(out)
    obj = bytes(range(10 + layout.TRAILER_BYTES))
    tg.write_at(0, obj[:7])
    tg.write_at(7, obj[7:20])  # crosses into the trailer
    tg.write_at(20, obj[20:])
    assert bytes(out) == obj[:10] and bytes(tg.trailer) == obj[10:]
    with pytest.raises(layout.CorruptObject):
        tg.write_at(len(obj) - 2, b"abc")


def test_slices_cover_range_without_copies():
    a, b = bytearray(b"0123456789"), b"TRAILER"
    got = _slices([memoryview(a), b], 8, 12)
    assert b"".join(bytes(s) for s in got) == b"89TR"
    assert got[0].obj is a  # a view of the slot, not a copy


def test_lru_victims_skip_busy_keys():
    lru = LruBytes(30)
    for k in (b"a", b"b", b"c"):
        lru.add(k, 10)
    assert lru.victims() == []
    lru.touch([b"a"])
    lru.add(b"d", 10)
    assert lru.victims(busy=[b"b"]) == [b"c"]
    assert lru.total == 30 and b"c" not in lru and len(lru) == 3


def test_plugin_imports_without_aiobotocore():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["aiobotocore"] = None  # make it unimportable
        import kvtiers
        reg = kvtiers.get_registry()
        assert "obj" in [t.name for t in reg.tiers()], reg.errors
        ctx = kvtiers.TierContext(kvtiers.Arena.allocate(1, 4096))
        try:
            kvtiers.open_tier("obj", {"bucket": "bkt"}, ctx)
        except kvtiers.TierError as e:
            print(e)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install 'kvtiers[obj]'" in r.stdout


def test_bounds_put_the_trailer_in_the_last_piece():
    from kvtiers_obj.tier import _bounds

    assert _bounds(10, 42, 4) == [(0, 4), (4, 8), (8, 42)]
    assert _bounds(8, 40, 4) == [(0, 4), (4, 40)]
    assert _bounds(3, 35, 4) == [(0, 35)]
