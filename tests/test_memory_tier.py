"""The memory tier: exact bytes, LRU eviction order, ctx.removed reports, touch, bounds."""

from __future__ import annotations

import threading

import pytest
from tier_helpers import wait_job

from kvtiers import Arena, Job, JobResult, Lookup, TierContext, TierError, open_tier
from kvtiers.memory import INLINE_BYTES, MemoryTier

SLOT = 4096


class Removals(list):
    """A ``ctx.removed`` sink that records ``(keys, reason)`` calls."""

    def __call__(self, keys, reason) -> None:
        self.append((tuple(keys), reason))


@pytest.fixture
def removed() -> Removals:
    return Removals()


@pytest.fixture
def ctx(removed: Removals) -> TierContext:
    return TierContext(Arena.allocate(8, SLOT), removed=removed)


def fill(ctx: TierContext, slot: int, tag: int) -> bytes:
    data = bytes([tag]) * 100 + bytes(range(256)) * 15 + bytes([tag]) * (SLOT - 100 - 256 * 15)
    ctx.arena[slot][:] = data
    return data


def one(tier, job_id: int) -> JobResult:
    return wait_job(tier, job_id)


def store(tier, ctx: TierContext, job_id: int, keys: list[bytes]) -> JobResult:
    for i, _ in enumerate(keys):
        fill(ctx, i, job_id * 16 + i)
    tier.submit_store(Job(job_id, tuple(keys), tuple(range(len(keys)))))
    return one(tier, job_id)


def bounded(ctx: TierContext, chunks: int) -> MemoryTier:
    return open_tier("memory", {"max_bytes": chunks * SLOT}, ctx).tier


def test_round_trip_exact_bytes(ctx: TierContext) -> None:
    tier = MemoryTier(ctx)
    a, b = fill(ctx, 0, 1), fill(ctx, 1, 2)
    tier.submit_store(Job(1, (b"a", b"b"), (0, 1)))
    r = one(tier, 1)
    assert r.ok and r.nbytes == 2 * SLOT and r.error is None
    ctx.arena[0][:] = b"\xee" * SLOT  # the tier copied: the slot may be reused
    ctx.arena[5][:] = b"\xee" * SLOT
    tier.submit_load(Job(2, (b"b", b"a"), (5, 6)))
    assert one(tier, 2).ok
    assert bytes(ctx.arena[5]) == b and bytes(ctx.arena[6]) == a


def test_missing_key_is_a_failed_key(ctx: TierContext) -> None:
    tier = MemoryTier(ctx)
    store(tier, ctx, 1, [b"here"])
    tier.submit_load(Job(2, (b"here", b"gone"), (3, 4)))
    r = one(tier, 2)
    assert r.failed_keys == (b"gone",)
    assert r.nbytes == SLOT
    assert "not stored" in r.error


def test_lru_eviction_order_and_removed_reports(ctx: TierContext, removed: Removals) -> None:
    tier = bounded(ctx, 3)
    store(tier, ctx, 1, [b"a", b"b", b"c"])
    assert removed == []
    store(tier, ctx, 2, [b"d"])
    assert removed == [((b"a",), "evicted")]
    assert tier.lookup([b"a", b"b", b"c", b"d"]) == [Lookup.MISS, Lookup.HIT, Lookup.HIT, Lookup.HIT]
    store(tier, ctx, 3, [b"e", b"f"])
    assert removed[1:] == [((b"b", b"c"), "evicted")]  # one report per job, oldest first
    assert tier.lookup([b"d", b"e", b"f"]) == [Lookup.HIT] * 3
    tier.submit_load(Job(4, (b"a",), (0,)))
    assert one(tier, 4).failed_keys == (b"a",)  # evicted keys fail to load


def test_touch_refreshes_lru(ctx: TierContext, removed: Removals) -> None:
    tier = bounded(ctx, 3)
    store(tier, ctx, 1, [b"a", b"b", b"c"])
    tier.touch([b"a", b"unknown"])
    store(tier, ctx, 2, [b"d"])
    assert removed == [((b"b",), "evicted")]
    assert tier.lookup([b"a"]) == [Lookup.HIT]


