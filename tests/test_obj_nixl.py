"""The obj tier's NIXL data path (``backend: "nixl"``) against a real SeaweedFS server: the
same object layout and format as the aiobotocore path in both directions, corrupt, short,
long and missing objects through NIXL, write-once, a stopped server failing keys within
``op_timeout``, and ``kvtiers bench obj --backend both``. Skipped where nixl-cu12 is absent
(``pip install 'kvtiers[nixl]'``); the clear error without it is tested everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from kvtiers_obj import layout
from kvtiers_obj.nixl_path import nixl_available
from s3_fixture import BUCKET, fill, load_damaged, make_ctx, open_obj, options_for, run_job, s3, wait_jobs

from kvtiers import Job, TierError

pytest_plugins = ["s3_fixture"]

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="nixl-cu12 not installed: pip install 'kvtiers[nixl]' (torch pinned)"
)


def test_backend_nixl_without_nixl_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)  # import fails as if absent
    with pytest.raises(TierError, match=r"nixl-cu12.*pip install 'kvtiers\[nixl\]'"):
        open_obj(make_ctx(), {"bucket": "never-contacted", "backend": "nixl"})


@needs_nixl
@pytest.mark.parametrize("slot_bytes,part_size", [(64 << 10, 5 << 20), (6 << 20, 5 << 20)], ids=["one-get", "ranged"])
def test_each_backend_reads_what_the_other_wrote(s3_server, slot_bytes, part_size):
    opts = options_for(s3_server, part_size=part_size)
    ctx_a, ctx_n = make_ctx(4, slot_bytes), make_ctx(4, slot_bytes)
    a = open_obj(ctx_a, dict(opts, backend="aiobotocore"))
    n = open_obj(ctx_n, dict(opts, backend="nixl"))
    try:
        by_a = [fill(ctx_a, i, 10 + i) for i in range(2)]
        assert run_job(a, True, [b"a0", b"a1"], [0, 1]).ok
        by_n = [fill(ctx_n, 2 + i, 20 + i) for i in range(2)]
        assert run_job(n, True, [b"n0", b"n1"], [2, 3], job_id=2).ok
        # NIXL's object is byte for byte the documented format
        name = layout.object_name(opts["prefix"], ctx_n.namespace.digest, b"n0")
        body = s3(s3_server, "get_object", Bucket=BUCKET, Key=name)["Body"]
        assert body == by_n[0] + layout.make_trailer(b"n0", by_n[0], ctx_n.namespace.digest)
        for ctx in (ctx_a, ctx_n):
            for i in range(4):
                ctx.arena[i][:] = b"\xee" * slot_bytes
        r = run_job(n, False, [b"a0", b"a1", b"absent"], [0, 1, 2], job_id=3)
        assert r.failed_keys == (b"absent",) and r.error == "missing"
        assert [bytes(ctx_n.arena[i]) for i in range(2)] == by_a
        assert run_job(a, False, [b"n0", b"n1"], [2, 3], job_id=4).ok
        assert [bytes(ctx_a.arena[i]) for i in (2, 3)] == by_n
    finally:
        a.close()
        n.close()


@needs_nixl
@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum"),
        (lambda b: b[:-1000], "magic|bytes"),  # ends inside the payload: the trailer is pattern
        (lambda b: b[:-10], "checksum|another key|namespace|magic|bytes"),  # a torn trailer
        (lambda b: b + b"extra", "longer"),
        (lambda b: b + b"\0" * 100, "longer"),
    ],
    ids=["bitflip", "short", "torn-trailer", "long", "much-longer"],
)
def test_corrupt_object_through_nixl_is_a_failed_key(s3_server, damage, why):
    removed = []
    ctx = make_ctx(removed=removed)
    opts = options_for(s3_server, backend="nixl")
    h = open_obj(ctx, opts)
    try:
        name, r = load_damaged(s3_server, h, ctx, opts["prefix"], damage)
        assert r.failed_keys == (b"c",)
        assert r.error.startswith("CorruptChunk") and any(w in r.error for w in why.split("|")), r.error
        assert removed == [((b"c",), "corrupt")]
        with pytest.raises(Exception, match="404|Not Found"):
            s3(s3_server, "head_object", Bucket=BUCKET, Key=name)
        assert run_job(h, True, [b"c"], [0], job_id=3).ok  # stored again through NIXL
        assert run_job(h, False, [b"c"], [1], job_id=4).ok
        assert bytes(ctx.arena[1]) == bytes(ctx.arena[0])
    finally:
        h.close()


@needs_nixl
def test_nixl_store_is_write_once(s3_server):
    opts = options_for(s3_server)
    ctx_a, ctx_n = make_ctx(), make_ctx()
    a = open_obj(ctx_a, opts)
    n = open_obj(ctx_n, dict(opts, backend="nixl"))
    try:
        first = fill(ctx_a, 0, 1)
        assert run_job(a, True, [b"w"], [0]).ok
        name = layout.object_name(opts["prefix"], ctx_a.namespace.digest, b"w")
        etag = s3(s3_server, "head_object", Bucket=BUCKET, Key=name)["ETag"]
        fill(ctx_n, 0, 2)  # other bytes under the same key: not uploaded again
        assert run_job(n, True, [b"w"], [0]).ok
        assert s3(s3_server, "head_object", Bucket=BUCKET, Key=name)["ETag"] == etag
        assert run_job(n, False, [b"w"], [1], job_id=2).ok and bytes(ctx_n.arena[1]) == first
    finally:
        a.close()
        n.close()


@needs_nixl
def test_paused_server_fails_nixl_keys_within_op_timeout(s3_fault_server):
    """NIXL cannot abort a posted GET; the key still fails at ``op_timeout`` and the slot is
    left alone (the transfer finishes into quarantined staging once the server is back)."""
    srv = s3_fault_server
    fast = {"connect_timeout": 1.0, "read_timeout": 1.0, "max_attempts": 2, "op_timeout": 2.0}
    ctx = make_ctx()
    h = open_obj(ctx, options_for(srv, backend="nixl", **fast))
    try:
        want = fill(ctx, 0, 1)
        assert run_job(h, True, [b"k0"], [0]).ok
        ctx.arena[2][:] = b"\xee" * ctx.arena.slot_bytes
        srv.pause()
        try:
            t0 = time.monotonic()
            h.submit_load(Job(2, (b"k0",), (2,)))
            got = wait_jobs(h, [2], timeout=30)
            assert got[2].failed_keys == (b"k0",) and "timed out" in got[2].error
            assert time.monotonic() - t0 < 10
        finally:
            srv.resume()
        time.sleep(1.0)  # let the abandoned GET land in staging, if it is going to
        assert bytes(ctx.arena[2]) == b"\xee" * ctx.arena.slot_bytes  # the slot was not touched
        assert run_job(h, False, [b"k0"], [2], job_id=3, timeout=60).ok and bytes(ctx.arena[2]) == want
    finally:
        h.close()


@needs_nixl
def test_bench_obj_backend_both(s3_server):
    cfg = json.dumps(options_for(s3_server))
    cmd = [sys.executable, "-m", "kvtiers.commands", "bench", "obj", "--config", cfg, "--json", "--backend", "both",
           "--rounds", "3", "--chunks", "4", "--chunk-bytes", str(256 << 10)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # NIXL's own log lines must not reach stdout
    rows = {(x["op"], x["backend"]): x for x in report["results"]}
    assert set(rows) == {(op, b) for op in ("store", "load") for b in ("aiobotocore", "nixl")}
    for x in rows.values():
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0 and len(x["round_gbps"]) == 3
        assert abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 0.01 * x["ratio"] + 1e-3
    for op in ("store", "load"):  # one baseline per op, shared by both rows
        assert rows[(op, "nixl")]["baseline_gbps"] == rows[(op, "aiobotocore")]["baseline_gbps"]
