"""Stores longer than the host arena run in waves, as loads do: every chunk reaches the tiers,
the store is reported once its last wave is on the host, and a store that can get no slot at
all says so in its result. Real memory tiers and the CPU DMA engine (tests/test_manager.py's
manager); a tier whose results are held back is the only fault injected."""

from __future__ import annotations

import time

import pytest
import torch
from test_manager import HeldTier, blocks_of, chunk_blocks, key, make_manager, poison, settle

from kvtiers import Request


@pytest.fixture
def held():
    HeldTier.hold.clear()
    yield HeldTier.hold
    HeldTier.hold.clear()


def store(mgr, keys, request=None):
    return mgr.store(keys, [chunk_blocks(i) for i in range(len(keys))], request)


def test_a_store_four_times_the_arena_reaches_the_tier_whole() -> None:
    mgr, kv, _ = make_manager(4, tiers=["memory"])
    with mgr:
        keys = [key(i) for i in range(16)]
        (res,) = mgr.wait([store(mgr, keys)], timeout=60)
        assert res.ok and res.skipped_keys == () and res.error is None
        settle(mgr)
        assert mgr.stats.stored_chunks == 16 and mgr.stats.host_full == 0
        look = mgr.lookup(keys)
        assert look.num_chunks == 16 and look.sources[:12] == ("memory",) * 12  # the host keeps the last wave
        # and every byte comes back (the load runs in waves too)
        dst = [chunk_blocks(20 + i) for i in range(16)]
        expected = blocks_of(kv, [b for i in range(16) for b in chunk_blocks(i)])
        poison(kv, [b for c in dst for b in c])
        (loaded,) = mgr.wait([mgr.load(keys, dst)], timeout=60)
        assert loaded.ok
        for e, g in zip(expected, blocks_of(kv, [b for c in dst for b in c]), strict=True):
            assert torch.equal(e, g)


def test_a_store_is_reported_only_once_its_last_wave_is_on_the_host(held) -> None:
    mgr, kv, _ = make_manager(2, tiers=[HeldTier])
    with mgr:
        held.set()  # the tier holds its results: the first wave's slots stay pinned
        tid = store(mgr, [key(i) for i in range(5)])
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert [r for r in mgr.get_finished() if r.transfer_id == tid] == []  # device blocks still needed
            time.sleep(0.01)
        assert mgr.stats.stored_chunks == 2
        held.clear()
        (res,) = mgr.wait([tid], timeout=60)
        assert res.ok and res.skipped_keys == () and mgr.stats.stored_chunks == 5


def test_a_store_that_gets_no_slot_says_so(held) -> None:
    mgr, kv, gate = make_manager(2)
    with mgr:
        gate.closed = True  # two device copies in flight pin every slot
        first = store(mgr, [key(0), key(1)])
        (res,) = mgr.wait([mgr.store([key(7)], [chunk_blocks(7)])], timeout=10)
        assert res.ok and res.skipped_keys == (key(7),)
        assert res.error is not None and "host arena full" in res.error and "2 slots" in res.error
        gate.closed = False
        mgr.wait([first], timeout=10)


def test_a_later_wave_gives_up_after_wave_timeout(held) -> None:
    mgr, kv, _ = make_manager(2, tiers=[HeldTier], tier_job_timeout=0.5)
    with mgr:
        held.set()  # the tier never reports while held: the first wave's slots never come free
        (res,) = mgr.wait([store(mgr, [key(i) for i in range(4)])], timeout=30)
        assert res.skipped_keys == (key(2), key(3)) and "host arena full" in res.error and "after" in res.error
        held.clear()


def test_a_cancelled_store_skips_its_later_waves(held) -> None:
    mgr, kv, _ = make_manager(2, tiers=[HeldTier])
    with mgr:
        held.set()
        req = Request("r")
        tid = store(mgr, [key(i) for i in range(4)], req)
        req.cancel()
        (res,) = mgr.wait([tid], timeout=10)
        assert res.cancelled and res.skipped_keys == (key(2), key(3))
        held.clear()


def test_close_reports_a_store_still_waiting_for_a_wave(held) -> None:
    mgr, kv, _ = make_manager(2, tiers=[HeldTier])
    held.set()
    tid = store(mgr, [key(i) for i in range(4)])
    mgr.close(timeout=0.5)
    (res,) = [r for r in mgr.get_finished() if r.transfer_id == tid]
    assert res.skipped_keys == (key(2), key(3)) and "closed" in res.error
