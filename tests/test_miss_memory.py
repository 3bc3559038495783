"""The MISS memory of the fs tier's index and of :class:`kvtiers.misscache.MissCache` (AsyncTier,
p2p) holds the same memory after 10 thousand MISSes as after 138 thousand (issue 36: the fs
soak's RSS grew 1.5x in 10 minutes, driven by a dict of evicted keys that refilled and was
halved, and by probed keys never asked again that stayed in it), and still answers as before:
a remembered MISS until it expires, a probe's MISS at least once, a stored key never."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import kvtiers_fs.index as fs_index
import pytest
from kvtiers_fs.index import Index
from kvtiers_fs.keytable import fingerprint

import kvtiers.misscache as misscache
from kvtiers.misscache import MissCache, MissTable, miss_fingerprint
from kvtiers.types import Lookup

_HELD_BY = (str(Path(fs_index.__file__)), str(Path(misscache.__file__)))
SLACK = 64 << 10  # bytes: a few small lists the methods keep in flight


def _held() -> int:
    """Bytes allocated by the index and the MISS table that are still held."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f) for f in _HELD_BY])
    return sum(s.size for s in snap.statistics("filename"))


def _soak_steps(idx: Index, first: int, steps: int) -> None:
    """The soak's pattern on the index alone: each step stores 64 fresh keys, evicts the 64
    oldest, and a probe finds 16 keys of an old step absent that nobody asks again."""
    for s in range(first, first + steps):
        keys = [b"soak-%d" % (s * 64 + i) for i in range(64)]
        for k in keys:
            idx.reserve(8, None, k)
            idx.commit(k, 8)
        for i in range(64):
            idx.drop(b"soak-%d" % ((s - 4) * 64 + i))
        idx.mark_absent([b"other-%d" % (s * 16 + i) for i in range(16)])


def test_the_fs_index_holds_the_same_memory_after_138k_evictions_as_after_10k():
    idx = Index(negative_ttl=3600.0, file_bytes=8)  # nothing expires: only the bound limits it
    tracemalloc.start()
    try:
        _soak_steps(idx, 4, 160)  # 10k evictions
        early = _held()
        _soak_steps(idx, 164, 2000)  # 128k more evictions, 32k never-asked-again probed MISSes
        late = _held()
    finally:
        tracemalloc.stop()
    # the dict of evicted keys held up to 65,536 keys (bytes and a float each, ~10 MiB with its
    # table) and grew again after each halving; the table is 1.1 MiB, allocated once
    assert late <= early + SLACK, f"{late - early} more bytes held after 138k evictions"
    assert idx.absent.nbytes == 17 * fs_index.ABSENT_KEYS
    assert len(idx.absent) <= fs_index.ABSENT_KEYS and idx.absent.unread_count() <= fs_index.ABSENT_KEYS
    assert len(idx) == 256 and idx.used == 256 * 8
    # the newest MISSes are still remembered, the newest probed ones still unanswered
    assert b"soak-%d" % (2160 * 64 - 1) in idx.absent and idx.absent.is_unread(b"other-%d" % (2164 * 16 - 1))


def test_the_fs_index_answers_misses_as_before():
    idx = Index(negative_ttl=0.0, file_bytes=8)
    idx.mark_absent([b"probed"])  # ttl 0: expired at once, still answered once
    idx.add(b"there")
    idx.mark_absent([b"there"])  # a probe that raced with a store: the store wins
    idx.drop(b"evicted")
    now = 1e12
    assert idx.absent.answer([b"probed", b"there", b"evicted", b"never"], now).tolist() == [True, False, False, False]
    assert idx.absent.answer([b"probed"], now).tolist() == [False]  # answered: the next lookup probes again
    idx.drop(b"evicted-later")
    idx.add(b"evicted-later")  # stored again: no MISS
    assert b"evicted-later" not in idx.absent and b"evicted" in idx.absent
    idx2 = Index(negative_ttl=3600.0, file_bytes=8)
    idx2.drop(b"gone")
    assert idx2.absent.answer([b"gone"], 0.0).tolist() == [True]  # within the ttl: MISS, again and again
    assert idx2.absent.answer([b"gone"], 0.0).tolist() == [True]
    assert miss_fingerprint(b"gone") == fingerprint(b"gone")  # one fingerprint for the index and its MISSes


def test_a_miss_table_never_grows_and_forgets_the_oldest_first():
    t = MissTable(1024)
    arrays = (t.fp, t.until, t.unread)
    for i in range(100_000):
        t.add(b"k-%d" % i, float(i), unread=i % 3 == 0)
    assert (t.fp, t.until, t.unread) == arrays and t.nbytes == 17 * 1024  # the same arrays: no reallocation
    assert len(t) <= t.capacity == 1024
    assert all(b"k-%d" % i in t for i in range(99_980, 100_000))  # forgotten only after ~capacity newer ones
    assert not any(b"k-%d" % i in t for i in range(80_000, 90_000))  # 10 times capacity newer ones
    assert t.pop(b"k-99999") == 99999.0 and b"k-99999" not in t and t.pop(b"k-99999", -1.0) == -1.0
    assert t.unread_count() == sum(t.is_unread(b"k-%d" % i) for i in range(0, 100_000, 3)) > 0
    with pytest.raises(ValueError, match="at least 4 slots"):
        MissTable(2)


def test_the_async_tiers_miss_cache_is_bounded_and_answers_as_before():
    mc = MissCache(4096)
    for i in range(300_000):  # evictions or probes of keys never asked again: unbounded before
        mc.missing(b"gone-%d" % i, 100.0)
    assert len(mc.absent) <= 4096 and mc.absent.nbytes == 17 * 4096
    out, probe = mc.answer([b"gone-299999", b"stored", b"new"], lambda k: k == b"stored", now=200.0)
    assert out == [Lookup.MISS, Lookup.HIT, Lookup.RETRY] and probe == [b"new"]  # expired, answered once
    out, probe = mc.answer([b"gone-299999", b"new"], lambda k: False, now=200.0)
    assert out == [Lookup.RETRY, Lookup.RETRY] and probe == [b"gone-299999"]  # "new" is being probed already
    mc.probing.discard(b"new")
    mc.missing(b"new", 300.0)
    out, _ = mc.answer([b"new", b"new"], lambda k: False, now=250.0)
    assert out == [Lookup.MISS, Lookup.MISS]  # within its ttl
    mc.present(b"new")
    assert mc.answer([b"new"], lambda k: False, now=250.0)[0] == [Lookup.RETRY]
