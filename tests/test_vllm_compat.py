"""What differs between vLLM releases, at vLLM's own scheduler-side classes (kvtiers.integrations.vllm.compat).

Runs on the vLLM wheel of the main environment (0.33) and, through
tests/test_vllm_releases.py, on vLLM 0.34 (build/vllm-0.34): the same claims on both.

- Recency: 0.34 has no ``touch``; a chunk vLLM keeps loading from its primary tier stays
  recent in a bounded kvtiers tier too (the spec's ``prepare_load`` refresh), so the tier
  evicts what vLLM does not use.
- A failed promotion: the rows the tier is still writing are never handed to another chunk,
  and every other chunk's bytes survive the tier's late write (0.34's ``deferred_release``
  is never needed: the adapter reports a job only once the tier has).
- The tenant wrapper around vLLM's own ``_create_req_context`` (one argument on 0.32 and
  0.33, two on 0.34).
- ``kvtiers_promotion_wait_ms`` and ``kvtiers_sync_load`` turn themselves off with one log
  line naming what they did not find.
"""

from __future__ import annotations

import inspect
import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by `make test`")

from test_integration_vllm import MODULE, ROW, STEP, Engine, chunks_for, offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

import kvtiers  # noqa: E402
from kvtiers.integrations.vllm import KvtiersOffloadingSpec, compat, promotion_wait, sync_load, tenant  # noqa: E402
from kvtiers.types import JobResult as TierResult  # noqa: E402


