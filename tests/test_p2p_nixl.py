"""The p2p tier's NIXL data path (``backend: "nixl"`` against ``kvtiers p2p serve --nixl``):
conformance checks, a peer killed mid-transfer, and a server without NIXL refusing clearly.
``kvtiers conformance p2p --config '{..., "backend": "nixl"}'`` runs the full suite."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("nixl_cu12")

from kvtiers_conformance import DEFAULT_LIMITS, run_conformance  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Namespace, TierContext, open_tier  # noqa: E402

NS = Namespace({"test": "p2p-nixl"})



@pytest.fixture(scope="module")
def nixl_server():
    srv = start_server(capacity=256 << 20, extra=["--nixl"])
    yield srv
    srv.stop()


def test_nixl_path_conformance(nixl_server):
    config = {"host": "127.0.0.1", "port": nixl_server.port, "backend": "nixl"}
    report = run_conformance("p2p", config, levels="core,shared,bounded", rules=[6, 7, 9, 11], seed=3,
                             limits=DEFAULT_LIMITS.replace(examples=5))
    assert not report.failed, "\n".join(f"{r.check.test_name}: {r.why}" for r in report.results if r.status == "FAIL")
    assert report.status(6) == report.status(7, "shared") == report.status(9) == report.status(11, "bounded") == "PASS"


def test_nixl_peer_killed_mid_transfer_never_wrong_bytes():
    server = start_server(capacity=512 << 20, extra=["--nixl"])
    n, size = 96, 1 << 20
    src = Arena.allocate(n, size)
    for i in range(n):
        src[i][:] = os.urandom(16) * (size // 16)
    keys = [b"nk-%d" % i for i in range(n)]
    a = open_tier("p2p", {"host": "127.0.0.1", "port": server.port}, TierContext(src, NS))
    a.submit_store(Job(1, tuple(keys), tuple(range(n))))
    assert wait(a, 1).ok
    a.close()
    dst = Arena.allocate(n, size)
    b = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "backend": "nixl", "timeout": 5.0},
                  TierContext(dst, NS))
    try:
        t0 = time.monotonic()
        b.submit_load(Job(2, tuple(keys), tuple(range(n))))
        while not any(dst[0][:16]) and time.monotonic() - t0 < 10:
            pass  # the first chunk landed in its slot
        os.kill(server.pid, signal.SIGKILL)
        r = wait(b, 2, timeout=20)
        assert time.monotonic() - t0 < 5.0 + 3.0
        assert r.failed_keys, "the whole load finished before the kill; nothing was tested"
        for i, k in enumerate(keys):
            if k not in r.failed_keys:
                assert bytes(dst[i]) == bytes(src[i]), f"key {k!r} reported loaded with wrong bytes"
    finally:
        b.close()
        server.kill()


def test_nixl_client_against_a_server_without_nixl_is_refused_clearly():
    srv = start_server(capacity=16 << 20)
    h = open_tier("p2p", {"host": "127.0.0.1", "port": srv.port, "backend": "nixl", "timeout": 5.0},
                  TierContext(Arena.allocate(2, 4096), NS))
    try:
        h.submit_load(Job(1, (b"k",), (0,)))
        r = wait(h, 1)
        assert not r.ok and "kvtiers p2p serve --nixl" in r.error
    finally:
        h.close()
        srv.stop()
