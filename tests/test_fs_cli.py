"""``kvtiers fs inspect``, ``kvtiers fs gc`` and ``kvtiers bench fs``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from kvtiers_fs import layout
from kvtiers_fs.cli import parse_size
from test_fs_helpers import SLOT, Env, chunk_files

from kvtiers import Namespace
from kvtiers.commands.cli import cli
from kvtiers.registry import get_registry

FILE = layout.file_bytes(SLOT)
NS2 = Namespace({"model": "other"})


@pytest.fixture(scope="module")
def run():
    get_registry().add_commands(cli)
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture
def root(tmp_path):
    """A root with two namespaces: 5 chunks with known ages in the first, 2 in the second."""
    r = str(tmp_path / "kv")
    a, b = Env(r), Env(r, ns=NS2)
    ta, tb = a.open(), b.open()
    keys = [b"c%d" % i for i in range(5)]
    assert a.store(ta, keys).ok and b.store(tb, [b"x", b"y"]).ok
    now = time.time()
    for i, k in enumerate(keys):  # c0 oldest ... c4 newest
        os.utime(ta.path(k), (now - 1000 + i, now - 1000 + i))
    a.close()
    b.close()
    return r


def test_parse_size():
    assert parse_size("1048576") == 1 << 20
    assert parse_size("4MiB") == parse_size("4M") == 4 << 20
    assert parse_size("1.5G") == 3 << 29
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_inspect_lists_namespaces(run, root):
    res = run("fs", "inspect", root)
    assert res.exit_code == 0, res.output
    d1 = Env(root).ctx.namespace.digest
    assert f"namespace {d1}" in res.output and f"namespace {NS2.digest}" in res.output
    assert '"model": "other"' in res.output
    doc = json.loads(run("fs", "inspect", root, "--json").output)
    by = {n["digest"]: n for n in doc["namespaces"]}
    assert by[d1]["chunks"] == 5 and by[d1]["bytes"] == 5 * FILE
    assert by[NS2.digest]["chunks"] == 2 and by[NS2.digest]["fields"] == {"model": "other"}
    assert by[d1]["oldest"] < by[d1]["newest"]
    assert run("fs", "inspect", os.path.join(root, "nope")).exit_code != 0


def test_gc_max_bytes_removes_least_recently_used_first(run, root):
    d1 = Env(root).ctx.namespace.digest
    res = run("fs", "gc", root, "--namespace", d1, "--max-bytes", 3 * FILE, "--dry-run")
    assert res.exit_code == 0 and "would remove 2 item(s)" in res.output
    assert len(chunk_files(root)) == 7
    res = run("fs", "gc", root, "--namespace", d1, "--max-bytes", 3 * FILE)
    assert res.exit_code == 0, res.output
    names = {os.path.basename(p) for p in chunk_files(root)}
    assert b"c0".hex() + ".bin" not in names and b"c1".hex() + ".bin" not in names
    assert b"c2".hex() + ".bin" in names and len(names) == 5
    res = run("fs", "gc", root, "--max-bytes", 0)  # every namespace
    assert res.exit_code == 0 and chunk_files(root) == []


def test_gc_drop_namespace_and_errors(run, root):
    res = run("fs", "gc", root, "--namespace", NS2.digest, "--drop")
    assert res.exit_code == 0, res.output
    assert not os.path.exists(os.path.join(root, NS2.digest))
    assert len(chunk_files(root)) == 5
    assert run("fs", "gc", root, "--drop").exit_code != 0
    res = run("fs", "gc", root, "--namespace", "0123456789abcdef", "--drop")
    assert res.exit_code != 0 and "no namespace" in res.output


def test_gc_removes_stale_temporary_files_only(run, root):
    d = os.path.dirname(chunk_files(root)[0])
    stale = os.path.join(d, f"{b'z'.hex()}.1@elsewhere.00000000.tmp")
    fresh = os.path.join(d, f"{b'z'.hex()}.1@elsewhere.00000001.tmp")
    for p in (stale, fresh):
        open(p, "wb").close()
    os.utime(stale, (time.time() - 7200,) * 2)
    res = run("fs", "gc", root)
    assert res.exit_code == 0 and "stale temporary file" in res.output
    assert not os.path.exists(stale) and os.path.exists(fresh)
    assert len(chunk_files(root)) == 7


def test_bench_json_shape(run, tmp_path):
    d = tmp_path / "bench"
    res = run("bench", "fs", "--config", json.dumps({"root_dir": str(d), "n_read_threads": 2, "n_write_threads": 2}),
              "--chunk-bytes", "64K", "--total-bytes", "1M", "--rounds", 3, "--no-concurrency", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    ops = {(r["op"], r["chunk_bytes"]) for r in doc["results"]}
    assert ops == {("store", 65536), ("load", 65536)}
    for r in doc["results"]:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=1e-2)
        assert len(r["round_gbps"]) == 3 and r["baseline_parallel"] == 2  # the tier's threads
    assert doc["lookup"][0]["keys_per_s"] > 0 and doc["lookup"][0]["batch"] == 1000
    assert {s["op"] for s in doc["submit_latency_us"]} == {"store", "load"}
    assert doc["baseline"].startswith("raw pwritev/preadv")
    assert chunk_files(str(d)) == [] and chunk_files(str(d), ".tmp") == []  # cleans up after itself


def test_commands_through_the_installed_script(root):
    exe = shutil.which("kvtiers", path=os.path.dirname(sys.executable))
    assert exe, "kvtiers script not installed next to the interpreter"
    out = subprocess.run([exe, "fs", "inspect", root, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["namespaces"]) == 2
    out = subprocess.run([exe, "bench", "fs", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--chunk-bytes" in out.stdout
