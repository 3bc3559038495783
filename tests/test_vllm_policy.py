"""``kvtiers_bip``, the primary-tier policy for cyclic reuse (kvtiers.integrations.vllm.policy),
in vLLM's own CPU offloading manager: conversations taken in turn whose chunks do not all fit
get no hit under vLLM's LRU and keep hitting under kvtiers_bip; where everything fits both hit
everything; eviction skips pinned chunks and is all or nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.manager", reason="vLLM 0.33.0 is installed by `make test`")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus  # noqa: E402

from kvtiers.integrations.vllm import plugin  # noqa: E402
from kvtiers.integrations.vllm.policy import BIP_EVERY, BipCachePolicy  # noqa: E402


def serve(policy: str, conversations: int, chunks: int, rounds: int, capacity: int = 64) -> list[int]:
    """Chunk hits per round: each conversation's request reads its chunks from the head (a miss
    ends it, as vLLM's lookup does), then stores them all, the conversations in turn."""
    plugin.register()  # as vLLM's plugin loader does at start-up
    m = CPUOffloadingManager(capacity, cache_policy=policy)
    keys = [[make_offload_key(bytes([c, i]) * 16, 0) for i in range(chunks)] for c in range(conversations)]
    hits = []
    for r in range(rounds):
        n = 0
        for c, ks in enumerate(keys):
            ctx = ReqContext(req_id=f"{r}-{c}")
            for i, k in enumerate(ks):
                ctx.set_offload_key_position(k, (i + 1) * 16)
            m.on_new_request(ctx)
            found = []
            for k in ks:
                if m.lookup(k, ctx) is not LookupResult.HIT:
                    break
                found.append(k)
            if found:
                m.prepare_load(found, ctx)
                m.complete_load(found, ctx)
            n += len(found)
            out = m.prepare_store(ks, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
        hits.append(n)
    return hits


def test_cyclic_reuse_larger_than_the_cache_hits_under_bip_only() -> None:
    lru = serve("lru", conversations=16, chunks=8, rounds=5)  # 128 chunks cycled through 64
    bip = serve("kvtiers_bip", conversations=16, chunks=8, rounds=5)
    assert lru == [0] * 5
    assert bip[0] == 0 and min(bip[1:]) >= 32, bip  # about half the cache keeps hitting


def test_a_working_set_that_fits_hits_everything_under_both() -> None:
    for policy in ("lru", "kvtiers_bip"):
        assert serve(policy, conversations=6, chunks=8, rounds=3) == [0, 48, 48], policy


def test_eviction_takes_the_old_end_skips_pins_and_is_all_or_nothing() -> None:
    p = BipCachePolicy(8)
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(5)]
    for k in keys:
        p.insert(k, ChunkStatus(len(p.chunks)), ctx)
        p.mark_evictable(k)  # insert with ref_cnt -1; the store completing makes it evictable
    p.touch([keys[0]], ctx)  # used again: to the new end
    # new chunks enter at the old end, the newest nearest it; a used one is evicted last
    assert [k for k, _ in p.evict(4, protected={keys[3]})] == [keys[4], keys[2], keys[1], keys[0]]
    assert list(p.chunks) == [keys[3]]
    p.mark_non_evictable(keys[3])
    assert p.evict(1, protected=set()) is None and list(p.chunks) == [keys[3]]  # pinned: nothing to take


def test_one_insert_in_bip_every_enters_at_the_new_end() -> None:
    p = BipCachePolicy(4 * BIP_EVERY)
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(i.to_bytes(4, "big") * 8, 0) for i in range(BIP_EVERY + 1)]
    for k in keys:
        p.insert(k, ChunkStatus(0), ctx)
        p.mark_evictable(k)
    order = [k for k, _ in p.evict(len(keys), protected=set())]
    assert order[-1] == keys[BIP_EVERY - 1]  # the 32nd insert went to the new end
    assert order[0] == keys[-1]


def test_a_chunk_promoted_from_a_kvtiers_tier_is_not_the_next_victim(tmp_path) -> None:
    """Under KvtiersOffloadingSpec with a kvtiers fs tier: a chunk promoted from the tier is a
    use (to the new end), so a store made before its request reads it does not evict it (at
    the old end, where insertion put it, it would be the first victim and be promoted again)."""
    from test_vllm_namespace import MODULE, ROW, STEP, Engine

    from kvtiers.integrations.vllm.spec import KvtiersOffloadingSpec

    rng = np.random.default_rng(5)

    def chunks(n: int) -> dict:
        return {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(n)}

    e = Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")},
               spec=KvtiersOffloadingSpec, eviction_policy="kvtiers_bip")
    try:
        a, b = chunks(16), chunks(16)  # the primary tier holds 16
        e.store(a)  # to the primary tier and on to fs
        e.store(b)  # every chunk of a leaves the primary tier
        (a0, *_) = a
        ctx = ReqContext(req_id="promote")
        e.m.on_new_request(ctx)
        for _ in range(2000):  # HIT_PENDING while the promotion from fs is in flight
            if e.m.lookup(a0, ctx) is LookupResult.HIT:
                break
            e.m.on_schedule_end(STEP)
            time.sleep(0.005)
        assert e.m.primary_tier.lookup(a0, ctx) is LookupResult.HIT
        e.store(chunks(1))  # one more store before the request reads a0
        assert e.m.primary_tier.lookup(a0, ctx) is LookupResult.HIT
    finally:
        e.close()
