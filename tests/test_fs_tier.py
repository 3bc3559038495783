"""The fs tier on a real directory: layout, round trips, lookup, pools, close."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
from kvtiers_fs import FsTier, direct, layout
from test_fs_helpers import SLOT, Env, chunk_files, open_fds, pattern, resolve, tier_threads, two_envs, wait_for

import kvtiers
from kvtiers import Arena, Job, Lookup, Namespace, TierContext

HIT, MISS, RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY


def test_registered_by_entry_point_and_opens_with_root_dir_only(tmp_path):
    info = kvtiers.get_registry().tier_info("fs")
    assert info.cls is FsTier and info.origin == "entry point fs"
    assert info.levels == {"core", "durable", "shared", "bounded"}
    ctx = TierContext(Arena.allocate(2, SLOT))
    handle = kvtiers.open_tier("fs", {"root_dir": str(tmp_path / "kv")}, ctx)
    try:
        handle.submit_store(Job(1, (b"a",), (0,)))
        wait_for(lambda: handle.backlog() == 0, what="store")
        assert resolve(handle, [b"a"]) == [HIT]
    finally:
        handle.close()
    with pytest.raises(kvtiers.ConfigError, match="n_read_threads"):
        kvtiers.open_tier("fs", {"root_dir": str(tmp_path), "n_read_threads": "8"}, ctx)


def test_layout_config_json_and_file_format(env):
    t = env.open()
    key = b"\x00/../key"
    assert env.store(t, [key]).ok
    nsdir = os.path.join(env.root, env.ctx.namespace.digest)
    doc = json.loads(open(os.path.join(nsdir, "config.json")).read())
    assert doc == {"kvtiers_namespace": 1, "digest": env.ctx.namespace.digest, "fields": env.ctx.namespace.fields}
    h1, h2 = layout.key_dirs(key)
    path = os.path.join(nsdir, h1, h2, key.hex() + ".bin")
    assert chunk_files(env.root) == [path]
    raw = open(path, "rb").read()
    assert len(raw) == SLOT + 4096 and raw[:SLOT] == pattern(key)
    trailer = memoryview(bytearray(raw[SLOT:]))
    ns = layout.namespace_tag(env.ctx.namespace.digest)
    assert raw[SLOT + 112 : SLOT + 120] == ns and raw[SLOT + 8 : SLOT + 12] == (2).to_bytes(4, "little")
    assert layout.check_trailer(trailer, key, SLOT, ns) == layout.data_digest(memoryview(raw[:SLOT]))
    with pytest.raises(ValueError, match="different key"):
        layout.check_trailer(trailer, b"other", SLOT, ns)
    with pytest.raises(ValueError, match="another namespace"):
        layout.check_trailer(trailer, key, SLOT, bytes(8))


def test_namespace_with_a_different_description_is_an_error_at_open(env):
    env.open().close()
    cfg = os.path.join(env.root, env.ctx.namespace.digest, "config.json")
    doc = json.loads(open(cfg).read())
    doc["fields"] = {"model": "something else"}
    open(cfg, "w").write(json.dumps(doc))
    with pytest.raises(ValueError, match="different description"):
        env.open()


def test_round_trip_exact_bytes_and_lookup(env):
    t = env.open()
    keys = [b"k%d" % i for i in range(20)]
    r = env.store(t, keys)
    assert r.ok and r.nbytes == 20 * SLOT and r.seconds > 0
    assert t.lookup(keys) == [HIT] * 20
    slots = list(range(20, 40)) if len(env.arena) >= 40 else list(range(12, 32))[:20]
    r = env.load(t, keys[: len(slots)], slots)
    assert r.ok and r.nbytes == len(slots) * SLOT
    env.check(keys[: len(slots)], slots)
    assert resolve(t, [b"never stored"]) == [MISS]
    r = env.load(t, [b"never stored", keys[0]])
    assert r.failed_keys == (b"never stored",) and "not stored" in r.error
    env.check([keys[0]], [1])


def test_hostile_keys_stay_inside_the_root_and_never_alias(env):
    t = env.open()
    keys = [bytes([b]) for b in range(256)][:24] + [b"/", b"..", b"../..", b"\x00", b"a/b", b"ab", b"\xff" * 64]
    keys = list(dict.fromkeys(keys))
    for i in range(0, len(keys), 16):
        assert env.store(t, keys[i : i + 16]).ok
    files = chunk_files(os.path.dirname(env.root))
    assert len(files) == len(keys)
    assert all(f.startswith(os.path.join(env.root, env.ctx.namespace.digest) + os.sep) for f in files)
    for i in range(0, len(keys), 16):
        batch = keys[i : i + 16]
        assert env.load(t, batch).ok
        env.check(batch)


def test_existing_chunk_is_success_without_rewrite(env):
    t = env.open()
    assert env.store(t, [b"x"]).ok
    path = t.path(b"x")
    ino = os.stat(path).st_ino
    r = env.store(t, [b"x"])
    assert r.ok and r.nbytes == 0  # content-addressed: nothing moved
    assert os.stat(path).st_ino == ino
    assert chunk_files(env.root, ".tmp") == []


def test_two_instances_share_a_root(tmp_path):
    with two_envs(tmp_path) as (a, b):
        ta, tb = a.open(), b.open()
        keys = [b"shared-%d" % i for i in range(8)]
        assert tb.lookup(keys[:1]) == [RETRY]  # unknown: probed off-thread
        assert resolve(tb, keys[:1]) == [MISS]
        assert a.store(ta, keys).ok
        # b remembers the MISS of keys[0] for negative_ttl (1 s); files written by a appear after it
        assert resolve(tb, keys[1:]) == [HIT] * 7
        wait_for(lambda: tb.lookup(keys) == [HIT] * 8, timeout=5.0, what="b to see a's files")
        assert b.load(tb, keys).ok
        b.check(keys)
        # concurrent stores of the same keys by both leave one valid copy each
        same = [b"both-%d" % i for i in range(8)]
        a.fill(same, range(8))
        b.fill(same, range(8))
        ta.submit_store(Job(100, tuple(same), tuple(range(8))))
        tb.submit_store(Job(100, tuple(same), tuple(range(8))))
        wait_for(lambda: ta.backlog() == 0 and tb.backlog() == 0, what="stores")
        assert all(r.ok for r in ta.get_finished_jobs() + tb.get_finished_jobs())
        assert len([f for f in chunk_files(str(tmp_path)) if "626f7468" in f]) == 8
        assert a.load(ta, same).ok
        a.check(same)


def test_negative_ttl_zero_sees_other_instances_at_once(tmp_path):
    with two_envs(tmp_path) as (a, b):
        ta, tb = a.open(), b.open(negative_ttl=0.0)
        assert resolve(tb, [b"late"]) == [MISS]  # RETRY still resolves with no negative cache
        assert a.store(ta, [b"late"]).ok
        assert resolve(tb, [b"late"]) == [HIT]


def test_lookup_is_fast_and_does_no_io_on_the_callers_thread(env, monkeypatch):
    t = env.open()
    keys = [b"k%d" % i for i in range(16)]
    assert env.store(t, keys).ok
    batch = (keys * 63)[:1000]
    unknown = [b"u%d" % i for i in range(1000)]
    caller = threading.current_thread()
    calls = []
    real_stat, real_lstat = os.stat, os.lstat

    def watching(real):
        def stat(*a, **k):
            calls.append(threading.current_thread())
            return real(*a, **k)

        return stat

    monkeypatch.setattr(os, "stat", watching(real_stat))
    monkeypatch.setattr(os, "lstat", watching(real_lstat))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert t.lookup(batch) == [HIT] * 1000
        t.lookup(unknown)
        times.append(time.perf_counter() - t0)
    assert sorted(times)[2] < 0.05
    assert caller not in calls
    wait_for(lambda: t.lookup(unknown[:1]) != [RETRY], what="probes")
    assert calls and caller not in calls


def test_job_keys_spread_over_the_pool_and_loads_pass_blocked_stores(env, monkeypatch):
    t = env.open(n_write_threads=4, n_read_threads=2)
    keys = [b"s%d" % i for i in range(16)]
    seen = set()
    real_digest = layout.data_digest

    def digest(data):
        seen.add(threading.current_thread().name)
        return real_digest(data)

    monkeypatch.setattr(layout, "data_digest", digest)
    assert env.store(t, keys).ok
    assert len({n for n in seen if "-write-" in n}) > 1, seen

    gate = threading.Event()
    real_write = t._write

    def slow_write(*a):
        gate.wait(30)
        return real_write(*a)

    monkeypatch.setattr(t, "_write", slow_write)
    env.fill([b"blocked"], [31])
    t.submit_store(Job(900, (b"blocked",) * 1, (31,)))
    r = env.load(t, keys[:8], range(8, 16))  # loads finish while the store waits
    assert r.ok
    env.check(keys[:8], range(8, 16))
    assert t.backlog() == 1
    gate.set()
    wait_for(lambda: t.backlog() == 0, what="blocked store")
    assert [r.job_id for r in t.get_finished_jobs()] == [900]


def test_submit_errors_and_clean_close(tmp_path):
    before_fds = open_fds()
    e = Env(str(tmp_path))
    t = e.open()
    with pytest.raises(IndexError):
        t.submit_store(Job(1, (b"a",), (999,)))
    with pytest.raises(TypeError):
        t.submit_load("not a job")
    t.submit_store(Job(2, (), ()))
    e.fill([b"k%d" % i for i in range(32)], range(32))
    t.submit_store(Job(3, tuple(b"k%d" % i for i in range(32)), tuple(range(32))))
    t.close()  # waits for the accepted jobs
    results = {r.job_id: r for r in t.get_finished_jobs()}
    assert set(results) == {2, 3} and results[3].ok
    assert t.get_finished_jobs() == []
    with pytest.raises(ValueError, match="closed"):
        t.submit_store(Job(4, (b"a",), (0,)))
    # this tier's threads (named by its namespace): an unclosed tier of another test may still run
    tag = e.ctx.namespace.digest[:6]
    assert [th for th in tier_threads() if th.name.endswith(tag) or f"-{tag}-" in th.name] == []
    assert open_fds() <= before_fds
    assert chunk_files(str(tmp_path), ".tmp") == []
    assert len(chunk_files(str(tmp_path))) == 32


def test_buffered_fallback_warns_once_and_works(env, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & direct.O_DIRECT:
            raise OSError(22, "Invalid argument", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(direct, "_probed", {})
    monkeypatch.setattr(direct, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kvtiers.fs"):
        t1 = env.open()
        t2 = env.open()
    assert not t1.direct and not t2.direct
    assert sum("O_DIRECT unavailable" in r.message for r in caplog.records) == 1
    assert env.store(t1, [b"a", b"b"]).ok and env.load(t2, [b"a", b"b"]).ok
    env.check([b"a", b"b"])
    with pytest.raises(ValueError, match="direct=true"):
        env.open(direct=True)


def test_unaligned_arena_uses_buffered_io(tmp_path):
    buf = bytearray(SLOT * 4 + 8)
    arena = Arena(memoryview(buf)[8:], SLOT)
    ctx = TierContext(arena, Namespace({"unaligned": True}))
    t = FsTier(ctx, root_dir=str(tmp_path))
    try:
        assert not t.direct
        arena[0][:] = pattern(b"u")
        t.submit_store(Job(1, (b"u",), (0,)))
        wait_for(lambda: t.backlog() == 0, what="store")
        arena[1][:] = bytes(SLOT)
        t.submit_load(Job(2, (b"u",), (1,)))
        wait_for(lambda: t.backlog() == 0, what="load")
        assert all(r.ok for r in t.get_finished_jobs())
        assert bytes(arena[1]) == pattern(b"u")
    finally:
        t.close()


def test_fsync_option_round_trips(env):
    t = env.open(fsync=True)
    assert env.store(t, [b"durable"]).ok
    assert env.load(t, [b"durable"]).ok
    env.check([b"durable"])



def test_scan_never_brings_back_a_key_removed_while_it_ran():
    from kvtiers_fs.index import Index
    from kvtiers_fs.keytable import dir_of, fingerprint, fingerprints

    idx = Index(negative_ttl=1.0, file_bytes=10)
    started = time.time()  # the listing begins
    idx.add(b"stored-meanwhile")
    idx.drop(b"listed-then-removed")
    keys = [b"listed-then-removed", b"listed", b"stored-meanwhile"]
    fps = fingerprints(keys)
    idx.merge_listing({dir_of(int(f)) for f in fps}, fps, [1.0, 2.0, 3.0], started)
    assert [k in idx for k in keys] == [False, True, True] and idx.used == 20
    assert [fp for fp, _ in idx.victims(2)] == [fingerprint(b"listed"), fingerprint(b"stored-meanwhile")]
    assert b"listed-then-removed" in idx.absent
