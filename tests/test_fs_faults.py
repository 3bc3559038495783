"""Faults under the fs tier: corrupt and truncated files written by someone else, files
deleted under it, permission denied, a full disk, and a writer killed mid-write."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner
from kvtiers_fs import layout
from test_fs_helpers import SLOT, Env, chunk_files, resolve, wait_for
from tier_helpers import mounted_tmpfs

from kvtiers import Lookup
from kvtiers.commands.cli import cli
from kvtiers.registry import get_registry


def _damage(path: str, how: str) -> None:
    if how == "truncated":
        os.truncate(path, SLOT // 2)
    elif how == "truncated_trailer":
        os.truncate(path, SLOT + 100)
    elif how == "data_flip":
        with open(path, "r+b") as f:
            f.seek(SLOT - 1)
            b = f.read(1)
            f.seek(SLOT - 1)
            f.write(bytes([b[0] ^ 1]))
    elif how == "trailer_flip":
        with open(path, "r+b") as f:
            f.seek(SLOT + 20)
            f.write(b"\x7f")
    elif how == "empty":
        os.truncate(path, 0)
    elif how == "swapped":  # a valid chunk file of another key under this key's name
        other = path.replace(b"victim".hex(), b"other!".hex())
        shutil.copyfile(other, path)


@pytest.mark.parametrize("how", ["truncated", "truncated_trailer", "data_flip", "trailer_flip", "empty", "swapped"])
def test_damaged_file_is_a_failed_key_removed_and_reported(env, how):
    t = env.open()
    assert env.store(t, [b"victim", b"other!"]).ok
    path = t.path(b"victim")
    if how == "swapped":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copyfile(t.path(b"other!"), path)
    else:
        _damage(path, how)
    r = env.load(t, [b"victim", b"other!"])
    assert r.failed_keys == (b"victim",)
    assert "corrupt" in r.error
    env.check([b"other!"], [1])
    assert not os.path.exists(path)
    assert env.removed == [(b"victim", "corrupt")]
    assert resolve(t, [b"victim"]) == [Lookup.MISS]
    assert env.store(t, [b"victim"]).ok and env.load(t, [b"victim"]).ok  # stored again, whole
    env.check([b"victim"])


def test_files_deleted_under_the_tier(env):
    t = env.open()
    # the open-time listing forgets, unreported, a known key it finds gone (the index holds
    # fingerprints, not keys): let it finish first, so the loads below are what find the files gone
    assert t.scanned.wait(30)
    keys = [b"d%d" % i for i in range(6)]
    assert env.store(t, keys).ok
    for k in keys[:3]:
        os.unlink(t.path(k))
    shutil.rmtree(os.path.dirname(t.path(keys[3])))  # a whole leaf directory
    r = env.load(t, keys)
    assert set(r.failed_keys) == set(keys[:4])
    env.check(keys, failed=r.failed_keys)
    assert sorted(env.removed) == sorted((k, "missing") for k in keys[:4])
    assert resolve(t, keys[:4]) == [Lookup.MISS] * 4
    assert env.store(t, keys).ok  # the directory is created again
    assert env.load(t, keys).ok
    env.check(keys)


def test_permission_denied_is_a_failed_key(env, monkeypatch):
    t = env.open()
    assert env.store(t, [b"readable", b"locked"]).ok
    real_open = os.open
    locked = t.path(b"locked")
    denied_prefix = t.path(b"cannot-write")[: -len(".bin")]

    def guarded(path, flags, *a, **k):  # root ignores file modes: inject EACCES instead
        unnamed = flags & os.O_TMPFILE == os.O_TMPFILE and path == os.path.dirname(denied_prefix)  # (O_TMPFILE)
        if path == locked or str(path).startswith(denied_prefix) or unnamed:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", guarded)
    r = env.load(t, [b"readable", b"locked"])
    assert r.failed_keys == (b"locked",) and "EACCES" in r.error
    env.check([b"readable"])
    assert os.path.exists(locked) and env.removed == []  # not corrupt: kept
    r = env.store(t, [b"cannot-write", b"fine"])
    assert r.failed_keys == (b"cannot-write",) and "EACCES" in r.error
    assert chunk_files(env.root, ".tmp") == []
    monkeypatch.undo()
    assert env.load(t, [b"locked", b"fine"]).ok
    env.check([b"locked", b"fine"])


@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "4m") as d:
        yield d


def test_disk_full_fails_cleanly_and_recovers_after_gc(small_disk):
    e = Env(small_disk, slots=16, slot_bytes=256 << 10)  # 260 KiB files on a 4 MiB disk
    try:
        t = e.open()
        keys = [b"full-%d" % i for i in range(16)]
        r = e.run(t, "store", keys)
        assert r.failed_keys and len(r.failed_keys) < len(keys)
        assert "ENOSPC" in r.error
        assert chunk_files(small_disk, ".tmp") == []  # no half-written leftovers
        stored = [k for k in keys if k not in r.failed_keys]
        r2 = e.run(t, "load", stored)
        assert r2.ok
        e.check(stored)
        get_registry().add_commands(cli)
        res = CliRunner().invoke(cli, ["fs", "gc", small_disk, "--max-bytes", "1M"])
        assert res.exit_code == 0, res.output
        assert "over max_bytes" in res.output
        r3 = e.run(t, "store", [b"after-gc-1", b"after-gc-2"], [0, 1])
        assert r3.ok
        assert e.load(t, [b"after-gc-1", b"after-gc-2"]).ok
        e.check([b"after-gc-1", b"after-gc-2"])
    finally:
        e.close()


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {helpers!r})
    from test_fs_helpers import Env, pattern
    from kvtiers import Job
    e = Env({root!r}, slots=8, slot_bytes={slot})
    t = e.open(n_write_threads=2)
    i = 0
    while True:
        keys = tuple(b"crash-%d-%d" % (i, j) for j in range(8))
        e.fill(keys, range(8))
        t.submit_store(Job(i, keys, tuple(range(8))))
        while not t.get_finished_jobs():
            time.sleep(0.0005)
        i += 1
    """
)


