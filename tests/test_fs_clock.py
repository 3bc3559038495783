"""The cleaner against clocks: its order does not depend on its own wall clock going forward
(issue 40 item 7), and directories with coarse mtimes (2 s, FAT-like) are listed again
until a change in the same tick would show (issue 40 item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from kvtiers_fs import layout
from test_fs_helpers import Env, chunk_files, wait_for

HELPERS = os.path.dirname(__file__)
SLOT = 4096
FILE = layout.file_bytes(SLOT)

# the cleaner, in its own process, whose wall clock steps back an hour when `step` appears
STEPPED_CLEANER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {helpers!r})
    real = time.time
    step, stop = {step!r}, {stop!r}
    time.time = lambda: real() - (3600.0 if os.path.exists(step) else 0.0)  # fault injection
    from test_fs_helpers import Env
    e = Env({root!r}, slots=2, slot_bytes={slot})
    t = e.open(max_bytes={bound}, rescan_seconds=0.1)
    assert t.is_cleaner and t.scanned.wait(30)
    print("cleaner", flush=True)
    while not os.path.exists(stop):
        time.sleep(0.01)
    t.close()
    """
)


def test_a_cleaner_whose_clock_steps_back_an_hour_still_keeps_the_bound(tmp_path):
    root, step, stop = str(tmp_path / "root"), str(tmp_path / "step"), str(tmp_path / "stop")
    p = subprocess.Popen([sys.executable, "-c", STEPPED_CLEANER.format(
        helpers=HELPERS, root=root, step=step, stop=stop, slot=SLOT, bound=8 * FILE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    w = Env(root, slots=32, slot_bytes=SLOT)
    try:
        assert p.stdout.readline().strip() == "cleaner", p.stderr.read()
        tw = w.open()  # another instance, unbounded: its stores are the cleaner's to evict
        keys = [b"k-%d" % i for i in range(30)]
        assert w.store(tw, keys).ok
        wait_for(lambda: len(chunk_files(root)) <= 8, timeout=60, what="the cleaner to evict to its bound")
        open(step, "w").close()  # the cleaner's wall clock goes back an hour
        time.sleep(0.5)  # (a few passes on the stepped clock)
        left = _settled_count(root)  # a pass may still be evicting: count once the files stop changing
        assert 0 < left <= 8, left  # the stepped clock neither emptied the root nor let it past its bound
        r = w.store(tw, keys)  # the evicted keys are stored again, at least those counted: the store's
        # new files push the namespace past the bound, and a pass during the store may evict some of
        # the ones left (the oldest) before the store reaches their keys (3 of 8 in one fresh run)
        assert r.ok and (30 - left) * SLOT <= r.nbytes <= 30 * SLOT, (r.nbytes, left)
        wait_for(lambda: len(chunk_files(root)) <= 8, timeout=60,
                 what=f"the cleaner to evict to its bound again ({len(chunk_files(root))} files of 8)")
    finally:
        open(stop, "w").close()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        w.close()
    assert p.returncode == 0, p.stderr.read()


def _settled_count(root: str, samples: int = 4, every: float = 0.2, timeout: float = 30.0) -> int:
    """The number of chunk files once it has stayed the same over ``samples`` looks ``every``
    seconds apart (a count taken mid-pass raced the cleaner's last eviction: 1 run in 15)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = (seen + [len(chunk_files(root))])[-samples:]
        if len(seen) == samples and len(set(seen)) == 1:
            return seen[0]
        time.sleep(every)
    raise AssertionError(f"the chunk files never settled: {seen}")


def _pairs(n: int) -> list[tuple[bytes, bytes]]:
    """``n`` pairs of keys whose chunk files share a directory."""
    seen: dict[tuple[str, str], bytes] = {}
    out = []
    i = 0
    while len(out) < n:
        k = b"coarse-%d" % i
        i += 1
        d = layout.key_dirs(k)
        if d in seen:
            out.append((seen.pop(d), k))
        else:
            seen[d] = k
    return out


def _coarse(paths: list[str], m: int) -> None:
    for d in paths:  # what a file system with 2 s mtimes shows: the tick the change fell in
        os.utime(d, ns=(m * 10**9, m * 10**9))


def test_a_second_store_in_the_same_two_second_tick_is_seen(tmp_path):
    root = str(tmp_path)
    pairs = _pairs(8)
    a, b = Env(root, slots=2, slot_bytes=SLOT), Env(root, slots=16, slot_bytes=SLOT)
    try:
        ta = a.open(max_bytes=8 * FILE, rescan_seconds=None)  # the cleaner: its passes are run here
        assert ta.scanned.wait(30) and ta.is_cleaner
        tb = b.open()
        dirs = [os.path.dirname(tb.path(k)) for k, _ in pairs]
        while True:  # one second into an even 2 s tick m: a 1 s racy window would call it done
            now = time.time()
            if int(now) % 2 == 1 and now % 1 < 0.4:
                break
            time.sleep(0.01)
        m = int(now) - 1
        assert b.store(tb, [k for k, _ in pairs]).ok
        _coarse(dirs, m)
        ta._scan_once(clean=False, full=False)  # lists the 8 directories, 1.0-1.4 s into their tick
        assert ta.index.used == 8 * FILE
        assert b.store(tb, [k for _, k in pairs]).ok  # the same tick: the directories still show m
        _coarse(dirs, m)
        ta._scan_once(clean=False, full=False)
        assert len(chunk_files(root)) == 8, f"{len(chunk_files(root))} files against a bound of 8"
        assert ta.index.used == 8 * FILE
    finally:
        a.close()
        b.close()


def test_the_walker_reads_granularity_off_the_mtime_and_time_off_the_file_system(tmp_path, monkeypatch):
    from kvtiers_fs.index import Index
    from kvtiers_fs.walker import Walker, granularity, racy

    assert [granularity(n) for n in (4 * 10**9, 5 * 10**9, 5 * 10**9 + 4_000_000)] == [2.0, 1.0, 0.0]
    assert racy(12.9, 10 * 10**9) and not racy(13.0, 10 * 10**9)  # 2 s tick: racy for 3 s
    assert racy(11.9, 11 * 10**9) and not racy(13.0, 11 * 10**9)  # 1 s tick
    assert racy(10.9, 10 * 10**9 + 5) and not racy(11.1, 10 * 10**9 + 5)
    clock = str(tmp_path / "clock")
    w = Walker(str(tmp_path), Index(1.0, FILE), FILE, clock_path=clock)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # this host's clock an hour ahead
    got = w.fs_now()
    monkeypatch.undo()
    assert abs(got - real()) < 5 and os.path.exists(clock)  # the file system's clock is not
