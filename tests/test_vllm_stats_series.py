"""kvtiers' own series (kvtiers_tier_*, kvtiers_host_*) through vLLM's offloading stats, the
path that reaches the API server's /metrics under ``vllm serve``.

vLLM 0.33's real classes: ``KvtiersOffloadingSpec`` (host arena = vLLM's CPU primary tier) with
the fs tier, driven as vLLM's scheduler drives it; its stats rendered by vLLM's own
``OffloadPromMetrics`` into a Prometheus registry, as the API server does.
"""

from __future__ import annotations

import contextlib
import functools
import re
import types
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from test_vllm_namespace import MODULE, ROW, Engine  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics  # noqa: E402
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402

from kvtiers.integrations.vllm import KvtiersOffloadingSpec  # noqa: E402


def rendered(stats_list: list, tiers: list[dict]) -> dict[str, float]:
    """``/metrics`` of vLLM's API server after it observed ``stats_list``: series -> value."""
    extra = {"spec_name": "KvtiersOffloadingSpec", "spec_module_path": MODULE, "cpu_bytes_to_use": 16 * ROW,
             "secondary_tiers": tiers}
    cfg = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra))
    reg = CollectorRegistry()
    prom = OffloadPromMetrics(cfg, {c: functools.partial(c, registry=reg) for c in (Counter, Gauge, Histogram)},
                              ["model_name", "engine"], {0: ["m", "0"]})
    for st in stats_list:
        prom.observe(st.data, 0)
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line.startswith("kvtiers_"):
            name, _, value = line.rpartition(" ")
            name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
            out[name] = float(value)
    return out


@contextlib.contextmanager
def stored_on_fs(tmp_path) -> Iterator[tuple[Engine, dict, dict]]:
    """test_vllm_namespace's engine with ``KvtiersOffloadingSpec`` on an fs tier, five random
    chunks stored: ``(engine, tier entry, chunks)``, the engine closed after."""
    tier = {"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")}
    rng = np.random.default_rng(0)
    chunks = {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(5)}
    e = Engine(tier, spec=KvtiersOffloadingSpec)
    try:
        e.store(chunks)
        yield e, tier, chunks
    finally:
        e.close()


def test_tier_and_host_series_reach_vllms_metrics(tmp_path) -> None:
    with stored_on_fs(tmp_path) as (e, tier, chunks):
        e.answers(list(chunks) + [make_offload_key(b"\x01" * 32, 0)])
        stats = [e.m.get_stats(), e.m.get_stats()]  # two steps: counters add up, the second adds nothing
    m = rendered(stats, [tier])
    assert m['kvtiers_tier_write_bytes_total{tier="kvtiers_fs"}'] == 5 * ROW
    assert m['kvtiers_tier_chunk_queries_total{tier="kvtiers_fs"}'] >= 6
    assert m['kvtiers_tier_chunk_hits_total{tier="kvtiers_fs"}'] >= 5
    assert m['kvtiers_tier_chunk_misses_total{tier="kvtiers_fs"}'] >= 1
    assert m['kvtiers_tier_lookup_duration_seconds_count{tier="kvtiers_fs"}'] == \
        m['kvtiers_tier_chunk_queries_total{tier="kvtiers_fs"}']
    assert m['kvtiers_tier_jobs_in_flight{kind="store",tier="kvtiers_fs"}'] == 0
    assert m["kvtiers_host_slots"] == 16 and m["kvtiers_host_used_slots"] == 5
    assert m["kvtiers_host_pinned_slots"] == 0


def test_host_only_has_the_host_series(tmp_path) -> None:
    e = Engine(None, spec=KvtiersOffloadingSpec)
    try:
        rng = np.random.default_rng(1)
        e.store({make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(3)})
        stats = [e.m.get_stats()]
    finally:
        e.close()
    m = rendered(stats, [])
    assert m["kvtiers_host_slots"] == 16 and m["kvtiers_host_used_slots"] == 3