def test_writer_killed_mid_write_leaves_no_wrong_hit(tmp_path):
    root = str(tmp_path / "root")
    slot = 1 << 20
    script = WRITER.format(helpers=os.path.dirname(__file__), root=root, slot=slot)
    for _attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
        try:
            wait_for(lambda: len(chunk_files(root)) >= 16 and chunk_files(root, ".tmp"), timeout=60,
                     what="the writer to have chunks published and a store in flight")
        finally:
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err.decode()
        if chunk_files(root, ".tmp"):  # killed mid-write (not in the gap after a rename)
            break
    else:
        raise AssertionError("the writer was never killed with a store in flight")
    # a half-written chunk under its final name, as a crash without rename could not make
    torn = chunk_files(root)[0]
    os.truncate(torn, slot // 3)
    e = Env(root, slots=8, slot_bytes=slot)
    try:
        t = e.open()
        assert t.scanned.wait(30)
        assert chunk_files(root, ".tmp") == []  # stale temporary files cleaned at open
        assert t.stale_removed
        keys = [bytes.fromhex(os.path.basename(p)[: -len(".bin")]) for p in chunk_files(root)]
        torn_key = bytes.fromhex(os.path.basename(torn)[: -len(".bin")])
        # a file of the wrong length is not indexed: no HIT for the torn chunk
        assert len(keys) >= 16 and resolve(t, keys) == [Lookup.MISS if k == torn_key else Lookup.HIT for k in keys]
        failed = set()
        for i in range(0, len(keys), 8):
            batch = keys[i : i + 8]
            r = e.load(t, batch)
            failed |= set(r.failed_keys)
            e.check(batch, failed=r.failed_keys)  # every success has exactly the stored bytes
        assert failed == {torn_key}
        assert resolve(t, [torn_key]) == [Lookup.MISS]
    finally:
        e.close()


def test_stale_temp_rules(tmp_path):
    e = Env(str(tmp_path))
    t = e.open()
    assert e.store(t, [b"k"]).ok
    t.close()
    d = os.path.dirname(t.path(b"k"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = layout._HOST
    names = {
        "dead": f"{b'k'.hex()}.{dead_pid}@{host}.00000000.tmp",
        "live": f"{b'k'.hex()}.{live.pid}@{host}.00000001.tmp",
        "remote_new": f"{b'k'.hex()}.1@elsewhere.00000002.tmp",
        "remote_old": f"{b'k'.hex()}.1@elsewhere.00000003.tmp",
    }
    try:
        for n in names.values():
            open(os.path.join(d, n), "wb").close()
        old = time.time() - 7200
        os.utime(os.path.join(d, names["remote_old"]), (old, old))
        t2 = e.open()
        assert t2.scanned.wait(30)
        left = sorted(os.path.basename(p) for p in chunk_files(str(tmp_path), ".tmp"))
        assert left == sorted([names["live"], names["remote_new"]])
    finally:
        live.kill()
        live.wait()
        e.close()
