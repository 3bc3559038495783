"""``kvtiers bench obj``: a tiny run against the fixture server, JSON in the bench shape."""

from __future__ import annotations

import json
import subprocess
import sys

from s3_fixture import options_for, s3

pytest_plugins = ["s3_fixture"]


def test_bench_obj_json_shape(s3_server):
    cfg = json.dumps(options_for(s3_server))
    cmd = [sys.executable, "-m", "kvtiers.cli", "bench", "obj", "--config", cfg, "--json",
           "--rounds", "3", "--chunks", "4", "--chunk-bytes", str(256 << 10)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    ops = {x["op"]: x for x in report["results"]}
    assert set(ops) == {"store", "load"}
    for x in ops.values():
        assert x["chunk_bytes"] == 256 << 10
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 0.01 * x["ratio"] + 1e-3
        assert len(x["rounds_gbps"]) == len(x["rounds_baseline_gbps"]) == 3
    opts = json.loads(cfg)  # the bench removed what it wrote: only the namespace document is left
    listed = s3(s3_server, "list_objects_v2", Bucket=opts["bucket"], Prefix=opts["prefix"] + "/")
    left = [o["Key"] for o in listed.get("Contents", []) if not o["Key"].endswith("config.json")]
    assert left == []


def test_bench_obj_needs_a_config():
    cmd = [sys.executable, "-m", "kvtiers.cli", "bench", "obj"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--config" in (r.stdout + r.stderr)
