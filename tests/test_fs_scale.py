"""The fs tier at scale (issue 24): the compact index, the restart from an index snapshot, the
cleaner's lease with real processes, passes that list only what changed, and a root_dir that
cannot exist. Roots of a few tens of thousands of chunks (``kvtiers_fs.scale.build_root``);
the 1M-chunk figures come from ``kvtiers bench fs --scale 1000000``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
from kvtiers_fs import FsTier, layout, scale, snapshot, walker
from kvtiers_fs.index import Index
from kvtiers_fs.keytable import KeyTable, dir_of, fingerprints
from test_fs_helpers import Env, chunk_files, resolve, wait_for
from tier_helpers import mounted_tmpfs

from kvtiers import Arena, Lookup, Namespace, TierContext

SLOT = 4096
FILE = layout.file_bytes(SLOT)
N = 20_000
HELPERS = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("scale") / "root")
    scale.build_root(root, N, SLOT, real=100)
    time.sleep(walker.RACY_SECONDS + 0.1)  # so no directory is too recent to trust its mtime
    return root


def _ctx(removed=None) -> TierContext:
    sink = (lambda keys, why: removed.extend((k, why) for k in keys)) if removed is not None else None
    return TierContext(Arena.allocate(8, SLOT), Namespace(scale.NAMESPACE), removed=sink)


def test_the_index_holds_at_most_32_bytes_per_key():
    keys = [scale.scale_key(i) for i in range(100_000)]
    fps = fingerprints(keys)
    dirs = dir_of(fps)
    Index(1.0, FILE).merge_listing([0], fps[:1], [1.0], time.time())  # (numpy's lazy imports, not the index)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx = Index(1.0, FILE)
        for lo in range(0, 65536, 4096):  # as a listing fills it, a batch of directories at a time
            part = fps[(dirs >= lo) & (dirs < lo + 4096)]
            idx.merge_listing(range(lo, lo + 4096), part, np.full(len(part), 1.0), time.time())
        for i in range(2000):  # and stores one by one
            idx.add(b"stored-%d" % i)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(idx) == 102_000 and idx.used == 102_000 * FILE
    assert idx.table.nbytes / len(idx) <= 32
    # the remembered MISSes are a fixed table (1.1 MiB, whatever the keys), not a cost per key
    per_key = (held - idx.absent.nbytes) / len(idx)
    assert idx.absent.nbytes <= 1.2 * 2**20
    assert per_key <= 32 + 4, f"{per_key:.1f} bytes per key"
    assert all(idx.known(keys[:1000])) and not any(idx.known([b"never-%d" % i for i in range(1000)]))


def test_the_table_survives_growth_removals_and_reuse_of_slots():
    t = KeyTable()
    fps = fingerprints([b"k%d" % i for i in range(30_000)])
    for f in fps[:10_000].tolist():
        t.put(f, 1.0)
    t.put_many(fps[10_000:], np.full(20_000, 2.0))
    for f in fps[::2].tolist():
        assert t.remove(f) is not None
    t.put_many(fps[::4], np.full(len(fps[::4]), 3.0))  # back into tombstones
    found = t.find(fps) >= 0
    expect = np.zeros(len(fps), bool)
    expect[1::2] = True
    expect[::4] = True
    assert (found == expect).all() and len(t) == int(expect.sum())
    assert t.get(int(fps[4])) == 3.0 and t.get(int(fps[1])) in (1.0, 2.0) and t.get(int(fps[2])) is None


def test_find_agrees_with_a_plain_set_over_long_runs_and_the_wrap_at_the_end():
    rng = np.random.default_rng(7)
    t = KeyTable()  # 1024 slots, filled to 0.74: long probe runs
    cap = t.cap
    # 60 fingerprints whose home is one of the last slots: their runs wrap to slot 0
    tail = (np.uint64(0xFFFFFFF0_00000000) | rng.integers(0, 2**16, 60, dtype=np.uint64)
            | np.uint64(0xFFFF0000)) + np.uint64(2)
    rest = rng.integers(2, 2**63, 700, dtype=np.uint64) * np.uint64(2)
    stored = np.unique(np.concatenate([tail, rest]))
    t.put_many(stored, np.ones(len(stored)))
    assert t.cap == cap and len(t) == len(stored)  # no growth: the runs stay long
    absent = np.setdiff1d(rng.integers(2, 2**64 - 1, 3000, dtype=np.uint64), stored)
    asked = np.concatenate([stored, absent, tail + np.uint64(1)])
    want = np.isin(asked, stored)
    slots = t.find(asked)
    assert ((slots >= 0) == want).all() and (t.contains(asked) == want).all()
    assert (t.fp[slots[want]] == asked[want]).all()
    for f in asked[::37].tolist():  # the one-key path agrees
        assert (t.slot(f) >= 0) == (f in set(stored.tolist()))


def test_a_restart_with_a_snapshot_has_the_full_view_at_once_and_lists_only_what_changed(big_root):
    ctx = _ctx()
    t = FsTier(ctx, root_dir=big_root)
    assert t.scanned.wait(120) and not t.snapshot_loaded and len(t.index) == N
    full_listing = t.listed_entries
    t.close()
    assert os.path.exists(snapshot.path(t.nsdir))
    # changes after the snapshot: another instance stores a chunk, two chunks are deleted
    saved = open(snapshot.path(t.nsdir), "rb").read()
    gone = [scale.scale_key(1), scale.scale_key(2)]
    for k in gone:
        os.unlink(layout.chunk_path(t.nsdir, k))
    other = FsTier(_ctx(), root_dir=big_root)
    other.ctx.arena[0][:] = b"\x01" * SLOT
    from test_fs_helpers import wait_job

    from kvtiers import Job

    other.submit_store(Job(1, (b"new-after-snapshot",), (0,)))
    assert wait_job(other, 1).ok
    other.close()
    with open(snapshot.path(t.nsdir), "wb") as f:  # the snapshot t wrote, from before those changes
        f.write(saved)
    t2 = FsTier(_ctx(), root_dir=big_root)
    try:
        assert t2.view_ready.wait(30) and t2.snapshot_loaded
        assert t2.scanned.wait(120)
        assert all(t2.index.known([scale.scale_key(i) for i in range(3, 1000)]))
        assert b"new-after-snapshot" in t2.index
        assert not any(t2.index.known(gone))
        assert t2.listed_entries < full_listing / 10, (t2.listed_entries, full_listing)
        assert resolve(t2, gone) == [Lookup.MISS, Lookup.MISS]
    finally:
        t2.close()


def test_a_stale_or_torn_snapshot_never_loads_wrong_bytes(tmp_path):
    e = Env(str(tmp_path), slot_bytes=SLOT)
    t = e.open()
    keys = [b"s-%d" % i for i in range(20)]
    assert e.store(t, keys).ok
    assert t.scanned.wait(30)  # closed before its first scan ends, a tier writes no snapshot
    t.close()
    snap = snapshot.path(t.nsdir)
    assert os.path.exists(snap)
    # a crash after the snapshot: files removed and one replaced by another key's chunk,
    # with the directories' mtimes put back so no listing notices
    for k in keys[:5]:
        p = t.path(k)
        d = os.path.dirname(p)
        st = os.stat(d)
        os.unlink(p)
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    victim, donor = t.path(keys[5]), t.path(keys[6])
    d = os.path.dirname(victim)
    st = os.stat(d)
    with open(donor, "rb") as f, open(victim, "r+b") as g:
        g.write(f.read())
    os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    t2 = e.open()
    assert t2.scanned.wait(30) and t2.snapshot_loaded
    e.poison(range(6))
    r = e.load(t2, keys[:6], range(6))
    assert sorted(r.failed_keys) == sorted(keys[:6])  # failed keys, never wrong bytes
    r = e.load(t2, keys[6:10], range(4))
    assert r.ok
    e.check(keys[6:10], range(4))
    t2.close()
    # a torn snapshot is ignored: the tier lists the directory
    with open(snap, "r+b") as f:
        f.truncate(os.path.getsize(snap) // 2)
    t3 = e.open()
    try:
        assert t3.scanned.wait(30) and not t3.snapshot_loaded
        assert all(t3.index.known(keys[7:]))
    finally:
        e.close()


HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {helpers!r})
    from test_fs_helpers import Env
    e = Env({root!r}, slots=2, slot_bytes={slot})
    t = e.open(max_bytes={bound}, rescan_seconds=3600)  # holds the lease, stores nothing, lists nothing
    assert t.is_cleaner and t.scanned.wait(60)  # its first listing (and eviction) is over
    print("cleaner", flush=True)
    time.sleep(600)
    """
)


