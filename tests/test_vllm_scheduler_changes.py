"""vLLM 0.34's scheduler-side changes, against a kvtiers tier in vLLM's own classes.

Runs on the vLLM wheel of the main environment (0.33) and, through
tests/test_vllm_releases.py, on vLLM 0.34 (build/vllm-0.34). What the adapter does for each
(docs/vllm.md, "vLLM 0.34"):

- KV events of Mamba groups: vLLM's ``OffloadingEventsTracker`` builds a recurrent group's
  state-checkpoint ``BlockStored`` from the store event's ``req_context``; a kvtiers tier's
  store event carries the request's own context, so its Mamba chunks are announced as vLLM's
  own tiers' are (0.34; the field is not there before).
- ``ReqContext`` token counts: the tenant wrapper returns the context vLLM's
  ``_create_req_context`` made, so its live counts stay (0.34).
- ``store_threshold``: vLLM refuses it for tiering specs, kvtiers' included, on every
  release the adapter runs on.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by `make test`")

from test_integration_vllm import MODULE, ROW, Engine, offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402

from kvtiers.integrations.vllm import KvtiersOffloadingSpec, compat, tenant  # noqa: E402

MEMORY = {"type": "kvtiers", "module_path": MODULE, "tier": "memory", "enable_kv_events": True}


def test_a_kvtiers_store_of_mamba_chunks_becomes_vllms_state_checkpoint_events() -> None:
    if not compat.EVENT_REQ_CONTEXT:
        pytest.skip("this vLLM's OffloadingEvent has no req_context (before 0.34): its events are not self-describing")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
        get_offloading_event_group_spec,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    # one Mamba group, a chunk per 16-token block: each chunk holds the state at its last token
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float16,))
    kind = get_offloading_event_group_spec(KVCacheGroupSpec(layer_names=["model.layers.0.mixer"], kv_cache_spec=mamba))
    group = GroupOffloadConfig(group_idx=0, tokens_per_block=16, tokens_per_chunk=16, hashes_per_chunk=1,
                               kv_event_group_spec=kind, sliding_window_size_in_chunks=1, kv_cache_spec=mamba,
                               manager_cls=object)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                               self_describing_kv_events=True), {0: kind})
    rng = np.random.default_rng(11)
    hashes = [BlockHash(rng.bytes(32)) for _ in range(3)]
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(48)), lora_request=None, resumable=False,
                              kv_transfer_params=None)
    ctx = ReqContext(req_id="mamba-req")
    tracker.on_new_request(ctx, request, (group,))  # what vLLM's scheduler does for each request
    keys = [make_offload_key(h, 0) for h in hashes]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    e = Engine(MEMORY)
    try:
        e.m.on_new_request(ctx)
        out = e.m.prepare_store(keys, ctx)
        for row in out.store_spec.block_ids:
            e.rows[row] = np.frombuffer(rng.bytes(ROW), dtype=np.uint8)
        e.m.complete_store(keys, ctx)
        e.m.on_request_finished(ctx)
        e.settle()
        raw = [ev for ev in e.tier.take_events() if not ev.removed]  # the kvtiers tier's own store events
        events = list(tracker.take_events(raw))
    finally:
        e.close()
    assert sorted(k for ev in raw for k in ev.keys) == sorted(keys)
    assert len(events) == 3
    parents = [None, *hashes[:2]]
    for ev, h, parent in zip(events, hashes, parents, strict=True):
        # a state checkpoint, chained to the hash before it (a placeholder has block size 0, no parent)
        assert ev.kv_cache_spec_kind == "mamba" and ev.token_ids == [] and ev.block_size == 16, ev
        assert ev.block_hashes == [maybe_convert_block_hash(h)], ev
        assert ev.parent_block_hash == (None if parent is None else maybe_convert_block_hash(parent)), ev


def test_the_tenant_wrapper_keeps_vllms_live_token_counts() -> None:
    mod = importlib.import_module(tenant._MODULE)
    assert tenant.install()
    create = mod._create_req_context
    if getattr(ReqContext, "num_computed_tokens", None) is None:
        pytest.skip("this vLLM's ReqContext has no token counts (before 0.34)")
    req = SimpleNamespace(request_id="r-tok", kv_transfer_params=None, kv_hints=None, cache_salt="acme",
                          num_computed_tokens=48, num_in_flight_tokens=16, num_prompt_tokens=100, num_tokens=101)
    scheduler = SimpleNamespace(_req_status={"r-tok": SimpleNamespace(req=req)})  # what the context reads
    ctx = create(req, scheduler)
    assert tenant.tenant_of(ctx) == "acme"
    assert (ctx.num_computed_tokens, ctx.num_in_flight_tokens, ctx.num_prompt_tokens, ctx.num_tokens) == \
        (48, 16, 100, 101)
    req.num_computed_tokens = 64  # live: the request's count as the scheduler moves on
    assert ctx.num_computed_tokens == 64


def test_store_threshold_is_refused_by_vllm_for_a_kvtiers_spec() -> None:
    spec = KvtiersOffloadingSpec(offloading_config({"secondary_tiers": [MEMORY], "store_threshold": 2}))
    with pytest.raises(ValueError, match="store_threshold is not supported"):
        spec.get_manager().shutdown()
