"""obj tier against a real SeaweedFS server: round trips, the documented layout, multipart
and ranged reads, write-once, integrity, namespaces, capacity, open-time errors."""

from __future__ import annotations

import json
import time

import psutil
import pytest
import xxhash
from kvtiers_obj import layout
from s3_fixture import BUCKET, fill, load_damaged, make_ctx, open_obj, resolve, run_job, s3

from kvtiers import ConfigError, Job, Lookup, TierError

pytest_plugins = ["s3_fixture"]


def test_round_trip_exact_bytes_and_lookup(obj_options):
    ctx = make_ctx()
    h = open_obj(ctx, obj_options)
    try:
        keys = [b"a", b"a/b", b"..", b"\x00" * 64]
        want = [fill(ctx, i, i) for i in range(4)]
        r = run_job(h, True, keys, range(4))
        assert r.ok and r.nbytes == 4 * ctx.arena.slot_bytes
        assert h.lookup(keys) == [Lookup.HIT] * 4
        for i in range(4, 8):
            ctx.arena[i][:] = b"\xee" * ctx.arena.slot_bytes
        r = run_job(h, False, keys + [b"nope"], [4, 5, 6, 7, 0], job_id=2)
        assert r.failed_keys == (b"nope",) and "missing" in r.error
        for i in range(4):
            assert bytes(ctx.arena[4 + i]) == want[i]
        assert resolve(h, [b"nope"]) == [Lookup.MISS]
    finally:
        h.close()


def test_objects_follow_documented_layout_and_format(s3_server, obj_options):
    ctx = make_ctx(namespace={"model": "layout-test"})
    h = open_obj(ctx, obj_options)
    try:
        data = fill(ctx, 0, 7)
        assert run_job(h, True, [b"k/1"], [0]).ok
    finally:
        h.close()
    digest = ctx.namespace.digest
    name = layout.object_name(obj_options["prefix"], digest, b"k/1")
    assert name.startswith(f"{obj_options['prefix']}/{digest}/") and name.endswith(b"k/1".hex() + ".bin")
    body = s3(s3_server, "get_object", Bucket=BUCKET, Key=name)["Body"]
    assert len(body) == len(data) + 40 and body[: len(data)] == data
    t = body[len(data) :]
    assert t[:8] == b"KVTOBJ02" and int.from_bytes(t[8:16], "little") == len(data)
    assert t[32:40] == bytes.fromhex(digest)
    assert int.from_bytes(t[16:24], "little") == xxhash.xxh3_64_intdigest(data)
    cfg = s3(s3_server, "get_object", Bucket=BUCKET, Key=layout.config_name(obj_options["prefix"], digest))["Body"]
    ctx.namespace.check_document(cfg)


def test_multipart_store_and_ranged_load(s3_server, obj_options):
    ctx = make_ctx(num_slots=2, slot_bytes=11 << 20)
    h = open_obj(ctx, dict(obj_options, part_size=5 << 20))
    try:
        want = fill(ctx, 0, 3)
        assert run_job(h, True, [b"big"], [0]).ok
        ctx.arena[1][:] = bytes(ctx.arena.slot_bytes)
        assert run_job(h, False, [b"big"], [1], job_id=2).ok
        assert bytes(ctx.arena[1]) == want
    finally:
        h.close()
    name = layout.object_name(obj_options["prefix"], ctx.namespace.digest, b"big")
    head = s3(s3_server, "head_object", Bucket=BUCKET, Key=name)
    assert head["ContentLength"] == layout.object_size(11 << 20)
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 1 MiB and the trailer
    ups = s3(s3_server, "list_multipart_uploads", Bucket=BUCKET, Prefix=obj_options["prefix"])
    assert not ups.get("Uploads")


def test_write_once_skips_present_chunks(obj_options):
    ctx = make_ctx()
    h1 = open_obj(ctx, obj_options)
    h2 = open_obj(ctx, obj_options)
    try:
        fill(ctx, 0, 1)
        assert run_job(h1, True, [b"x"], [0]).ok
        puts = []
        orig = h2.tier._client.put_object

        async def counting_put(**kw):
            puts.append(kw["Key"])
            return await orig(**kw)

        h2.tier._client.put_object = counting_put  # count uploads, change nothing
        assert run_job(h2, True, [b"x"], [0]).ok  # found by HEAD: not uploaded
        assert run_job(h2, True, [b"x"], [0], job_id=2).ok  # known: not even a HEAD
        assert run_job(h2, True, [b"y"], [0], job_id=3).ok
        assert len(puts) == 1 and puts[0].endswith(b"y".hex() + ".bin")
    finally:
        h1.close()
        h2.close()


def test_second_instance_reads_after_close(obj_options):
    ctx = make_ctx()
    h = open_obj(ctx, obj_options)
    want = fill(ctx, 0, 11)
    assert run_job(h, True, [b"durable"], [0]).ok
    h.close()
    h2 = open_obj(ctx, obj_options)
    try:
        assert h2.lookup([b"durable"]) == [Lookup.RETRY]  # not known yet: probed off-thread
        assert resolve(h2, [b"durable"]) == [Lookup.HIT]
        assert run_job(h2, False, [b"durable"], [1]).ok and bytes(ctx.arena[1]) == want
    finally:
        h2.close()


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum"),
        (lambda b: b[:-1000], "bytes"),
        (lambda b: b + b"extra", "bytes"),
    ],
    ids=["bitflip", "short", "long"],
)
def test_corrupt_object_fails_is_deleted_and_reported(s3_server, obj_options, damage, why):
    removed = []
    ctx = make_ctx(removed=removed)
    h = open_obj(ctx, obj_options)
    try:
        name, r = load_damaged(s3_server, h, ctx, obj_options["prefix"], damage)
        assert r.failed_keys == (b"c",) and why in r.error
        assert removed == [((b"c",), "corrupt")]
        with pytest.raises(Exception, match="404|Not Found"):
            s3(s3_server, "head_object", Bucket=BUCKET, Key=name)
        assert resolve(h, [b"c"]) == [Lookup.MISS]
        assert run_job(h, True, [b"c"], [0], job_id=3).ok  # can be stored again
        assert run_job(h, False, [b"c"], [1], job_id=4).ok
    finally:
        h.close()


