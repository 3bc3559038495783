"""obj tier hardening (issue 10 items 9 and 10, issue 11 item 3) against real SeaweedFS
servers: a chunk of another slot size on the same namespace is a miss left alone, an object
copied from another namespace is refused, timeouts name what timed out (at open, against a
socket that never answers, and on jobs, against a SIGSTOPped server), and
``conformance_corrupt`` damages a chunk so that its load fails."""

from __future__ import annotations

import socket
import time

import pytest
from kvtiers_obj import layout
from kvtiers_obj.tier import ObjTier
from s3_fixture import BUCKET, fill, make_ctx, open_obj, options_for, resolve, run_job, s3, wait_jobs

from kvtiers import Job, Lookup, TierError

pytest_plugins = ["s3_fixture"]


def _head(srv, name: str) -> dict:
    return s3(srv, "head_object", Bucket=BUCKET, Key=name)


# -- item 9: geometry and namespace -----------------------------------------------------------


def test_a_chunk_of_another_slot_size_is_a_miss_and_left_alone(s3_server, obj_options):
    removed_a, removed_b = [], []
    ctx_a = make_ctx(4, 64 << 10, removed=removed_a)
    ctx_b = make_ctx(4, 128 << 10, removed=removed_b)  # same namespace, twice the slot size
    a, b = open_obj(ctx_a, obj_options), open_obj(ctx_b, obj_options)
    try:
        want = fill(ctx_a, 0, 1)
        assert run_job(a, True, [b"k"], [0]).ok
        name = layout.object_name(obj_options["prefix"], ctx_a.namespace.digest, b"k")
        etag = _head(s3_server, name)["ETag"]
        assert resolve(b, [b"k"]) == [Lookup.MISS]  # not loadable here: not a HIT
        r = run_job(b, False, [b"k"], [1], job_id=2)
        assert r.failed_keys == (b"k",) and r.error == "missing"
        fill(ctx_b, 2, 2)
        r = run_job(b, True, [b"k"], [2], job_id=3)  # a store neither deletes nor replaces it
        assert r.failed_keys == (b"k",) and "another slot size" in r.error
        assert _head(s3_server, name)["ETag"] == etag
        assert removed_a == removed_b == []
        assert run_job(a, False, [b"k"], [3], job_id=4).ok and bytes(ctx_a.arena[3]) == want
    finally:
        a.close()
        b.close()


def test_an_object_copied_from_another_namespace_is_not_loaded(s3_server, obj_options):
    ctx_1 = make_ctx(namespace={"model": "one"})
    removed = []
    ctx_2 = make_ctx(namespace={"model": "two"}, removed=removed)
    one, two = open_obj(ctx_1, obj_options), open_obj(ctx_2, obj_options)
    try:
        fill(ctx_1, 0, 3)
        assert run_job(one, True, [b"k"], [0]).ok
        p = obj_options["prefix"]
        body = s3(s3_server, "get_object", Bucket=BUCKET, Key=layout.object_name(p, ctx_1.namespace.digest, b"k"))
        s3(s3_server, "put_object", Bucket=BUCKET, Key=layout.object_name(p, ctx_2.namespace.digest, b"k"),
           Body=body["Body"])
        r = run_job(two, False, [b"k"], [1], job_id=2)
        assert r.failed_keys == (b"k",) and f"namespace {ctx_1.namespace.digest}" in r.error
        assert removed == [((b"k",), "corrupt")]  # not this namespace's: removed from its prefix
    finally:
        one.close()
        two.close()


# -- issue 11 item 3: conformance_corrupt --------------------------------------------------------


def test_conformance_corrupt_flips_payload_bytes_in_place_and_the_load_fails(s3_server, obj_options):
    ctx = make_ctx()
    h = open_obj(ctx, obj_options)
    try:
        want = [fill(ctx, i, 10 + i) for i in range(2)]
        assert run_job(h, True, [b"bad", b"good"], [0, 1]).ok
        name = layout.object_name(obj_options["prefix"], ctx.namespace.digest, b"bad")
        before = s3(s3_server, "get_object", Bucket=BUCKET, Key=name)
        ObjTier.conformance_corrupt(dict(obj_options), ctx.namespace, b"bad")
        after = s3(s3_server, "get_object", Bucket=BUCKET, Key=name)
        assert len(after["Body"]) == len(before["Body"])
        diff = [i for i, (x, y) in enumerate(zip(before["Body"], after["Body"], strict=True)) if x != y]
        assert diff and max(diff) < ctx.arena.slot_bytes  # payload bytes only; the trailer as it was
        assert after.get("ContentType") == before.get("ContentType")
        for s in (2, 3):
            ctx.arena[s][:] = b"\xee" * ctx.arena.slot_bytes
        r = run_job(h, False, [b"bad", b"good"], [2, 3], job_id=2)
        assert r.failed_keys == (b"bad",) and "checksum" in r.error
        assert bytes(ctx.arena[3]) == want[1]
    finally:
        h.close()


