"""The fs tier against a hostile or broken file system: things at a chunk's path that are
not chunk files (FIFOs, directories, devices, links), reads that never return, entries the
open-time scan cannot remove, read-only roots, chunks of another slot size or namespace,
and damage done in place by ``conformance_corrupt``."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import threading
import time

import pytest
import xxhash
from kvtiers_fs import FsTier, layout
from test_fs_helpers import NS, SLOT, Env, chunk_files, resolve, wait_for
from tier_helpers import mounted_tmpfs

from kvtiers import Job, Lookup, Namespace

FILE = layout.file_bytes(SLOT)


def _close_within(tier, seconds: float) -> float:
    """Close ``tier`` on another thread; fail (instead of hanging) if it takes longer."""
    t0 = time.monotonic()
    th = threading.Thread(target=tier.close, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"close() had not returned after {seconds} s"
    return time.monotonic() - t0


# -- item 1: nothing at a chunk's path blocks or misleads a load ------------------------------
@pytest.mark.parametrize("direct", [False, None])
def test_fifos_at_chunk_paths_fail_their_keys_and_block_nothing(env, direct):
    t = env.open(direct=direct, n_read_threads=4)
    assert env.store(t, [b"good"]).ok
    fifo_keys = [b"fifo-%d" % i for i in range(10)]  # more FIFOs than read threads
    for k in fifo_keys:
        os.makedirs(os.path.dirname(t.path(k)), exist_ok=True)
        os.mkfifo(t.path(k))
    try:
        for i, k in enumerate(fifo_keys):  # one job per FIFO: each would take a read thread
            t.submit_load(Job(100 + i, (k,), (i,)))
        results = {}
        deadline = time.monotonic() + 15
        while len(results) < len(fifo_keys) and time.monotonic() < deadline:
            results.update((r.job_id, r) for r in t.get_finished_jobs())
            time.sleep(0.005)
        assert len(results) == len(fifo_keys), f"only {len(results)} of {len(fifo_keys)} FIFO loads reported"
        for r in results.values():
            assert not r.ok and "FIFO" in r.error and "left alone" in r.error, r
        r = env.load(t, [b"good"], [20])  # a normal load still works afterwards
        assert r.ok
        env.check([b"good"], [20])
        assert all(stat.S_ISFIFO(os.lstat(t.path(k)).st_mode) for k in fifo_keys)  # left alone
        assert resolve(t, fifo_keys[:2]) == [Lookup.MISS] * 2  # a FIFO is no chunk: a probe says MISS
        assert env.store(t, [fifo_keys[0]]).ok  # a store replaces it with a chunk
        assert env.load(t, [fifo_keys[0]]).ok
        _close_within(t, 15)
    finally:  # with a tier that blocks in open(), let its threads go (each waits for a writer)
        deadline = time.monotonic() + 20
        while t.backlog() and time.monotonic() < deadline:
            for k in fifo_keys:
                try:
                    os.close(os.open(t.path(k), os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            time.sleep(0.02)


@pytest.mark.parametrize("kind", ["directory", "symbolic link", "character device"])
def test_other_non_regular_files_are_refused_and_left_alone(env, tmp_path, kind):
    t = env.open()
    assert env.store(t, [b"victim", b"other"]).ok
    path = t.path(b"victim")
    outside = tmp_path / "outside.bin"
    shutil.copyfile(path, outside)  # a valid chunk of the key, outside the root
    os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "symbolic link":
        os.symlink(outside, path)
    else:
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
    r = env.load(t, [b"victim", b"other"])
    assert r.failed_keys == (b"victim",) and kind in r.error and "left alone" in r.error, r
    env.check([b"other"], [1])
    assert os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode)
    assert outside.stat().st_size == FILE
    assert resolve(t, [b"victim"]) == [Lookup.MISS]


# -- item 2: close() is bounded even when a read never returns --------------------------------
def test_close_returns_within_close_timeout_with_a_stuck_read(env, monkeypatch):
    t = env.open(close_timeout=1.0, n_read_threads=1)
    assert env.store(t, [b"stuck", b"queued", b"fine"]).ok
    assert env.load(t, [b"fine"]).ok
    entered, release = threading.Event(), threading.Event()

    def hung_read(fd, key, data, trailer):  # a read on a hung mount: returns only when released
        entered.set()
        release.wait(60)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(t, "_read", hung_read)
    env.poison([3, 4])
    t.submit_load(Job(7, (b"stuck", b"queued"), (3, 4)))
    assert entered.wait(10)
    try:
        took = _close_within(t, 15)
        assert took < 8, f"close took {took:.1f} s with close_timeout=1"
        (r,) = t.get_finished_jobs()
        assert r.job_id == 7 and set(r.failed_keys) == {b"stuck", b"queued"}
        assert "abandoned on close" in r.error and "close_timeout=1.0" in r.error
        assert [th.name for th in t.abandoned] == [th.name for th in t.abandoned if "-read-" in th.name] != []
    finally:
        release.set()
    wait_for(lambda: not any(th.is_alive() for th in t.abandoned), what="the stuck thread to end")
    assert t.get_finished_jobs() == []  # exactly once: the late end of the read reports nothing
    assert bytes(env.arena[4]) == b"\xee" * SLOT  # the queued key never touched its slot


def test_close_without_stuck_io_reports_every_job_and_leaves_no_thread(env):
    t = env.open(close_timeout=5.0)
    keys = [b"c%d" % i for i in range(16)]
    env.fill(keys, range(16))
    t.submit_store(Job(1, tuple(keys), tuple(range(16))))
    t.close()
    (r,) = t.get_finished_jobs()
    assert r.ok and t.abandoned == []


# -- item 4: one bad entry never aborts the open-time scan --------------------------------------
def test_scan_skips_a_stale_temp_it_cannot_remove_and_indexes_the_rest(env, monkeypatch):
    t = env.open()
    keys = [b"s%02d" % i for i in range(12)]
    for i in range(0, 12, 4):
        assert env.store(t, keys[i : i + 4]).ok
    t.close()
    d = os.path.dirname(t.path(keys[5]))
    stale = os.path.join(d, f"{keys[5].hex()}.999999@{layout._HOST}.deadbeef.tmp")  # no such pid
    open(stale, "wb").close()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    real_unlink = os.unlink

    def immutable(path, *a, **k):  # EACCES / EROFS / chattr +i: root cannot remove it either
        if str(path).endswith(".tmp"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", immutable)
    env.removed.clear()
    t2 = env.open(max_bytes=4 * FILE)
    assert t2.scanned.wait(30)
    assert any(stale in p for p in t2.scan_problems), t2.scan_problems
    assert os.path.exists(stale)
    assert len(chunk_files(env.root)) == 4  # every chunk indexed: the bound applied to them all
    assert len([k for k, why in env.removed if why == "evicted"]) == 8
    assert t2.index.used == 4 * FILE


# -- item 8: a read-only cache directory -------------------------------------------------------
def _tree(root: str) -> dict[str, tuple[int, float]]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime)
    return out


def test_read_only_option_loads_and_never_writes(env, tmp_path):
    t = env.open()
    keys = [b"ro-%d" % i for i in range(4)]
    assert env.store(t, keys).ok
    t.close()
    before = _tree(env.root)
    ro = env.open(read_only=True)
    assert ro.scanned.wait(30)
    assert resolve(ro, keys) == [Lookup.HIT] * 4
    assert env.load(ro, keys).ok
    env.check(keys)
    r = env.store(ro, [b"new", keys[0]])
    assert set(r.failed_keys) == {b"new", keys[0]} and "read_only" in r.error
    ro.close()
    assert _tree(env.root) == before  # no file, directory or mtime changed
    # a read-only tier on a root without the namespace: opens, misses, creates nothing
    empty = Env(str(tmp_path / "empty"))
    os.mkdir(empty.root)
    t3 = empty.open(read_only=True)
    assert resolve(t3, [b"x"]) == [Lookup.MISS] and not empty.load(t3, [b"x"]).ok
    t3.close()
    assert os.listdir(empty.root) == []
    with pytest.raises(ValueError, match="read_only"):
        env.open(read_only=True, max_bytes=FILE)


@pytest.fixture
def ro_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "8m") as d:
        yield d


def test_read_only_mount_opens_with_default_direct_loads_and_fails_stores(ro_tmpfs, monkeypatch):
    from kvtiers_fs import direct

    e = Env(ro_tmpfs)
    try:
        t = e.open()
        keys = [b"m-%d" % i for i in range(3)]
        assert e.store(t, keys).ok
        t.close()
        r = subprocess.run(["mount", "-o", "remount,ro", ro_tmpfs], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        monkeypatch.setattr(direct, "_probed", {})  # as in a fresh process
        t2 = e.open()  # direct left at its default: the O_DIRECT probe must not need a write
        assert t2.scanned.wait(30)
        assert resolve(t2, keys) == [Lookup.HIT] * 3
        assert e.load(t2, keys).ok
        e.check(keys)
        r = e.store(t2, [b"new"])
        assert r.failed_keys == (b"new",) and "read-only file system" in r.error
    finally:
        e.close()


# -- item 9: another geometry is a miss, another namespace is not loaded ----------------------
def test_a_chunk_of_another_slot_size_is_a_miss_and_left_alone(tmp_path):
    big, small = Env(str(tmp_path), slot_bytes=SLOT), Env(str(tmp_path), slot_bytes=SLOT // 2)
    try:
        tb, ts = big.open(), small.open()
        assert big.store(tb, [b"from-big"]).ok and small.store(ts, [b"from-small"]).ok
        for env, t, key in ((small, ts, b"from-big"), (big, tb, b"from-small")):
            size = os.path.getsize(t.path(key))
            assert resolve(t, [key]) == [Lookup.MISS]  # not indexed: not a chunk of this size
            r = env.load(t, [key])
            assert r.failed_keys == (key,) and "another slot size" in r.error and "left alone" in r.error
            assert os.path.getsize(t.path(key)) == size  # never deleted as "corrupt"
            r = env.store(t, [key])
            assert r.failed_keys == (key,) and "another slot size" in r.error
            assert os.path.getsize(t.path(key)) == size
        assert big.removed == [] and small.removed == []
        assert big.load(tb, [b"from-big"]).ok and small.load(ts, [b"from-small"]).ok
        big.check([b"from-big"])
        small.check([b"from-small"])
    finally:
        big.close()
        small.close()


def test_a_chunk_copied_into_another_namespace_is_not_loaded_there(tmp_path):
    a, b = Env(str(tmp_path)), Env(str(tmp_path), ns=Namespace({"model": "other"}))
    try:
        ta, tb = a.open(), b.open()
        assert a.store(ta, [b"copied"]).ok
        os.makedirs(os.path.dirname(tb.path(b"copied")), exist_ok=True)
        shutil.copyfile(ta.path(b"copied"), tb.path(b"copied"))
        r = b.load(tb, [b"copied"])
        assert r.failed_keys == (b"copied",) and "another namespace" in r.error
        assert not os.path.exists(tb.path(b"copied"))  # a misplaced file: removed like a corrupt one
        assert b.removed == [(b"copied", "corrupt")]
        assert a.load(ta, [b"copied"]).ok
        a.check([b"copied"])
    finally:
        a.close()
        b.close()


def _rewrite_trailer(path: str, version: int) -> None:
    """Turn a chunk file's trailer into a format-``version`` one (1: no namespace field)."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        tr = SLOT
        magic, _v, flags, dlen, klen, key, digest, _ns = struct.unpack_from("<8sIIQI4x64s16s8s", raw, tr)
        raw[tr : tr + 4096] = bytes(4096)
        if version == 1:
            head = struct.pack("<8sIIQI4x64s16s", magic, 1, flags, dlen, klen, key, digest)
        else:
            head = struct.pack("<8sIIQI4x64s16s8s", magic, version, flags, dlen, klen, key, digest, _ns)
        raw[tr : tr + len(head)] = head
        raw[tr + len(head) : tr + len(head) + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
        f.seek(0)
        f.write(raw)


def test_old_format_chunks_still_load_and_newer_ones_are_left_alone(env):
    t = env.open()
    assert env.store(t, [b"v1", b"v9"]).ok
    _rewrite_trailer(t.path(b"v1"), 1)
    _rewrite_trailer(t.path(b"v9"), 9)
    r = env.load(t, [b"v1", b"v9"])
    assert r.failed_keys == (b"v9",) and "newer" in r.error and "left alone" in r.error
    env.check([b"v1"])
    assert os.path.exists(t.path(b"v9")) and env.removed == []


# -- issue 11 item 3: conformance_corrupt damages a chunk in place -------------------------------
def test_conformance_corrupt_makes_the_load_fail_never_wrong_bytes(env):
    t = env.open()
    keys = [b"cc-%d" % i for i in range(4)]
    assert env.store(t, keys).ok
    path = t.path(keys[1])
    size, trailer = os.path.getsize(path), open(path, "rb").read()[SLOT:]
    FsTier.conformance_corrupt({"root_dir": env.root}, NS, keys[1])
    raw = open(path, "rb").read()
    assert len(raw) == size and raw[SLOT:] == trailer  # same length, payload damaged in place
    r = env.load(t, keys)
    assert r.failed_keys == (keys[1],) and "checksum" in r.error
    env.check(keys, failed=r.failed_keys)
    with pytest.raises(FileNotFoundError):
        FsTier.conformance_corrupt({"root_dir": env.root}, NS, b"never stored")


def test_a_fifo_as_config_json_is_an_error_at_open_not_a_hang(env):
    nsdir = os.path.join(env.root, env.ctx.namespace.digest)
    os.makedirs(nsdir)
    os.mkfifo(os.path.join(nsdir, "config.json"))
    outcome = []

    def try_open():
        try:
            env.open()
            outcome.append("opened")
        except ValueError as e:
            outcome.append(str(e))

    th = threading.Thread(target=try_open, daemon=True)
    th.start()
    th.join(10)
    if th.is_alive():  # let the old code's blocked open go before failing
        os.close(os.open(os.path.join(nsdir, "config.json"), os.O_WRONLY | os.O_NONBLOCK))
        th.join(10)
        raise AssertionError("opening the tier blocked on a FIFO at config.json")
    assert len(outcome) == 1 and "not a regular file" in outcome[0]


def test_a_writer_waits_out_a_cleaner_that_checks_its_lock(tmp_path):
    """A cleaner's lock probe holds a new temporary file's lock for a moment: the writer's
    lock attempt waits for it instead of failing the store."""
    import fcntl

    path = str(tmp_path / f"{b'k'.hex()}.1@{layout._HOST}.00000000.tmp")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    cleaner = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.flock(cleaner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the cleaner got there first
    threading.Timer(0.05, os.close, (cleaner,)).start()
    try:
        assert layout.lock_temp(fd) is True
        assert layout.temp_locked(path) is True  # now the writer holds it: alive
    finally:
        os.close(fd)
    assert layout.temp_locked(path) is False