def test_object_under_another_keys_name_is_corrupt(s3_server, obj_options):
    ctx = make_ctx(removed=[])
    h = open_obj(ctx, obj_options)
    try:
        fill(ctx, 0, 5)
        assert run_job(h, True, [b"a"], [0]).ok
        d, p = ctx.namespace.digest, obj_options["prefix"]
        body = s3(s3_server, "get_object", Bucket=BUCKET, Key=layout.object_name(p, d, b"a"))["Body"]
        s3(s3_server, "put_object", Bucket=BUCKET, Key=layout.object_name(p, d, b"b"), Body=body)
        r = run_job(h, False, [b"b"], [1], job_id=2)
        assert r.failed_keys == (b"b",) and "another key" in r.error
    finally:
        h.close()


def test_namespace_mismatch_is_an_error_at_open(s3_server, obj_options):
    ctx = make_ctx(namespace={"model": "m1"})
    open_obj(ctx, obj_options).close()
    name = layout.config_name(obj_options["prefix"], ctx.namespace.digest)
    doc = ctx.namespace.document()
    doc["fields"] = {"model": "m2"}
    s3(s3_server, "put_object", Bucket=BUCKET, Key=name, Body=json.dumps(doc).encode())
    with pytest.raises(ConfigError, match="different description"):
        open_obj(ctx, obj_options)


def test_missing_bucket_without_create_bucket(obj_options):
    opts = dict(obj_options, bucket="no-such-bucket-here", create_bucket=False)
    with pytest.raises(ConfigError, match="does not exist.*create_bucket"):
        open_obj(make_ctx(), opts)


def test_unreachable_endpoint_is_a_bounded_error(obj_options):
    from kvtiers_obj.seaweed import free_ports

    port = free_ports(1)[0]
    opts = dict(obj_options, endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1, connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(TierError, match="cannot reach"):
        open_obj(make_ctx(), opts)
    assert time.monotonic() - t0 < 30


def test_endpoint_override_alias_and_bad_options(obj_options):
    opts = dict(obj_options)
    opts["endpoint_override"] = opts.pop("endpoint_url")
    open_obj(make_ctx(), opts).close()
    with pytest.raises(ConfigError, match="part_size"):
        open_obj(make_ctx(), dict(obj_options, part_size=1 << 20))
    with pytest.raises(ConfigError, match="both"):
        open_obj(make_ctx(), dict(obj_options, aws_access_key_id="x"))
    with pytest.raises(ConfigError, match="unknown option"):
        open_obj(make_ctx(), dict(obj_options, bukket="x"))


def test_max_bytes_evicts_lru_and_reports(s3_server, obj_options):
    removed = []
    ctx = make_ctx(removed=removed)
    size = layout.object_size(ctx.arena.slot_bytes)
    h = open_obj(ctx, dict(obj_options, max_bytes=3 * size))
    try:
        for i, k in enumerate([b"k0", b"k1", b"k2"]):
            fill(ctx, i, i)
            assert run_job(h, True, [k], [i], job_id=i).ok
        assert run_job(h, False, [b"k0"], [5], job_id=10).ok  # k0 is now the most recent
        h.touch([b"k1"])  # and k1 after it: k2 is the oldest
        fill(ctx, 3, 3)
        assert run_job(h, True, [b"k3"], [3], job_id=11).ok
        assert removed == [((b"k2",), "evicted")]
        assert resolve(h, [b"k0", b"k1", b"k2", b"k3"]) == [Lookup.HIT, Lookup.HIT, Lookup.MISS, Lookup.HIT]
        assert not run_job(h, False, [b"k2"], [5], job_id=12).ok
    finally:
        h.close()
    # a new instance learns the stored chunks from a listing and keeps the bound
    removed.clear()
    h = open_obj(ctx, dict(obj_options, max_bytes=3 * size))
    try:
        fill(ctx, 4, 4)
        assert run_job(h, True, [b"k4"], [4], job_id=13).ok
        assert len(removed) == 1 and removed[0][1] == "evicted"
        listed = s3(s3_server, "list_objects_v2", Bucket=BUCKET, Prefix=obj_options["prefix"] + "/")
        chunks = [o for o in listed.get("Contents", []) if o["Key"].endswith(".bin")]
        assert len(chunks) == 3
    finally:
        h.close()


def test_chunk_larger_than_max_bytes_fails(obj_options):
    ctx = make_ctx()
    h = open_obj(ctx, dict(obj_options, max_bytes=1000))
    try:
        r = run_job(h, True, [b"k"], [0])
        assert r.failed_keys == (b"k",) and "max_bytes" in r.error
    finally:
        h.close()


def test_close_leaves_no_sockets(s3_server, obj_options):
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    me = psutil.Process()

    def conns():
        return [c for c in me.net_connections("tcp") if c.raddr and c.raddr.port == port]

    ctx = make_ctx()
    h = open_obj(ctx, obj_options)
    fill(ctx, 0, 0)
    ids = []
    for j in range(8):
        h.submit_store(Job(j, (f"s{j}".encode(),), (j,)))
        ids.append(j)
    h.close()  # waits for the jobs
    assert len(h.get_finished_jobs()) == 8
    deadline = time.monotonic() + 5
    while conns() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conns() == []
