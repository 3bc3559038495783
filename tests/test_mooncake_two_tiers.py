"""Two mooncake tiers over one host arena (issue 40 item 9): two namespaces on one pool, or two
tiers of one manager's config. Both open (Mooncake's transfer engine refuses a second
``register_buffer`` of a region it holds, -600, so the region is registered once per client and
shared, refcounted), both store and load, and the arena stays registered until the last one
closes. Against a real pool (``mooncake_master`` and a ``serve`` process, the project's launcher).
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake import client as mc  # noqa: E402
from kvtiers_mooncake.client import missing  # noqa: E402
from kvtiers_mooncake.pool import shared_test_pool  # noqa: E402
from tier_helpers import resolve_lookup, wait_job  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

if missing():
    pytest.skip(missing(), allow_module_level=True)

SLOT = 64 << 10


@pytest.fixture(scope="module")
def pool():
    return shared_test_pool()


def options(pool) -> dict:
    return {"master_server_address": pool.address, "global_segment_size": 0, "timeout": 10.0}


def client_of(handle) -> mc.SharedClient:
    return handle.tier._client


def roundtrip(handle, arena: Arena, key: bytes, src: int, dst: int, job_id: int) -> None:
    """Store slot ``src`` under ``key``, load it into ``dst``, check the bytes."""
    data = os.urandom(arena.slot_bytes)
    arena[src][:] = data
    handle.submit_store(Job(job_id, (key,), (src,)))
    assert wait_job(handle, job_id).ok
    assert resolve_lookup(handle, [key]) == [Lookup.HIT]
    arena[dst][:] = b"\0" * arena.slot_bytes
    handle.submit_load(Job(job_id + 1, (key,), (dst,)))
    res = wait_job(handle, job_id + 1)
    assert res.ok, res
    assert bytes(arena[dst]) == data


def test_two_namespaces_over_one_arena_on_one_pool_both_open_store_and_load(pool) -> None:
    arena = Arena.allocate(8, SLOT)
    start = mc.address(arena.buffer)
    a = open_tier("mooncake", options(pool), TierContext(arena, Namespace({"env": "prod"})))
    try:
        # the second instance used to fail here: register_buffer of the arena failed: -600 (INVALID_PARAMS)
        b = open_tier("mooncake", options(pool), TierContext(arena, Namespace({"env": "test"})))
        client = client_of(a)
        assert client is client_of(b)  # one client per process and setup
        assert client.regions[start] == [arena.buffer.nbytes, 2]  # one registration, two users
        roundtrip(a, arena, b"k-prod", 0, 1, 10)
        roundtrip(b, arena, b"k-test", 2, 3, 20)
        assert resolve_lookup(a, [b"k-test"]) == [Lookup.MISS]  # the namespaces stay apart
        b.close()
        assert client.regions[start][1] == 1  # still registered for the other instance
        roundtrip(a, arena, b"k-prod-2", 4, 5, 30)  # which still moves bytes
    finally:
        a.close()
    assert start not in client.regions  # the last user unregistered it
    c = open_tier("mooncake", options(pool), TierContext(arena, Namespace({"env": "again"})))
    try:
        roundtrip(c, arena, b"k-again", 6, 7, 40)  # registered afresh
    finally:
        c.close()


def test_a_manager_config_with_two_mooncake_tiers_on_one_pool_opens_and_cascades_to_both(pool) -> None:
    torch = pytest.importorskip("torch")
    from kvtiers import TieringManager

    kv = {"kv": [[torch.randn(8, 16, 64) for _ in range(2)]]}
    config = {"host_bytes": 1 << 20, "tiers": [
        {"type": "mooncake", "name": "pool-a", **options(pool)},
        {"type": "mooncake", "name": "pool-b", **options(pool)},
    ]}
    mgr = TieringManager.from_config(config, kv)  # the second tier used to fail to open (-600)
    try:
        assert [t.name for t in mgr.tiers] == ["pool-a", "pool-b"]
        tid = mgr.store([b"chunk-0", b"chunk-1"], [[0], [1]])
        (res,) = mgr.wait([tid], timeout=30)
        assert res.ok
        end = time.monotonic() + 30
        while mgr.pending() and time.monotonic() < end:
            mgr.poll()
            time.sleep(0.005)
        assert not mgr.pending()
        for t in mgr.tiers:
            assert resolve_lookup(t.handle, [b"chunk-0", b"chunk-1"]) == [Lookup.HIT, Lookup.HIT], t.name
        assert mgr.stats.tier_errors == {}
    finally:
        mgr.close(timeout=10)
