"""Prometheus metrics: around every tier (a third-party one too, with its own metric), the
host cache and the DMA engine; ``/metrics`` of a running demo scraped over HTTP and parsed
with prometheus_client's parser; several worker processes summed in multiprocess mode."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tier_helpers import CopyDma

from kvtiers import Arena, Job, JobResult, hookimpl
from kvtiers.engine.manager import TieringManager
from kvtiers.errors import ConfigError
from kvtiers.memory import MemoryTier
from kvtiers.metrics import attach_metrics, parse_metrics, tier_metrics

TESTS = Path(__file__).resolve().parent
SLOT = 4096


class CountingTier(MemoryTier):
    """A third-party tier with a metric of its own, made through the documented call."""

    def __init__(self, ctx, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        m = tier_metrics(ctx)
        self.stored = m.counter("counting_tier_stored_chunks", "Chunks this tier was asked to store.", ["phase"])

    @hookimpl
    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        self.stored.labels(phase="submit").inc(len(job.keys))


class BrokenLoads(MemoryTier):
    """Every load fails with an error naming an exception type."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._finished.append(JobResult(job.job_id, job.keys, error="OSError: disk gone"))


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of an exposition, via prometheus_client's parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(found: dict, name: str, **labels: str) -> float:
    return found[name, tuple(sorted(labels.items()))]


def settle(mgr: TieringManager) -> None:
    deadline = time.monotonic() + 10
    while mgr.pending() and time.monotonic() < deadline:
        mgr.poll()
        time.sleep(0.001)


def test_every_tier_is_observed_and_a_tiers_own_metric_is_exposed() -> None:
    reg = CollectorRegistry()
    mgr = TieringManager(arena=Arena.allocate(2, SLOT), dma=CopyDma())
    mgr.add_tier(CountingTier, {}, name="counting")
    mgr.add_tier(BrokenLoads, {}, name="broken")
    mm = attach_metrics(mgr, {"interval": 0}, registry=reg)
    keys = [bytes([i]) for i in range(5)]
    for k in keys:
        mgr.wait([mgr.store([k], [0])])
    settle(mgr)
    look = mgr.lookup(keys)  # b"\x00" was evicted from the 2-slot host: the tiers have it
    assert look.sources[0] == "counting"
    (res,) = mgr.wait([mgr.load(keys[:1], [1])])
    assert res.ok and res.sources[keys[0]] == "counting"
    mgr.close()
    found = samples(generate_latest(reg).decode())
    for tier in ("counting", "broken"):
        assert value(found, "kvtiers_tier_write_bytes_total", tier=tier) == 5 * SLOT
        assert value(found, "kvtiers_tier_write_seconds_total", tier=tier) > 0
        assert value(found, "kvtiers_tier_jobs_in_flight", tier=tier, kind="store") == 0
        assert value(found, "kvtiers_tier_lookup_duration_seconds_count", tier=tier) > 0
    assert value(found, "kvtiers_tier_read_bytes_total", tier="counting") == SLOT
    assert value(found, "kvtiers_tier_chunk_hits_total", tier="counting") >= 2  # the lookup and the promotion
    q = value(found, "kvtiers_tier_chunk_queries_total", tier="counting")
    assert q == (value(found, "kvtiers_tier_chunk_hits_total", tier="counting")
                 + value(found, "kvtiers_tier_chunk_misses_total", tier="counting")
                 + value(found, "kvtiers_tier_chunk_retries_total", tier="counting"))
    assert value(found, "counting_tier_stored_chunks_total", tier="counting", phase="submit") == 5
    assert value(found, "kvtiers_host_slots") == 2
    assert value(found, "kvtiers_host_evictions_total") == mgr.cache.evictions == 4  # 3 stores, 1 promotion
    assert mm.tier_summary()["counting"]["hits"] == value(found, "kvtiers_tier_chunk_hits_total", tier="counting")

    # a failed load job is counted once, by kind and the exception type the tier named
    mgr2 = TieringManager(arena=Arena.allocate(2, SLOT), dma=CopyDma())
    mgr2.add_tier(BrokenLoads, {}, name="broken")
    attach_metrics(mgr2, {}, registry=reg)
    mgr2.wait([mgr2.store([b"a"], [0])])
    mgr2.wait([mgr2.store([b"b"], [0])])
    mgr2.wait([mgr2.store([b"c"], [0])])  # b"a" leaves the host
    settle(mgr2)
    (res,) = mgr2.wait([mgr2.load([b"a"], [1])])
    assert not res.ok
    mgr2.close()
    found = samples(generate_latest(reg).decode())
    assert value(found, "kvtiers_tier_job_failures_total", tier="broken", kind="load", reason="OSError") == 1


