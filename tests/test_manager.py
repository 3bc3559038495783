"""Tiering manager: stores cascade, lookups answer prefixes and sources, loads promote from
the first tier that has each chunk, pins hold across transfers and cancellation, tier faults
degrade to misses, per-request limits, listeners.

The device is CPU tensors; tiers are real (the memory tier, and memory-tier subclasses that
hold or fail results for fault injection); copies go through the DMA engine of
:mod:`kvtiers.engine.dma`, behind a gate that can hold completions to observe in-flight states.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
from tier_helpers import InlineMemoryTier

import kvtiers
from kvtiers import Job, JobResult, TierContext, hookimpl
from kvtiers.engine.hostcache import LOADING, READY
from kvtiers.engine.layout import KVLayout
from kvtiers.engine.manager import CacheEvent, Request, TieringManager
from kvtiers.errors import TierError

NUM_LAYERS = 2
BLOCK_SHAPE = (16, 16)  # float32: 1 KiB per block per tensor, a block of TOKENS_PER_BLOCK tokens
BPC = 2  # chunk = 2 layers x K,V x 2 blocks x 1 KiB = 8 KiB = 2 slots' worth of pages
NUM_BLOCKS = 96
TOKENS_PER_BLOCK = 16


def kv_caches(seed: int = 0) -> dict[str, list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": [[torch.rand((NUM_BLOCKS, *BLOCK_SHAPE), generator=g) for _ in range(2)] for _ in range(NUM_LAYERS)]}


def blocks_of(kv, blocks: Sequence[int]) -> list[torch.Tensor]:
    return [t[list(blocks)].clone() for layer in kv["kv"] for t in layer]


def poison(kv, blocks: Sequence[int]) -> None:
    for layer in kv["kv"]:
        for t in layer:
            t[list(blocks)] = -1.0


def chunk_blocks(i: int) -> list[int]:
    return [BPC * i, BPC * i + 1]


def key(i: int, tag: str = "") -> bytes:
    return f"chunk-{i}{tag}".encode()


class Gate:
    """Wraps a DMA engine; while closed, finished transfers are held back (the copies
    themselves ran), so tests can look at the in-flight state."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.closed = False
        self.held: list[int] = []

    def submit_store(self, tid, chunks):
        self.inner.submit_store(tid, chunks)

    def submit_load(self, tid, chunks):
        self.inner.submit_load(tid, chunks)

    def poll(self):
        self.held += self.inner.poll()
        if self.closed:
            return []
        out, self.held = self.held, []
        return out

    def close(self):
        self.inner.close()


def make_manager(num_slots: int, *, tiers=(), kv=None, **kw) -> tuple[TieringManager, dict, Gate]:
    from kvtiers.engine.arena import create_host_arena, slot_bytes_for
    from kvtiers.engine.dma import DmaEngine

    kv = kv if kv is not None else kv_caches()
    layout = KVLayout.from_tensors(kv)
    chunk_bytes = layout.chunk_bytes(BPC)
    host = create_host_arena(num_slots, slot_bytes_for(chunk_bytes), pin=False)
    gate = Gate(DmaEngine(layout, kv, host, BPC))
    kw.setdefault("tokens_per_chunk", TOKENS_PER_BLOCK * BPC)
    mgr = TieringManager(arena=host.arena, dma=gate, blocks_per_chunk=BPC, chunk_bytes=chunk_bytes, host=host, **kw)
    for t in tiers:
        if isinstance(t, tuple):
            mgr.add_tier(t[0], t[1], name=t[2] if len(t) > 2 else None)
        else:
            mgr.add_tier(t)
    return mgr, kv, gate


@pytest.fixture
def managers():
    made = []

    def make(*a, **kw):
        m = make_manager(*a, **kw)
        made.append(m[0])
        return m

    yield make
    for m in made:
        m.close(timeout=5)


def store_all(mgr, keys, first_block_chunk=0, request=None):
    blocks = [chunk_blocks(first_block_chunk + i) for i in range(len(keys))]
    tid = mgr.store(keys, blocks, request)
    (res,) = mgr.wait([tid], timeout=10)
    return res


def settle(mgr, timeout=10.0):
    """Let tier jobs (cascades) finish."""
    deadline = time.monotonic() + timeout
    while mgr.pending() and time.monotonic() < deadline:
        mgr.poll()
        time.sleep(0.001)
    assert not mgr.pending()


