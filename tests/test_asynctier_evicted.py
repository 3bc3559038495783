"""``AsyncTier.evicted``: keys a bounded tier drops answer MISS, leave the base class's caches
and reach ``ctx.removed``, also when the eviction happens inside the job that stored them
(issue 11, item 1). The memory tier, which writes its hooks directly, reports the same way."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

import pytest
from tier_helpers import resolve_lookup as settle
from tier_helpers import wait_job as result

import kvtiers
from kvtiers import Arena, AsyncTier, Job, Lookup, TierContext

SLOT = 4096
BOUND = 16  # chunks


class Removals(list):
    def __call__(self, keys, reason) -> None:
        self.append((tuple(keys), reason))

    def keys(self, reason: str = "evicted") -> list[bytes]:
        return [k for keys, why in self if why == reason for k in keys]


class CappedTier(AsyncTier):
    """At most ``max_chunks`` chunks in memory, oldest stored first out, reported with
    ``self.evicted``. ``batch``: stores come through ``put_many`` instead of ``put``."""

    negative_ttl = 60.0  # an evicted key must answer MISS without a probe

    def __init__(self, ctx: TierContext, *, max_chunks: int = BOUND) -> None:
        super().__init__(ctx)
        self.max_chunks = max_chunks
        self.chunks: OrderedDict[bytes, bytes] = OrderedDict()

    def _keep(self, key: bytes, blob: bytes) -> None:
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return
        self.chunks[key] = blob
        gone = []
        while len(self.chunks) > self.max_chunks:
            gone.append(self.chunks.popitem(last=False)[0])
        if gone:
            self.evicted(gone)

    async def exists(self, key):
        return key in self.chunks

    async def put(self, key, data):
        blob = bytes(data)
        await asyncio.sleep(0)  # let the other workers interleave
        self._keep(key, blob)

    async def get_into(self, key, out):
        blob = self.chunks.get(key)
        if blob is None:
            return False
        out[:] = blob
        return True


class CappedBatchTier(CappedTier):
    async def put_many(self, items):
        blobs = [(k, bytes(v)) for k, v in items]
        await asyncio.sleep(0)
        for k, b in blobs:
            self._keep(k, b)


@pytest.fixture
def tiers():
    """``tiers(cls, slots)``: a ``cls`` tier on an arena of ``slots`` filled slots, its
    context and its removals; each closed at the end of the test."""
    made = []

    def make(cls=CappedTier, slots: int = 64):
        removed = Removals()
        ctx = TierContext(Arena.allocate(slots, SLOT), removed=removed)
        for s in range(slots):
            ctx.arena[s][:] = bytes([s]) * 8 + bytes(SLOT - 8)
        made.append(cls(ctx))
        return made[-1], ctx, removed

    yield make
    for t in made:
        t.close()


def check_bound_holds(t, ctx, removed: Removals, keys: list[bytes]) -> None:
    """Every key answering HIT is stored and loads its bytes; every other key left through
    ctx.removed, once; none answers RETRY (evicted keys are a MISS at once)."""
    answers = t.lookup(keys)
    hits = {k for k, a in zip(keys, answers, strict=True) if a is Lookup.HIT}
    assert Lookup.RETRY not in answers
    assert hits == set(t.chunks) and len(hits) == BOUND
    gone = removed.keys()
    assert sorted(gone) == sorted(set(keys) - hits)  # each evicted key reported exactly once
    hit_list = [k for k in keys if k in hits]
    t.submit_load(Job(999, tuple(hit_list), tuple(range(len(hit_list)))))
    assert result(t, 999).ok
    for s, k in enumerate(hit_list):
        assert bytes(ctx.arena[s]) == t.chunks[k]


@pytest.mark.parametrize("cls", [CappedTier, CappedBatchTier], ids=["per-key", "batch"])
def test_one_job_larger_than_the_bound(tiers, cls) -> None:
    t, ctx, removed = tiers(cls)
    keys = [b"key-%02d" % i for i in range(64)]
    t.submit_store(Job(1, tuple(keys), tuple(range(64))))
    assert result(t, 1).ok  # stores keep succeeding (rule 11)
    check_bound_holds(t, ctx, removed, keys)


def test_many_small_jobs(tiers) -> None:
    t, ctx, removed = tiers()
    keys = [b"small-%02d" % i for i in range(64)]
    for j in range(16):
        t.submit_store(Job(j, tuple(keys[4 * j:4 * j + 4]), (0, 1, 2, 3)))
    got = []
    deadline = time.monotonic() + 20
    while len(got) < 16:
        got += t.get_finished_jobs()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert all(r.ok for r in got)
    check_bound_holds(t, ctx, removed, keys)


def test_evicted_from_another_thread_then_stored_again(tiers) -> None:
    t, ctx, removed = tiers()
    t.submit_store(Job(1, (b"a", b"b"), (0, 1)))
    assert result(t, 1).ok
    th = threading.Thread(target=t.evicted, args=([b"a"], "gc"))
    th.start()
    th.join()
    assert removed == [((b"a",), "gc")]
    assert t.lookup([b"a", b"b"]) == [Lookup.MISS, Lookup.HIT]
    t.submit_store(Job(2, (b"a",), (0,)))  # stored again: a HIT again
    assert result(t, 2).ok
    assert t.lookup([b"a"]) == [Lookup.HIT]


def test_eviction_during_a_job_wins_over_its_end(tiers) -> None:
    """A key evicted (from a coroutine of another job) while its own job is in flight does not
    answer HIT when that job ends."""
    t, ctx, removed = tiers()
    gate = threading.Event()
    put = t.put

    async def slow_put(key, data):
        if key == b"late":
            while not gate.is_set():
                await asyncio.sleep(0.005)
        await put(key, data)

    t.put = slow_put
    t.submit_store(Job(1, (b"early", b"late"), (0, 1)))
    deadline = time.monotonic() + 10
    while b"early" not in t.chunks:
        assert time.monotonic() < deadline
        time.sleep(0.002)

    async def evict_early():
        t.chunks.pop(b"early")
        t.evicted([b"early"])

    asyncio.run_coroutine_threadsafe(evict_early(), ctx.loop).result(10)
    gate.set()
    assert result(t, 1).ok
    assert t.lookup([b"early", b"late"]) == [Lookup.MISS, Lookup.HIT]
    assert removed == [((b"early",), "evicted")]


def test_eviction_during_a_probe_wins_over_its_answer(tiers) -> None:
    t, ctx, removed = tiers()
    gate = threading.Event()

    async def slow_exists(key):
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return True  # the backend said yes before the eviction was reported

    t.exists = slow_exists
    assert t.lookup([b"p"]) == [Lookup.RETRY]
    t.evicted([b"p"])
    gate.set()
    time.sleep(0.1)
    assert settle(t, [b"p"]) == [Lookup.MISS]


def test_memory_tier_reports_every_eviction_of_a_job_larger_than_the_bound() -> None:
    removed = Removals()
    ctx = TierContext(Arena.allocate(64, SLOT), removed=removed)
    h = kvtiers.open_tier("memory", {"max_bytes": BOUND * SLOT}, ctx)
    try:
        keys = [b"m-%02d" % i for i in range(64)]
        h.submit_store(Job(1, tuple(keys), tuple(range(64))))
        (r,) = h.get_finished_jobs()
        assert r.ok
        answers = h.lookup(keys)
        hits = [k for k, a in zip(keys, answers, strict=True) if a is Lookup.HIT]
        assert hits == keys[-BOUND:] and Lookup.RETRY not in answers
        assert sorted(removed.keys()) == sorted(keys[:-BOUND])
    finally:
        h.close()