def test_metrics_config_block_is_checked() -> None:
    assert parse_metrics({"enable": False}) is None and parse_metrics({"port": 9100}).port == 9100
    with pytest.raises(ConfigError, match="metrics: unknown key 'prot'"):
        parse_metrics({"prot": 9100})
    with pytest.raises(ConfigError, match="metrics.port expects a port number"):
        parse_metrics({"port": "9100"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_metrics_endpoint_of_a_running_demo(tmp_path) -> None:
    port = free_port()
    # TMPDIR: the demo is killed while it lingers, so the directory it makes is never removed
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))
    config = {"host_bytes": 8 << 20, "tiers": [{"type": "fs", "root_dir": str(tmp_path / "kv")},
                                               {"type": "test_metrics:CountingTier", "name": "counting"}]}
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvtiers.commands", "demo", "--turns", "3", "--conversations", "4", "--json",
         "--metrics-port", str(port), "--linger", "30", "--config", json.dumps(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    found: dict = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                    found = samples(r.read().decode())
            except OSError:
                found = {}
            if (found.get(("kvtiers_tier_read_bytes_total", (("tier", "fs"),)), 0) > 0
                    and found.get(("counting_tier_stored_chunks_total", (("phase", "submit"), ("tier", "counting"))),
                                  0) > 0):
                break
            assert demo.poll() is None, demo.communicate()
            time.sleep(0.2)
    finally:
        demo.kill()
        demo.communicate()
    assert found, "no /metrics answer while the demo ran"
    for tier in ("fs", "counting"):
        for name in ("kvtiers_tier_chunk_queries_total", "kvtiers_tier_chunk_hits_total",
                     "kvtiers_tier_write_bytes_total", "kvtiers_tier_read_seconds_total"):
            assert (name, (("tier", tier),)) in found, (name, tier)
        assert ("kvtiers_tier_jobs_in_flight", (("kind", "load"), ("tier", tier))) in found
    assert value(found, "kvtiers_tier_write_bytes_total", tier="fs") > 0
    assert value(found, "counting_tier_stored_chunks_total", tier="counting", phase="submit") > 0
    assert value(found, "kvtiers_host_slots") == 8


WORKER = textwrap.dedent("""
    import sys
    from kvtiers import Arena
    from kvtiers.engine.manager import TieringManager
    from kvtiers.metrics import attach_metrics

    class CopyDma:
        done = []
        def submit_store(self, tid, chunks): self.done.append(tid)
        def submit_load(self, tid, chunks): self.done.append(tid)
        def poll(self):
            out, self.done[:] = list(self.done), []
            return out

    mgr = TieringManager(arena=Arena.allocate(4, 4096), dma=CopyDma())
    mgr.add_tier("memory", {}, name="ram")
    attach_metrics(mgr)
    for i in range(int(sys.argv[1])):
        mgr.wait([mgr.store([bytes([i])], [0])])
    mgr.close()
""")

SCRAPER = textwrap.dedent("""
    import urllib.request
    from kvtiers.metrics import serve_metrics

    server = serve_metrics(0, "127.0.0.1")
    print(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode())
    server.close()
""")


def test_multiprocess_mode_sums_the_workers(tmp_path) -> None:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for n in (3, 5):  # two worker processes, one after the other
        subprocess.run([sys.executable, "-c", WORKER, str(n)], check=True, env=env, timeout=120)
    p = subprocess.run([sys.executable, "-c", SCRAPER], capture_output=True, text=True, env=env, timeout=120,
                       check=True)
    found = samples(p.stdout)
    assert value(found, "kvtiers_tier_write_bytes_total", tier="ram") == 8 * SLOT
    assert value(found, "kvtiers_tier_chunk_queries_total", tier="ram") == 8


#: a process whose default registry already holds kvtiers' series under their names, as vLLM's
#: in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) declares them; then a tier outside any
#: manager (as under vLLM) counts with a metric of its own
_HOST_HOLDS_THE_NAMES = textwrap.dedent("""
    import sys
    from prometheus_client import REGISTRY, Counter, generate_latest
    sys.path.insert(0, sys.argv[1])
    from test_metrics import CountingTier
    from kvtiers import Arena, Job, TierContext

    Counter("kvtiers_tier_chunk_queries", "as vLLM declares it", ["tier"], registry=REGISTRY)
    tier = CountingTier(TierContext(Arena.allocate(2, 4096)))
    tier.submit_store(Job(1, [b"a", b"b"], [0, 1]))
    print(generate_latest(REGISTRY).decode())
""")


def test_a_tiers_own_metric_works_where_the_host_registered_kvtiers_series_first() -> None:
    proc = subprocess.run([sys.executable, "-c", _HOST_HOLDS_THE_NAMES, str(TESTS)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = samples(proc.stdout)
    assert value(found, "counting_tier_stored_chunks_total", tier="unattached", phase="submit") == 2
