"""Lookups that wait: vLLM's scheduler defers a request a whole engine step for a RETRY or a
HIT_PENDING (its ``lookup_async_delay``). With kvtiers' spec and adapter, a chunk held only by
the fs tier is HIT in the step that asks for it, and a key the fs tier does not know is MISS
in that step, not a step later.

Real parts: vLLM's tiering manager built by ``KvtiersOffloadingSpec``, the kvtiers fs tier on
real files, driven as vLLM's offloading scheduler drives it (``scripts/lookup_wait.py``).
Budgets are generous: these tests assert what a step answers, not how fast.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402

from kvtiers.errors import ConfigError  # noqa: E402

_spec = importlib.util.spec_from_file_location("lookup_wait", Path(__file__).parents[1] / "scripts" / "lookup_wait.py")
lookup_wait = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_wait)

STEP = ScheduleEndContext((), ())
ROW = lookup_wait.ROW
# generous, so a loaded machine does not make the test flaky
PATIENT = {"kvtiers_promotion_wait_ms": 2000}
PATIENT_TIER = {"retry_wait_ms": 2000}


def _ctx(req: str, keys: list) -> ReqContext:
    ctx = ReqContext(req_id=req)
    for i, k in enumerate(keys):  # what vLLM's scheduler records before it looks keys up
        ctx.set_offload_key_position(k, (i + 1) * 16)
    return ctx


def _scan(m, ctx: ReqContext, keys: list) -> list[LookupResult]:
    """One scheduler step's lookups of a request (``_maximal_prefix_lookup``): stop at a MISS."""
    out = []
    for k in keys:
        out.append(m.lookup(k, ctx))
        if out[-1] is LookupResult.MISS:
            break
    return out


def _store_in(m, keys: list, data: bytes, req: str = "writer") -> None:
    """A request that computed ``keys``: stored in the primary tier, cascaded to the fs tier."""
    view = np.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
    ctx = ReqContext(req_id=req)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    for row in out.store_spec.block_ids:
        view[row] = np.frombuffer(data, dtype=np.uint8)
    view = None
    m.complete_store(keys, ctx)
    m.on_request_finished(ctx)
    deadline = time.monotonic() + 30
    while m.has_pending_work():
        m.on_schedule_end(STEP)
        assert time.monotonic() < deadline, "the cascade did not finish"
        time.sleep(0.002)


def _store(root: str, keys: list, data: bytes) -> None:
    """An engine that computed the prefix: its stores cascade to the fs tier at ``root``."""
    m = lookup_wait.make_manager(root, 32, {})
    try:
        _store_in(m, keys, data)
    finally:
        m.shutdown()