def load_and_check(mgr, kv, keys, src_chunks, dst_chunk0=20):
    """Load ``keys`` into fresh (poisoned) device blocks; compare with the source blocks."""
    dst = [chunk_blocks(dst_chunk0 + i) for i in range(len(keys))]
    flat_dst = [b for c in dst for b in c]
    expected = blocks_of(kv, [b for i in src_chunks for b in chunk_blocks(i)])
    poison(kv, flat_dst)
    (res,) = mgr.wait([mgr.load(keys, dst)], timeout=10)
    got = blocks_of(kv, flat_dst)
    if res.ok:
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
    return res


# -- basics --------------------------------------------------------------------------


def test_store_lookup_load_from_host(managers) -> None:
    mgr, kv, _ = managers(8)
    keys = [key(i) for i in range(3)]
    res = store_all(mgr, keys)
    assert res.ok and res.kind == "store" and not res.skipped_keys
    assert mgr.lookup(keys + [key(99)]) == kvtiers.engine.manager.LookupResult(3, ("host",) * 3, False)
    res = load_and_check(mgr, kv, keys, [0, 1, 2])
    assert res.ok and res.sources == dict.fromkeys(keys, "host")
    assert mgr.stats.hits["host"] == 3
    assert res.nbytes == 3 * mgr.chunk_bytes
    # a second store of the same chunks copies nothing
    res = store_all(mgr, keys)
    assert res.skipped_keys == tuple(keys)


def test_device_blocks_flat_or_per_chunk_and_errors(managers) -> None:
    mgr, kv, _ = managers(4)
    (res,) = mgr.wait([mgr.store([key(0), key(1)], [0, 1, 2, 3])])
    assert res.ok
    assert mgr.lookup([key(0), key(1)]).num_chunks == 2
    with pytest.raises(ValueError, match="expected 1 sequences of 2 block ids"):
        mgr.store([key(5)], [0, 1, 2])
    with pytest.raises(ValueError, match="duplicate keys"):
        mgr.load([key(0), key(0)], [0, 1, 2, 3])
    with pytest.raises(TypeError):
        mgr.lookup(["not bytes"])


def test_overflow_comes_back_from_the_tier_with_exact_bytes(managers) -> None:
    events: list[CacheEvent] = []
    mgr, kv, _ = managers(2, tiers=["memory"])
    mgr.add_listener(events.append)
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys):  # one store per chunk: the host keeps the last two
        store_all(mgr, [k], first_block_chunk=i)
        settle(mgr)  # the memory tier copies on its own thread: the slot is free once its cascade is done
    look = mgr.lookup(keys)
    assert look.num_chunks == 5
    assert look.sources == ("memory", "memory", "memory", "host", "host")
    res = load_and_check(mgr, kv, keys[:2], [0, 1])
    assert res.ok and res.sources == dict.fromkeys(keys[:2], "memory")
    assert mgr.stats.hits["memory"] == 2
    stored_in_tier = {k for e in events if e.kind == "stored" and e.medium == "memory" for k in e.keys}
    assert stored_in_tier == set(keys)
    evicted = [k for e in events if e.kind == "removed" and e.medium == "host" and e.reason == "evicted"
               for k in e.keys]
    assert evicted[:3] == keys[:3]
    promoted = [k for e in events if e.kind == "stored" and e.medium == "host" and e.reason == "promoted"
                for k in e.keys]
    assert promoted == keys[:2]
    for path in ("device->host", "host->memory", "memory->host", "host->device"):
        assert mgr.stats.paths[path].nbytes > 0, path


