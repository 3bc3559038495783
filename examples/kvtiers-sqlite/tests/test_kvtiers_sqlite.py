"""Tests of the sqlite example tier: the conformance suite, then what is particular to it."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kvtiers_conformance import TierTests

from kvtiers import Arena, Job, JobResult, Lookup, Namespace, TierContext, TierError, open_tier

SLOT = 4096


class TestSqliteConformance(TierTests):
    """Every check of the suite, at the levels the tier claims: core, durable, shared, bounded."""

    @pytest.fixture
    def tier_config(self, tmp_path: Path):
        return "sqlite", {"path": str(tmp_path / "kv.sqlite3")}


# -- direct tests --------------------------------------------------------------------


class Removals(list):
    def __call__(self, keys, reason) -> None:
        self.append((tuple(keys), reason))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sub" / "kv.sqlite3"


def ctx_for(fields: dict | None = None, removed=None) -> TierContext:
    return TierContext(Arena.allocate(8, SLOT), Namespace(fields or {"model": "m"}), removed=removed)


def wait(h, job_id: int, timeout: float = 20.0) -> JobResult:
    deadline = time.monotonic() + timeout
    while True:
        for r in h.get_finished_jobs():
            assert r.job_id == job_id
            return r
        assert time.monotonic() < deadline, f"job {job_id} not reported within {timeout} s"
        time.sleep(0.002)


def settle(h, keys: list[bytes], timeout: float = 20.0) -> list[Lookup]:
    deadline = time.monotonic() + timeout
    while Lookup.RETRY in (answers := h.lookup(keys)):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return answers


def store(h, key: bytes, data: bytes, job_id: int = 1) -> None:
    h.ctx.arena[0][:] = data
    h.submit_store(Job(job_id, (key,), (0,)))
    assert wait(h, job_id).ok


def test_round_trip_and_reopen(db: Path) -> None:
    data = bytes(range(256)) * (SLOT // 256)
    h = open_tier("sqlite", {"path": str(db)}, ctx_for())
    store(h, b"k", data)
    h.close()
    h2 = open_tier("sqlite", {"path": str(db)}, ctx_for())
    try:
        assert settle(h2, [b"k", b"other"]) == [Lookup.HIT, Lookup.MISS]
        h2.submit_load(Job(2, (b"k",), (3,)))
        assert wait(h2, 2).ok
        assert bytes(h2.ctx.arena[3]) == data
    finally:
        h2.close()


def test_stores_are_write_once(db: Path) -> None:
    h = open_tier("sqlite", {"path": str(db)}, ctx_for())
    try:
        store(h, b"k", b"\x01" * SLOT, 1)
        store(h, b"k", b"\x02" * SLOT, 2)  # succeeds, keeps the first copy
        h.submit_load(Job(3, (b"k",), (5,)))
        assert wait(h, 3).ok
        assert bytes(h.ctx.arena[5]) == b"\x01" * SLOT
    finally:
        h.close()


@pytest.mark.parametrize("damage", ["UPDATE {t} SET data = zeroblob(4096)", "UPDATE {t} SET data = substr(data, 1, 9)"])
def test_corrupt_or_truncated_chunk_is_a_failed_key_and_removed(db: Path, damage: str) -> None:
    removed = Removals()
    h = open_tier("sqlite", {"path": str(db)}, ctx_for(removed=removed))
    try:
        store(h, b"bad", b"\x07" * SLOT)
        with sqlite3.connect(db) as raw:  # another process damaging the file, say
            raw.execute(damage.format(t=h.tier.table))
        h.ctx.arena[4][:] = b"\xee" * SLOT
        h.submit_load(Job(2, (b"bad",), (4,)))
        r = wait(h, 2)
        assert r.failed_keys == (b"bad",)
        assert "corrupt" in r.error
        assert removed == [((b"bad",), "corrupt")]
        assert settle(h, [b"bad"]) == [Lookup.MISS]  # deleted, not served again
    finally:
        h.close()


def test_namespaces_are_separate_tables_in_one_file(db: Path) -> None:
    a = open_tier("sqlite", {"path": str(db)}, ctx_for({"model": "a"}))
    b = open_tier("sqlite", {"path": str(db)}, ctx_for({"model": "b"}))
    try:
        store(a, b"k", b"a" * SLOT)
        assert settle(b, [b"k"]) == [Lookup.MISS]
        assert a.tier.table != b.tier.table
    finally:
        a.close()
        b.close()
    with sqlite3.connect(db) as raw:
        docs = dict(raw.execute("SELECT digest, document FROM namespaces"))
    for fields in ({"model": "a"}, {"model": "b"}):
        ns = Namespace(fields)
        ns.check_document(docs[ns.digest])


def test_a_different_description_under_the_same_digest_is_refused_at_open(db: Path) -> None:
    open_tier("sqlite", {"path": str(db)}, ctx_for()).close()
    ns = Namespace({"model": "m"})
    forged = json.dumps({"kvtiers_namespace": 1, "digest": ns.digest, "fields": {"model": "forged"}})
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE namespaces SET document = ? WHERE digest = ?", (forged, ns.digest))
    with pytest.raises(TierError, match=f"namespace {ns.digest} holds a different description"):
        open_tier("sqlite", {"path": str(db)}, ctx_for())


def test_two_instances_share_one_file(db: Path) -> None:
    a = open_tier("sqlite", {"path": str(db)}, ctx_for())
    b = open_tier("sqlite", {"path": str(db)}, ctx_for())
    try:
        assert settle(b, [b"k"]) == [Lookup.MISS]
        store(a, b"k", b"\x42" * SLOT)
        deadline = time.monotonic() + 20
        while b.lookup([b"k"]) != [Lookup.HIT]:  # after its negative cache expires
            assert time.monotonic() < deadline
            time.sleep(0.01)
        b.submit_load(Job(9, (b"k",), (2,)))
        assert wait(b, 9).ok and bytes(b.ctx.arena[2]) == b"\x42" * SLOT
    finally:
        a.close()
        b.close()


def test_close_leaves_no_thread_and_no_connection(db: Path) -> None:
    h = open_tier("sqlite", {"path": str(db)}, ctx_for())
    store(h, b"k", b"\x01" * SLOT)
    h.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtiers-sqlite")]
    with pytest.raises(sqlite3.ProgrammingError):
        h.tier.db.execute("SELECT 1")


def test_path_is_required(db: Path) -> None:
    from kvtiers import ConfigError

    with pytest.raises(ConfigError, match="tier 'sqlite': missing required option 'path'"):
        open_tier("sqlite", {}, ctx_for())
    with pytest.raises(ConfigError, match="option 'busy_timeout' expects float"):
        open_tier("sqlite", {"path": str(db), "busy_timeout": "30"}, ctx_for())


def test_listed_by_kvtiers_tiers() -> None:
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "tiers"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = "sqlite\tkvtiers-sqlite\t0.1.0\tentry point sqlite\tlevels=bounded,core,durable,shared"
    assert line in r.stdout.splitlines()