# -- item 10: timeouts say what timed out --------------------------------------------------------


@pytest.fixture
def silent_endpoint():
    """A listening TCP socket that accepts connections (the kernel does) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize(
    "opts,bound",
    [({"read_timeout": 1.0, "op_timeout": 10.0}, "read_timeout=1 s, 1 attempt(s)"),
     ({"read_timeout": 30.0, "op_timeout": 1.5}, "no answer within 1.5 s (op_timeout=1.5 s)")],
    ids=["read-timeout", "op-timeout"],
)
def test_open_against_an_endpoint_that_never_answers_names_it(obj_options, silent_endpoint, opts, bound):
    o = dict(obj_options, endpoint_url=silent_endpoint, connect_timeout=1.0, max_attempts=1, **opts)
    t0 = time.monotonic()
    with pytest.raises(TierError) as ei:
        open_obj(make_ctx(), o)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert silent_endpoint in msg and "checking the bucket" in msg and "head_bucket" in msg, msg
    assert "timed out" in msg and bound in msg, msg


@pytest.fixture
def stopped(s3_fault_server):
    yield s3_fault_server
    s3_fault_server.resume()


@pytest.mark.parametrize(
    "opts,bound",
    [({"read_timeout": 1.0, "op_timeout": 20.0}, "read_timeout=1 s, 1 attempt(s)"),
     ({"read_timeout": 30.0, "op_timeout": 3.0}, "(op_timeout=3 s)")],
    ids=["read-timeout", "op-timeout"],
)
def test_jobs_against_a_stopped_server_name_what_timed_out(stopped, opts, bound):
    srv = stopped
    ctx = make_ctx()
    o = options_for(srv, connect_timeout=1.0, max_attempts=1, **opts)
    h = open_obj(ctx, o)
    try:
        fill(ctx, 0, 0)
        assert run_job(h, True, [b"k0"], [0]).ok
        srv.pause()
        h.submit_store(Job(2, (b"k1",), (1,)))
        h.submit_load(Job(3, (b"k0",), (2,)))
        got = wait_jobs(h, [2, 3], timeout=30)
        for jid, op, k in ((2, "store", b"k1"), (3, "load", b"k0")):
            err = got[jid].error
            assert got[jid].failed_keys == (k,)
            assert f"{op} of s3://{BUCKET}/{layout.object_name(o['prefix'], ctx.namespace.digest, k)}" in err, err
            assert f"at {srv.endpoint_url} timed out" in err and bound in err, err
    finally:
        srv.resume()
        h.close()


# -- issue 10 item 2 end to end: a manager over an obj tier whose server stops -------------------


def test_manager_close_with_a_stopped_server_is_bounded_and_fails_the_load(stopped, monkeypatch):
    from test_manager import chunk_blocks, key, make_manager, settle, store_all

    from kvtiers.engine import manager

    monkeypatch.setattr(manager, "CLOSE_GRACE", 1.0)  # the tiers' extra time after timeout (5 s): shorter here
    srv = stopped
    opts = options_for(srv, op_timeout=30.0, read_timeout=30.0)  # nothing in the tier gives up first
    mgr, kv, _ = make_manager(2, tiers=[("obj", opts)])
    try:
        for i in range(3):
            store_all(mgr, [key(i)], first_block_chunk=i)
            settle(mgr, timeout=30)  # the cascade keeps the slot pinned until the tier has it
        assert mgr.lookup([key(0)]).sources == ("obj",)
        srv.pause()
        tid = mgr.load([key(0)], [chunk_blocks(20)])
        t0 = time.monotonic()
        mgr.close(timeout=2.0)
        assert time.monotonic() - t0 < 2.0 + 10
    finally:
        srv.resume()
        mgr.close(timeout=30)  # no-op once closed
    (res,) = [r for r in mgr.get_finished() if r.transfer_id == tid]
    assert res.failed_keys == (key(0),) and "abandoned at close" in res.error