def test_load_refreshes_lru(ctx: TierContext, removed: Removals) -> None:
    tier = bounded(ctx, 2)
    store(tier, ctx, 1, [b"a", b"b"])
    tier.submit_load(Job(2, (b"a",), (4,)))
    assert one(tier, 2).ok
    store(tier, ctx, 3, [b"c"])
    assert removed == [((b"b",), "evicted")]


def test_storing_an_existing_key_succeeds_refreshes_and_keeps_first_bytes(ctx, removed) -> None:
    tier = bounded(ctx, 2)
    first = fill(ctx, 0, 7)
    tier.submit_store(Job(1, (b"a",), (0,)))
    assert one(tier, 1).ok
    store(tier, ctx, 2, [b"b"])
    fill(ctx, 0, 9)
    tier.submit_store(Job(3, (b"a",), (0,)))
    assert one(tier, 3).ok
    store(tier, ctx, 4, [b"c"])
    assert removed == [((b"b",), "evicted")]  # a was refreshed by the repeated store
    tier.submit_load(Job(5, (b"a",), (7,)))
    assert one(tier, 5).ok
    assert bytes(ctx.arena[7]) == first  # rule 7: one valid copy, not a mix


def test_a_job_larger_than_the_bound_evicts_its_own_first_keys(ctx, removed) -> None:
    tier = bounded(ctx, 2)
    r = store(tier, ctx, 1, [b"a", b"b", b"c"])
    assert r.ok  # stores keep succeeding (rule 11)
    assert removed == [((b"a",), "evicted")]
    assert tier.lookup([b"a", b"b", b"c"]) == [Lookup.MISS, Lookup.HIT, Lookup.HIT]


@pytest.mark.parametrize("max_bytes", [0, SLOT - 1])
def test_max_bytes_smaller_than_a_chunk_fails_the_store(ctx, removed, max_bytes: int) -> None:
    tier = MemoryTier(ctx, max_bytes=max_bytes)
    r = store(tier, ctx, 1, [b"a", b"b"])
    assert r.failed_keys == (b"a", b"b")
    assert r.nbytes == 0
    assert r.error == f"chunk of {SLOT} bytes exceeds max_bytes={max_bytes}"
    assert removed == []
    assert tier.lookup([b"a"]) == [Lookup.MISS]


def test_exact_bound_holds_exactly_that_many_chunks(ctx, removed) -> None:
    tier = MemoryTier(ctx, max_bytes=SLOT)
    store(tier, ctx, 1, [b"a"])
    assert removed == []
    store(tier, ctx, 2, [b"b"])
    assert removed == [((b"a",), "evicted")]


def test_negative_max_bytes_is_refused_at_open(ctx) -> None:
    with pytest.raises(TierError, match="max_bytes must be >= 0, got -1"):
        open_tier("memory", {"max_bytes": -1}, ctx)


def test_caller_errors_raise_and_accept_nothing(ctx) -> None:
    tier = MemoryTier(ctx)
    with pytest.raises(IndexError, match="slot 8 out of range"):
        tier.submit_store(Job(1, (b"a", b"b"), (0, 8)))
    with pytest.raises(TypeError, match="expected a kvtiers.Job"):
        tier.submit_load((1, (b"a",), (0,)))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tier.lookup([b""])
    assert tier.get_finished_jobs() == []
    assert tier.lookup([b"a"]) == [Lookup.MISS]  # the refused store stored nothing


def test_empty_job_is_reported(ctx) -> None:
    tier = MemoryTier(ctx)
    tier.submit_store(Job(1, (), ()))
    tier.submit_load(Job(2, (), ()))
    tier.close()  # waits for both: their results come with the next call
    assert [(r.job_id, r.ok, r.nbytes) for r in tier.get_finished_jobs()] == [(1, True, 0), (2, True, 0)]


