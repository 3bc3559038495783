"""``kvtiers bench tier mooncake`` with no ``--config`` runs with its defaults (issue 39): the
scratch pool ``conformance_config`` starts holds a round of the bench's default size, and a load
batch that outlasts the master's lease (-707, ``LEASE_EXPIRED``: 64 MiB jobs on a busy machine
against the test pool's 1 s lease) is fetched again in smaller batches instead of failing its
keys. Against real pools started by the project's launcher."""

from __future__ import annotations

import inspect
import os

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake import client as mc  # noqa: E402
from kvtiers_mooncake.pool import SHARED_SEGMENT, start_test_pool  # noqa: E402
from tier_helpers import wait_job  # noqa: E402

from kvtiers import Arena, Job, Namespace, TierContext, open_tier  # noqa: E402
from kvtiers.commands.bench.harness import run_tier_bench  # noqa: E402

if mc.missing():
    pytest.skip(mc.missing(), allow_module_level=True)

MIB = 1 << 20


def test_a_load_batch_that_outlasts_the_lease_is_fetched_again_not_failed() -> None:
    pool = start_test_pool(128 * MIB, lease_ms=10)  # a 64 MiB batch takes far longer than 10 ms
    try:
        n = 64
        arena = Arena.allocate(2 * n, MIB)
        for i in range(n):
            arena[i][:] = os.urandom(MIB)
        h = open_tier("mooncake", {"master_server_address": pool.address, "global_segment_size": 0, "timeout": 30.0},
                      TierContext(arena, Namespace({"lease": os.urandom(3).hex()})))
        try:
            keys = tuple(b"k%d" % i for i in range(n))
            h.submit_store(Job(1, keys, tuple(range(n))))
            assert wait_job(h, 1).ok
            h.submit_load(Job(2, keys, tuple(range(n, 2 * n))))
            res = wait_job(h, 2, timeout=60)
            assert res.ok, res.error  # was: every key failed with "load failed: -707"
            assert all(bytes(arena[i]) == bytes(arena[n + i]) for i in range(n))
        finally:
            h.close()
    finally:
        pool.stop()


def test_the_scratch_pool_holds_a_round_of_the_bench_defaults() -> None:
    default_round = inspect.signature(run_tier_bench).parameters["total_bytes"].default
    # a round (the tier's and the raw baseline's) and the one before it, with room to spare
    assert SHARED_SEGMENT >= 8 * default_round


def test_the_bench_runs_a_default_sized_round_without_a_config() -> None:
    # options None: conformance_config's scratch pool, as `kvtiers bench tier mooncake` does;
    # it used to fail with "evicted by the pool (not found)" (a 512 MiB pool) or -707
    report = run_tier_bench("mooncake", None, chunk_sizes=(MIB,), rounds=1, concurrency=())
    assert {r["op"] for r in report["results"]} == {"store", "load"}
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in report["results"])
