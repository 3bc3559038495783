"""``kvtiers bench tier mooncake`` on the one bench harness: the tier and its raw baseline
(Mooncake's own batch_put_from / batch_get_into on the tier's client and registered arena) in
the same run on a real pool; the baseline cleans up what it wrote. Figures are printed by the
harness, never asserted (docs/mooncake.md has them)."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake import client as mc  # noqa: E402
from kvtiers_mooncake.bench import RAW_PREFIX, loopback_tcp  # noqa: E402
from kvtiers_mooncake.pool import shared_test_pool  # noqa: E402

from kvtiers.commands.bench.harness import format_table, run_tier_bench  # noqa: E402

if mc.missing():
    pytest.skip(mc.missing(), allow_module_level=True)


def test_bench_runs_the_tier_against_the_raw_baseline():
    pool = shared_test_pool()
    opts = {"master_server_address": pool.address, "global_segment_size": 0}
    report = run_tier_bench("mooncake", opts, chunk_sizes=(1 << 20, 4 << 20), total_bytes=16 << 20, rounds=2,
                            concurrency=((1, 1), (4, 16)))
    assert report["baseline"].startswith("raw batch_put_from/batch_get_into")
    rows = {(r["op"], r["chunk_bytes"]) for r in report["results"]}
    assert rows == {(op, c) for op in ("store", "load") for c in (1 << 20, 4 << 20)}
    for r in report["results"] + report["concurrency"]:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0
    print(format_table(report))


def test_the_raw_baseline_round_trips_and_removes_what_it_wrote():
    import os

    from kvtiers import Arena, Namespace, TierContext, open_tier

    pool = shared_test_pool()
    arena = Arena.allocate(4, 1 << 20)
    h = open_tier("mooncake", {"master_server_address": pool.address, "global_segment_size": 0},
                  TierContext(arena, Namespace({"raw": os.urandom(3).hex()})))
    try:
        base = type(h.tier).bench_baseline(h.tier, 1 << 20)
        assert base.concurrency == h.tier.max_concurrency
        for i in (0, 1):
            arena[i][:] = os.urandom(1 << 20)
            base.put(b"r%d" % i, arena[i])
        for i in (0, 1):
            base.get(b"r%d" % i, arena[2 + i])
            assert bytes(arena[2 + i]) == bytes(arena[i])
        names = [f"{RAW_PREFIX}/{h.tier.digest}/{(b'r%d' % i).hex()}" for i in (0, 1)]
        assert h.tier._store.batch_is_exist(names) == [1, 1]
        base.close([b"r0", b"r1"])
        assert h.tier._store.batch_is_exist(names) == [0, 0]
    finally:
        h.close()


def test_raw_tcp_loopback_context_figures():
    r = loopback_tcp(1 << 20, total_bytes=16 << 20)
    assert r["put_gbps"] > 0 and r["get_gbps"] > 0
