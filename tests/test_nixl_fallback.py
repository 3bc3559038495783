"""The NIXL paths when NIXL's canary crashes (the RDMA-driver segfault of docs/p2p.md, here
injected into the canary child with ``KVTIERS_NIXL_CANARY_FAULT=segv``): the p2p tier, the
p2p server, the ``serve`` block (through the PD demo) and the obj tier take their fallback
(ZMQ, aiobotocore) with one warning and still verify every byte; ``nixl_strict`` makes it an
error at open; ``data_path`` and the ``kvtiers_tier_data_path`` gauge say which path is in use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("zmq")
pytest.importorskip("nixl_cu12")

from kvtiers_nixl import canary  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Namespace, TierContext, TierError, open_tier  # noqa: E402

NS = Namespace({"test": "nixl-fallback"})


@pytest.fixture
def crashing(monkeypatch, tmp_path):
    """The canary crashes with SIGSEGV at exit in this process and every child started now."""
    monkeypatch.setenv(canary.CACHE_ENV, str(tmp_path / "canary"))
    monkeypatch.setenv(canary.FAULT_ENV, "segv")
    canary.forget()
    yield dict(os.environ)
    canary.forget()


def _round_trip(port: int, backend: str, n: int = 8, size: int = 64 << 10, **opts):
    src, dst = Arena.allocate(n, size), Arena.allocate(n, size)
    for i in range(n):
        src[i][:] = os.urandom(size)
    keys = tuple(b"fb-%d-%s" % (i, os.urandom(4).hex().encode()) for i in range(n))
    a = open_tier("p2p", {"host": "127.0.0.1", "port": port}, TierContext(src, NS))
    b = open_tier("p2p", {"host": "127.0.0.1", "port": port, "backend": backend, "timeout": 10.0, **opts},
                  TierContext(dst, NS))
    try:
        a.submit_store(Job(1, keys, tuple(range(n))))
        assert wait(a, 1).ok
        b.submit_load(Job(2, keys, tuple(range(n))))
        r = wait(b, 2)
        assert r.ok, r.error
        assert all(bytes(dst[i]) == bytes(src[i]) for i in range(n))
        return b.tier.data_path
    finally:
        a.close()
        b.close()


def test_p2p_tier_falls_back_to_zmq_loudly(crashing, caplog):
    srv = start_server(capacity=64 << 20, extra=["--nixl"], env={k: v for k, v in crashing.items()
                                                                   if k != canary.FAULT_ENV})
    try:
        with caplog.at_level("WARNING"):
            assert _round_trip(srv.port, "nixl") == "zmq"
        lines = [r.getMessage() for r in caplog.records if "NIXL is off" in r.getMessage()]
        assert lines == ["tier 'p2p': NIXL is off in this process: NIXL's UCX canary process was killed by SIGSEGV "
                         "at 'exit'; using ZMQ instead (docs/p2p.md, 'NIXL and RDMA drivers')"]
    finally:
        srv.stop()


def test_p2p_tier_strict_is_an_error_at_open(crashing):
    with pytest.raises(TierError, match=r"tier 'p2p': NIXL is unsafe in this process \(NIXL's UCX canary process "
                                        r"was killed by SIGSEGV at 'exit'\); nixl_strict is set"):
        open_tier("p2p", {"host": "127.0.0.1", "port": 9, "backend": "nixl", "nixl_strict": True},
                  TierContext(Arena.allocate(2, 4096), NS))


def test_data_path_gauge_says_which_path(crashing):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from tier_helpers import CopyDma

    from kvtiers.engine.manager import TieringManager
    from kvtiers.metrics import attach_metrics

    reg = CollectorRegistry()
    mgr = TieringManager(arena=Arena.allocate(2, 4096), dma=CopyDma())
    h = mgr.add_tier("p2p", {"host": "127.0.0.1", "port": 9, "backend": "nixl"}, name="peers")
    attach_metrics(mgr, {"interval": 0}, registry=reg)
    try:
        assert h.tier.data_path == "zmq"
        mgr.lookup([b"k"])  # the tier's hooks set the gauge once the manager has named the tier
        found = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}
        assert found[("kvtiers_tier_data_path", (("path", "zmq"), ("tier", "peers")))] == 1.0
    finally:
        mgr.close()


def test_p2p_server_falls_back_and_nixl_clients_load_over_zmq(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(canary.CACHE_ENV, str(tmp_path / "canary"))
    env = {**os.environ, canary.FAULT_ENV: "segv@transfer"}  # the server's canary only
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    srv = start_server(capacity=64 << 20, extra=["--nixl"], env=env, stderr=log)
    try:
        with caplog.at_level("WARNING"):
            assert _round_trip(srv.port, "nixl") == "nixl"  # this client's NIXL is fine; the server has none
        assert any("does not serve NIXL" in r.getMessage() and "over ZMQ" in r.getMessage() for r in caplog.records)
    finally:
        srv.stop()
    log.seek(0)
    text = log.read()
    assert "p2p server: NIXL is off in this process: NIXL's UCX canary process was killed by SIGSEGV at " \
           "'transfer'; using ZMQ instead" in text


def test_p2p_server_strict_refuses_to_start(tmp_path):
    env = {**os.environ, canary.CACHE_ENV: str(tmp_path / "canary"), canary.FAULT_ENV: "segv"}
    r = subprocess.run([sys.executable, "-m", "kvtiers_p2p", "serve", "--nixl", "--nixl-strict", "--bind",
                        "tcp://127.0.0.1:0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "p2p server: NIXL is unsafe in this process (NIXL's UCX canary process was killed by SIGSEGV" in r.stderr


def test_eight_client_processes_verify_every_byte_over_zmq(crashing):
    from test_p2p_faults import run_clients  # the 8-client check of test_p2p_faults, here with the canary crashing

    srv = start_server(capacity=512 << 20, extra=["--nixl"], env=crashing)
    try:
        results = run_clients(srv.port, "nixl", 180, env=crashing)
    finally:
        alive = srv.proc.poll() is None
        srv.stop()
    assert alive
    for rc, out, err in results:
        assert rc == 0 and out.strip() == "ok", err[-2000:]
        assert "tier 'p2p': NIXL is off in this process" in err and "using ZMQ instead" in err


def test_pd_demo_verifies_every_byte_over_zmq(crashing):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--scenario", "pd", "--conversations",
                        "2", "--p2p-backend", "nixl", "--json"], env=crashing, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    pre, dec = report["prefill"], report["decode"]
    assert dec["mismatches"] == 0 and dec["failed"] == 0 and dec["chunks"] > 0
    assert report["backend"] == "nixl" and pre["data_path"] == dec["data_path"] == "zmq"
    assert dec["sources"]["p2p"] == pre["chunks"] == pre["served"]  # every stored chunk crossed over p2p once
    assert "serve block: NIXL is off in this process" in r.stderr  # the prefill serves over ZMQ
    assert "tier 'p2p': NIXL is off in this process" in r.stderr  # the decode loads over ZMQ

