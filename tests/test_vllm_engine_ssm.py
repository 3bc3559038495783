"""kvtiers under a running vLLM on CPU with an SSM hybrid: gated delta net + full attention.

A tiny Qwen3-Next (``make_tiny_model(arch="qwen3_next")``: layers 0 and 2 gated delta net,
1 and 3 full attention, real random weights from transformers): vLLM gives it a KV cache
group per kind, the state group's state smaller than its padded page, and 256-token blocks.
The CPU worker copies each ref at its own size, so the bytes copied are fewer than the rows'.

Engine A computes a 1024-token prefix (the run without offloading), stores it through the fs
tier, serves it again from its host region; engine B (new process, cold host cache, same
root) takes it from the tier. The greedy tokens are the same in all three.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engines import assert_reloads, describe, fs_pair, metric, needs_vllm_cpu

from kvtiers.commands.vllm_engine import offload_config, prompt_family

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

PREFIX = 1024
FS = "1:kvtiers_fs"


def ssm_job(tiers: list[dict], runs: list[list[int]]) -> dict:
    return {"model": None, "tiny_model": {"arch": "qwen3_next"}, "prompts": prompt_family(PREFIX, 1, seed=39),
            "max_tokens": 8, "kv_transfer_config": offload_config(tiers, 64 << 20), "runs": runs}


def run_engines(workdir: Path) -> dict:
    """Engines A and B (started with the other modules' by conftest's ``engine_runs``)."""
    return fs_pair("ssm", ssm_job, workdir)


@pytest.fixture(scope="module")
def runs(engine_runs):
    return engine_runs.result(__name__)


def test_ssm_hybrid_prefix_from_the_host_region_and_from_the_tier_same_tokens(runs):
    assert_reloads(runs, PREFIX)
    assert len(set(runs["a"]["requests"][0]["tokens"])) > 1  # real random weights: not one token repeated


def test_every_stored_row_comes_back_and_states_move_at_their_own_size(runs):
    a, b, files = runs["a"], runs["b"], runs["files"]
    written = metric(a, "vllm:kv_offload_tiering_write_bytes", tier=FS)
    assert files and written > 0, describe(a)
    assert metric(b, "vllm:kv_offload_tiering_read_bytes", tier=FS) == written, describe(b)
    # the worker copies each ref's page_size_bytes: the state is smaller than its padded page
    assert metric(a, "vllm:kv_offload_store_bytes") < written, describe(a)
    assert metric(b, "vllm:kv_offload_load_bytes") == metric(a, "vllm:kv_offload_store_bytes"), describe(b)
