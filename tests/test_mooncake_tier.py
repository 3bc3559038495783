"""The mooncake tier against a real Mooncake Store pool (a ``mooncake_master`` on loopback and
a ``serve`` process holding the memory, one per test session): options, the object names and
format, zero-copy stores and loads, Mooncake's put semantics, and every way a stored object can
be wrong (corrupt, truncated, another namespace's, another chunk size) failing its key."""

from __future__ import annotations

import mmap
import os

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake import client as mc  # noqa: E402
from kvtiers_mooncake import layout  # noqa: E402
from kvtiers_mooncake.client import OBJECT_NOT_FOUND, missing  # noqa: E402
from kvtiers_mooncake.pool import shared_test_pool  # noqa: E402
from kvtiers_mooncake.tier import address  # noqa: E402
from tier_helpers import resolve_lookup, wait_job  # noqa: E402

from kvtiers import Arena, ConfigError, Job, Lookup, Namespace, TierContext, TierError, open_tier  # noqa: E402
from kvtiers.types import make_chunk_trailer  # noqa: E402

if missing():
    pytest.skip(missing(), allow_module_level=True)

SLOT = 64 << 10


@pytest.fixture(scope="session")
def mooncake_pool():
    return shared_test_pool()


class Opened:
    """A tier instance on its own arena, the ctx.removed calls it made, and its namespace."""

    def __init__(self, pool, ns: Namespace, slot: int = SLOT, slots: int = 16, **opts) -> None:
        self.arena = Arena.allocate(slots, slot)
        self.removed: list[tuple[tuple[bytes, ...], str]] = []
        self.ns = ns
        ctx = TierContext(self.arena, ns, removed=lambda keys, why: self.removed.append((tuple(keys), why)))
        options = {"master_server_address": pool.address, "global_segment_size": 0, "timeout": 10.0, **opts}
        self.h = open_tier("mooncake", options, ctx)
        self.ids = iter(range(1, 1 << 30))

    def fill(self, slot: int) -> bytes:
        data = os.urandom(self.arena.slot_bytes)
        self.arena[slot][:] = data
        return data

    def store(self, keys, slots):
        jid = next(self.ids)
        self.h.submit_store(Job(jid, tuple(keys), tuple(slots)))
        return wait_job(self.h, jid)

    def load(self, keys, slots):
        jid = next(self.ids)
        self.h.submit_load(Job(jid, tuple(keys), tuple(slots)))
        return wait_job(self.h, jid)

    def close(self) -> None:
        self.h.close()


@pytest.fixture
def ns():
    return Namespace({"test": "mooncake", "run": os.urandom(4).hex()})


@pytest.fixture
def opened(mooncake_pool, ns):
    made: list[Opened] = []

    def make(**kw) -> Opened:
        o = Opened(mooncake_pool, kw.pop("ns", ns), **kw)
        made.append(o)
        return o

    yield make
    for o in made:
        o.close()


def raw(pool):
    """The process's shared client on the test pool (what the tier instances use)."""
    return mc.acquire(mc.Setup(pool.address))


class Scratch:
    """A registered scratch buffer on a raw client."""

    def __init__(self, client, size: int) -> None:
        self.client = client
        self.mem = mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.view = memoryview(self.mem)
        self.addr = address(self.view)
        client.register(self.addr, len(self.mem), "scratch")

    def close(self) -> None:
        self.client.unregister(self.addr)
        self.view.release()
        self.mem.close()


def put_raw(pool, name: str, data: bytes) -> None:
    client = raw(pool)
    s = Scratch(client, len(data))
    try:
        s.view[:len(data)] = data
        assert client.store.upsert_from(name, s.addr, len(data)) == 0
    finally:
        s.close()
        mc.release(client)


def get_raw(pool, name: str) -> bytes | None:
    client = raw(pool)
    try:
        size = client.store.get_size(name)
        if size < 0:
            return None
        s = Scratch(client, size)
        try:
            got = client.store.get_into(name, s.addr, size)
            if got == OBJECT_NOT_FOUND:  # removed between the two calls: Mooncake's removal is not atomic with them
                return None
            assert got == size
            return bytes(s.view[:size])
        finally:
            s.close()
    finally:
        mc.release(client)


def test_bad_options_are_one_line_errors(mooncake_pool):
    arena = Arena.allocate(2, 4096)
    with pytest.raises(ConfigError, match="master_server_address' must be host:port"):
        open_tier("mooncake", {"master_server_address": "nowhere"}, TierContext(arena))
    with pytest.raises(ConfigError, match="'protocol'"):
        open_tier("mooncake", {"master_server_address": mooncake_pool.address, "protocol": "udp"},
                  TierContext(arena))
    with pytest.raises(ConfigError, match="'replicas' must be >= 1"):
        open_tier("mooncake", {"master_server_address": mooncake_pool.address, "replicas": 0}, TierContext(arena))
    with pytest.raises(ConfigError, match="unknown option"):
        open_tier("mooncake", {"master_server_address": mooncake_pool.address, "bucket": "x"}, TierContext(arena))


def test_an_unreachable_master_is_a_tier_error_naming_it():
    from kvtiers_mooncake.master import free_port

    where = f"127.0.0.1:{free_port()}"
    with pytest.raises(TierError, match=f"no mooncake_master answers at {where}"):
        open_tier("mooncake", {"master_server_address": where, "global_segment_size": 0},
                  TierContext(Arena.allocate(2, 4096)))


