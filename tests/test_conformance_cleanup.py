"""Friendly defaults of the suite (issue 11 item 6): a tier with no required option and no
``conformance_config`` runs with ``{}``; what a run stored in a location the caller named is
removed afterwards unless ``--keep``; an evicted key is never called never-stored."""

from __future__ import annotations

import json
import os
import pathlib
import sqlite3
import subprocess
import sys

import pytest
from broken_tiers import ZombieLoadTier
from kvtiers_conformance import Limits, run_conformance

from kvtiers import ConfigError
from kvtiers.memory import MemoryTier

TESTS = pathlib.Path(__file__).parent
FAST = Limits(finish_s=5.0, examples=5, shrink=False)


class PlainTier(MemoryTier):
    """The memory tier without conformance_config: every option has a default."""

    conformance_config = None


class NeedsRootTier(MemoryTier):
    conformance_config = None

    def __init__(self, ctx, *, root_dir: str, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)


def test_no_config_and_no_required_option_runs_with_empty_options() -> None:
    report = run_conformance(PlainTier, None, levels="core", rules=[2], limits=FAST, seed=1)
    assert report.status(2) == "PASS", [r.line() for r in report.rules()]
    with pytest.raises(ConfigError, match="needs option.s. root_dir and has no conformance_config"):
        run_conformance(NeedsRootTier, None, rules=[2], limits=FAST)


def _tree(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_files_stored_under_a_named_directory_are_removed_unless_keep(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    (root / "mine.txt").write_text("the user's file")
    report = run_conformance("fs", {"root_dir": str(root)}, levels="core,durable", rules=[2], limits=FAST, seed=2)
    assert not report.failed and not report.notes
    assert _tree(root) == {"mine.txt"}  # the namespace directory and its chunks are gone
    report = run_conformance("fs", {"root_dir": str(root)}, levels="core", rules=[2], limits=FAST, seed=2, keep=True)
    assert len(_tree(root)) > 10  # kept: chunk files under the namespace directory


def _rows(db: pathlib.Path) -> int:
    con = sqlite3.connect(db)
    try:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE name LIKE 'chunks_%'")]
        return sum(con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)
    finally:
        con.close()


def test_a_new_database_file_is_removed_and_keys_in_an_existing_one_deleted(tmp_path: pathlib.Path) -> None:
    """The sqlite tier: a path that did not exist goes with its -wal/-shm siblings; in a file
    that existed, the keys the suite stored are deleted through AsyncTier.delete."""
    new = tmp_path / "new.sqlite3"
    report = run_conformance("sqlite", {"path": str(new)}, levels="core", rules=[2, 7], limits=FAST, seed=3)
    assert not report.failed and not report.notes
    assert os.listdir(tmp_path) == []
    old = tmp_path / "old.sqlite3"
    con = sqlite3.connect(old)
    con.execute("CREATE TABLE chunks_user (key BLOB PRIMARY KEY, crc INTEGER, data BLOB)")
    con.execute("INSERT INTO chunks_user VALUES (x'01', 0, x'00')")
    con.commit()
    con.close()
    report = run_conformance("sqlite", {"path": str(old)}, levels="core", rules=[2, 7], limits=FAST, seed=3)
    assert not report.failed and not report.notes
    assert _rows(old) == 1  # only the user's row: every key the suite stored was deleted


def test_cli_keep(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    base = [sys.executable, "-m", "kvtiers.commands", "conformance", "fs",
            "--level", "bounded", "--seed", "4"]
    for keep, left in ((["--keep"], True), ([], False)):
        root = tmp_path / f"kv{len(keep)}"
        p = subprocess.run([*base, "--config", json.dumps({"root_dir": str(root)}), *keep],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert (root.exists() and any(root.rglob("*.bin"))) is left, (keep, _tree(root) if root.exists() else None)


def test_an_evicted_key_is_never_called_never_stored() -> None:
    report = run_conformance(ZombieLoadTier, {}, levels="bounded", rules=[11], limits=FAST, seed=5)
    failed = [r for r in report.results if r.status == "FAIL"]
    assert failed and all("evicted key" in r.why and "never" not in r.why for r in failed), [r.why for r in failed]


def test_obj_conformance_cleanup_leaves_nothing_of_the_suite_and_keeps_the_rest(tmp_path: pathlib.Path) -> None:
    """Issue 27: a run with --config on a real S3 server (SeaweedFS) leaves none of the
    suite's objects, through ObjTier.conformance_cleanup; an object of another namespace
    under the same prefix stays."""
    s3_fixture = pytest.importorskip("s3_fixture")
    if not s3_fixture.HAVE_WEED:
        pytest.skip("SeaweedFS 'weed' not installed")
    from kvtiers_obj.seaweed import SeaweedServer
    from tier_helpers import wait_job

    from kvtiers import Arena, Job, Namespace, TierContext, open_tier

    srv = SeaweedServer(tmp_path / "weed")
    srv.start()
    try:
        opts = s3_fixture.options_for(srv)
        user = open_tier("obj", opts, TierContext(Arena.allocate(2, 4096), Namespace({"model": "mine"})))
        user.submit_store(Job(1, (b"keep-me",), (0,)))
        assert wait_job(user, 1).ok
        user.close()

        def names() -> list[str]:
            r = s3_fixture.s3(srv, "list_objects_v2", Bucket=s3_fixture.BUCKET, Prefix=opts["prefix"] + "/")
            return [o["Key"] for o in r.get("Contents", [])]

        mine = set(names())
        report = run_conformance("obj", opts, levels="core,shared", rules=[2, 7], limits=FAST, seed=9)
        assert not report.failed and not report.notes, (report.summary(), report.notes)
        assert set(names()) == mine, sorted(set(names()) - mine)[:5]  # the suite's are gone, the user's stay
    finally:
        srv.stop()
