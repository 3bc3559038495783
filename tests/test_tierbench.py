"""``kvtiers bench tier``: one harness for any tier (memory, fs, the SQLite example, a
third-party tier installed from outside the repository), its raw baselines, ``--plot``, and
the progress helper it reports through. (obj: tests/test_obj_bench.py.)"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers.commands.progress import Progress

TINY = ["--chunk-bytes", "64K", "--chunks", "8", "--rounds", "3", "--concurrency", "1x1", "--concurrency", "2x4",
        "--lookup-batch", "100"]


def kvtiers(*args: str, path: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvtiers.commands", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def check_shape(doc: dict, tier: str, with_baseline: bool) -> None:
    assert doc["tier"] == tier
    rows = {(r["op"], r["chunk_bytes"]) for r in doc["results"]}
    assert rows == {("store", 65536), ("load", 65536)}
    conc = {(r["op"], r["jobs"], r["keys_per_job"]) for r in doc["concurrency"]}
    assert conc == {(op, j, k) for op in ("store", "load") for j, k in ((1, 1), (2, 4))}
    for r in doc["results"] + doc["concurrency"]:
        assert r["gbps"] > 0 and len(r["round_gbps"]) == 3
        if with_baseline:
            assert r["baseline_gbps"] > 0 and len(r["baseline_round_gbps"]) == 3
            assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=0.02)
        else:
            assert r["baseline_gbps"] is None and r["ratio"] is None
    (lk,) = doc["lookup"]
    assert lk["hits"] == lk["batch"] == 100 and lk["keys_per_s"] > 0
    assert {s["op"] for s in doc["submit_latency_us"]} == {"store", "load"}
    for s in doc["submit_latency_us"]:
        assert 0 < s["median"] <= s["p99"] <= s["max"]


def test_memory_tier_json_without_baseline():
    r = kvtiers("bench", "tier", "memory", *TINY, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # --json: no progress lines
    doc = json.loads(r.stdout)
    check_shape(doc, "memory", with_baseline=False)
    assert doc["baseline"] is None


def test_fs_tier_table_progress_plot_and_cleanup(tmp_path):
    root = tmp_path / "kv"
    png = tmp_path / "fs.png"
    cfg = json.dumps({"root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2})
    r = kvtiers("bench", "tier", "fs", "--config", cfg, *TINY, "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "raw pwritev/preadv" in r.stdout and "ratio" in r.stdout
    assert "plot written to" in r.stdout
    # not a terminal: one plain progress line per step on stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bench fs ")]
    assert len(lines) == 3 + 1 + 2 and lines[0].startswith("bench fs 1/6: chunk 65536 round 1/3")
    assert "\r" not in r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    left = [p for p in root.rglob("*") if p.is_file() and p.name != "config.json"]
    assert left == []  # the tier's chunks and the baseline's files are gone


def test_fs_alias_is_the_same_harness(tmp_path):
    cfg = json.dumps({"root_dir": str(tmp_path / "kv"), "n_read_threads": 2, "n_write_threads": 2})
    r = kvtiers("bench", "fs", "--config", cfg, *TINY, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_shape(doc, "fs", with_baseline=True)
    assert doc["baseline"].startswith("raw pwritev/preadv")
    for row in doc["results"]:
        assert row["baseline_parallel"] == 2  # the tier's thread counts


def test_variants_are_measured_in_the_same_rounds_against_one_baseline(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    root = tmp_path / "kv"
    cfg = json.dumps({"root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2})
    enc = json.dumps({"encrypt": {"key_file": str(key)}})
    r = kvtiers("bench", "tier", "fs", "--config", cfg, *TINY, "--no-concurrency", "--variant", "plain=",
                "--variant", f"encrypted={enc}", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    by = {(row["op"], row["variant"]): row for row in doc["results"]}
    assert set(by) == {(op, v) for op in ("store", "load") for v in ("plain", "encrypted")}
    for op in ("store", "load"):  # one baseline, the same for both variants
        assert by[(op, "plain")]["baseline_round_gbps"] == by[(op, "encrypted")]["baseline_round_gbps"]
        assert by[(op, "encrypted")]["gbps"] > 0
    # a variant's options reach the tier: a key file of the wrong size is refused, naming it
    short = tmp_path / "short"
    short.write_bytes(b"12345")
    short.chmod(0o600)
    r = kvtiers("bench", "tier", "fs", "--config", cfg, *TINY, "--no-concurrency", "--variant", "plain={}",
                "--variant", "bad=" + json.dumps({"encrypt": {"key_file": str(short)}}))
    assert r.returncode != 0 and str(short) in r.stderr and "Traceback" not in r.stderr, r.stderr
    for bad, why in ((["--variant", "x"], "NAME=JSON"), (["--variant", "x=[1]"], "object of tier options"),
                     (["--variant", "x={", "--variant", "y={}"], "not JSON"),
                     (["--variant", "x={}", "--variant", "x={}"], "given twice")):
        r = kvtiers("bench", "tier", "fs", "--config", cfg, *TINY, *bad)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sqlite_example_without_config_uses_a_scratch_instance():
    r = kvtiers("bench", "tier", "sqlite", *TINY, "--no-concurrency", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["tier"] == "sqlite" and doc["concurrency"] == [] and len(doc["results"]) == 2


THIRD_PARTY = '''
"""A third-party tier, installed from outside the repository: chunks as files, plus a raw baseline."""
import os

import kvtiers
from kvtiers import Baseline


class DirTier(kvtiers.AsyncTier):
    def __init__(self, ctx, *, path: str):
        super().__init__(ctx)
        self.dir = os.path.join(path, ctx.namespace.digest)
        os.makedirs(self.dir, exist_ok=True)

    def _p(self, key):
        return os.path.join(self.dir, key.hex())

    async def exists(self, key):
        return os.path.exists(self._p(key))

    async def put(self, key, data):
        with open(self._p(key), "wb") as f:
            f.write(data)

    async def get_into(self, key, out):
        try:
            with open(self._p(key), "rb") as f:
                return f.readinto(out) == len(out)
        except FileNotFoundError:
            return False

    async def delete(self, key):
        os.remove(self._p(key))
        self.forget([key])

    @classmethod
    def bench_baseline(cls, tier, chunk_bytes):
        raw = tier.dir + "-raw"
        os.makedirs(raw, exist_ok=True)
        written = []

        def put(key, data):
            written.append(key)
            with open(os.path.join(raw, key.hex()), "wb") as f:
                f.write(data)

        def get(key, out):
            with open(os.path.join(raw, key.hex()), "rb") as f:
                f.readinto(out)

        def close(tier_keys):
            for k in written:
                os.remove(os.path.join(raw, k.hex()))
            os.rmdir(raw)

        return Baseline("plain open/write/readinto", put, get, concurrency=4, close=close)


@kvtiers.hookimpl
def register_tiers(register):
    register("dirtier", DirTier)
'''


def test_third_party_tier_installed_outside_the_repo_with_its_baseline(tmp_path):
    site = tmp_path / "site"
    (site / "dirtier_plugin").mkdir(parents=True)
    (site / "dirtier_plugin" / "__init__.py").write_text(THIRD_PARTY)
    info = site / "dirtier_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dirtier-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvtiers]\ndirtier = dirtier_plugin\n")
    data = tmp_path / "data"
    r = kvtiers("bench", "tier", "dirtier", "--config", json.dumps({"path": str(data)}), *TINY, "--json", path=site)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    check_shape(doc, "dirtier", with_baseline=True)
    assert doc["baseline"] == "plain open/write/readinto"
    assert all(r["baseline_parallel"] <= 4 for r in doc["results"] + doc["concurrency"])
    # the baseline removed its files; the tier's keys were deleted through AsyncTier.delete
    assert [p for p in data.rglob("*") if p.is_file()] == []


def test_errors_are_one_line():
    r = kvtiers("bench", "tier", "no-such-tier")
    assert r.returncode != 0 and "no-such-tier" in r.stderr and "Traceback" not in r.stderr
    r = kvtiers("bench", "tier", "memory", "--chunk-bytes", "1000")
    assert r.returncode == 2 and "multiple of 4096" in r.stderr
    r = kvtiers("bench", "tier", "memory", "--concurrency", "4by16")
    assert r.returncode == 2 and "JOBSxKEYS" in r.stderr


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_lines_elsewhere_nothing_when_quiet():
    tty = _Tty()
    with Progress(4, "work", file=tty) as bar:
        bar.advance(note="one")
        bar.note("halfway")
        bar.advance(3)
    out = tty.getvalue()
    assert "\r" in out and "[" + "#" * 6 in out and "4/4" in out and "work: halfway\n" in out
    assert out.endswith("\n")
    plain = io.StringIO()
    with Progress(2, "work", file=plain) as bar:
        bar.advance(note="a")
        bar.advance(note="b")
    assert plain.getvalue() == "work 1/2: a\nwork 2/2: b\n"
    quiet = _Tty()
    with Progress(2, "work", file=quiet, quiet=True) as bar:
        bar.advance()
        bar.note("x")
    assert quiet.getvalue() == ""


def test_a_failing_tier_or_baseline_stops_the_run_with_its_reason():
    from kvtiers.commands.bench.harness import Baseline, run_tier_bench
    from kvtiers.memory import MemoryTier

    # room for one chunk of two: the first is evicted by the second, its load fails
    with pytest.raises(RuntimeError, match=r"tier 'memory' load failed for 1 key\(s\)"):
        run_tier_bench("memory", {"max_bytes": 4096}, chunk_sizes=[4096], chunks=2, rounds=1, concurrency=())

    class BrokenBaseline(MemoryTier):
        @classmethod
        def bench_baseline(cls, tier, chunk_bytes):
            def get(key, out):
                raise OSError("disk on fire")

            return Baseline("broken", lambda key, data: None, get)

    with pytest.raises(RuntimeError, match="baseline 'broken' load failed: OSError: disk on fire"):
        run_tier_bench(BrokenBaseline, {}, chunk_sizes=[4096], chunks=2, rounds=1, concurrency=())


def test_progress_clear_and_bar_only():
    from kvtiers.commands.progress import bar_only

    tty = _Tty()
    bar = Progress(2, "work", file=tty)
    bar.advance()
    bar.clear()  # the caller prints a line of its own now
    assert tty.getvalue().endswith("\r\x1b[2K")
    bar.close()
    assert not tty.getvalue().endswith("\n")  # nothing drawn since the clear: no line to end
    plain = io.StringIO()
    b = bar_only(2, "work", file=plain)
    b.advance(note="x")
    b.clear()
    b.close()
    assert plain.getvalue() == ""  # not a terminal: the command's own lines are enough
    tty2 = _Tty()
    b = bar_only(2, "work", file=tty2)
    b.advance()
    assert "1/2" in tty2.getvalue()


def on_terminal(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``kvtiers ARGS`` with stderr on a pseudo-terminal; return (rc, stdout, stderr)."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "kvtiers.commands", *args], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    got = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child is gone
            break
        if not data:
            break
        got.append(data)
    out, _ = p.communicate(timeout=timeout)
    os.close(master)
    return p.returncode, out.decode(), b"".join(got).decode(errors="replace")


def test_long_commands_draw_a_bar_on_a_terminal(tmp_path):
    from kvtiers_conformance import all_checks

    from kvtiers import Arena, Job, Namespace, TierContext, open_tier

    rc, out, err = on_terminal("bench", "tier", "memory", "--chunk-bytes", "64K", "--chunks", "4", "--rounds", "1",
                               "--no-concurrency", "--lookup-batch", "10")
    assert rc == 0 and "kvtiers bench tier memory" in out
    assert "\r" in err and "bench memory [" in err and "2/2" in err
    n = len(all_checks())
    rc, out, err = on_terminal("conformance", "memory", "--seed", "1", "--examples", "3")
    assert rc == 0 and "summary: PASSED" in out
    assert "conformance memory [" in err and f"{n}/{n}" in err
    root = tmp_path / "kv"  # one namespace with one chunk
    h = open_tier("fs", {"root_dir": str(root)}, TierContext(Arena.allocate(1, 4096), Namespace({"m": 1})))
    h.submit_store(Job(1, (b"k",), (0,)))
    while not h.get_finished_jobs():
        pass
    h.close()
    rc, out, err = on_terminal("fs", "gc", str(root))
    assert rc == 0 and "removed 0 item(s)" in out
    assert "fs gc [" in err and "1/1" in err and "1 chunks" in err
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "fs", "gc", str(root)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == ""  # not a terminal: only the command's own lines