def test_close_then_submit_raises(ctx) -> None:
    tier = MemoryTier(ctx)
    store(tier, ctx, 1, [b"a"])
    tier.close()
    assert tier.backlog() == 0
    with pytest.raises(ValueError, match="job 2: tier is closed"):
        tier.submit_store(Job(2, (b"b",), (0,)))
    with pytest.raises(ValueError, match="tier is closed"):
        tier.submit_load(Job(3, (b"a",), (0,)))
    assert tier.get_finished_jobs() == []


def test_claims_core_and_bounded(ctx) -> None:
    h = open_tier("memory", {}, ctx)
    assert h.levels == {"core", "bounded"}
    assert MemoryTier.conformance_config(None) == {}
    h.close()


class WatchedArena(Arena):
    """An arena that records which thread takes each slot view, and can hold those takers
    (fault injection: a copy that takes long)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.takers: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def __getitem__(self, i):
        if threading.current_thread() is not threading.main_thread():
            self.gate.wait()
        self.takers.append(threading.current_thread().name)
        return super().__getitem__(i)


def test_copies_run_off_the_submitting_thread_and_close_waits_for_them() -> None:
    # rule 8: a submit returns before its copies (a 64-key job of 4 MiB chunks is 256 MiB of memcpy)
    big = INLINE_BYTES // 2  # a 4-key job of twice INLINE_BYTES goes to the worker
    arena = WatchedArena.allocate(4, big)
    ctx = TierContext(arena)
    tier = MemoryTier(ctx)
    for i in range(4):
        arena[i][:] = bytes([i + 1]) * big
    arena.takers.clear()
    arena.gate.clear()  # the worker's copies wait here
    tier.submit_store(Job(1, (b"a", b"b", b"c", b"d"), (0, 1, 2, 3)))
    assert tier.get_finished_jobs() == [] and tier.backlog() == 1  # accepted, copy held, submit returned
    worker = tier._worker
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # rule 9: close waits for the accepted job
    arena.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    (r,) = tier.get_finished_jobs()  # reported once, by the call after close
    assert r.job_id == 1 and r.ok and r.nbytes == 4 * big
    assert arena.takers and set(arena.takers) == {"kvtiers-memory-tier"}, arena.takers
    assert worker is not None and not worker.is_alive()  # rule 9: no thread left behind


def test_a_failing_copy_is_a_failed_job_not_a_lost_one(ctx: TierContext) -> None:
    tier = MemoryTier(ctx)
    tier.submit_store(Job(1, (b"a",), (0,)))
    assert one(tier, 1).ok
    tier._data[b"a"] = b"short"  # fault injection: a stored blob of the wrong length
    tier.submit_load(Job(2, (b"a",), (1,)))
    r = one(tier, 2)
    assert r.failed_keys == (b"a",) and "memory tier: ValueError" in (r.error or "")
    tier.close()


def test_a_small_job_is_copied_in_the_call_and_a_queued_one_keeps_submit_order() -> None:
    arena = WatchedArena.allocate(6, INLINE_BYTES // 2)
    ctx = TierContext(arena)
    tier = MemoryTier(ctx)
    arena[0][:] = b"\x01" * arena.slot_bytes
    tier.submit_store(Job(1, (b"small",), (0,)))  # half of INLINE_BYTES: done when submit returns
    assert [r.job_id for r in tier.get_finished_jobs()] == [1]
    assert set(arena.takers) == {threading.main_thread().name}
    arena.gate.clear()
    tier.submit_store(Job(2, (b"a", b"b", b"c"), (1, 2, 3)))  # large: the worker, held at the gate
    tier.submit_load(Job(3, (b"small",), (4,)))  # small, but queued behind job 2
    assert tier.get_finished_jobs() == [] and tier.backlog() == 2
    arena.gate.set()
    tier.close()  # waits for both
    assert [(r.job_id, r.ok) for r in tier.get_finished_jobs()] == [(2, True), (3, True)]  # in submit order
    assert bytes(arena[4]) == b"\x01" * arena.slot_bytes
