"""Tenants under a running vLLM on CPU (docs/security.md#tenants): one prompt, three tenants
(``cache_salt``), an encrypted fs tier with keys for two of them.

Engine A serves the prompt for alice, bob and carol in turn: bob's request takes nothing
from alice's (no tier hit, nothing cached), each tenant's 32 chunks land on the medium under
its own key id, and carol (no key: ``unknown_tenant`` "skip") stores nothing there, each chunk
counted as a failed store. Engine B, a new process over the same root, serves alice and bob
again: each reloads its whole prefix from the tier, the same tokens as an engine with no
offloading.

The engines run beside other modules' through conftest's ``engine_runs``.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
from test_encryption import _key
from vllm_engines import (
    MAX_TOKENS,
    PREFIX,
    PROMPTS,
    X0,
    describe,
    engine,
    metric,
    needs_vllm_cpu,
    reference,
    start_reference,
    tokens,
)

from kvtiers.commands.vllm_engine import offload_config
from kvtiers.encryption import HEADER, read_header

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1200)]

CHUNKS = PREFIX // 128  # chunks of the prefix (vLLM's 128-token CPU blocks)
ROW = 256 << 10  # bytes of one chunk row of the tiny model
FS = "1:kvtiers_fs"
#: the tenants' cache_salts (a real salt is a secret of its tenant's; these are test names)
SALTS = {"0": "tenant-alice", "1": "tenant-bob", "2": "tenant-carol"}
ALICE, BOB, CAROL = 0, 1, 2


def _job(tiers: list[dict], runs: list[list[int]]) -> dict:
    """The one prompt X0 three times, one per tenant (prompt index -> cache_salt)."""
    return {"model": None, "prompts": [PROMPTS[X0]] * 3, "max_tokens": MAX_TOKENS, "runs": runs,
            "cache_salts": SALTS, "kv_transfer_config": offload_config(tiers)}


def _offload(result: dict, prompt: int, name: str) -> float:
    """How much vLLM's counter ``name`` (summed over labels) moved during ``prompt``'s request."""
    (req,) = [r for r in result["requests"] if r["prompt"] == prompt]
    return sum(v for k, v in req["offload"].items() if k.partition("{")[0] == name)


def _req(result: dict, prompt: int) -> dict:
    (req,) = [r for r in result["requests"] if r["prompt"] == prompt]
    return req


def run_engines(wd: Path) -> dict:
    """Engines A and B, the reference beside A (started with the other modules' by conftest's
    ``engine_runs``)."""
    start_reference()
    root = wd / "kv"
    enc = {"tenants": {SALTS["0"]: {"key_file": _key(wd, "alice.key"), "key_id": "alice-1"},
                       SALTS["1"]: {"key_file": _key(wd, "bob.key"), "key_id": "bob-1"}},
           "unknown_tenant": "skip"}
    tiers = [{"type": "kvtiers_fs", "root_dir": str(root), "encrypt": enc}]
    a = engine("tenants-A", _job(tiers, [[ALICE], [BOB], [CAROL]]), wd)
    kids = collections.Counter(read_header(p.read_bytes()[:HEADER.size])[0] for p in root.rglob("*.bin"))
    b = engine("tenants-B", _job(tiers, [[ALICE], [BOB]]), wd)
    return {"a": a, "b": b, "kids": kids}


@pytest.fixture(scope="module")
def runs(engine_runs):
    return {**engine_runs.result(__name__), "ref": tokens(reference())[X0]}


def test_tenants_share_nothing_through_the_tier(runs):
    a = runs["a"]
    for p in (ALICE, BOB, CAROL):
        assert _req(a, p)["tokens"] == runs["ref"], f"prompt {p}"
        # the same prompt, another tenant: nothing cached, nothing read from the tier
        assert _req(a, p)["cached_tokens"] == 0, describe(a)
        assert _offload(a, p, "vllm:kv_offload_tiering_chunk_hits") == 0, describe(a)
        assert _offload(a, p, "vllm:kv_offload_tiering_read_bytes") == 0, describe(a)
    # on the medium: each tenant's chunks under its own key id; carol's (no key) not at all
    assert runs["kids"] == {"alice-1": CHUNKS, "bob-1": CHUNKS}, describe(a)
    assert metric(a, "vllm:kv_offload_tiering_write_bytes", tier=FS) == 2 * CHUNKS * ROW, describe(a)
    assert metric(a, "vllm:kv_offload_kvtiers_failed_chunks", kvtiers_tier="kvtiers_fs", op="store") == CHUNKS


def test_each_tenant_reloads_its_own_prefix_in_a_new_engine(runs):
    b = runs["b"]
    for p in (ALICE, BOB):
        req = _req(b, p)
        assert req["tokens"] == runs["ref"], f"prompt {p}"
        assert req["cached_tokens"] == PREFIX, describe(b)
        assert _offload(b, p, "vllm:kv_offload_tiering_chunk_hits") >= CHUNKS, describe(b)
        assert _offload(b, p, "vllm:kv_offload_tiering_read_bytes") >= CHUNKS * ROW, describe(b)
    assert metric(b, "vllm:kv_offload_kvtiers_failed_chunks", kvtiers_tier="kvtiers_fs", op="load") == 0
