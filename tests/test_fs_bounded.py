"""``max_bytes``: LRU eviction reported through ``ctx.removed``, an order that survives a
restart, files being read are never deleted, and instances sharing a bounded root."""

from __future__ import annotations

import contextlib
import os
import threading
import time

from kvtiers_fs import layout, snapshot
from kvtiers_fs.keytable import dir_of, fingerprint, fingerprints
from test_fs_helpers import SLOT, chunk_files, resolve, two_envs, wait_for

from kvtiers import Job, Lookup

FILE = layout.file_bytes(SLOT)


def hold_reads(t, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make ``t``'s reads wait, with their file open, until ``release`` is set (at most
    30 s); ``entered`` is set once a read has begun."""
    entered, release = threading.Event(), threading.Event()
    real_read = t._read

    def slow_read(fd, key, data, trailer):
        entered.set()
        release.wait(30)
        return real_read(fd, key, data, trailer)

    monkeypatch.setattr(t, "_read", slow_read)
    return entered, release


def test_stores_keep_succeeding_and_evict_lru(env):
    t = env.open(max_bytes=4 * FILE)
    keys = [b"b%d" % i for i in range(10)]
    for k in keys[:4]:
        assert env.store(t, [k]).ok
    assert env.load(t, [keys[0]]).ok  # keys[0] is now the most recently used
    for k in keys[4:]:
        assert env.store(t, [k]).ok
        assert len(chunk_files(env.root)) * FILE <= 4 * FILE
        if k == keys[6]:  # b1..b3 went first: b0 was used after them
            assert os.path.exists(t.path(keys[0])) and not os.path.exists(t.path(keys[3]))
    kept = {k for k in keys if os.path.exists(t.path(k))}
    assert kept == set(keys[6:])
    evicted = [k for k, why in env.removed if why == "evicted"]
    assert sorted(evicted) == sorted(set(keys) - kept) and len(evicted) == len(set(evicted))
    assert resolve(t, keys) == [Lookup.HIT if k in kept else Lookup.MISS for k in keys]
    assert t.index.used == 4 * FILE


def test_touch_and_load_protect_from_eviction(env):
    t = env.open(max_bytes=3 * FILE)
    for k in (b"a", b"b", b"c"):  # one job each: keys of one job finish in any order
        assert env.store(t, [k]).ok
    t.touch([b"a"])
    assert env.store(t, [b"d"]).ok
    assert not os.path.exists(t.path(b"b")) and os.path.exists(t.path(b"a"))


def test_a_chunk_larger_than_max_bytes_fails(env):
    t = env.open(max_bytes=FILE - 1)
    r = env.store(t, [b"big"])
    assert r.failed_keys == (b"big",) and "max_bytes" in r.error
    assert chunk_files(env.root) == []


def test_lru_order_survives_a_restart(env):
    t = env.open()
    keys = [b"old", b"mid", b"new"]
    assert env.store(t, keys).ok
    now = time.time()
    for age, k in zip((300, 200, 100), keys, strict=True):
        os.utime(t.path(k), (now - age, now - age))
    assert env.load(t, [b"old"]).ok  # a load touches the file: "old" is the newest now
    t.close()
    with contextlib.suppress(FileNotFoundError):  # (none if close came before the first listing ended)
        os.unlink(os.path.join(t.nsdir, snapshot.NAME))  # without a snapshot the files' mtimes give the order
    t2 = env.open(max_bytes=3 * FILE)
    assert t2.scanned.wait(30) and not t2.snapshot_loaded
    assert [fp for fp, _ in t2.index.victims(3)] == [fingerprint(k) for k in (b"mid", b"new", b"old")]
    assert env.store(t2, [b"fourth"]).ok
    assert not os.path.exists(t2.path(b"mid"))
    assert all(os.path.exists(t2.path(k)) for k in (b"new", b"old", b"fourth"))
    # reopening with a smaller bound evicts down to it at the scan
    t2.close()
    env.removed.clear()
    t3 = env.open(max_bytes=FILE)
    assert t3.scanned.wait(30)
    assert [k for k, _ in env.removed] == [b"new", b"old"]
    assert chunk_files(env.root) == [t3.path(b"fourth")]


def test_a_file_being_read_is_never_evicted(env, monkeypatch):
    t = env.open(max_bytes=2 * FILE)
    assert env.store(t, [b"reading", b"x"]).ok
    entered, release = hold_reads(t, monkeypatch)
    env.poison([10])
    t.submit_load(Job(500, (b"reading",), (10,)))
    assert entered.wait(10), f"the load never read the file: {t.get_finished_jobs()}"
    for i in range(3):  # "reading" is the least recently used, but pinned
        assert env.store(t, [b"push-%d" % i], [i]).ok
    assert os.path.exists(t.path(b"reading"))
    assert b"reading" not in [k for k, _ in env.removed]
    release.set()
    wait_for(lambda: t.backlog() == 0, what="load")
    (r,) = t.get_finished_jobs()
    assert r.ok
    env.check([b"reading"], [10])


def test_unlink_by_another_instance_while_reading_is_safe(tmp_path, monkeypatch):
    """POSIX keeps an unlinked file's data for descriptors already open: a load that
    opened the file before another instance evicted it still gets the exact bytes."""
    with two_envs(tmp_path) as (a, b):
        ta = a.open()
        assert ta.scanned.wait(30)  # (a listing after b's eviction would forget "shared" unreported)
        assert a.store(ta, [b"shared"]).ok
        tb = b.open(max_bytes=FILE)  # its scan finds "shared": b knows its age and may evict it
        assert tb.scanned.wait(30)
        entered, release = hold_reads(ta, monkeypatch)
        a.poison([5])
        ta.submit_load(Job(1, (b"shared",), (5,)))
        assert entered.wait(10)
        assert resolve(tb, [b"shared"]) == [Lookup.HIT]
        assert b.store(tb, [b"evicts-it"]).ok  # b's bound pushes "shared" out
        assert not os.path.exists(ta.path(b"shared"))
        assert (b"shared", "evicted") in b.removed
        release.set()
        wait_for(lambda: ta.backlog() == 0, what="load")
        (r,) = ta.get_finished_jobs()
        assert r.ok
        a.check([b"shared"], [5])
        # a's next load of it fails cleanly and a reports the removal it noticed
        r = a.load(ta, [b"shared"])
        assert r.failed_keys == (b"shared",)
        assert (b"shared", "missing") in a.removed


def test_two_bounded_instances_on_one_root_stay_correct(tmp_path):
    with two_envs(tmp_path) as (a, b):
        ta, tb = a.open(max_bytes=6 * FILE), b.open(max_bytes=6 * FILE)
        for i in range(6):
            ka = [b"a%d-%d" % (i, j) for j in range(3)]
            kb = [b"b%d-%d" % (i, j) for j in range(3)]
            assert a.store(ta, ka).ok and b.store(tb, kb).ok
            both = ka + kb
            for env, t in ((a, ta), (b, tb)):
                assert resolve(t, both) != [Lookup.RETRY] * 6
                r = env.load(t, both)
                env.check(both, failed=r.failed_keys)  # a key either loads exactly or fails
        # one of them holds the cleaner's lease and keeps the bound for both, at its next pass
        assert [ta.is_cleaner, tb.is_cleaner] == [True, False]
        ta._scan_once(clean=False, full=False)
        assert len(chunk_files(str(tmp_path))) <= 6


def test_a_chunk_being_stored_is_neither_counted_twice_nor_evicted():
    """The start-up scan can list a chunk renamed into place before its store has indexed it.
    It must not count that chunk next to the store's reservation (the bound would then evict
    fresh chunks, and the store would index a deleted file), and a chunk being written is never
    an eviction victim, however it entered the index."""
    from kvtiers_fs.index import Index

    idx = Index(negative_ttl=1.0, file_bytes=FILE)
    started = time.time()
    assert idx.reserve(FILE, 2 * FILE, b"a") == 0
    assert idx.reserve(FILE, 2 * FILE, b"b") == 0
    fps = fingerprints([b"a", b"b"])
    idx.merge_listing({dir_of(int(f)) for f in fps}, fps, [started + 1, started + 2], started)  # renamed into place
    assert idx.victims(2) == []  # being written: never victims, however they entered the index
    idx.add(b"a")  # e.g. a lookup probe found the renamed file first
    assert idx.reserve(FILE, 2 * FILE, b"c") > 0 and idx.victims(3) == []  # "a" and "b" are still being written
    idx.commit(b"a")
    idx.commit(b"b")
    assert idx.used == 2 * FILE  # each counted once
    assert [fp for fp, _ in idx.victims(1)] == [fingerprint(b"a")]  # stores done: "a" is evictable again, LRU first
    idx.unreserve(FILE, b"c")
    assert idx.writing == {} and idx.reserved == 0


def test_a_victim_found_used_elsewhere_keeps_its_place_in_the_lru_order():
    """A victim whose file another instance used since (mtime newer than its clock) moves up to
    that mtime, not past every key: the next victims are the oldest by the new clocks. (The
    eviction's candidate list was kept from before the move, so a pass evicted the newest key,
    one just stored, while the moved one stayed: the README's conformance run, rule 13.)"""
    from kvtiers_fs.index import Index

    idx = Index(negative_ttl=1.0, file_bytes=FILE)
    for k in (b"a", b"b", b"c", b"d"):
        idx.add(k)
    clock = {k: idx.clock_of(k) for k in (b"a", b"b", b"c", b"d")}
    first = idx.victims(3)
    assert [fp for fp, _ in first] == fingerprints([b"a", b"b", b"c"]).tolist()
    # as _evict does: "a" was used elsewhere since (its mtime between c's clock and d's), b and c go
    idx.refresh(fingerprint(b"a"), clock[b"a"], (clock[b"c"] + clock[b"d"]) / 2)
    for k in (b"b", b"c"):
        assert idx.evicted(fingerprint(k), clock[k], k)
    assert [fp for fp, _ in idx.victims(1)] == [fingerprint(b"a")]  # not d, the newest
