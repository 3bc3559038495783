"""The fs tier under sustained churn: what the index keeps about dropped keys is bounded in
memory and costs the same per drop after 10 evictions or 100 000 (issue 36 item 1), and
``kvtiers fs churn`` measures the store rate after many evictions."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner
from kvtiers_fs import drops, index
from kvtiers_fs.drops import DropRing
from kvtiers_fs.index import Index
from kvtiers_fs.keytable import dir_of, fingerprints

from kvtiers.commands.cli import cli
from kvtiers.registry import get_registry


def _drop_rate(idx: Index, tag: bytes) -> float:
    """Adds and drops per second of CPU time, the best of five rounds of 2000: the other test
    worker and the machine's load slow single rounds down, never the best one much."""
    best = 0.0
    for r in range(5):
        t0 = time.process_time()
        for i in range(2000):
            k = b"%s-%d-%d" % (tag, r, i)
            idx.add(k)
            idx.drop(k)
        best = max(best, 2000 / max(time.process_time() - t0, 1e-6))
    return best


def test_a_drop_costs_the_same_after_a_hundred_thousand_and_memory_stays_bounded():
    idx = Index(negative_ttl=3600.0, file_bytes=10)  # MISSes remembered an hour: nothing expires
    early = _drop_rate(idx, b"early")
    for i in range(100_000):
        idx.add(b"k-%d" % i)
        idx.drop(b"k-%d" % i)
    late = _drop_rate(idx, b"late")
    # the old dict of dropped fingerprints rebuilt itself on every drop past 65 536 entries
    assert late >= 0.3 * early, f"{late:.0f} drops/s after 100k drops, {early:.0f} at first"
    assert len(idx.dropped) == drops.CAPACITY and isinstance(idx.dropped, DropRing)
    assert idx.dropped.fp.nbytes + idx.dropped.at.nbytes == 16 * drops.CAPACITY
    assert len(idx.absent) <= index.ABSENT_KEYS
    assert b"late-4-1999" in idx.absent  # the latest drops are still remembered as MISSes


def test_keys_probed_absent_and_never_asked_again_stay_bounded():
    # a soak's lookups probe keys of other processes that are gone by the time they could be
    # asked again: those "unread" MISSes must not pin memory for good (RSS grew 1.57x in 10 min)
    idx = Index(negative_ttl=3600.0, file_bytes=10)
    for i in range(0, 300_000, 1000):
        idx.mark_absent([b"gone-%d" % j for j in range(i, i + 1000)])
    assert len(idx.absent) <= index.ABSENT_KEYS and idx.absent.unread_count() <= index.ABSENT_KEYS
    assert idx.absent.is_unread(b"gone-299999")  # the newest are still answered MISS without a probe


def test_the_ring_answers_the_drops_since_a_stamp_and_says_when_it_lost_some():
    ring = DropRing(4)
    assert ring.since(0.0) == (pytest.approx(np.zeros(0)), True)
    for i in range(3):
        ring.add(100 + i, float(i))
    got, complete = ring.since(1.0)
    assert sorted(got.tolist()) == [101, 102] and complete
    for i in range(3, 7):
        ring.add(100 + i, float(i))
    got, complete = ring.since(3.0)  # 3, 4, 5, 6: all still there
    assert sorted(got.tolist()) == [103, 104, 105, 106] and complete
    got, complete = ring.since(2.0)  # 2 was overwritten
    assert sorted(got.tolist()) == [103, 104, 105, 106] and not complete


def test_a_listing_never_brings_back_a_dropped_key_even_when_the_ring_overflowed():
    """More keys dropped during a listing than the ring remembers: the merge keeps only keys
    it knew, and asks for the directories to be listed again (new keys come at the next pass)."""
    idx = Index(negative_ttl=1.0, file_bytes=10)
    idx.dropped = DropRing(8)
    dropped_keys = [b"gone-%d" % i for i in range(20)]
    for k in dropped_keys + [b"known"]:
        idx.add(k)
    started = idx.stamp()  # the listing begins, and sees every file
    for k in dropped_keys:
        idx.drop(k)
    listed = dropped_keys + [b"known", b"new"]
    fps = fingerprints(listed)
    dirs = {dir_of(int(f)) for f in fps}
    idx.merge_listing(dirs, fps, np.full(len(fps), 1.0), started)
    assert [k in idx for k in listed] == [False] * 20 + [True, False]
    assert idx.relist == dirs
    # a later listing that began after the drops trusts what it finds
    idx.relist.clear()
    idx.merge_listing(dirs, fingerprints([b"known", b"new"]), [1.0, 2.0], idx.stamp())
    assert b"new" in idx and not idx.relist


def test_a_stepped_back_wall_clock_does_not_make_old_drops_look_recent(monkeypatch):
    """Drops and listings are stamped by the index's own increasing clock: after the wall
    clock steps back an hour, keys dropped before are listed again as soon as they return."""
    idx = Index(negative_ttl=1.0, file_bytes=10)
    keys = [b"evicted-%d" % i for i in range(30)]
    for k in keys:
        idx.add(k)
        idx.drop(k)
    real = time.time

    class Stepped:  # the index's wall clock, an hour back (its monotonic clock unchanged)
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def time() -> float:
            return real() - 3600

    monkeypatch.setattr(index, "time", Stepped)
    fps = fingerprints(keys)  # another instance stored them again
    idx.merge_listing({dir_of(int(f)) for f in fps}, fps, np.full(len(fps), real()), idx.stamp())
    assert all(k in idx for k in keys) and idx.used == 300


def test_kvtiers_fs_churn_prints_the_rates_and_their_ratio(tmp_path):
    get_registry().add_commands(cli)
    res = CliRunner().invoke(cli, ["fs", "churn", "--dir", str(tmp_path), "--evictions", "400", "--first", "100",
                                   "--window", "256", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["evictions"] >= 400 and out["rate_after_first"] > 0 and out["rate_after_last"] > 0
    assert out["ratio"] == pytest.approx(out["rate_after_last"] / out["rate_after_first"], rel=0.01)
    assert out["dropped_ring_bytes"] == 16 * drops.CAPACITY
    res = CliRunner().invoke(cli, ["fs", "churn", "--evictions", "10", "--first", "20"])
    assert res.exit_code != 0 and "need 0 < first (20) < evictions (10)" in res.output
