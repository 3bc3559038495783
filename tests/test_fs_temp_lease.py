"""A live writer's temporary files survive any cleaner, whatever PID namespace it runs in:
the writer holds a lock on the file from before it has a name, and cleaners decide and
remove while holding that lock themselves (issue 36 item 3), never by the pid in its name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from kvtiers_fs import layout
from test_fs_helpers import Env, chunk_files, wait_for

HELPERS = os.path.dirname(__file__)

CLEANER = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {helpers!r})
    from kvtiers_fs import gc
    from kvtiers_fs.index import Index
    from kvtiers_fs.walker import Walker
    root, nsdir, ready, stop = {root!r}, {nsdir!r}, {ready!r}, {stop!r}
    removed, passes = [], 0
    walker = Walker(nsdir, Index(1.0, {file_bytes}), {file_bytes})
    while not os.path.exists(stop):
        removed += [p for p, _ in gc.gc_root(root).removed]  # `kvtiers fs gc`
        walker.removed = []
        walker.run(full=True, clean=True)  # a tier's open-time scan
        removed += walker.removed
        passes += 1
        if passes == 1:
            open(ready, "w").close()
    print(json.dumps({{"pid": os.getpid(), "removed": removed, "passes": passes}}))
    """
)


def test_a_cleaner_in_another_pid_namespace_never_removes_a_live_writers_temp_file(tmp_path, monkeypatch):
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.strip()}")
    root = str(tmp_path / "root")
    e = Env(root, slots=8, slot_bytes=4096)
    t = e.open(n_write_threads=8)
    assert t.scanned.wait(30)
    assert e.store(t, [b"first"]).ok
    # an abandoned temporary file (its writer died: no lock, a pid alive nowhere) is still removed
    d = os.path.dirname(t.path(b"first"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = os.path.join(d, f"{b'first'.hex()}.{int(dead.stdout)}@{layout._HOST}.0000dead.tmp")
    open(abandoned, "wb").close()

    real_lock = layout.lock_temp

    def slow_lock(fd: int, tries: int = 200) -> bool:  # the writer descheduled before it locks its file
        time.sleep(0.03)
        return real_lock(fd, tries)

    monkeypatch.setattr(layout, "lock_temp", slow_lock)
    ready, stop = str(tmp_path / "ready"), str(tmp_path / "stop")
    script = CLEANER.format(helpers=HELPERS, root=root, nsdir=t.nsdir, ready=ready, stop=stop,
                            file_bytes=t.file_bytes)
    cleaner = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", script],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(ready) or cleaner.poll() is not None, timeout=30, what="the cleaner")
        assert cleaner.poll() is None, cleaner.communicate()
        failed = []
        for r in range(6):  # stores whose temporary files live 30 ms unlocked under the old writer
            keys = [b"live-%d-%d" % (r, i) for i in range(8)]
            res = e.store(t, keys)
            failed += [(k, res.error) for k in res.failed_keys]
    finally:
        open(stop, "w").close()
        out, err = cleaner.communicate(timeout=60)
    assert cleaner.returncode == 0, err
    report = json.loads(out)
    assert report["pid"] == 1  # it ran in a PID namespace of its own, where the writer's pid is no process
    assert failed == []
    live = [p for p in report["removed"] if os.path.basename(p).startswith(b"live-".hex())]
    assert live == [], f"{len(live)} temporary files of a live writer removed"
    assert abandoned in report["removed"] and report["passes"] > 10
    assert e.load(t, [b"live-5-%d" % i for i in range(8)]).ok
    e.check([b"live-5-%d" % i for i in range(8)])
    e.close()
    assert chunk_files(root, ".tmp") == []


def test_the_writers_lock_is_there_before_its_file_has_a_name(tmp_path):
    final = str(tmp_path / f"{b'k'.hex()}.bin")
    tmp, fd, anon = layout.create_locked_temp(final, os.O_WRONLY | os.O_CLOEXEC)
    try:
        assert anon  # O_TMPFILE on this file system: locked, then linked under its name
        assert os.path.exists(tmp) and layout.temp_locked(tmp) is True
        assert layout.remove_if_abandoned(tmp, time.time() + 7200, 0.0) is False  # held: alive, however old
    finally:
        os.close(fd)
    assert layout.remove_if_abandoned(tmp, time.time() + 7200, 0.0) is True  # its writer is gone


def test_without_o_tmpfile_a_temp_file_removed_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """Where files cannot be locked before they have a name, a cleaner may remove one in that
    moment: the writer sees it lost its name and starts again, under a new one."""
    final = str(tmp_path / f"{b'k'.hex()}.bin")
    real_lock = layout.lock_temp
    seen = []

    def cleaner_first(fd: int, tries: int = 200) -> bool:
        (name,) = [n for n in os.listdir(tmp_path) if n not in seen]
        seen.append(name)
        if len(seen) == 1:  # a cleaner judged and removed the first one before the writer locked it
            assert layout.remove_if_abandoned(str(tmp_path / name), time.time() + 7200, 0.0)
        return real_lock(fd, tries)

    monkeypatch.setattr(layout, "lock_temp", cleaner_first)
    tmp, fd, anon = layout.create_locked_temp(final, os.O_WRONLY | os.O_CLOEXEC, anon=False)
    try:
        assert not anon and len(seen) == 2 and os.path.basename(tmp) == seen[1]
        assert os.fstat(fd).st_nlink == 1 and layout.temp_locked(tmp) is True
    finally:
        os.close(fd)
