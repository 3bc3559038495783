"""``kvtiers bench tier TYPE --soak``: short soaks of the fs tier (one process, and two on one
root) and the memory tier: every interval stores and loads, the backend stays within the
bound, fds and threads do not grow; a tier loading wrong bytes fails the soak; bad options
are one-line errors. No wall-clock asserts: rates only have to be above zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
FD_MARGIN = 3
THREAD_MARGIN = 2


def kvtiers(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvtiers.commands", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def soak(*args: str) -> dict:
    r = kvtiers("bench", "tier", *args, "--json")
    assert r.returncode == 0, r.stderr + r.stdout[-2000:]
    assert r.stderr == ""  # --json: no progress, no rows on stderr
    return json.loads(r.stdout)


def check_rows(doc: dict, processes: int, intervals: int) -> None:
    """Every interval stored and loaded, nothing failed or came back wrong, and no process's
    open fds or threads grew past a small margin from the first interval to the last."""
    rows = doc["intervals"]
    assert doc["processes"] == processes and len(rows) == intervals
    assert [r["i"] for r in rows] == list(range(intervals))
    for r in rows:
        assert r["stored"] > 0 and r["loaded"] > 0, r
        assert r["store_failed"] == 0 and r["wrong"] == 0, (r, doc["errors"])
        assert r["lookups"] > 0 and r["lookup_keys_per_s"] > 0
        assert len(r["rss"]) == len(r["fds"]) == len(r["threads"]) == processes
        assert all(x > 0 for x in r["rss"] + r["fds"] + r["threads"])
    for p in range(processes):
        assert rows[-1]["fds"][p] <= rows[0]["fds"][p] + FD_MARGIN, [r["fds"] for r in rows]
        assert rows[-1]["threads"][p] <= rows[0]["threads"][p] + THREAD_MARGIN, [r["threads"] for r in rows]
    s = doc["summary"]
    assert s["stored"] == sum(r["stored"] for r in rows) and s["store_ratio"] > 0 and s["load_ratio"] > 0
    assert len(s["rss_growth"]) == processes


def test_fs_one_process_stays_within_its_bound(tmp_path):
    root = tmp_path / "kv"
    bound = 4 << 20  # 60 files of 64 KiB + the 4 KiB trailer: every job of 15 keys evicts
    png = tmp_path / "soak.png"
    doc = soak("fs", "--config", json.dumps({"root_dir": str(root)}), "--soak", "20s", "--interval", "4s",
               "--max-bytes", str(bound), "--plot", str(png))
    check_rows(doc, 1, 5)
    assert doc["bound_bytes"] == bound and doc["keys_per_job"] == 16
    assert doc["summary"]["load_failed"] == 0  # the previous job is always within the bound
    assert doc["summary"]["evicted"] > 0
    for r in doc["intervals"]:
        # process 0 walks the namespace between its steps: with one process nothing is in flight,
        # so the chunk files are within max_bytes exactly (slack 0, docs/bench.md#soak)
        assert r["fs"]["temp_bytes"] == 0
        assert 0 < r["backend_bytes"] <= bound, r["fs"]
        assert r["evictions_per_s"] > 0 and r["removed_by_reason"].get("evicted", 0) > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_fs_two_processes_on_one_root(tmp_path):
    root = tmp_path / "kv"
    bound = 4 << 20
    doc = soak("fs", "--config", json.dumps({"root_dir": str(root), "rescan_seconds": 1}), "--soak", "20s",
               "--interval", "4s", "--processes", "2", "--max-bytes", str(bound))
    check_rows(doc, 2, 5)
    # the bound is shared and only the cleaner evicts: reported, not asserted (docs/fs.md says
    # how far the others may take it past max_bytes)
    assert all(r["backend_bytes"] > 0 and r["fs"]["files"] > 0 for r in doc["intervals"])
    assert doc["summary"]["evicted"] > 0


def test_memory_one_process_and_the_table(tmp_path):
    bound = 2 << 20
    doc = soak("memory", "--soak", "12s", "--interval", "3s", "--max-bytes", str(bound))
    check_rows(doc, 1, 4)
    assert doc["summary"]["load_failed"] == 0
    assert "ctx.removed" in doc["backend"]
    for r in doc["intervals"]:
        assert 0 < r["backend_bytes"] <= bound  # stored minus reported removals: exact for this tier
        assert r["evictions_per_s"] > 0
    r = kvtiers("bench", "tier", "memory", "--soak", "4s", "--interval", "2s", "--chunk-bytes", "16K")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("kvtiers bench tier memory --soak 4s: 1 process(es), 16 KiB chunks")
    assert lines[2].split()[:3] == ["t", "s", "store"]
    assert len([ln for ln in lines if ln.lstrip()[:1].isdigit()]) >= 2  # a row per interval (and the totals)
    assert any(ln.startswith("last/first interval: store ") for ln in lines)
    assert any(ln.startswith("RSS MiB ") for ln in lines)


def test_sigterm_ends_the_soak_and_its_processes_cleanly(tmp_path):
    """Stopped in its first interval, the soak's processes finish their step and close the
    tier: none is left running, and no temporary file of a store is left behind."""
    import psutil

    root = tmp_path / "kv"
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "kvtiers.commands", "bench", "tier", "fs", "--config",
                             json.dumps({"root_dir": str(root)}), "--soak", "120s", "--interval", "2s",
                             "--processes", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.lstrip()[:1].isdigit():  # the first row: both processes are storing
                break
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2
        proc.terminate()
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert list(root.rglob("*.tmp")) == []
    assert list(root.rglob("*.bin"))  # it did store


def test_wrong_bytes_fail_the_soak():
    r = kvtiers("bench", "tier", "broken_tiers:BitFlipTier", "--soak", "3s", "--interval", "1s",
                "--chunk-bytes", "8K")
    assert r.returncode != 0
    assert "load(s) returned bytes that were not the ones stored" in r.stderr
    assert "wrong" in r.stdout  # the rows say so too


def test_bad_options_are_errors_naming_what_was_wrong():
    cases = [
        (("memory", "--soak", "0s"), "a duration must be > 0"),
        (("memory", "--soak", "ten minutes"), "is not a duration"),
        (("memory", "--soak", "4s", "--processes", "2"), "does not claim the 'shared' level"),
        (("memory", "--processes", "2"), "--processes goes with --soak"),
        (("memory", "--soak", "4s", "--max-bytes", "64K"), "must hold at least 4 chunks"),
        (("broken_tiers:DirTier", "--soak", "4s"), "takes no max_bytes option"),
    ]
    for args, want in cases:
        r = kvtiers("bench", "tier", *args, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert want in r.stderr.strip().splitlines()[-1], (args, r.stderr)  # click's usage error, or one line