def test_objects_are_payload_then_trailer_under_the_namespaced_hex_name(mooncake_pool, opened, ns):
    t = opened()
    key = b"k/../\x00\xff"
    data = t.fill(0)
    assert t.store([key], [0]).ok
    name = f"kvtiers/{ns.digest}/{key.hex()}"
    assert layout.object_name(ns.digest, key) == name and layout.key_from_name(name, ns.digest) == key
    obj = get_raw(mooncake_pool, name)
    assert obj is not None and len(obj) == SLOT + 40
    assert obj[:SLOT] == data and obj[SLOT:] == make_chunk_trailer(key, data, ns.digest)


def test_store_and_load_many_keys_byte_exact(opened):
    t = opened(slots=32)
    keys = [b"key-%d" % i for i in range(16)]
    want = [t.fill(i) for i in range(16)]
    r = t.store(keys, range(16))
    assert r.ok and r.nbytes == 16 * SLOT
    assert resolve_lookup(t.h, keys + [b"never"]) == [Lookup.HIT] * 16 + [Lookup.MISS]
    r = t.load(keys, range(16, 32))
    assert r.ok, r.error
    assert [bytes(t.arena[16 + i]) for i in range(16)] == want
    r = t.load([b"never"], [0])
    assert r.failed_keys == (b"never",) and r.error == "missing"


def test_a_put_to_an_existing_key_keeps_the_first_value(opened):
    """Mooncake's put keeps what a key holds (rule 7: storing a key that exists succeeds)."""
    t = opened()
    first = t.fill(0)
    assert t.store([b"same"], [0]).ok
    t2 = opened()  # another instance: knows nothing of the first store
    t2.fill(0)
    assert t2.store([b"same"], [0]).ok
    assert t2.load([b"same"], [1]).ok
    assert bytes(t2.arena[1]) == first


def test_a_corrupt_object_fails_its_key_and_is_removed(mooncake_pool, opened, ns):
    t = opened()
    t.fill(0)
    assert t.store([b"rot"], [0]).ok
    from kvtiers_mooncake.tier import MooncakeTier

    MooncakeTier.conformance_corrupt({"master_server_address": mooncake_pool.address, "global_segment_size": 0},
                                     ns, b"rot")
    r = t.load([b"rot"], [1])
    assert r.failed_keys == (b"rot",), r
    assert "corrupt" in r.error and "checksum" in r.error, r.error
    assert ((b"rot",), "corrupt") in t.removed
    assert resolve_lookup(t.h, [b"rot"]) == [Lookup.MISS]
    assert get_raw(mooncake_pool, layout.object_name(ns.digest, b"rot")) is None


@pytest.mark.parametrize("case", ["truncated", "foreign namespace", "other key", "other size"])
def test_a_wrong_object_is_a_failed_key_never_wrong_bytes(mooncake_pool, opened, ns, case):
    t = opened()
    key = b"wrong-" + case.encode()
    name = layout.object_name(ns.digest, key)
    payload = os.urandom(SLOT)
    if case == "truncated":
        obj = (payload + make_chunk_trailer(key, payload, ns.digest))[:-1]
    elif case == "foreign namespace":
        obj = payload + make_chunk_trailer(key, payload, Namespace({"other": 1}).digest)
    elif case == "other key":
        obj = payload + make_chunk_trailer(b"not-" + key, payload, ns.digest)
    else:  # a valid chunk of another arena's slot size, on the same namespace
        payload = os.urandom(2 * SLOT)
        obj = payload + make_chunk_trailer(key, payload, ns.digest)
    put_raw(mooncake_pool, name, obj)
    sentinel = t.fill(1)
    r = t.load([key], [1])
    assert r.failed_keys == (key,) and r.error
    if case in ("truncated", "other size"):
        assert "bytes" in r.error  # names the size it found
    if case == "other size":  # not this arena's to remove: left alone, a miss here
        assert get_raw(mooncake_pool, name) == obj
        assert resolve_lookup(t.h, [key]) == [Lookup.MISS]
    del sentinel


def test_a_chunk_of_another_size_on_the_same_namespace_is_left_alone(opened, ns):
    small = opened(slot=SLOT)
    big = opened(slot=2 * SLOT)
    data = big.fill(0)
    assert big.store([b"sized"], [0]).ok
    r = small.load([b"sized"], [0])
    assert r.failed_keys == (b"sized",) and "another size" in r.error
    assert not small.removed
    assert big.load([b"sized"], [1]).ok and bytes(big.arena[1]) == data


def test_max_bytes_evicts_oldest_and_reports_them(opened):
    t = opened(slots=16, max_bytes=4 * (SLOT + 40))
    keys = [b"b%d" % i for i in range(12)]
    for i, k in enumerate(keys):
        t.fill(i)
        assert t.store([k], [i]).ok
    gone = {k for ks, why in t.removed if why == "evicted" for k in ks}
    assert gone == set(keys[:8])
    assert resolve_lookup(t.h, keys) == [Lookup.MISS] * 8 + [Lookup.HIT] * 4
    assert t.load(keys[8:], range(8, 12)).ok


def test_close_leaves_no_thread_of_the_instance(opened):
    import threading

    t = opened()
    t.fill(0)
    assert t.store([b"x"], [0]).ok
    t.close()
    assert not [th for th in threading.enumerate() if th.name.startswith("kvtiers-mooncake")]
