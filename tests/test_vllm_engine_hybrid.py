"""kvtiers under a running vLLM on CPU with a hybrid model: sliding-window and full attention.

The tiny Llama with ``"layer_types": ["sliding_attention", "full_attention"] * 2,
"sliding_window": 256``: vLLM gives it two KV cache groups (the window group, layers 0 and 2;
the full group, layers 1 and 3) sharing two KV tensors, so a chunk row (128 tokens of one
group, both tensors) is 128 KiB. For a 1024-token prefix the full group stores all 8 of its
chunks and the window group only the last 2 (its 256-token window): 10 rows, not 16.

Engine A (one process) serves the prompt, computing its prefix (nothing cached: the run
without offloading), stores through the fs tier, then serves it again from its host region.
Engine B, a new process with a cold host cache over the same root, takes the prefix from the
tier. Tokens are the same in all three requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engines import assert_reloads, describe, fs_pair, metric, needs_vllm_cpu

from kvtiers.commands.vllm_engine import offload_config, prompt_family

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

TINY = {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 256}
PREFIX = 1024
FULL, WINDOW = PREFIX // 128, 256 // 128  # chunks of the full group, of the window group
ROW = 128 << 10  # one group's chunk: 128 tokens x 2 tensors (one layer each) x K,V x 2 heads x 64 x bf16
FS = "1:kvtiers_fs"


def hybrid_job(tiers: list[dict], runs: list[list[int]]) -> dict:
    return {"model": None, "tiny_model": TINY, "prompts": prompt_family(PREFIX, 1, seed=37), "max_tokens": 8,
            "kv_transfer_config": offload_config(tiers, 64 << 20), "runs": runs}


def run_engines(workdir: Path) -> dict:
    """Engines A and B (started with the other modules' by conftest's ``engine_runs``)."""
    return fs_pair("hybrid", hybrid_job, workdir)


@pytest.fixture(scope="module")
def runs(engine_runs):
    return engine_runs.result(__name__)


def test_the_prefix_comes_back_from_the_host_region_and_from_the_tier_same_tokens(runs):
    assert_reloads(runs, PREFIX)
    assert metric(runs["b"], "vllm:external_prefix_cache_hits") >= PREFIX, describe(runs["b"])


def test_the_window_group_stores_and_reloads_only_its_window(runs):
    a, b, files = runs["a"], runs["b"], runs["files"]
    # one file per row: the full group's 8 chunks and the window group's last 2, not 2 x 8
    assert len(files) == FULL + WINDOW, describe(a)
    assert metric(a, "vllm:kv_offload_store_bytes") == (FULL + WINDOW) * ROW, describe(a)
    assert metric(a, "vllm:kv_offload_tiering_write_bytes", tier=FS) == (FULL + WINDOW) * ROW, describe(a)
    assert metric(b, "vllm:kv_offload_tiering_read_bytes", tier=FS) == (FULL + WINDOW) * ROW, describe(b)
    assert metric(b, "vllm:kv_offload_load_bytes") == (FULL + WINDOW) * ROW, describe(b)
