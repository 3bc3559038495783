"""kvtiers tiers inside vLLM 0.33.0's own tiering classes, on CPU.

Everything vLLM here is the real thing, installed by ``make test`` (``--no-deps``, next to the
pinned torch): ``TieringOffloadingSpec`` builds the real ``TieringOffloadingManager`` with its
CPU primary tier in a shared-memory region, and ``SecondaryTierFactory`` loads the kvtiers
adapter by ``module_path`` or by the name kvtiers' ``vllm.general_plugins`` entry point
registers (run through vLLM's own ``load_general_plugins``). The tests drive the manager as
vLLM's scheduler-side connector does: ``prepare_store``, the worker's copy into the primary
rows (written here with numpy), ``complete_store`` (the cascade), ``lookup`` (HIT_PENDING while
a promotion runs, then HIT), ``prepare_load`` and the bytes of the promoted rows.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402
from vllm_engines import offloading_config as shared_config  # noqa: E402

import kvtiers  # noqa: E402
import kvtiers.memory  # noqa: E402
from kvtiers.errors import ConfigError  # noqa: E402
from kvtiers.integrations.vllm import KvtiersTier, metrics  # noqa: E402
from kvtiers.ioloop import THREAD_NAME  # noqa: E402

ROW = 8192  # bytes of one chunk row: one block of 8 KiB per chunk, one worker
MODULE = "kvtiers.integrations.vllm"
STEP = ScheduleEndContext((), ())


def offloading_config(extra: dict, *, chunks: int = 16, agnostic: bool = True, events: bool = True):
    """One worker's config; not parallelism-agnostic means TP=2 (a worker's share of each row)."""
    return shared_config(extra, row=ROW, chunks=chunks, tp=1 if agnostic else 2, world_size=1, agnostic=agnostic,
                         events=events, dtype="float16")


class Engine:
    """vLLM's scheduler side, as far as the offloading manager sees it: real spec and manager."""

    def __init__(self, tier: dict, **kw) -> None:
        self.spec = TieringOffloadingSpec(offloading_config({"secondary_tiers": [tier]}, **kw))
        self.m = self.spec.get_manager()
        self.rows = np.frombuffer(self.m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        self.tier = self.m.secondary_tiers[0]

    def settle(self, timeout: float = 30.0) -> None:
        """End scheduler steps until no cascade or promotion is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.m.on_schedule_end(STEP)
            if not self.m.has_pending_work():
                return
            assert time.monotonic() < deadline, "jobs still in flight"
            time.sleep(0.005)

    def store(self, req: str, chunks: dict[bytes, bytes]) -> None:
        """prepare_store, the worker's copy into the primary rows, complete_store (the cascade)."""
        ctx = ReqContext(req_id=req)
        self.m.on_new_request(ctx)
        keys = list(chunks)
        out = self.m.prepare_store(keys, ctx)
        assert out is not None
        for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.rows[row] = np.frombuffer(chunks[key], dtype=np.uint8)
        self.m.complete_store(keys, ctx)
        self.m.on_request_finished(ctx)
        self.settle()

    def load(self, req: str, keys: list[bytes], timeout: float = 30.0) -> tuple[dict[bytes, bytes], list]:
        """Look the keys up as the scheduler does (a step per round) until each is HIT or MISS;
        return the bytes of the rows vLLM would copy to the GPU, and the answers seen."""
        ctx = ReqContext(req_id=req)
        self.m.on_new_request(ctx)
        seen = []
        deadline = time.monotonic() + timeout
        final: dict[bytes, LookupResult] = {}
        while len(final) < len(keys):
            for k in keys:
                if k not in final:
                    r = self.m.lookup(k, ctx)
                    seen.append(r)
                    if r in (LookupResult.HIT, LookupResult.MISS):
                        final[k] = r
            self.m.on_schedule_end(STEP)
            assert time.monotonic() < deadline, f"lookups did not resolve: {seen[-len(keys):]}"
            time.sleep(0.002)
        hits = [k for k in keys if final[k] is LookupResult.HIT]
        got = {}
        if hits:
            spec = self.m.prepare_load(hits, ctx)
            got = {k: self.rows[row].tobytes() for k, row in zip(hits, spec.block_ids, strict=True)}
            self.m.complete_load(hits, ctx)
        self.m.on_request_finished(ctx)
        self.settle()
        return got, seen

    def close(self) -> None:
        self.rows = None  # our numpy view of the region: vLLM unmaps it only when no view is left
        self.m.shutdown()


def chunks_for(n: int, seed: int) -> dict[bytes, bytes]:
    rng = np.random.default_rng(seed)
    return {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(n)}


@pytest.fixture(scope="module")
def plugins_loaded():
    """vLLM's own start-up path for general plugins, which runs kvtiers' entry point."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return SecondaryTierFactory


def test_the_entry_point_names_every_kvtiers_tier_to_vllm(plugins_loaded) -> None:
    names = [f"kvtiers_{info.name}" for info in kvtiers.get_registry().tiers()]
    assert {"kvtiers_fs", "kvtiers_memory", "kvtiers_obj"} <= set(names)
    for name in ["kvtiers", *names]:
        cls = plugins_loaded.get_tier_class({"type": name})
        assert issubclass(cls, SecondaryTierManager) and issubclass(cls, KvtiersTier), name
    assert plugins_loaded.get_tier_class({"type": "kvtiers_fs"}).kvtiers_tier == "fs"
    # vLLM's own tiers keep their names
    assert not issubclass(plugins_loaded.get_tier_class({"type": "fs"}), KvtiersTier)
    from kvtiers.integrations.vllm.plugin import register

    register()  # vLLM loads plugins in every process, maybe twice: harmless


@pytest.mark.parametrize("how", ["module_path", "entry_point"])
def test_fs_tier_stores_the_cascade_and_a_new_engine_promotes_every_byte(how, tmp_path, request) -> None:
    tier = {"type": "kvtiers_fs", "root_dir": str(tmp_path / "kv")}
    if how == "module_path":
        tier["module_path"] = MODULE
    else:
        request.getfixturevalue("plugins_loaded")
    chunks = chunks_for(6, seed=1)

    a = Engine(tier)
    assert type(a.tier).__name__ == "kvtiers_fs" and a.tier.kvtiers_name == "fs"
    try:
        a.store("r1", chunks)
        # the cascade reached the tier: it answers HIT for every chunk
        assert [a.tier.handle.lookup([k]) for k in chunks] == [[kvtiers.Lookup.HIT]] * len(chunks)
        stats = a.m.get_stats().reduce()
        assert stats["vllm:kv_offload_tiering_write_bytes:('1:kvtiers_fs',)"] == len(chunks) * ROW
    finally:
        a.close()

    b = Engine(tier)  # a new engine on the same directory: its primary tier starts empty
    try:
        got, seen = b.load("r2", list(chunks))
        assert LookupResult.HIT_PENDING in seen  # vLLM promoted from the tier before answering HIT
        assert got == chunks  # every byte of every promoted row
        stats = b.m.get_stats().reduce()
        assert stats["vllm:kv_offload_tiering_read_bytes:('1:kvtiers_fs',)"] == len(chunks) * ROW
    finally:
        b.close()

    doc = json.loads(next((tmp_path / "kv").glob("*/config.json")).read_text())
    assert doc["fields"]["engine"] == "vllm" and doc["fields"]["model"] == "org/tiny-model"
    assert doc["fields"]["chunk_bytes"] == ROW and doc["fields"]["parallel"]["tp"] == 1  # TP is always in it


def test_memory_tier_promotes_what_the_primary_evicted_and_reports_its_own_evictions(tmp_path) -> None:
    # a 4-row primary and a memory tier bounded to 6 chunks: 10 stores evict from both
    tier = {"type": "kvtiers", "module_path": MODULE, "tier": "memory", "max_bytes": 6 * ROW,
            "enable_kv_events": True}
    e = Engine(tier, chunks=4)
    try:
        assert e.tier.medium.name == "CPU" and e.tier.kvtiers_name == "memory"
        chunks = chunks_for(10, seed=2)
        keys = list(chunks)
        for i in range(0, 10, 2):
            e.store(f"s{i}", {k: chunks[k] for k in keys[i:i + 2]})
        events = list(e.tier.take_events())
        assert {k for ev in events if not ev.removed for k in ev.keys} == set(keys)  # each store, as an event
        assert [k for ev in events if ev.removed for k in ev.keys] == keys[:4]  # the tier's LRU evictions
        stats = e.m.get_stats()
        assert stats.reduce()[f"{metrics.REMOVED}:('kvtiers', 'evicted')"] == 4

        got, _ = e.load("r", keys[4:6])  # in the tier, no longer in the 4-row primary
        assert got == {k: chunks[k] for k in keys[4:6]}
        got, _ = e.load("r2", keys[:2])  # evicted everywhere
        assert got == {}
    finally:
        e.close()


class RetryingMemoryTier(kvtiers.memory.MemoryTier):
    """The memory tier, answering RETRY to the first two lookups of each key (as a tier does
    while it checks a slow backend in the background)."""

    asked: dict[bytes, int] = {}

    @kvtiers.hookimpl
    def lookup(self, keys):
        answers = super().lookup(keys)
        out = []
        for k, a in zip(keys, answers, strict=True):
            n = self.asked[k] = self.asked.get(k, 0) + 1
            out.append(kvtiers.Lookup.RETRY if n <= 2 else a)
        return out


def test_a_tier_answering_retry_makes_vllm_retry_then_promote() -> None:
    tier = {"type": "kvtiers", "module_path": MODULE, "tier": f"{__name__}:RetryingMemoryTier",
            "retry_wait_ms": 0}  # RETRY passed as is (test_lookup_wait.py: asked again within the step)
    e = Engine(tier, chunks=4)
    try:
        chunks = chunks_for(6, seed=5)
        keys = list(chunks)
        for i in range(0, 6, 2):  # the 4-row primary keeps only the last 4
            e.store(f"s{i}", {k: chunks[k] for k in keys[i:i + 2]})
        RetryingMemoryTier.asked.clear()
        got, seen = e.load("r", keys[:2])
        assert got == {k: chunks[k] for k in keys[:2]}
        assert seen[:2] == [LookupResult.RETRY, LookupResult.RETRY]  # the tier's RETRY, passed through
        assert LookupResult.HIT_PENDING in seen and seen[-1] is LookupResult.HIT
    finally:
        e.close()


def test_misses_corrupt_chunks_and_failed_loads(tmp_path) -> None:
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")}
    chunks = chunks_for(4, seed=3)
    a = Engine(tier)
    try:
        a.store("r1", chunks)
        ns = a.tier.namespace
    finally:
        a.close()
    keys = list(chunks)
    fs_cls = kvtiers.get_registry().tier_info("fs").cls
    fs_cls.conformance_corrupt({"root_dir": str(tmp_path / "kv")}, ns, keys[1])

    b = Engine(tier)
    try:
        unknown = make_offload_key(b"\x07" * 32, 0)
        got, _ = b.load("miss", [unknown])
        assert got == {}
        got, seen = b.load("r2", keys)
        # the corrupt chunk failed its load: vLLM recomputes it, the others arrive intact
        assert got == {k: chunks[k] for k in keys if k != keys[1]}
        assert b.tier.lookup(keys[1], ReqContext("x")) is LookupResult.MISS  # not promoted again
        stats = b.m.get_stats().reduce()
        assert stats[f"{metrics.FAILED}:('kvtiers_fs', 'load')"] == 1
        assert stats["vllm:kv_offload_tiering_promotion_job_failures:('1:kvtiers_fs',)"] >= 1
        # storing it again heals it
        b.store("r3", {keys[1]: chunks[keys[1]]})
        assert b.tier.handle.lookup([keys[1]]) == [kvtiers.Lookup.HIT]
        assert b.tier.lookup(keys[1], ReqContext("x")) is LookupResult.HIT
    finally:
        b.close()


def test_reset_cache_drains_in_flight_jobs_and_shutdown_leaves_nothing(tmp_path) -> None:
    threads = {t.ident for t in threading.enumerate()}
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv"), "namespace": {"seed": 7}}
    e = Engine(tier, agnostic=False)
    shm = Path(f"/dev/shm/vllm_offload_{e.spec.config.engine_id}.mmap")
    assert shm.exists()
    chunks = chunks_for(8, seed=4)
    ctx = ReqContext(req_id="r")
    e.m.on_new_request(ctx)
    out = e.m.prepare_store(list(chunks), ctx)
    for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        e.rows[row] = np.frombuffer(chunks[key], dtype=np.uint8)
    e.m.complete_store(list(chunks), ctx)  # 8 stores in flight
    e.m.reset_cache()  # drain_jobs, then every job's result is consumed
    assert not e.tier.has_pending_work()
    assert all(e.tier.handle.lookup([k]) == [kvtiers.Lookup.HIT] for k in chunks)
    fields = e.tier.namespace.fields
    assert fields["parallel"] == {"tp": 2, "pp": 1, "pcp": 1, "dcp": 1} and fields["seed"] == 7
    assert e.m.config_info()[1]["kvtiers_namespace"] == e.tier.namespace.digest
    e.close()
    assert not shm.exists()  # vLLM could unmap and unlink its region: the adapter let go of it
    deadline = time.monotonic() + 10
    while {t.ident for t in threading.enumerate()} - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [t.name for t in threading.enumerate() if t.ident not in threads]
    assert all(t == THREAD_NAME for t in left), left  # only the SDK's shared I/O loop may stay


def test_config_errors_name_the_problem(tmp_path, caplog) -> None:
    with pytest.raises(ConfigError, match="max_byte"):
        Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path), "max_byte": 1})
    assert "still exported" not in caplog.text  # vLLM's clean-up could unmap its region
    with pytest.raises(ConfigError, match="name the kvtiers tier"):
        Engine({"type": "kvtiers", "module_path": MODULE})
    with pytest.raises(ConfigError, match="is the kvtiers tier 'fs'"):
        Engine({"type": "kvtiers_fs", "module_path": MODULE, "tier": "memory", "root_dir": str(tmp_path)})
    with pytest.raises(AttributeError, match="kvtiers_nope"):
        Engine({"type": "kvtiers_nope", "module_path": MODULE})


def test_metric_definitions_reach_vllms_spec() -> None:
    extra = {"cpu_bytes_to_use": 1 << 20,
             "secondary_tiers": [{"type": "kvtiers_memory", "module_path": MODULE}]}
    defs = TieringOffloadingSpec.build_metric_definitions(extra)
    assert {metrics.REMOVED, metrics.FAILED, metrics.BACKLOG} <= set(defs)
    assert defs[metrics.REMOVED].labelnames == ("kvtiers_tier", "reason")
    assert {"kvtiers_tier", "kvtiers_namespace"} <= set(TieringOffloadingSpec.config_info_keys(extra))
    assert os.environ.get("VLLM_PLUGINS") is None or "kvtiers" in os.environ["VLLM_PLUGINS"]


def test_a_tier_whose_polls_keep_raising_is_given_up_and_its_jobs_fail(tmp_path, monkeypatch, caplog) -> None:
    """Rule 4 says get_finished_jobs never raises; a tier that does it on every poll must not
    leave vLLM waiting for its jobs forever (it did: the adapter logged and reported nothing)."""
    from kvtiers.integrations.vllm import tier as tier_module

    monkeypatch.setattr(tier_module, "POLL_GIVE_UP_S", 0.5)
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")}
    e = Engine(tier)
    try:
        stored = chunks_for(2, seed=5)
        e.store("r0", stored)  # a healthy tier first: these are HITs
        assert all(e.tier.lookup(k, ReqContext("x")) is LookupResult.HIT for k in stored)

        def raising() -> list:  # fault injection: the tier's poll breaks
            raise OSError("poll broke")

        monkeypatch.setattr(e.tier.handle, "get_finished_jobs", raising)
        chunks = chunks_for(4, seed=6)
        with caplog.at_level("WARNING", logger="kvtiers.integrations.vllm"):
            e.store("r1", chunks)  # settle() fails after 30 s if a job is never reported
        assert e.tier.handle.closed  # closed (rule 9: its threads are gone) before its jobs were failed
        assert "given up" in caplog.text and "OSError: poll broke" in caplog.text
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "get_finished_jobs raised" in r.message]
        assert len(warned) == 1  # once, not once per poll
        stats = e.m.get_stats().reduce()
        assert stats[f"{metrics.FAILED}:('kvtiers_fs', 'store')"] == 4
        # from now on: every answer MISS (vLLM recomputes), every new job failed at once
        assert all(e.tier.lookup(k, ReqContext("y")) is LookupResult.MISS for k in [*stored, *chunks])
        e.store("r3", chunks_for(1, seed=7))
        assert not e.tier.has_pending_work()
    finally:
        e.close()


def test_a_failed_promotion_and_the_store_of_the_recomputed_chunks_are_one_offer(tmp_path) -> None:
    """A request whose promotions fail (corrupt chunks) stores the chunks vLLM recomputed: one
    offer of each key, not two, for the reuse ceiling, and its store counts for ``min_offers``;
    the next request's offer is their second."""
    root = tmp_path / "kv"
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(root), "admit": {"min_offers": 2}}
    chunks = chunks_for(3, seed=8)
    keys = list(chunks)
    a = Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(root)})
    try:
        a.store("r0", chunks)
        ns = a.tier.namespace
    finally:
        a.close()
    fs_cls = kvtiers.get_registry().tier_info("fs").cls
    for k in keys:
        fs_cls.conformance_corrupt({"root_dir": str(root)}, ns, k)

    b = Engine(tier)
    try:
        ctx = ReqContext(req_id="r1")
        b.m.on_new_request(ctx)
        deadline = time.monotonic() + 30
        while any(b.m.lookup(k, ctx) is not LookupResult.MISS for k in keys):  # promoted, failed: MISS
            b.m.on_schedule_end(STEP)
            assert time.monotonic() < deadline, "the failed promotions never answered MISS"
            time.sleep(0.002)
        assert b.tier.reuse.offers == 3  # the promotion offered them
        out = b.m.prepare_store(keys, ctx)  # vLLM recomputed them: the same request stores them
        for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            b.rows[row] = np.frombuffer(chunks[key], dtype=np.uint8)
        b.m.complete_store(keys, ctx)
        b.m.on_request_finished(ctx)
        b.settle()
        assert b.tier.reuse.offers == 3  # still one offer each
        assert b.tier.admission.declined == 3 and b.tier.admission.admitted == 0  # offered once: kept back
        assert b.tier.reuse.windows["15m"].ceiling() == pytest.approx(0.0, abs=0.01)
        # a second request offers them again (vLLM's primary tier holds them): their second offer
        ctx = ReqContext(req_id="r2")
        b.m.on_new_request(ctx)
        assert not b.m.prepare_store(keys, ctx).keys_to_store
        b.m.on_request_finished(ctx)
        b.settle()
        assert b.tier.admission.admitted == 3  # min_offers 2 met: the failed promotion's store counted
        deadline = time.monotonic() + 10  # stored: HIT, after any RETRY (rule 2)
        while kvtiers.Lookup.RETRY in (answers := b.tier.handle.lookup(keys)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answers == [kvtiers.Lookup.HIT] * 3
    finally:
        b.close()