class SpecEngine(Engine):
    """:class:`Engine` with kvtiers' spec (its ``prepare_load`` refresh) instead of vLLM's."""

    def __init__(self, tier: dict, **kw) -> None:
        self.spec = KvtiersOffloadingSpec(offloading_config({"secondary_tiers": [tier]}, **kw))
        self.m = self.spec.get_manager()
        self.rows = np.frombuffer(self.m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        self.tier = self.m.secondary_tiers[0]


def test_what_this_vllm_has_is_found_by_capability() -> None:
    import vllm.v1.kv_offload.base as base
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    assert compat.HAS_TOUCH == hasattr(SecondaryTierManager, "touch")
    assert (compat.DEVICE_POINTERS is not None) == hasattr(base, "DevicePointers")
    if compat.DEVICE_POINTERS is not None:  # 0.34: the two go together
        assert not compat.HAS_TOUCH and compat.HAS_DEFERRED_RELEASE


def test_a_chunk_vllm_keeps_loading_from_its_primary_stays_in_a_bounded_tier(tmp_path) -> None:
    # a 4-row primary and a memory tier of 4 chunks: both hold k0..k3; k0, k1 are loaded again
    # (from the primary: the tier is never asked); two new chunks then evict two from each
    tier = {"type": "kvtiers", "module_path": MODULE, "tier": "memory", "max_bytes": 4 * ROW}
    e = SpecEngine(tier, chunks=4)
    try:
        chunks = chunks_for(6, seed=7)
        keys = list(chunks)
        e.store("s0", {k: chunks[k] for k in keys[:2]})
        e.store("s1", {k: chunks[k] for k in keys[2:4]})
        got, seen = e.load("hot", keys[:2])
        assert got == {k: chunks[k] for k in keys[:2]} and LookupResult.HIT_PENDING not in seen  # the primary's
        e.store("s2", {k: chunks[k] for k in keys[4:6]})
        in_primary = [e.m.primary_tier.lookup(k, ReqContext(req_id="q")) is LookupResult.HIT for k in keys[:4]]
        in_tier = [a is kvtiers.Lookup.HIT for a in e.tier.handle.lookup(keys[:4])]
        assert in_primary == [True, True, False, False]  # vLLM's primary kept the chunks it loaded
        assert in_tier == [True, True, False, False]  # and so did the tier
    finally:
        e.close()


class GatedFailingLoads:
    """Fault injection: the tier's promotions wait for ``gate``, then write junk into their
    slots and fail (a tier whose I/O outlives the failure it reports would be a broken one)."""

    def __init__(self, tier) -> None:
        self.gate = threading.Event()
        self.slots: list[int] = []
        self.done: list[TierResult] = []
        self.handle = tier.handle
        self._poll = tier.handle.get_finished_jobs
        self.threads: list[threading.Thread] = []
        tier.handle.submit_load = self.submit_load
        tier.handle.get_finished_jobs = self.get_finished_jobs

    def submit_load(self, job) -> None:
        self.slots.extend(job.slots)

        def run() -> None:
            self.gate.wait(30)
            for s in job.slots:
                self.handle.ctx.arena[s][:] = b"\xee" * self.handle.ctx.arena.slot_bytes
            self.done.append(TierResult(job.job_id, job.keys, 0, 0.0, "injected: the device failed"))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def get_finished_jobs(self) -> list[TierResult]:
        out, self.done = self.done, []
        return self._poll() + out


def test_a_failed_promotion_never_lets_vllm_reuse_a_row_the_tier_still_writes() -> None:
    tier = {"type": "kvtiers", "module_path": MODULE, "tier": "memory"}
    e = Engine(tier, chunks=4)
    try:
        chunks = chunks_for(10, seed=8)
        keys = list(chunks)
        for i in range(0, 6, 2):  # k0, k1 leave the 4-row primary; the tier holds all six
            e.store(f"s{i}", {k: chunks[k] for k in keys[i:i + 2]})
        gated = GatedFailingLoads(e.tier)
        ctx = ReqContext(req_id="promote")
        e.m.on_new_request(ctx)
        assert e.m.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
        e.m.on_schedule_end(STEP)
        assert len(gated.slots) == 1
        (held,) = gated.slots
        # while the tier still writes: new chunks fill the primary, steps go by, none gets the held row
        for i, k in enumerate(keys[6:10]):
            sctx = ReqContext(req_id=f"w{i}")
            e.m.on_new_request(sctx)
            out = e.m.prepare_store([k], sctx)
            if out is not None and out.keys_to_store:
                (row,) = out.store_spec.block_ids
                assert int(row) != held, "vLLM handed out a row the tier is still writing"
                e.rows[row] = np.frombuffer(chunks[k], dtype=np.uint8)
                e.m.complete_store([k], sctx)
            e.m.on_request_finished(sctx)
            for _ in range(3):
                e.m.on_schedule_end(STEP)
        assert e.m.lookup(keys[0], ctx) is LookupResult.HIT_PENDING  # still in flight
        gated.gate.set()  # the tier writes its junk, then reports the failure
        for t in gated.threads:
            t.join(10)
        e.m.on_request_finished(ctx)
        e.settle()
        # the failed key is a miss; every chunk vLLM stored meanwhile kept its bytes
        stored = [k for k in keys[6:10] if e.m.primary_tier.lookup(k, ReqContext(req_id="q")) is LookupResult.HIT]
        assert stored
        for k in stored:
            spec = e.m.primary_tier.prepare_load([k], ReqContext(req_id="r"))
            (row,) = spec.block_ids
            assert e.rows[row].tobytes() == chunks[k]
        assert e.tier.lookup(keys[0], ReqContext(req_id="again")) is LookupResult.MISS
    finally:
        e.close()


def test_the_tenant_reaches_the_context_vllms_own_scheduler_function_makes() -> None:
    import importlib

    mod = importlib.import_module(tenant._MODULE)
    assert tenant.install()
    create = mod._create_req_context
    req = SimpleNamespace(request_id="r1", kv_transfer_params=None, kv_hints=None, cache_salt="acme")
    n = len(inspect.signature(create.__wrapped__).parameters)  # 1 on 0.32/0.33, 2 on 0.34 (req, scheduler)
    ctx = create(req, *([SimpleNamespace()] * (n - 1)))
    assert ctx.req_id == "r1" and tenant.tenant_of(ctx) == "acme"


def test_promotion_wait_off_with_one_line_naming_what_the_manager_lacks(caplog) -> None:
    manager = SimpleNamespace(secondary_tiers=[object()], _jobs={}, lookup=None, on_schedule_end=None)
    with caplog.at_level(logging.INFO, logger="kvtiers.integrations.vllm"):
        assert promotion_wait.install(manager, {"kvtiers_promotion_wait_ms": 50}) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "_pending_load_submissions, _flush_pending_promotions, _process_finished_jobs, primary_tier" in lines[0]
    assert "kvtiers_promotion_wait_ms is off" in lines[0]


def test_promotion_wait_is_on_with_this_vllms_manager() -> None:
    e = Engine({"type": "kvtiers", "module_path": MODULE, "tier": "memory"})
    try:
        assert promotion_wait.install(e.m, {"kvtiers_promotion_wait_ms": 50}) is not None
    finally:
        e.close()


def test_sync_load_off_with_one_line_naming_what_the_connector_lacks(monkeypatch, caplog) -> None:
    import importlib

    sched = importlib.import_module(sync_load._SCHEDULER)
    monkeypatch.setattr(sync_load, "_installed", False)
    monkeypatch.delattr(sched.OffloadingConnectorScheduler, "update_state_after_alloc")
    with caplog.at_level(logging.INFO, logger="kvtiers.integrations.vllm"):
        assert sync_load.install() is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "OffloadingConnectorScheduler.update_state_after_alloc" in lines[0]
    assert "kvtiers_sync_load is off" in lines[0]


def test_a_store_event_carries_its_request_where_vllm_has_the_field() -> None:
    import dataclasses

    from vllm.v1.kv_offload.base import OffloadingEvent

    e = Engine({"type": "kvtiers", "module_path": MODULE, "tier": "memory", "enable_kv_events": True})
    try:
        chunks = chunks_for(2, seed=9)
        e.store("req-ev", chunks)
        (stored,) = [ev for ev in e.tier.take_events() if not ev.removed]
        assert set(stored.keys) == set(chunks)
        has = "req_context" in {f.name for f in dataclasses.fields(OffloadingEvent)}
        assert compat.EVENT_REQ_CONTEXT is has
        if has:  # vLLM 0.34: the store's request
            assert stored.req_context is not None and stored.req_context.req_id == "req-ev"
    finally:
        e.close()
