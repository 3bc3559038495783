"""Tiering manager against tiers that never answer: lost promotions that start the next load
wave, and a bounded ``close`` (issue 10 item 2) with a tier whose job never reports and a tier
whose read blocks forever (so its own ``close`` blocks too).

Tiers are real (memory-tier subclasses); faults are injected by holding results back or by a
read thread that waits on an event nobody sets until the test ends.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_manager import FailLoads, chunk_blocks, key, make_manager, settle, store_all

from kvtiers import Job, hookimpl
from kvtiers.engine import manager
from kvtiers.memory import MemoryTier


def test_a_lost_promotion_that_starts_the_next_wave_does_not_break_the_lost_check() -> None:
    """The lost-job handler can finish a wave and submit the next wave's promotion to the same
    tier while ``check_lost`` walks that tier's jobs (it used to raise "dictionary changed
    size during iteration" out of the engine's call)."""
    mgr, kv, _ = make_manager(2, tiers=["memory"], tier_job_timeout=0.3)
    try:
        for i in range(4):
            store_all(mgr, [key(i)], first_block_chunk=i)
        settle(mgr)  # host: chunks 2 and 3; the tier: all four
        mgr.tiers[0].handle.add_wrapper(FailLoads("lose"))
        # wave 1: chunk 3 from the host, chunk 0 promoted (evicts 2), chunk 1 finds no slot;
        # when chunk 0's promotion is declared lost the wave copies chunk 3 and wave 2
        # promotes chunk 1 from inside the lost check
        tid = mgr.load([key(3), key(0), key(1)], [chunk_blocks(20), chunk_blocks(21), chunk_blocks(22)])
        (res,) = mgr.wait([tid], timeout=20)
        assert set(res.failed_keys) == {key(0), key(1)}
        assert res.sources == {key(3): "host"}
        assert mgr.stats.tier_errors["memory"] >= 2  # both promotions were declared lost
    finally:
        mgr.close(timeout=2)


# -- bounded close -------------------------------------------------------------------------


class NeverReportsLoads(MemoryTier):
    """A memory tier that does its loads but never reports them (a tier breaking rule 5);
    its ``close`` returns at once."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        self._finished.pop()


class BlockingRead(MemoryTier):
    """A memory tier whose loads run in a thread of their own that blocks, like a read from a
    hung NFS mount, until ``release`` is set; its ``close`` waits for them (rule 9), so it
    blocks as long."""

    release = threading.Event()

    def __init__(self, ctx, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self.threads: list[threading.Thread] = []

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._check(job)

        def read() -> None:
            self.release.wait()
            MemoryTier.submit_load(self, job)  # writes the slot, then reports

        th = threading.Thread(target=read, daemon=True)
        th.start()
        self.threads.append(th)

    @hookimpl
    def close(self) -> None:
        for th in self.threads:
            th.join()
        super().close()


@pytest.fixture
def blocked():
    BlockingRead.release.clear()
    yield BlockingRead.release
    BlockingRead.release.set()  # let the stuck threads end


def _evicted(tier) -> tuple:
    """A manager of 2 slots whose first chunk lives only in ``tier``."""
    mgr, kv, gate = make_manager(2, tiers=[tier])
    for i in range(3):
        store_all(mgr, [key(i)], first_block_chunk=i)
    settle(mgr)
    assert key(0) not in mgr.cache and mgr.lookup([key(0)]).sources == (mgr.tiers[0].name,)
    return mgr, kv


def _close_in_thread(mgr, timeout: float, bound: float) -> float:
    """``mgr.close(timeout)`` in a thread (a hang fails the test instead of hanging it);
    returns how long it took."""
    t0 = time.monotonic()
    th = threading.Thread(target=mgr.close, kwargs={"timeout": timeout}, daemon=True)
    th.start()
    th.join(bound)
    assert not th.is_alive(), f"close(timeout={timeout}) had not returned after {bound} s"
    return time.monotonic() - t0


@pytest.mark.parametrize("tier", [NeverReportsLoads, BlockingRead], ids=["never-reports", "blocking-read"])
def test_close_is_bounded_and_fails_abandoned_loads(tier, blocked, caplog, monkeypatch) -> None:
    monkeypatch.setattr(manager, "CLOSE_GRACE", 1.0)  # the tiers' extra time after timeout (5 s): shorter here
    mgr, kv = _evicted(tier)
    tid = mgr.load([key(0), key(2)], [chunk_blocks(20), chunk_blocks(21)])
    slot = mgr.cache.slot(key(0))
    assert slot is not None and mgr.pending()
    took = _close_in_thread(mgr, timeout=1.0, bound=1.0 + 10)
    assert took < 1.0 + 10
    # the engine gets the load's result: the stuck chunk failed, saying why; the host chunk loaded
    results = {r.transfer_id: r for r in mgr.get_finished()}
    res = results[tid]
    assert res.failed_keys == (key(0),) and res.sources == {key(2): "host"}
    assert res.error and "abandoned at close" in res.error
    assert mgr.pending() == 0
    # rule 6: the slot the tier may still write stays pinned, and the arena is not freed
    assert mgr.cache.refs(slot) >= 1
    assert mgr.host.resident_bytes() > 0
    assert "abandoned" in caplog.text
    blocked.set()  # the hung read wakes up and writes into the kept arena: no crash
    for th in getattr(mgr.tiers[0].handle.tier, "threads", []):
        th.join(10)


def test_close_without_stuck_jobs_still_frees_the_arena() -> None:
    mgr, kv = _evicted(MemoryTier)
    (res,) = mgr.wait([mgr.load([key(0)], [chunk_blocks(20)])])
    assert res.ok
    _close_in_thread(mgr, timeout=5.0, bound=15)
    assert mgr.host.resident_bytes() == 0  # closed: nothing was abandoned
