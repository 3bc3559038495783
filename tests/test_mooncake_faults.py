"""Mooncake's failure semantics mapped onto the tier contract, each against a real pool of its
own (a ``mooncake_master`` on loopback with ``client_ttl`` 2 s and a 1 s lease, and ``serve``
processes holding the memory, killed with SIGKILL at the end):

- a full pool (-200) is retried within the job's deadline, then the key fails; never a hang;
- the master's own evictions are found and reported through ``ctx.removed``;
- a key whose holder segment died fails (-800), then answers MISS once ``client_ttl`` passes;
- a master killed and restarted loses every object: keys fail or miss, nothing hangs, and the
  tier stores and loads again on its own;
- leases never make a remove or a close wait.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake.client import missing  # noqa: E402
from kvtiers_mooncake.master import start_master  # noqa: E402
from kvtiers_mooncake.pool import start_test_pool  # noqa: E402
from kvtiers_mooncake.serve import start_serve  # noqa: E402
from tier_helpers import resolve_lookup, wait_job  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

if missing():
    pytest.skip(missing(), allow_module_level=True)

SLOT = 1 << 20


class Client:
    """A tier instance on its own arena, recording ctx.removed."""

    def __init__(self, address: str, slots: int = 32, **opts) -> None:
        self.arena = Arena.allocate(slots, SLOT)
        self.removed: list[tuple[tuple[bytes, ...], str]] = []
        ctx = TierContext(self.arena, Namespace({"faults": os.urandom(4).hex()}),
                          removed=lambda keys, why: self.removed.append((tuple(keys), why)))
        options = {"master_server_address": address, "global_segment_size": 0, "timeout": 10.0,
                   "watch_interval": 3.0, **opts}
        self.h = open_tier("mooncake", options, ctx)
        self.ids = iter(range(1, 1 << 30))
        self.data: dict[int, bytes] = {}

    def fill(self, slot: int) -> bytes:
        self.data[slot] = d = os.urandom(SLOT)
        self.arena[slot][:] = d
        return d

    def store(self, keys, slots, timeout: float = 60.0):
        jid = next(self.ids)
        self.h.submit_store(Job(jid, tuple(keys), tuple(slots)))
        return wait_job(self.h, jid, timeout)

    def load(self, keys, slots, timeout: float = 60.0):
        jid = next(self.ids)
        self.h.submit_load(Job(jid, tuple(keys), tuple(slots)))
        return wait_job(self.h, jid, timeout)

    def gone(self, why: str | None = None) -> set[bytes]:
        return {k for ks, w in self.removed if why is None or w == why for k in ks}


@pytest.fixture
def pool():
    p = start_test_pool(64 << 20)
    yield p
    p.stop()  # SIGKILL of the serve processes and the master: a graceful close takes seconds


def until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.05)


def test_a_pool_with_no_space_fails_the_key_within_its_deadline():
    """No segment at all: every put answers -200; the store retries until its deadline, then
    fails the key saying why; nothing hangs, close returns."""
    master = start_master(client_ttl=2, default_kv_lease_ttl=1000)
    try:
        c = Client(master.address, timeout=2.0)
        c.fill(0)
        t0 = time.monotonic()
        r = c.store([b"nowhere"], [0])
        took = time.monotonic() - t0
        assert r.failed_keys == (b"nowhere",)
        assert "pool full" in r.error and "-200" in r.error and "NO_AVAILABLE_HANDLE" in r.error
        assert took < 30  # bounded by the 2 s deadline (generous: a busy machine)
        assert resolve_lookup(c.h, [b"nowhere"]) == [Lookup.MISS]
        c.h.close()
    finally:
        master.kill()


def test_a_full_pool_is_retried_while_the_master_evicts_and_evictions_are_reported(pool):
    """Store three times the pool's 64 MiB in 1 MiB chunks: puts that meet a full pool are
    retried until the master's asynchronous eviction frees space, so the stores succeed; the
    keys the master evicted are found by the watcher and reported through ctx.removed, they
    answer MISS, and what still answers HIT loads byte-exact."""
    c = Client(pool.address, slots=32)
    keys = [b"fill-%d" % i for i in range(192)]
    want = {}
    failed = []
    for i in range(0, len(keys), 8):
        for j in range(8):
            want[keys[i + j]] = c.fill(j)
        r = c.store(keys[i:i + 8], range(8))
        failed += r.failed_keys
    assert len(failed) <= len(keys) // 4, f"{len(failed)} stores failed into a full pool: {r.error}"
    until(lambda: len(c.gone("evicted by the pool")) >= 64, 30, "the master's evictions reported")
    gone = c.gone("evicted by the pool")
    answers = dict(zip(keys, resolve_lookup(c.h, keys), strict=True))
    assert all(answers[k] is Lookup.MISS for k in gone)
    hits = [k for k in keys if answers[k] is Lookup.HIT][:16]
    assert hits
    r = c.load(hits, range(16, 16 + len(hits)))
    ok = [k for k in hits if k not in r.failed_keys]
    for i, k in enumerate(hits):
        if k in ok:
            assert bytes(c.arena[16 + i]) == want[k]
    c.h.close()


def test_a_dead_holder_fails_its_keys_then_they_miss_and_are_reported(pool):
    """SIGKILL the serve process holding the objects: the master still lists them (is_exist 1)
    until client_ttl passes, and gets fail (-800): a failed key, never wrong bytes; then the
    keys answer MISS and the watcher reports them removed."""
    extra = start_serve(pool.address, 64 << 20)  # a second holder, so the pool keeps taking stores
    pool.serves.append(extra)
    c = Client(pool.address)
    keys = [b"held-%d" % i for i in range(8)]
    for i in range(8):
        c.fill(i)
    assert c.store(keys, range(8)).ok
    for s in pool.serves:
        s.kill()
    r = c.load(keys, range(8, 16), timeout=30)
    assert set(r.failed_keys) == set(keys), "a load from a dead segment reported success"
    assert "-800" in r.error or "TRANSFER_FAIL" in r.error or "evicted" in r.error
    until(lambda: set(keys) <= c.gone(), 15, "the dead holder's keys reported removed")
    assert resolve_lookup(c.h, keys) == [Lookup.MISS] * 8
    c.h.close()


def test_a_restarted_master_loses_everything_and_the_tier_recovers(pool):
    """SIGKILL the master: jobs fail within their deadline (nothing hangs); restart it on the
    same ports: the old keys are gone (reported, MISS), and new stores and loads work again
    without reopening the tier (the serve process mounts its segment on the new master)."""
    c = Client(pool.address, timeout=5.0)
    c.fill(0)
    assert c.store([b"before"], [0]).ok
    m = pool.master
    m.kill()
    c.fill(1)
    t0 = time.monotonic()
    r = c.store([b"during"], [1], timeout=60)
    assert r.failed_keys == (b"during",) and time.monotonic() - t0 < 45
    r = c.load([b"before"], [2], timeout=60)
    assert r.failed_keys == (b"before",)
    pool.master = start_master(rpc_port=m.rpc_port, metrics_port=m.metrics_port, client_ttl=2,
                               default_kv_lease_ttl=1000)
    data = c.fill(3)

    def stored() -> bool:
        return c.store([b"after"], [3], timeout=60).ok

    until(stored, 30, "a store after the master's restart")
    assert c.load([b"after"], [4]).ok and bytes(c.arena[4]) == data
    until(lambda: b"before" in c.gone(), 15, "the lost key reported removed")
    assert resolve_lookup(c.h, [b"before"]) == [Lookup.MISS]
    c.h.close()


def test_leases_never_make_a_remove_or_close_wait():
    """With a 60 s lease, evictions by max_bytes are refused (-706) and queued; close forces
    them and returns at once, and the pool no longer holds them."""
    p = start_test_pool(64 << 20, lease_ms=60_000)
    try:
        c = Client(p.address, max_bytes=2 * (SLOT + 40))
        keys = [b"leased-%d" % i for i in range(6)]
        for i in range(6):
            c.fill(i)
        assert c.store(keys, range(6)).ok
        assert c.gone("evicted") == set(keys[:4])
        t0 = time.monotonic()
        c.h.close()
        assert time.monotonic() - t0 < 15
        from kvtiers_mooncake import client as mc
        from kvtiers_mooncake import layout

        raw = mc.acquire(mc.Setup(p.address))
        digest = c.h.tier.digest
        names = [layout.object_name(digest, k) for k in keys]
        assert raw.store.batch_is_exist(names) == [0, 0, 0, 0, 1, 1]
        mc.release(raw)
    finally:
        p.stop()
