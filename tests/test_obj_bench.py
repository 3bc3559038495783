"""``kvtiers bench obj`` (and ``bench tier obj``): tiny runs against the fixture server, JSON
in the bench shape, the aiobotocore baseline interleaved, everything written removed."""

from __future__ import annotations

import json
import subprocess
import sys

from s3_fixture import options_for, s3

pytest_plugins = ["s3_fixture"]


def _left(srv, opts: dict) -> list[str]:
    listed = s3(srv, "list_objects_v2", Bucket=opts["bucket"], Prefix=opts["prefix"] + "/")
    return [o["Key"] for o in listed.get("Contents", []) if not o["Key"].endswith("config.json")]


def test_bench_obj_json_shape(s3_server):
    cfg = json.dumps(options_for(s3_server))
    cmd = [sys.executable, "-m", "kvtiers.commands", "bench", "obj", "--config", cfg, "--json",
           "--rounds", "3", "--chunks", "4", "--chunk-bytes", str(256 << 10), "--no-concurrency"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["tier"] == "obj" and report["baseline"].startswith("aiobotocore put_object")
    ops = {x["op"]: x for x in report["results"]}
    assert set(ops) == {"store", "load"}
    for x in ops.values():
        assert x["chunk_bytes"] == 256 << 10 and x["chunks"] == 4
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 0.01 * x["ratio"] + 1e-3
        assert len(x["round_gbps"]) == len(x["baseline_round_gbps"]) == 3
        assert x["baseline_parallel"] == 16  # the tier's max_concurrency
    # the bench removed what it wrote: only the namespace document is left
    assert _left(s3_server, json.loads(cfg)) == []


def test_bench_tier_obj_by_concurrency(s3_server):
    opts = options_for(s3_server, max_concurrency=4)
    cmd = [sys.executable, "-m", "kvtiers.commands", "bench", "tier", "obj", "--config", json.dumps(opts), "--json",
           "--rounds", "1", "--chunks", "4", "--chunk-bytes", "64K", "--concurrency", "2x2"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    conc = {x["op"]: x for x in report["concurrency"]}
    assert set(conc) == {"store", "load"}
    for x in conc.values():
        assert (x["jobs"], x["keys_per_job"], x["in_flight"]) == (2, 2, 4)
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0 and x["baseline_parallel"] == 4
    assert report["lookup"][0]["hits"] == report["lookup"][0]["batch"]
    assert _left(s3_server, opts) == []


def test_bench_obj_needs_a_config():
    cmd = [sys.executable, "-m", "kvtiers.commands", "bench", "obj"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--config" in (r.stdout + r.stderr)
