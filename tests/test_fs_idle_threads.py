"""What the fs tier's close reports as stuck: a thread inside I/O, never one that is only
waiting for work and has not been scheduled yet on a loaded machine."""

from __future__ import annotations

import os
import sys
import threading

from kvtiers_fs.index import Index, Prober
from kvtiers_fs.pool import Pool
from test_fs_helpers import wait_for


def test_shutdown_reports_only_threads_inside_a_task_as_stuck():
    """A thread waiting for its next task that the machine has not scheduled by the deadline
    is not stuck in I/O (CI once saw close list an idle write thread beside a hung read)."""
    pool = Pool("kvtiers-test-pool", 2)
    entered, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def hung(scratch):
        runs.append(threading.current_thread().name)
        entered.set()
        release.wait(30)

    pool.submit(hung)
    assert entered.wait(10)
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the idle thread cannot run until this one blocks: a loaded machine
    try:
        behind = pool.shutdown(timeout=0)
    finally:
        sys.setswitchinterval(old)
        release.set()
    assert [t.name for t in behind] == runs  # the one in the hung task only, not the idle one
    ours = [t for t in threading.enumerate() if t.name.startswith("kvtiers-test-pool-")]
    for t in ours:  # both end on their own: the idle one once scheduled, the other once released
        t.join(10)
    assert len(ours) == 2 and not any(t.is_alive() for t in ours)


def test_shutdown_runs_what_is_queued_and_returns_no_thread():
    pool = Pool("kvtiers-test-queue", 1)
    ran: list[int] = []
    pool.submit_many([lambda s, i=i: ran.append(i) for i in range(5)])
    assert pool.shutdown(timeout=10) == []
    assert ran == [0, 1, 2, 3, 4]


def test_a_prober_waiting_for_work_is_not_stuck(tmp_path):
    prober = Prober(Index(60.0), lambda k: str(tmp_path / k.hex()), "kvtiers-test-probe", 4096)
    prober.request([b"absent"])
    wait_for(lambda: not prober.pending(b"absent"), what="the probe to answer")
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the prober cannot run until this thread blocks
    try:
        assert prober.stop(timeout=0) is True
    finally:
        sys.setswitchinterval(old)
    prober._thread.join(10)
    assert not prober._thread.is_alive()


def test_a_prober_inside_a_stat_is_stuck(tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real_lstat = os.lstat

    def hung_lstat(path, *a, **kw):  # a stat on a hung mount
        entered.set()
        release.wait(30)
        return real_lstat(path, *a, **kw)

    prober = Prober(Index(60.0), lambda k: str(tmp_path / k.hex()), "kvtiers-test-probe-hung", 4096)
    monkeypatch.setattr(os, "lstat", hung_lstat)
    prober.request([b"absent"])
    assert entered.wait(10)
    try:
        assert prober.stop(timeout=0.2) is False
    finally:
        release.set()
    prober._thread.join(10)
    assert not prober._thread.is_alive()
