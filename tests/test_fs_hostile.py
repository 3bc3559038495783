"""The fs tier against hostile files under its root and in its own index (issue 40 items 3-6
and 9): special files at ``index.snapshot`` (a FIFO, a link to ``/dev/zero``, a directory, a
device node), crafted snapshots with a valid checksum (a table with no free slot, NaN or
infinite clocks, entries out of place), fingerprint collisions forced in-process, and corrupt
chunks that a read-only root cannot remove. The rule each time: never a hang, never unbounded
memory, never wrong bytes; one warning naming the file; the tier goes on."""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import pytest
from kvtiers_fs import FsTier, keytable, layout, snapshot
from kvtiers_fs.keytable import KeyTable
from test_fs_helpers import NS, SLOT, chunk_files, resolve, wait_for

from kvtiers import Lookup

FILE = layout.file_bytes(SLOT)
TAG = layout.namespace_tag(NS.digest)


def _returns_within(fn: Callable[[], object], seconds: float) -> object:
    """Call ``fn`` on a daemon thread; fail (instead of hanging) if it has not returned."""
    out: list[object] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still running after {seconds} s (spinning or blocked)"
    assert out, "raised instead of returning (see the thread's traceback above)"
    return out[0]


@contextmanager
def _memory_cap(extra: int):
    """Cap this process's data (heap and private writable mappings) at what it uses now
    plus ``extra`` bytes, so that an unbounded read fails with MemoryError instead of taking
    the machine's memory."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    old = resource.getrlimit(resource.RLIMIT_DATA)
    cap = size + extra if old[1] == resource.RLIM_INFINITY else min(old[1], size + extra)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


def _warnings_naming(caplog, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvtiers.fs" and r.levelno >= logging.WARNING and what in r.getMessage()]


def _stored_root(env, n: int) -> FsTier:
    """``n`` chunks stored and closed by an unbounded instance (which writes a snapshot)."""
    t = env.open()
    assert t.scanned.wait(30)  # (a close during the open-time scan writes no snapshot)
    for i in range(n):  # one at a time: oldest first
        assert env.store(t, [b"h-%d" % i]).ok
    t.close()
    assert len(chunk_files(env.root)) == n and os.path.isfile(snapshot.path(t.nsdir))
    return t


# -- item 3: special files at index.snapshot --------------------------------------------------
def _fifo(p: str) -> None:
    os.mkfifo(p)


def _link_to_dev_zero(p: str) -> None:
    os.symlink("/dev/zero", p)


def _directory(p: str) -> None:
    os.mkdir(p)
    open(os.path.join(p, "x"), "wb").close()


def _dev_zero_node(p: str) -> None:
    try:
        os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 5))
    except OSError as e:
        pytest.skip(f"cannot make a device node here: {e}")


@pytest.mark.parametrize("make", [_fifo, _link_to_dev_zero, _directory, _dev_zero_node],
                         ids=["fifo", "link-to-dev-zero", "directory", "char-device"])
def test_a_special_file_at_index_snapshot_is_a_full_listing_and_the_cleaner_still_cleans(env, caplog, make):
    first = _stored_root(env, 30)
    snap = snapshot.path(first.nsdir)
    os.unlink(snap)
    make(snap)
    caplog.set_level(logging.WARNING, logger="kvtiers.fs")
    with _memory_cap(2 << 30):
        t = env.open(max_bytes=8 * FILE, rescan_seconds=3600.0)
        assert t.scanned.wait(30), "the open-time scan never finished (blocked on the snapshot?)"
        assert t.is_cleaner and not t.snapshot_loaded
        # the lease holder listed everything and cleaned
        wait_for(lambda: len(chunk_files(env.root)) <= 8, timeout=30, what="the root back within its bound")
        assert len(_warnings_naming(caplog, snap)) == 1, caplog.text
        # the tier goes on: stores and loads work, and the bound holds
        assert env.store(t, [b"after"]).ok and env.load(t, [b"after"]).ok
        env.check([b"after"])
        assert len(chunk_files(env.root)) <= 8
        # a second instance takes no lease but answers for what is there
        other = env.open(max_bytes=8 * FILE, rescan_seconds=3600.0)
        assert other.scanned.wait(60) and not other.is_cleaner
        assert resolve(other, [b"after"]) == [Lookup.HIT]
        other.close()
        t.close()


# -- item 4: a table with no free slot -----------------------------------------------------------
def _full_fingerprints(n: int) -> np.ndarray:
    rng = np.random.default_rng(40)
    return np.unique(rng.integers(2, 2**63, 2 * n, dtype=np.uint64))[:n]


def test_probes_of_a_table_with_no_free_slot_end():
    fp = _full_fingerprints(1024)
    assert _returns_within(lambda: KeyTable._probe(fp, 12345, 0), 10) == -1
    with pytest.raises(ValueError, match="free slot"):
        KeyTable.from_arrays(fp.copy(), np.ones(1024))


def test_from_arrays_takes_every_table_a_writer_makes_and_no_other():
    rng = np.random.default_rng(7)
    # 60 fingerprints whose home is one of the last slots (their runs wrap to slot 0), tombstones
    tail = (np.uint64(0xFFFFFFF0_00000000) | rng.integers(0, 2**16, 60, dtype=np.uint64)
            | np.uint64(0xFFFF0000)) + np.uint64(2)
    fps = np.unique(np.concatenate([tail, rng.integers(2, 2**63, 600, dtype=np.uint64)]))
    t = KeyTable()
    t.put_many(fps, np.ones(len(fps)))
    for f in fps[::7].tolist():
        t.remove(f)
    live = np.flatnonzero(t.fp > keytable.TOMB)
    assert (keytable._home(t.fp[live], t.cap) > live).any()  # some probes did wrap
    back = KeyTable.from_arrays(t.fp.copy(), t.clock.copy())
    assert len(back) == len(t) and (back.find(fps) == t.find(fps)).all()
    # the same key again in the first free slot after its own: reachable, but twice
    fp = t.fp.copy()
    i = int(live[0])
    j = next(s % t.cap for s in range(i + 1, i + t.cap) if fp[s % t.cap] == keytable.EMPTY)
    fp[j] = fp[i]
    with pytest.raises(ValueError, match="twice"):
        KeyTable.from_arrays(fp, t.clock.copy())


def test_a_snapshot_with_no_free_slot_is_refused_and_lookups_return(env, caplog):
    t = env.open()
    t.close()
    snapshot.save(t.nsdir, _full_fingerprints(1024), np.ones(1024), np.zeros(snapshot.NDIRS, np.int64),
                  FILE, TAG, time.time())
    caplog.set_level(logging.WARNING, logger="kvtiers.fs")
    t = env.open()
    assert t.scanned.wait(30) and not t.snapshot_loaded
    assert _returns_within(lambda: resolve(t, [b"never stored"]), 15) == [Lookup.MISS]
    assert len(_warnings_naming(caplog, snapshot.path(t.nsdir))) == 1, caplog.text
    assert env.store(t, [b"k"]).ok and resolve(t, [b"k"]) == [Lookup.HIT]


# -- item 5: NaN (and infinite) clocks -------------------------------------------------------------
def _rewrite_clocks(nsdir: str, value: float) -> None:
    """Give every key of the snapshot clock ``value``, with a valid checksum (anyone can)."""
    table, dirs, written = snapshot.load(nsdir, FILE, TAG)
    clock = table.clock.copy()
    clock[table.fp > keytable.TOMB] = value
    snapshot.save(nsdir, table.fp, clock, dirs, FILE, TAG, written)


def test_a_snapshot_with_nan_clocks_is_refused_and_the_bound_holds(env, caplog):
    first = _stored_root(env, 20)
    _rewrite_clocks(first.nsdir, float("nan"))
    caplog.set_level(logging.WARNING, logger="kvtiers.fs")
    t = env.open(max_bytes=8 * FILE, rescan_seconds=3600.0)
    assert t.scanned.wait(60) and t.is_cleaner and not t.snapshot_loaded
    wait_for(lambda: len(chunk_files(env.root)) <= 8, timeout=30, what="the root back within its bound")
    wait_for(lambda: sum(why == "evicted" for _, why in env.removed) >= 12, timeout=30, what="the evictions' report")
    evicted = [k for k, why in env.removed if why == "evicted"]
    assert len(evicted) == 12 and b"h-19" not in evicted
    assert len(_warnings_naming(caplog, snapshot.path(t.nsdir))) == 1, caplog.text


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_snapshot_load_refuses_non_finite_clocks(env, value):
    first = _stored_root(env, 3)
    _rewrite_clocks(first.nsdir, value)
    assert snapshot.load(first.nsdir, FILE, TAG) is None


def test_a_snapshot_with_an_entry_out_of_its_probe_sequence_is_refused(env):
    """Entries a probe cannot reach would count against the bound but never be evicted."""
    first = _stored_root(env, 3)
    table, dirs, written = snapshot.load(first.nsdir, FILE, TAG)
    fp, clock = table.fp.copy(), table.clock.copy()
    live = np.flatnonzero(fp > keytable.TOMB)
    empty = np.flatnonzero(fp == keytable.EMPTY)
    # move one entry away from its home (left empty): a probe from its home stops there
    i = int(live[0])
    home = int(keytable._home(fp[i : i + 1], len(fp))[0])
    j = next(int(s) for s in empty if abs(int(s) - home) > 2)
    fp[j], clock[j], fp[i], clock[i] = fp[i], clock[i], keytable.EMPTY, 0.0
    snapshot.save(first.nsdir, fp, clock, dirs, FILE, TAG, written)
    assert snapshot.load(first.nsdir, FILE, TAG) is None


# -- item 6: fingerprint collisions --------------------------------------------------------------
def _colliding_pair() -> tuple[bytes, bytes]:
    """Two keys whose chunk files share a directory (their xxh3-64s agree in 16 bits)."""
    seen: dict[int, bytes] = {}
    i = 0
    while True:
        k = b"col-%d" % i
        d = keytable._h64(k) >> 48
        if d in seen:
            return seen[d], k
        seen[d] = k
        i += 1


@pytest.fixture
def collide(monkeypatch):
    """Make the second key of a pair have the first one's fingerprint (fault injection: a real
    collision of xxh3-64 needs about 2^32 keys)."""
    a, b = _colliding_pair()
    real = keytable._h64
    monkeypatch.setattr(keytable, "_h64", lambda k: real(a) if k == b else real(k))
    assert keytable.fingerprint(a) == keytable.fingerprint(b)
    return a, b


def _run_jobs(env, t, keys) -> None:
    for k in keys:  # one job each, so each is the newest use when it lands
        r = env.run(t, "store", [k], timeout=15)  # a job never reported fails here
        assert r.ok, r.error


def test_colliding_keys_are_evicted_together_and_every_deletion_is_reported(env, collide):
    a, b = collide
    t = env.open(max_bytes=4 * FILE, rescan_seconds=3600.0)
    assert t.scanned.wait(30) and t.is_cleaner
    _run_jobs(env, t, [a, b])
    assert resolve(t, [a, b]) == [Lookup.HIT, Lookup.HIT]  # one entry answers for both
    others = [b"o-%d" % i for i in range(6)]
    _run_jobs(env, t, others)  # the pair is the oldest entry: the first eviction takes it
    wait_for(lambda: t.backlog() == 0, what="the stores to finish")
    assert t.index.reserved == 0, "a reservation leaked"
    on_disk = {layout.key_of_name(os.path.basename(p)) for p in chunk_files(env.root)}
    assert a not in on_disk and b not in on_disk  # both dropped
    evicted = [k for k, why in env.removed if why == "evicted"]
    assert sorted(evicted) == sorted(set([a, b, *others]) - on_disk)  # each deletion reported once
    assert resolve(t, [a, b]) == [Lookup.MISS, Lookup.MISS]  # neither answers HIT from the set of found keys
    assert len(on_disk) <= 4


def test_colliding_keys_are_kept_together_when_one_was_used_elsewhere(env, collide):
    a, b = collide
    t = env.open(max_bytes=4 * FILE, rescan_seconds=3600.0)
    assert t.scanned.wait(30) and t.is_cleaner
    _run_jobs(env, t, [a, b])
    later = time.time() + 60
    os.utime(t.path(a), (later, later))  # another instance loaded a since (its mtime moved up)
    others = [b"o-%d" % i for i in range(6)]
    _run_jobs(env, t, others)
    assert t.index.reserved == 0
    assert os.path.exists(t.path(a)) and os.path.exists(t.path(b))  # both kept
    evicted = [k for k, why in env.removed if why == "evicted"]
    assert a not in evicted and b not in evicted
    on_disk = {layout.key_of_name(os.path.basename(p)) for p in chunk_files(env.root)}
    assert sorted(evicted) == sorted(set(others) - on_disk)


# -- item 9: a corrupt chunk that cannot be removed is not reported removed ------------------------
def _corrupt_one(env) -> tuple[list[bytes], str]:
    t = env.open()
    keys = [b"rc-%d" % i for i in range(3)]
    assert env.store(t, keys).ok
    t.close()
    FsTier.conformance_corrupt({"root_dir": env.root}, NS, keys[1])
    return keys, t.path(keys[1])


def _refuse_unlink(monkeypatch, path: str) -> None:
    real = os.unlink

    def unlink(p, *a, **kw):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, "Permission denied", p)
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)


@pytest.mark.parametrize("how", ["read_only", "unlink-refused"])
def test_a_corrupt_chunk_left_in_place_is_not_reported_removed(env, caplog, monkeypatch, how):
    keys, path = _corrupt_one(env)
    if how == "unlink-refused":
        _refuse_unlink(monkeypatch, path)  # an immutable file, a directory we may not write
        t = env.open()
    else:
        t = env.open(read_only=True)
    caplog.set_level(logging.INFO, logger="kvtiers.fs")
    r = env.load(t, keys)
    assert r.failed_keys == (keys[1],) and "left in place" in r.error and "removed" not in r.error
    env.check(keys, failed=r.failed_keys)
    assert os.path.exists(path)
    assert env.removed == []  # the file did not go
    logged = _warnings_naming(caplog, path)
    assert len(logged) == 1 and "left in place" in logged[0] and "removed" not in logged[0], logged
    # never wrong bytes later either: the key fails again, the others still load
    r = env.load(t, keys)
    assert r.failed_keys == (keys[1],)
    env.check(keys, failed=r.failed_keys)


def test_a_corrupt_chunk_that_is_removed_is_reported_once(env, caplog):
    keys, path = _corrupt_one(env)
    t = env.open()
    caplog.set_level(logging.INFO, logger="kvtiers.fs")
    r = env.load(t, keys)
    assert r.failed_keys == (keys[1],) and "corrupt chunk removed" in r.error
    assert not os.path.exists(path) and env.removed == [(keys[1], "corrupt")]
    assert len(_warnings_naming(caplog, path)) == 1


# -- issue 44 item 14: a snapshot is a hint that never hides a directory from the bound ------------
def _hiding_snapshot(nsdir: str) -> int:
    """What a writer of the root can do: record every directory's current mtime (so that to
    a reader none changed since) with a table that holds none of their files, and a valid
    checksum. Returns how many directories it vouches for."""
    _table, dirs, written = snapshot.load(nsdir, FILE, TAG)
    dirs[:] = 0
    for h1 in os.scandir(nsdir):
        if len(h1.name) == 2 and h1.is_dir(follow_symlinks=False):
            n1 = int(h1.name, 16)
            dirs[65536 + n1] = os.stat(h1.path).st_mtime_ns
            for h2 in os.scandir(h1.path):
                dirs[n1 * 256 + int(h2.name, 16)] = os.stat(h2.path).st_mtime_ns
    assert (dirs[:65536] > 0).sum() > 10
    empty = KeyTable()
    snapshot.save(nsdir, empty.fp, empty.clock, dirs, FILE, TAG, written)
    return int((dirs > 0).sum())


def test_a_snapshot_hiding_every_directory_is_listed_through_by_the_cleaner_at_open(env):
    first = _stored_root(env, 40)
    _hiding_snapshot(first.nsdir)
    t = env.open(max_bytes=16 * FILE, rescan_seconds=3600.0)  # no rescan within the test
    assert t.scanned.wait(60) and t.is_cleaner and t.snapshot_loaded
    wait_for(lambda: len(chunk_files(env.root)) <= 16, timeout=30, what="the hidden chunks counted and evicted")
    assert sum(why == "evicted" for _, why in env.removed) == 24
    assert t.walker.pending_verification == 0


def test_a_snapshot_hiding_directories_is_listed_through_when_the_lease_passes(env, tmp_path):
    """An instance that loaded the snapshot while another held the lease lists what it vouched
    for at its first pass as the cleaner (one rescan_seconds after the lease is free)."""
    import fcntl

    first = _stored_root(env, 40)
    vouched = _hiding_snapshot(first.nsdir)
    holder = os.open(os.path.join(first.nsdir, "cleaner.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another cleaner (a process that will die)
        t = env.open(max_bytes=16 * FILE, rescan_seconds=0.5)
        assert t.scanned.wait(60) and not t.is_cleaner and t.snapshot_loaded
        # not listed by an instance that does not count the bound
        assert t.walker.pending_verification == vouched > 0
    finally:
        os.close(holder)  # its lock goes with it
    wait_for(lambda: t.is_cleaner, timeout=30, what="the lease to pass on")
    wait_for(lambda: len(chunk_files(env.root)) <= 16, timeout=30, what="the hidden chunks counted and evicted")
    assert t.walker.pending_verification == 0


def test_a_snapshot_header_of_more_than_2_30_slots_is_refused_without_reading_it(env, caplog, tmp_path):
    """A header that claims 2^30 + 1 slots, in a (sparse) file of exactly the size it implies:
    refused by its slot count before anything is allocated or read (a 16 GiB read otherwise)."""
    first = _stored_root(env, 3)
    snap = snapshot.path(first.nsdir)
    slots = snapshot.MAX_SLOTS + 1
    with open(snap, "r+b") as f:
        f.write(snapshot._HEAD.pack(snapshot.MAGIC, snapshot.VERSION, 0, FILE, slots, TAG, time.time()))
        f.truncate(snapshot.size_of(slots))  # sparse: no disk, and no reader should touch it
    caplog.set_level(logging.WARNING, logger="kvtiers.fs")
    with _memory_cap(256 << 20):
        assert _returns_within(lambda: snapshot.load(first.nsdir, FILE, TAG), 10) is None
    said = _warnings_naming(caplog, snap)
    assert len(said) == 1 and f"a table of {slots} slots (1 to {snapshot.MAX_SLOTS})" in said[0], said
    t = env.open()  # the tier goes on: a full listing instead
    assert t.scanned.wait(30) and not t.snapshot_loaded
    assert resolve(t, [b"h-0", b"h-2"]) == [Lookup.HIT, Lookup.HIT]


# -- issue 44 item 11: unequal max_bytes on one root ----------------------------------------------
def test_unequal_max_bytes_on_one_root_warn_at_open_and_the_cleaners_bound_governs(env, caplog):
    caplog.set_level(logging.WARNING, logger="kvtiers.fs")
    a = env.open(max_bytes=64 * FILE, rescan_seconds=0.3)
    assert a.scanned.wait(30) and a.is_cleaner
    b = env.open(max_bytes=32 * FILE, rescan_seconds=0.3)
    c = env.open(max_bytes=16 * FILE, rescan_seconds=0.3)
    same = env.open(max_bytes=64 * FILE, rescan_seconds=0.3)
    assert not (b.is_cleaner or c.is_cleaner or same.is_cleaner)
    said = _warnings_naming(caplog, "the cleaner's bound governs")
    assert len(said) == 2, said  # b and c, once each; not the instance that agrees
    for mine in (32, 16):
        assert [w for w in said if f"max_bytes={mine * FILE} here" in w and f"max_bytes={64 * FILE}:" in w], said
    for i in range(40):
        for t in (a, b, c):
            assert env.store(t, [b"%s-%d" % (bytes([t is a and 97 or t is b and 98 or 99]), i)]).ok
    # stores stopped: the cleaner's next pass settles the directory at its bound (64), not 16
    wait_for(lambda: len(chunk_files(env.root)) <= 64, timeout=30, what="the cleaner's bound")
    time.sleep(1.0)  # a few more passes: nothing else is removed
    # the cleaner's own 40 chunks are never removed by the others: not settled at 16 or 32
    assert 40 <= len(chunk_files(env.root)) <= 64
    assert len(_warnings_naming(caplog, "the cleaner's bound governs")) == 2  # not again at every rescan
