"""Host cache: slots, states, pin counts, eviction reports, drops, store_threshold."""

from __future__ import annotations

import pytest

from kvtiers.engine.hostcache import LOADING, READY, STORING, HostCache
from kvtiers.engine.policies import LRUPolicy


def k(i: int) -> bytes:
    return b"c%d" % i


def filled(n: int, **kw) -> tuple[HostCache, list[int]]:
    evicted: list[tuple[bytes, int]] = []
    cache = HostCache(n, LRUPolicy(n), on_evict=lambda key, slot: evicted.append((key, slot)), **kw)
    cache.evicted = evicted  # type: ignore[attr-defined]
    slots = []
    for i in range(n):
        s = cache.allocate(k(i), STORING)
        cache.mark_ready(k(i))
        cache.unpin(s)
        slots.append(s)
    return cache, slots


def test_allocate_uses_every_slot_once_then_evicts_lru() -> None:
    cache, slots = filled(4)
    assert sorted(slots) == [0, 1, 2, 3]
    assert cache.free_slots() == 0
    cache.touch(k(0))
    s = cache.allocate(k(10), LOADING)
    assert s == slots[1]
    assert cache.evicted == [(k(1), slots[1])]
    assert cache.state(k(10)) == LOADING and cache.is_pinned(s)
    assert cache.evictions == 1


def test_filling_entries_are_not_evicted_even_unpinned() -> None:
    cache = HostCache(1, LRUPolicy(1))
    s = cache.allocate(k(0), LOADING)
    cache.unpin(s)  # a buggy caller: still not ready -> not evictable
    assert cache.allocate(k(1), STORING) is None


def test_refcounts_stack_and_release() -> None:
    cache, slots = filled(2)
    s = cache.pin(k(0))
    cache.pin(k(0))
    assert cache.refs(s) == 2
    assert cache.allocate(k(5), STORING) == slots[1]  # k0 pinned twice: k1 goes
    cache.unpin(s)
    assert cache.allocate(k(6), STORING) is None  # k0 still pinned once, k5 filling
    cache.unpin(s)
    assert cache.allocate(k(6), STORING) == s


def test_drop_while_pinned_frees_at_last_unpin() -> None:
    cache, _ = filled(2)
    s = cache.pin(k(0))
    assert cache.drop(k(0))
    assert k(0) not in cache and cache.free_slots() == 0
    assert cache.allocate(k(7), STORING) != s  # the orphaned slot is not reused yet
    cache.unpin(s)
    assert cache.free_slots() == 1
    assert cache.allocate(k(8), STORING) == s
    assert not cache.drop(b"absent")


def test_unpin_of_an_unpinned_slot_is_an_error() -> None:
    cache, slots = filled(1)
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(slots[0])


def test_state_transitions() -> None:
    cache = HostCache(2, LRUPolicy(2))
    s = cache.allocate(k(0), STORING)
    assert cache.state(k(0)) == STORING and cache.slot(k(0)) == s
    cache.mark_ready(k(0))
    assert cache.state(k(0)) == READY
    with pytest.raises(ValueError, match="already has slot"):
        cache.allocate(k(0), STORING)
    with pytest.raises(ValueError, match="not 'ready'"):
        cache.allocate(k(1), READY)
    with pytest.raises(KeyError):
        cache.mark_ready(k(9))


def test_store_threshold_counts_offers() -> None:
    cache = HostCache(4, LRUPolicy(4), store_threshold=3)
    assert [cache.offer(k(0)) for _ in range(3)] == [False, False, True]
    assert cache.offer(k(1)) is False
    assert HostCache(4, LRUPolicy(4)).offer(k(0)) is True


def test_offer_counts_are_bounded() -> None:
    cache = HostCache(1, LRUPolicy(1), store_threshold=2, max_offer_keys=3)
    cache.offer(k(0))
    for i in range(1, 5):  # pushes k0's count out
        cache.offer(k(i))
    assert cache.offer(k(0)) is False
    assert cache.offer(k(4)) is True