def test_the_cleaners_lease_passes_on_when_its_holder_dies(tmp_path):
    root = str(tmp_path)
    bound = 8 * FILE
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(helpers=HELPERS, root=root, slot=SLOT, bound=bound)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    e, w = Env(root, slot_bytes=SLOT), Env(root, slot_bytes=SLOT)
    try:
        assert p.stdout.readline().strip() == "cleaner", p.stderr.read()
        t = e.open(max_bytes=bound, rescan_seconds=0.1)
        assert t.scanned.wait(30) and not t.is_cleaner
        keys = [b"l-%d" % i for i in range(20)]
        tw = w.open()  # an unbounded instance stores (a bounded one would keep to its share of the bound)
        for k in keys:
            assert w.store(tw, [k]).ok
            time.sleep(0.01)  # (mtimes apart: the LRU order)
        assert not [k for k, why in e.removed if why == "evicted"]  # not the cleaner: it evicts nothing
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        wait_for(lambda: t.is_cleaner, timeout=30, what="the lease to pass on")
        wait_for(lambda: len(chunk_files(root)) <= 8, timeout=30, what="the new cleaner to evict to the bound")
        # a pass reports its evictions once it has removed them all: the files go first
        wait_for(lambda: any(why == "evicted" for _, why in e.removed), timeout=30, what="the evictions' report")
        evicted = [k for k, why in e.removed if why == "evicted"]
        assert sorted(evicted) == sorted(keys[:12])  # the oldest first
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        e.close()
        w.close()


