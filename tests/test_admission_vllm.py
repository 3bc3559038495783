"""The ``"admit"`` option under vLLM's own tiering (the vLLM adapter, docs/admission.md#under-vllm):
vLLM cascades every store to each secondary tier itself; with ``"admit"`` the adapter asks vLLM
for its request-level policy (each request offers the tier all its chunks) and keeps back the
chunks offered fewer than ``min_offers`` times; write-back, which needs the primary tier's
evictions, is refused with one line. Run on
vLLM's own spec, manager and primary region with a real fs tier."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from kvtiers.errors import ConfigError  # noqa: E402

_spec = importlib.util.spec_from_file_location("lookup_wait", Path(__file__).parents[1] / "scripts" / "lookup_wait.py")
lookup_wait = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_wait)


def test_write_back_on_a_vllm_secondary_tier_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(ConfigError) as e:
        lookup_wait.make_manager(str(tmp_path), 16, {"admit": {"when": "evicted"}})
    assert "'when': 'evicted' is not applied under vLLM's tiering" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        lookup_wait.make_manager(str(tmp_path), 16, {"admit": {"min_offers": 0}})
    assert "min_offers" in str(e.value) and "\n" not in str(e.value)


def offer_again(e, chunks: dict, rid: str) -> None:
    """A request whose chunks vLLM's primary tier holds: the scheduler offers them for storing
    (request-level policy), the primary stores none, the manager cascades them."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=rid)
    e.m.on_new_request(ctx)
    out = e.m.prepare_store(list(chunks), ctx)
    assert out is not None and not out.keys_to_store
    e.m.on_request_finished(ctx)
    e.settle()


def test_min_offers_keeps_one_shot_chunks_out_of_the_tier(tmp_path) -> None:
    """Five chunks stored by one request are kept back (MISS in the tier, nothing written);
    offered by a second request, which finds them in vLLM's primary tier, they go down from
    there (vLLM's request-level policy cascades them); a third request writes nothing again.
    Sixteen chunks of one request stay out. A new engine on the same root finds exactly the
    five. vLLM's /metrics counts the decisions and the bytes written."""
    from test_vllm_namespace import MODULE, ROW, Engine, make_offload_key
    from test_vllm_stats_series import rendered
    from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ReqContext

    from kvtiers.integrations.vllm.spec import KvtiersOffloadingSpec

    root = tmp_path / "kv"
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(root), "admit": {"min_offers": 2}}
    rng = np.random.default_rng(3)
    shared = {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(5)}
    once = {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(6)}
    e = Engine(tier, spec=KvtiersOffloadingSpec)
    try:
        assert e.m.on_new_request(ReqContext(req_id="policy")).policy is OffloadPolicy.REQUEST_LEVEL
        e.store(shared, ReqContext(req_id="r1"))
        assert e.answers(list(shared)) == {LookupResult.MISS}
        assert not list(root.rglob("*.bin"))
        offer_again(e, shared, "r2")  # in the primary tier already: offered again, admitted
        assert e.answers(list(shared)) == {LookupResult.HIT}
        offer_again(e, shared, "r3")  # held by the tier: not sent again
        e.store(once, ReqContext(req_id="r4"))
        assert e.answers(list(once)) == {LookupResult.MISS}
        stats = [e.m.get_stats()]
    finally:
        e.close()
    m = rendered(stats, [tier])
    assert m['kvtiers_tier_admission_chunks_total{decision="admitted",tier="kvtiers_fs"}'] == 5
    assert m['kvtiers_tier_admission_chunks_total{decision="declined",tier="kvtiers_fs"}'] == 11
    assert m['kvtiers_tier_write_bytes_total{tier="kvtiers_fs"}'] == 5 * ROW
    plain = Engine({k: v for k, v in tier.items() if k != "admit"}, spec=KvtiersOffloadingSpec)
    try:
        assert plain.m.on_new_request(ReqContext(req_id="policy")).policy is OffloadPolicy.CHUNK_LEVEL
        assert plain.answers(list(shared)) == {LookupResult.HIT}
        assert plain.answers(list(once)) == {LookupResult.MISS}
    finally:
        plain.close()


def test_the_reuse_ceiling_reaches_vllms_metrics(tmp_path) -> None:
    """The vLLM adapter counts the chunks vLLM stores (its cascade) and loads (from the primary
    tier, ``refresh``; promotions) and reports ``kvtiers_reuse_ceiling`` per window in its
    stats, which vLLM's Prometheus logger exports on /metrics beside the tier's hit counts
    (docs/observability.md#the-reuse-ceiling)."""
    from test_vllm_namespace import ROW
    from test_vllm_stats_series import rendered, stored_on_fs

    with stored_on_fs(tmp_path) as (e, tier_cfg, chunks):
        (tier,) = e.m.secondary_tiers
        tier.refresh(list(chunks)[:2], None)  # two of them loaded again from the primary tier
        stats = [e.m.get_stats()]
    assert tier.reuse.offers == 7
    m = rendered(stats, [tier_cfg])
    for window in ("15m", "1h", "1d"):
        assert m[f'kvtiers_reuse_ceiling{{tier="kvtiers_fs",window="{window}"}}'] == pytest.approx(2 / 7, abs=0.01)
    assert m['kvtiers_tier_write_bytes_total{tier="kvtiers_fs"}'] == 5 * ROW
