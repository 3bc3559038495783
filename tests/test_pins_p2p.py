"""Lifetime pins in the p2p tier (docs/pins.md): the peer server keeps a pinned chunk out of
eviction until the last of its pins ends (each tier instance pins for its own time), refuses
a pin past half of the namespace's cap or of a key it does not hold, with the reason; the
tier's close ends its pins. Against real ``kvtiers p2p serve`` children, and the server's
store on its own. Rule 13 of the conformance suite runs on p2p here and in
tests/test_p2p_conformance.py (TierTests)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

import tier_helpers  # noqa: E402
from kvtiers_conformance import Limits, run_conformance  # noqa: E402
from kvtiers_p2p.store import MemoryStore  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

server = tier_helpers.p2p_server  # one peer server for the module
CHUNK = 4096
FAST = Limits(finish_s=10.0, retry_s=5.0, examples=10, crash_rounds=1, shrink=False)


def tier(server, ns: str, **opts):
    arena = Arena.allocate(16, CHUNK)
    for i in range(16):
        arena[i][:] = bytes([i + 1]) * CHUNK
    return open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "positive_ttl": 0.2, "negative_ttl": 0.1,
                             **opts}, TierContext(arena, Namespace({"test": ns})))


def store(t, keys, job_id: int) -> None:
    t.submit_store(Job(job_id, tuple(keys), tuple(range(len(keys)))))
    r = wait(t, job_id)
    assert r.ok, r


def settled(t, keys):
    """What the server holds: lookups until no key answers RETRY, HITs remembered 0.2 s."""
    time.sleep(0.3)
    return resolve(t, keys)


def test_a_pinned_chunk_outlives_eviction_and_a_pin_past_the_cap_is_refused(server):
    t = tier(server, "pins-hold", max_bytes=4 * CHUNK)
    try:
        first = [b"k0", b"k1", b"k2", b"k3"]
        store(t, first, 1)
        assert t.pin(first[:2], 3600.0) is None
        store(t, [b"k4", b"k5", b"k6", b"k7"], 2)  # least recently used first: k0 and k1 would go
        assert settled(t, first) == [Lookup.HIT, Lookup.HIT, Lookup.MISS, Lookup.MISS]
        t.submit_load(Job(3, (b"k0", b"k1"), (8, 9)))
        assert wait(t, 3).ok and bytes(t.ctx.arena[8]) == bytes([1]) * CHUNK
        why = t.pin([b"k6"], 60.0)  # 3 of at most 2 chunks (half of max_bytes)
        assert why and f"would pin {3 * CHUNK} of at most {2 * CHUNK} bytes (0.5 of the namespace's max_bytes)" in why
        why = t.pin([b"k7", b"never stored"], 60.0)
        assert why and "p2p server: 1 of 2 key(s) not stored here" in why, why
        t.unpin([b"k1"])  # k1 goes back to the LRU as just used; k7's pin now fits
        assert t.pin([b"k7"], 60.0) is None
        store(t, [b"k8", b"k9", b"k10"], 4)
        assert settled(t, [b"k0", b"k1", b"k7"]) == [Lookup.HIT, Lookup.MISS, Lookup.HIT]
    finally:
        t.close()


def test_a_soft_pin_ends_at_its_time(server):
    t = tier(server, "pins-expire", max_bytes=4 * CHUNK)
    try:
        store(t, [b"k0", b"k1", b"k2", b"k3"], 1)
        assert t.pin([b"k0"], 0.5) is None
        time.sleep(1.0)  # past its time: k0 is a chunk like the others (back as just used)
        store(t, [b"k4", b"k5", b"k6", b"k7"], 2)
        assert settled(t, [b"k0", b"k1"]) == [Lookup.MISS, Lookup.MISS]
    finally:
        t.close()


def test_pins_belong_to_their_instance_and_end_when_it_closes(server):
    a = tier(server, "pins-owners", max_bytes=4 * CHUNK)
    b = tier(server, "pins-owners", max_bytes=4 * CHUNK)
    try:
        store(a, [b"k0", b"k1", b"k2", b"k3"], 1)
        assert a.pin([b"k0"], None) is None and b.pin([b"k0", b"k1"], None) is None
        b.unpin([b"k0", b"k1"])  # b's pins end; a's pin of k0 still holds
        b.close()
        store(a, [b"k4", b"k5", b"k6", b"k7"], 2)
        assert settled(a, [b"k0", b"k1"]) == [Lookup.HIT, Lookup.MISS]
        a.close()  # a's hard pin ends with a
        c = tier(server, "pins-owners", max_bytes=4 * CHUNK)
        try:
            store(c, [b"k8", b"k9", b"k10", b"k11"], 3)
            assert settled(c, [b"k0"]) == [Lookup.MISS]
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_rule_13_passes_on_the_p2p_tier(server):
    report = run_conformance("p2p", {"host": "127.0.0.1", "port": server.port}, levels={"bounded"}, rules={13},
                             limits=FAST, seed=13)
    line = next(r for r in report.rules() if (r.rule, r.level) == (13, "bounded"))
    assert line.status == "PASS", line.line()


def test_the_store_holds_pinned_chunks_out_of_every_eviction():
    s = MemoryStore(8 * CHUNK)
    clock = [100.0]
    s.clock = lambda: clock[0]

    def put(ns, key, quota=None):
        got = s.reserve(ns, CHUNK, quota)
        if got is None:
            return None
        s.commit(ns, key, got[0], 0)
        return got[1]

    for i in range(4):
        put("a", b"a%d" % i)
    assert s.pin("a", [b"a0", b"a1"], 10.0, "x", None) == (None, [b"a0", b"a1"])
    assert s.pin("a", [b"a0"], 20.0, "y", None) == (None, [b"a0"])  # a second owner
    for i in range(20):  # another namespace fills the capacity over and over
        put("b", b"b%d" % i)
    assert s.has("a", b"a0") and s.has("a", b"a1") and not s.has("a", b"a2")
    assert s.bytes <= s.capacity and s.pinned() == 2
    why, _ = s.pin("b", [b"b17", b"b18", b"b19"], 10.0, "x", None)  # 5 of at most 4 chunks of the capacity
    assert why and "would pin" in why and "0.5 of the capacity" in why
    assert s.pin("a", [b"a0"], 1.0, "x", None) == (None, [])  # a renewal keeps the later end
    clock[0] += 15  # x's pins ended (a1 back as just used); y holds a0 until 120
    for i in range(20, 28):
        put("b", b"b%d" % i)
    assert s.has("a", b"a0") and not s.has("a", b"a1") and s.pinned() == 1
    # a quota shrunk below what its namespace pinned: a store that would overflow it is refused
    assert put("a", b"a9", quota=CHUNK) is None
    assert s.unpin("a", None, "y") == 1 and s.pinned() == 0
    assert put("a", b"a9", quota=CHUNK) is not None and not s.has("a", b"a0")
    assert s.pin("a", [b"a9"], None, "z", None)[0] is None
    assert s.drop("a") == 1 and s.pinned() == 0 and not s.has("a", b"a9")