class OnlySuffix(InlineMemoryTier):
    """A memory tier that keeps only keys ending in ``suffix`` (others: failed keys)."""

    def __init__(self, ctx: TierContext, *, suffix: str, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self.suffix = suffix.encode()

    @hookimpl
    def submit_store(self, job: Job) -> None:
        mine = [(k, s) for k, s in zip(job.keys, job.slots, strict=True) if k.endswith(self.suffix)]
        super().submit_store(Job(job.job_id, tuple(k for k, _ in mine), tuple(s for _, s in mine)))
        res = self._finished.pop()
        others = tuple(k for k in job.keys if not k.endswith(self.suffix))
        self._finished.append(JobResult(res.job_id, res.failed_keys + others, res.nbytes, res.seconds, res.error))


def test_chunks_of_one_request_from_host_and_two_tiers(managers) -> None:
    mgr, kv, _ = managers(3, tiers=[(OnlySuffix, {"suffix": "-a"}, "tier-a"), (OnlySuffix, {"suffix": "-b"}, "tier-b")])
    keys = [key(0, "-h"), key(1, "-a"), key(2, "-b")]
    store_all(mgr, [keys[1]], first_block_chunk=1)
    store_all(mgr, [keys[2]], first_block_chunk=2)
    settle(mgr)
    for i in range(3, 6):  # push chunks 1 and 2 out of the host
        store_all(mgr, [key(i, "-x")], first_block_chunk=i)
    store_all(mgr, [keys[0]], first_block_chunk=0)
    settle(mgr)
    assert mgr.cache.state(keys[0]) == READY and keys[1] not in mgr.cache and keys[2] not in mgr.cache
    look = mgr.lookup(keys)
    assert look.sources == ("host", "tier-a", "tier-b")
    res = load_and_check(mgr, kv, keys, [0, 1, 2])
    assert res.ok
    assert res.sources == {keys[0]: "host", keys[1]: "tier-a", keys[2]: "tier-b"}
    assert mgr.stats.hits == {"host": 1, "tier-a": 1, "tier-b": 1}


def test_a_load_longer_than_the_arena_runs_in_waves(managers) -> None:
    mgr, kv, _ = managers(3, tiers=["memory"])
    keys = [key(i) for i in range(8)]
    for i, k in enumerate(keys):
        store_all(mgr, [k], first_block_chunk=i)
        settle(mgr)  # the cascade frees the slot for the next store
    assert mgr.lookup(keys).num_chunks == 8
    res = load_and_check(mgr, kv, keys, list(range(8)))
    assert res.ok and len(res.sources) == 8
    assert mgr.stats.paths["host->device"].chunks == 8
    assert mgr.cache.pinned_slots() == 0


def test_a_load_finding_every_slot_busy_fails_instead_of_waiting(managers) -> None:
    mgr, kv, gate = managers(2, tiers=["memory"])
    for i in range(3):
        store_all(mgr, [key(i)], first_block_chunk=i)
    settle(mgr)
    gate.closed = True
    busy = mgr.store([key(5), key(6)], [chunk_blocks(5), chunk_blocks(6)])  # pins both slots
    res = load_and_check(mgr, kv, [key(0)], [0])
    assert res.failed_keys == (key(0),)
    gate.closed = False
    assert mgr.wait([busy])[0].ok


def test_lookup_stops_at_the_first_chunk_nobody_has(managers) -> None:
    mgr, kv, _ = managers(4, tiers=["memory"])
    store_all(mgr, [key(0), key(2)])
    settle(mgr)
    look = mgr.lookup([key(0), key(1), key(2)])
    assert (look.num_chunks, look.retry) == (1, False)
    # a load of a chunk nobody has reports it failed, loads the rest, raises nothing
    res = load_and_check(mgr, kv, [key(0), key(1)], [0, 1])
    assert res.failed_keys == (key(1),)


# -- pins, cancellation, RETRY -------------------------------------------------------------


class HeldTier(InlineMemoryTier):
    """A memory tier whose results are held back while ``hold`` is set (fault injection:
    a slow tier)."""

    hold = threading.Event()

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        if self.hold.is_set():
            return []
        return super().get_finished_jobs()


@pytest.fixture
def held():
    HeldTier.hold.clear()
    yield HeldTier.hold
    HeldTier.hold.clear()


def test_slots_are_pinned_during_the_device_copy(managers) -> None:
    mgr, kv, gate = managers(2)
    gate.closed = True
    tid = mgr.store([key(0), key(1)], [chunk_blocks(0), chunk_blocks(1)])
    assert mgr.get_finished() == []
    assert mgr.lookup([key(0)]).retry  # storing: not loadable yet
    tid2 = mgr.store([key(2)], [chunk_blocks(2)])  # every slot pinned: skipped, nothing evicted
    (r2,) = mgr.wait([tid2])
    assert r2.skipped_keys == (key(2),) and mgr.stats.host_full == 1
    assert mgr.cache.pinned_slots() == 2
    gate.closed = False
    (r1,) = mgr.wait([tid])
    assert r1.ok and mgr.cache.pinned_slots() == 0
    (r3,) = mgr.wait([mgr.store([key(2)], [chunk_blocks(2)])])
    assert not r3.skipped_keys and key(0) not in mgr.cache


def test_slots_are_pinned_during_the_tier_store(managers, held) -> None:
    mgr, kv, _ = managers(1, tiers=[HeldTier])
    held.set()
    store_all(mgr, [key(0)])
    assert mgr.cache.pinned_slots() == 1  # the cascade still reads the slot
    (res,) = mgr.wait([mgr.store([key(1)], [chunk_blocks(1)])])
    assert res.skipped_keys == (key(1),)
    held.clear()
    settle(mgr)
    assert mgr.cache.pinned_slots() == 0
    (res,) = mgr.wait([mgr.store([key(1)], [chunk_blocks(1)])])
    assert not res.skipped_keys


def test_retry_while_a_promotion_is_in_flight(managers, held) -> None:
    mgr, kv, _ = managers(1, tiers=[HeldTier])
    store_all(mgr, [key(0)])
    settle(mgr)
    store_all(mgr, [key(1)], first_block_chunk=1)  # evicts key 0 from the host
    settle(mgr)
    assert mgr.lookup([key(0)]).num_chunks == 1
    held.set()
    tid = mgr.load([key(0)], [chunk_blocks(30)])
    assert mgr.cache.state(key(0)) == LOADING
    look = mgr.lookup([key(0)])
    assert (look.num_chunks, look.retry) == (0, True)
    held.clear()
    (res,) = mgr.wait([tid])
    assert res.ok
    assert mgr.lookup([key(0)]) == kvtiers.engine.manager.LookupResult(1, ("host",), False)


def test_cancelled_request_keeps_slots_pinned_until_the_transfer_ends(managers, held) -> None:
    mgr, kv, _ = managers(2, tiers=[HeldTier])
    for i in range(4):
        store_all(mgr, [key(i)], first_block_chunk=i)
    settle(mgr)  # host: chunks 2, 3; tier: all
    req = Request("r1")
    held.set()
    dst = [chunk_blocks(40), chunk_blocks(41)]
    poison(kv, dst[0] + dst[1])
    before = blocks_of(kv, dst[0] + dst[1])
    tid = mgr.load([key(0), key(1)], dst, req)
    slots = [mgr.cache.slot(key(0)), mgr.cache.slot(key(1))]
    req.cancel()
    assert mgr.store([key(9)], [chunk_blocks(9)], req) is None
    assert mgr.load([key(2)], [chunk_blocks(42)], req) is None
    for _ in range(3):  # still pinned: neither evicted nor reused by other requests
        (res,) = mgr.wait([mgr.store([key(10)], [chunk_blocks(10)])])
        assert res.skipped_keys == (key(10),)
        assert all(mgr.cache.refs(s) >= 1 for s in slots)
    assert mgr.get_finished() == []
    held.clear()
    (res,) = mgr.wait([tid])
    assert res.cancelled and not res.ok and res.request_id == "r1"
    assert set(res.failed_keys) == {key(0), key(1)}  # nothing was copied to the device
    for b, a in zip(before, blocks_of(kv, dst[0] + dst[1]), strict=True):
        assert torch.equal(a, b)
    assert all(mgr.cache.refs(s) == 0 for s in slots)
    assert mgr.cache.state(key(0)) == READY  # the promoted chunks stay useful to others


# -- failing tiers ---------------------------------------------------------------------------


class FailLoads:
    """A wrapper plugin injecting faults into a tier's loads: ``raise`` (submit raises),
    ``fail`` (every key reported failed), ``lose`` (results never reported)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.keys: dict[int, tuple[bytes, ...]] = {}

    @hookimpl(wrapper=True)
    def submit_load(self, job):
        if self.mode == "raise":
            raise TierError("injected: backend down")
        self.keys[job.job_id] = job.keys
        return (yield)

    @hookimpl(wrapper=True)
    def get_finished_jobs(self):
        results = yield
        if self.mode == "fail":
            return [JobResult(r.job_id, self.keys.get(r.job_id, ()), error="injected") for r in results]
        if self.mode == "lose":
            return [r for r in results if r.job_id not in self.keys]
        return results


class LookupBoom:
    @hookimpl(wrapper=True)
    def lookup(self, keys):
        raise OSError("injected: lookup fails")
        yield  # pragma: no cover


def evicted_setup(managers, **kw):
    mgr, kv, gate = managers(2, tiers=["memory"], **kw)
    for i in range(3):  # each cascade settles before the next store needs its slot
        store_all(mgr, [key(i)], first_block_chunk=i)
        settle(mgr)
    assert mgr.lookup([key(0)]).sources == ("memory",)
    return mgr, kv


@pytest.mark.parametrize("mode", ["raise", "fail", "lose"])
def test_a_failing_tier_degrades_to_a_miss(managers, mode, caplog) -> None:
    mgr, kv = evicted_setup(managers, tier_job_timeout=0.3)
    mgr.tiers[0].handle.add_wrapper(FailLoads(mode))
    res = load_and_check(mgr, kv, [key(0)], [0])
    assert res.failed_keys == (key(0),) and not res.ok
    assert key(0) not in mgr.cache or mgr.cache.state(key(0)) != READY
    assert mgr.stats.failed_loads == 1
    if mode != "fail":
        assert mgr.stats.tier_errors["memory"] >= 1
        assert "treated as a miss" in caplog.text
    # the host keeps working: stores and host loads go on
    store_all(mgr, [key(5)], first_block_chunk=5)
    assert load_and_check(mgr, kv, [key(5)], [5]).ok
    settle(mgr)  # key(5)'s cascade to the tier holds its slot until it is done
    # a lost job's slot stays quarantined (pinned) as long as the tier might write it
    assert mgr.cache.pinned_slots() == (1 if mode == "lose" else 0)


def test_a_tier_whose_lookup_raises_answers_miss(managers) -> None:
    mgr, kv = evicted_setup(managers)
    mgr.tiers[0].handle.add_wrapper(LookupBoom())
    assert mgr.lookup([key(0)]) == kvtiers.engine.manager.LookupResult(0, (), False)
    res = load_and_check(mgr, kv, [key(0)], [0])
    assert res.failed_keys == (key(0),)


def test_a_failed_promotion_falls_to_a_miss_not_a_later_tier_hit(managers) -> None:
    """A chunk a tier claims but cannot load is a failed key for that load; the engine
    recomputes it. (The next lookup may still name the tier; the tier's answer rules.)"""
    mgr, kv = evicted_setup(managers)
    mgr.tiers[0].handle.tier._data.clear()  # the tier lost everything behind our back
    res = load_and_check(mgr, kv, [key(0)], [0])
    assert res.failed_keys == (key(0),)
    assert mgr.lookup([key(0)]).num_chunks == 0


# -- admission and limits ----------------------------------------------------------------------


def test_store_threshold(managers) -> None:
    mgr, kv, _ = managers(4, store_threshold=2)
    assert store_all(mgr, [key(0)]).skipped_keys == (key(0),)
    assert mgr.lookup([key(0)]).num_chunks == 0
    assert store_all(mgr, [key(0)]).skipped_keys == ()
    assert mgr.lookup([key(0)]).num_chunks == 1


def test_offload_prompt_only_and_max_offload_tokens(managers) -> None:
    tpc = TOKENS_PER_BLOCK * BPC  # 32 tokens per chunk
    mgr, kv, _ = managers(16)
    keys = [key(i) for i in range(5)]
    res = store_all(mgr, keys, request=Request("a", num_prompt_tokens=3 * tpc + 5))
    assert res.skipped_keys == tuple(keys[3:])  # the 4th chunk would hold generated tokens
    keys = [key(i, "b") for i in range(5)]
    res = store_all(mgr, keys, request=Request("b", num_prompt_tokens=10 * tpc, max_offload_tokens=2 * tpc))
    assert res.skipped_keys == tuple(keys[2:])
    # first_chunk: the request's 3rd and 4th chunks, the limit is 3 chunks
    keys = [key(i, "c") for i in range(2)]
    tid = mgr.store(keys, [chunk_blocks(0), chunk_blocks(1)], Request("c", num_prompt_tokens=3 * tpc), first_chunk=2)
    (res,) = mgr.wait([tid])
    assert res.skipped_keys == (keys[1],)
    mgr.offload_prompt_only = False
    keys = [key(i, "d") for i in range(4)]
    assert store_all(mgr, keys, request=Request("d", num_prompt_tokens=tpc)).skipped_keys == ()


def test_config_max_offload_tokens(managers) -> None:
    mgr, kv, _ = managers(8, max_offload_tokens=TOKENS_PER_BLOCK * BPC)
    res = store_all(mgr, [key(0), key(1)])
    assert res.skipped_keys == (key(1),)


# -- listeners ---------------------------------------------------------------------------------


def test_listeners_receive_tier_removals_and_host_evictions(managers) -> None:
    events: list[CacheEvent] = []
    mgr, kv, _ = managers(1)
    chunk = mgr.arena.slot_bytes
    mgr.add_tier("memory", {"max_bytes": 2 * chunk}, name="small")
    mgr.add_listener(events.append)

    def boom(ev):
        raise RuntimeError("a broken listener")

    mgr.add_listener(boom)  # logged, the others still hear everything
    for i in range(4):
        store_all(mgr, [key(i)], first_block_chunk=i)
    settle(mgr)
    removed_tier = [k for e in events if (e.kind, e.medium) == ("removed", "small") for k in e.keys]
    assert removed_tier == [key(0), key(1)]
    assert {e.reason for e in events if (e.kind, e.medium) == ("removed", "small")} == {"evicted"}
    removed_host = [k for e in events if (e.kind, e.medium) == ("removed", "host") for k in e.keys]
    assert removed_host == [key(0), key(1), key(2)]
    stored_host = [k for e in events if (e.kind, e.medium) == ("stored", "host") for k in e.keys]
    assert stored_host == [key(i) for i in range(4)]
    assert all(isinstance(k, bytes) for e in events for k in e.keys)


def test_removals_reported_from_a_tier_thread_arrive_on_the_engine_thread(managers) -> None:
    mgr, kv, _ = managers(2, tiers=["memory"])
    seen: list[tuple[CacheEvent, str]] = []
    mgr.add_listener(lambda ev: seen.append((ev, threading.current_thread().name)))
    t = threading.Thread(target=mgr.tiers[0].handle.ctx.removed, args=([b"gone"], "corrupt"), name="tier-io")
    t.start()
    t.join()
    assert seen == []  # queued until the engine's next call
    mgr.get_finished()
    assert seen == [(CacheEvent("removed", (b"gone",), "memory", "corrupt"), threading.current_thread().name)]


def test_tier_names_are_unique(managers) -> None:
    mgr, kv, _ = managers(2, tiers=["memory", "memory"])
    assert [t.name for t in mgr.tiers] == ["memory", "memory#2"]
    with pytest.raises(ValueError, match="already used"):
        mgr.add_tier("memory", name="memory")


# -- from_config ----------------------------------------------------------------------------


def test_from_config_with_vllm_names(tmp_path) -> None:
    kv = kv_caches()
    chunk = KVLayout.from_tensors(kv).chunk_bytes(BPC)
    cfg = {
        "cpu_bytes_to_use": 6 * chunk,
        "block_size": TOKENS_PER_BLOCK * BPC,
        "eviction_policy": "arc",
        "secondary_tiers": [{"type": "memory", "name": "ram"}],
        "spec_name": "TieringOffloadingSpec",
    }
    with TieringManager.from_config(cfg, kv, namespace_fields={"model": "m"}, tokens_per_block=TOKENS_PER_BLOCK) as mgr:
        assert mgr.blocks_per_chunk == BPC and mgr.tokens_per_chunk == TOKENS_PER_BLOCK * BPC
        assert len(mgr.arena) >= 1 and mgr.arena.slot_bytes % 4096 == 0
        assert [t.name for t in mgr.tiers] == ["ram"]
        fields = mgr.namespace.fields
        assert fields["model"] == "m" and fields["blocks_per_chunk"] == BPC and fields["chunk_bytes"] == chunk
        assert fields["layout"] == KVLayout.from_tensors(kv).describe()
        assert mgr.tiers[0].handle.ctx.namespace.digest == mgr.namespace.digest
        (res,) = mgr.wait([mgr.store([key(0)], [0, 1])])
        assert res.ok
        settle(mgr)
        assert mgr.lookup([key(0)]).sources == ("host",)


def test_from_config_bad_block_size(tmp_path) -> None:
    kv = kv_caches()
    with pytest.raises(kvtiers.ConfigError, match="not a multiple"):
        TieringManager.from_config({"host_bytes": 1 << 20, "block_size": 24}, kv, tokens_per_block=16)


def test_close_finishes_tier_jobs_and_is_idempotent(held) -> None:
    mgr, kv, _ = make_manager(2, tiers=[HeldTier])
    held.set()
    store_all(mgr, [key(0)])
    assert mgr.pending() == 1  # the cascade to the tier
    threading.Timer(0.2, held.clear).start()
    mgr.close(timeout=10)
    assert mgr.pending() == 0
    mgr.close()
    assert mgr.tiers[0].handle.closed