def test_a_pass_lists_only_the_directories_that_changed(big_root):
    t = FsTier(_ctx(), root_dir=big_root, max_bytes=(N + 1000) * FILE, rescan_seconds=3600.0)
    other = FsTier(_ctx(), root_dir=big_root)
    try:
        assert t.scanned.wait(120) and t.is_cleaner
        assert other.scanned.wait(120) and not other.is_cleaner  # unbounded: never takes the lease
        time.sleep(walker.RACY_SECONDS + 0.1)
        t._scan_once(clean=False, full=False)  # settle what the first listing saw as too recent
        before = t.listed_entries
        t._scan_once(clean=False, full=False)
        assert t.listed_entries - before <= 300, "an idle pass listed more than the first level"
        keys = [b"changed-%d" % i for i in range(5)]
        other.ctx.arena[0][:] = b"\x02" * SLOT
        from test_fs_helpers import wait_job

        from kvtiers import Job

        other.submit_store(Job(1, tuple(keys), (0, 1, 2, 3, 4)))
        assert wait_job(other, 1).ok
        before = t.listed_entries
        t._scan_once(clean=False, full=False)
        assert all(t.index.known(keys))
        per_dir = N / 65536 + 10
        # the five directories, and the first level above any of them that was new
        assert t.listed_entries - before <= 300 + 5 * (256 + per_dir), t.listed_entries - before
    finally:
        t.close()
        other.close()


def test_a_missing_root_that_cannot_be_created_is_an_error_at_open(tmp_path):
    ctx = TierContext(Arena.allocate(2, SLOT), Namespace({"model": "m"}))
    with pytest.raises(ValueError, match=r"root_dir .*typo does not exist and cannot be created.*read_only"):
        FsTier(ctx, root_dir=str(tmp_path / "typo"), read_only=True)
    with mounted_tmpfs(tmp_path / "ro", "4m") as d:
        r = subprocess.run(["mount", "-o", "remount,ro", d], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        with pytest.raises(ValueError, match=r"typo does not exist and cannot be created.*read-only file system"):
            FsTier(ctx, root_dir=os.path.join(d, "typo"))
        t = FsTier(ctx, root_dir=d)  # the mount itself exists: an empty, read-only cache
        try:
            assert resolve(t, [b"x"]) == [Lookup.MISS]
        finally:
            t.close()


def test_bench_fs_scale_prints_the_figures_as_json(tmp_path):
    kvtiers_cmd = os.path.join(os.path.dirname(sys.executable), "kvtiers")
    r = subprocess.run([kvtiers_cmd, "bench", "fs", "--scale", "2000", "--dir", str(tmp_path / "root"),
                        "--instances", "2", "--window", "2", "--rescan-seconds", "0.5", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import json

    report = json.loads(r.stdout)
    assert report["chunks"] == 2000 and report["open_with_snapshot"]["snapshot"] is True
    assert report["open_without_snapshot"]["snapshot"] is False
    assert report["open_with_snapshot"]["first_hit_s"] is not None and report["lookup_keys_per_s"] > 0
    assert report["lookup_small_keys_per_s"] > 0 and report["lookup_baseline_keys_per_s"] > 0
    (steady,) = report["steady"]
    assert steady["instances"] == 2 and [p["cleaner"] for p in steady["per_instance"]].count(True) == 1
    assert steady["projected_entries_per_s"] > 0
    assert "projected at 10,000,000 chunks x 100 instances" in r.stderr


def test_a_key_lookups_found_lately_answers_miss_once_removed(tmp_path):
    """Lookups answer recently found keys from a small set in front of the table: every
    removal (a drop, an eviction, a listing that finds the file gone) takes the key out."""
    e = Env(str(tmp_path), slot_bytes=SLOT)
    try:
        t = e.open(max_bytes=2 * FILE, rescan_seconds=3600.0)
        assert t.scanned.wait(30)
        assert e.store(t, [b"a"]).ok and e.store(t, [b"b"]).ok
        assert resolve(t, [b"a", b"b"]) == [Lookup.HIT, Lookup.HIT] and b"a" in t.index.hot
        assert e.store(t, [b"c"]).ok  # evicts "a", the least recently used
        assert resolve(t, [b"a"]) == [Lookup.MISS]
        os.unlink(t.path(b"b"))  # removed by hand: the next listing of its directory notices
        t._scan_once(clean=False, full=False)
        assert b"b" not in t.index.hot and resolve(t, [b"b"]) == [Lookup.MISS]
        assert resolve(t, [b"c"]) == [Lookup.HIT]
    finally:
        e.close()