@pytest.mark.parametrize("wait_ms, deferred", [(None, False), (0, True)])
def test_a_prefix_held_only_by_the_fs_tier_is_hit_in_the_step_that_asks(tmp_path, wait_ms, deferred) -> None:
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(8)]
    data = bytes(range(256)) * (ROW // 256)
    _store(str(tmp_path), keys, data)
    extra = PATIENT if wait_ms is None else {"kvtiers_promotion_wait_ms": wait_ms}
    m = lookup_wait.make_manager(str(tmp_path), 32, PATIENT_TIER, extra)  # a new engine: its host arena is empty
    try:
        ctx = _ctx("r", keys)
        m.on_new_request(ctx)
        first = _scan(m, ctx, keys)
        if deferred:  # vLLM's own behaviour: promoted now, readable only at the next step
            assert set(first) == {LookupResult.HIT_PENDING}
            deadline = time.monotonic() + 30
            while m.has_pending_work() or m._pending_load_submissions:  # steps go by
                m.on_schedule_end(STEP)
                assert time.monotonic() < deadline, "the promotion did not finish"
                time.sleep(0.005)
            assert _scan(m, ctx, keys) == [LookupResult.HIT] * len(keys)
            return
        assert first == [LookupResult.HIT] * len(keys)  # every chunk loaded before the step ended
        spec = m.prepare_load(keys, ctx)
        view = np.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        assert all(view[row].tobytes() == data for row in spec.block_ids)  # the bytes the tier holds
        view = None
        m.complete_load(keys, ctx)
        m.on_request_finished(ctx)
    finally:
        m.shutdown()


@pytest.mark.parametrize("retry_wait_ms, first", [(2000, LookupResult.MISS), (0, LookupResult.RETRY)])
def test_a_new_prompt_is_a_miss_in_the_step_that_asks(tmp_path, retry_wait_ms, first) -> None:
    # the fs tier answers RETRY for a key it does not know while it probes for the file
    m = lookup_wait.make_manager(str(tmp_path), 16, {"retry_wait_ms": retry_wait_ms})
    try:
        keys = [make_offload_key(bytes([i + 100]) * 32, 0) for i in range(4)]
        ctx = _ctx("new", keys)
        m.on_new_request(ctx)
        assert _scan(m, ctx, keys)[0] is first
    finally:
        m.shutdown()


def test_the_scheduler_waits_far_fewer_steps_on_lookups(tmp_path) -> None:
    # a small prefix-repetition workload: cold prefixes, prefixes promoted back from the fs tier
    kw = dict(prefixes=8, per_prefix=3, chunks=8, concurrency=2, rows=24, run_steps=2, step_ms=1.0)
    before = lookup_wait.run(**kw, tier_options={"retry_wait_ms": 0}, extra={"kvtiers_promotion_wait_ms": 0})
    after = lookup_wait.run(**kw, tier_options=PATIENT_TIER, extra=PATIENT)
    assert before["retry"] >= 8 and before["hit_pending"] >= 5, before  # each cold prefix, each promotion
    assert after["deferrals"] * 5 <= before["deferrals"], (before, after)


def test_a_scan_answered_hit_keeps_every_chunk_it_answered_until_it_is_loaded(tmp_path) -> None:
    # the first half of a prefix in the host arena, the second half only in the fs tier, the arena
    # full: promoting the second half evicts the first (unpinned until prepare_load). vLLM's own
    # path defers such a scan; answering it HIT would make prepare_load fail on an evicted chunk
    # (vLLM's engine died on "Chunk ... not found in cache" under `vllm serve`).
    data = bytes(ROW)
    p = [make_offload_key(bytes([i]) * 32, 0) for i in range(8)]
    x = [make_offload_key(bytes([i + 50]) * 32, 0) for i in range(4)]
    m = lookup_wait.make_manager(str(tmp_path), 8, {}, PATIENT)
    try:
        _store_in(m, p[4:], data, "a")
        _store_in(m, p[:4], data, "b")
        _store_in(m, x, data, "c")  # evicts the oldest: p[4:]
        probe = ReqContext(req_id="probe")
        assert [m.primary_tier.lookup(k, probe) for k in p] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 4
        for step in range(20):
            ctx = _ctx(f"r{step}", p)
            m.on_new_request(ctx)
            answers = _scan(m, ctx, p)
            deferred = LookupResult.HIT_PENDING in answers or LookupResult.RETRY in answers
            if not deferred:
                hits = p[:answers.count(LookupResult.HIT)]
                m.prepare_load(hits, ctx)  # raises (vLLM asserts) if a chunk answered HIT was evicted
                m.complete_load(hits, ctx)
            m.on_request_finished(ctx)
            m.on_schedule_end(STEP)
            if not deferred:
                break
            time.sleep(0.01)
        assert not deferred
    finally:
        m.shutdown()


def test_bad_wait_options_name_the_option(tmp_path) -> None:
    with pytest.raises(ConfigError, match="retry_wait_ms"):
        lookup_wait.make_manager(str(tmp_path), 16, {"retry_wait_ms": -1})
    with pytest.raises(ValueError, match="kvtiers_promotion_wait_ms"):
        lookup_wait.make_manager(str(tmp_path), 16, {}, {"kvtiers_promotion_wait_ms": "soon"})
