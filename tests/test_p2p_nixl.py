"""The p2p tier's NIXL data path (``backend: "nixl"`` against ``kvtiers p2p serve --nixl``):
conformance checks, a peer killed mid-transfer, the fence that keeps a silent server's late
writes out of reported slots (rule 6), and a server without NIXL: loaded from over ZMQ, or
refused clearly with ``nixl_strict``.
``kvtiers conformance p2p --config '{..., "backend": "nixl"}'`` runs the full suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("nixl_cu12")

from kvtiers_conformance import DEFAULT_LIMITS, run_conformance  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
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


KILLED_CLIENT = r"""
import sys
from kvtiers import Arena, Job, Namespace, TierContext, open_tier
port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dst = Arena.allocate(n, size)
h = open_tier("p2p", {"host": "127.0.0.1", "port": port, "backend": "nixl"},
              TierContext(dst, Namespace({"test": "p2p-nixl"})))
h.submit_load(Job(1, tuple(b"fence-%d" % i for i in range(n)), tuple(range(n))))
while not any(dst[0][:16]):
    pass
print("landing", flush=True)
sys.stdin.read()  # killed here, with writes still posted into its memory
"""


def test_a_client_killed_mid_load_leaves_the_nixl_server_serving():
    """The server's NIXL writes into a dead client fail (NIXL_ERR_REMOTE_DISCONNECT): that
    must fail those writes, not the server."""
    n, size = 96, 1 << 20
    server, src, keys = _stored_server(n, size)
    child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(server.port), str(n), str(size)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"landing\n"
        child.kill()
        child.wait(10)
        dst = Arena.allocate(n, size)
        h = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "backend": "nixl"}, TierContext(dst, NS))
        try:
            h.submit_load(Job(2, keys, tuple(range(n))))
            r = wait(h, 2, timeout=60)
            assert r.ok, r
            assert all(bytes(dst[i]) == bytes(src[i]) for i in range(n))
        finally:
            h.close()
        assert server.proc.poll() is None, "the server died with its client"
    finally:
        child.kill()
        server.kill()


def _stored_server(n: int, size: int, stderr=subprocess.DEVNULL):
    server = start_server(capacity=max(256 << 20, 2 * n * size), extra=["--nixl"], stderr=stderr)
    src = Arena.allocate(n, size)
    for i in range(n):
        src[i][:] = os.urandom(16) * (size // 16)
    keys = tuple(b"fence-%d" % i for i in range(n))
    a = open_tier("p2p", {"host": "127.0.0.1", "port": server.port}, TierContext(src, NS))
    a.submit_store(Job(1, keys, tuple(range(n))))
    assert wait(a, 1).ok
    a.close()
    return server, src, keys


def test_nixl_writes_in_flight_stay_within_the_servers_budget(tmp_path):
    """Four GETN streams at once: the server posts each stream's next chunk, and writes ahead
    of them only while its writes in flight are under NIXL_INFLIGHT_BYTES; every write it
    posted is seen over by the end, and the loaded bytes are exact."""
    from kvtiers_p2p.server import NIXL_AHEAD, NIXL_INFLIGHT_BYTES

    n, size, streams = 64, 1 << 20, 4
    bound = NIXL_INFLIGHT_BYTES + streams * size
    assert bound < streams * NIXL_AHEAD * size  # what 16 ahead per stream alone would post
    err = tmp_path / "server.err"
    with open(err, "w") as f:
        server, src, keys = _stored_server(n, size, stderr=f)
    dst = Arena.allocate(n, size)
    h = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "backend": "nixl"}, TierContext(dst, NS))
    try:
        per = n // streams
        for j in range(streams):
            h.submit_load(Job(10 + j, keys[j * per : (j + 1) * per], tuple(range(j * per, (j + 1) * per))))
        done, end = [], time.monotonic() + 60
        while len(done) < streams and time.monotonic() < end:
            done += h.get_finished_jobs()
            time.sleep(0.005)
        assert sorted(r.job_id for r in done if r.ok) == [10 + j for j in range(streams)], done
        assert all(bytes(dst[i]) == bytes(src[i]) for i in range(n))
    finally:
        h.close()
        server.stop()
    stats = server_stats(err)
    assert stats["nixl_write_bytes_in_flight"] == 0, stats
    assert 0 < stats["nixl_write_bytes_peak"] <= bound, stats


def _finished(h, job_id: int, seconds: float):
    """The job's result if ``h`` reports it within ``seconds``, else None."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for r in h.get_finished_jobs():
            assert r.job_id == job_id
            return r
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("fence", [3.0, None])
def test_a_silent_nixl_server_holds_the_load_until_it_settles_or_the_fence_passes(fence):
    """The server is stopped with the GETN on its way: the load's deadline passes, but the
    job stays unreported (the server could still write the slots) until the fence passes,
    or, with no fence, until the resumed server answers the CANCEL with DONE."""
    n, size = 8, 256 << 10
    server, src, keys = _stored_server(n, size)
    dst = Arena.allocate(n, size)
    h = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "backend": "nixl", "timeout": 1.0,
                          "nixl_fence_timeout": fence}, TierContext(dst, NS))
    try:
        deadline = time.monotonic() + 10  # connected and handshaken before the stop
        while not getattr(h.tier._client.peers.get(f"tcp://127.0.0.1:{server.port}"), "ready", False):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h.submit_load(Job(2, keys, tuple(range(n))))
            assert _finished(h, 2, 1.0 + 1.5) is None, "reported while the stopped server could still write"
            if fence is not None:
                r = _finished(h, 2, 30)
                assert r is not None and set(r.failed_keys) == set(keys)
                assert time.monotonic() - t0 >= 1.0 + fence - 0.5  # held to the fence, not just the timeout
                assert h.tier._client.late_fences == 1
            else:
                assert _finished(h, 2, 2.0) is None, "no fence: held while the server is silent"
        finally:
            os.kill(server.pid, signal.SIGCONT)
        if fence is None:
            r = _finished(h, 2, 30)  # the server wakes, sees the GETN and the CANCEL, answers DONE
            assert r is not None and h.tier._client.late_fences == 0
            for i, k in enumerate(keys):
                if k not in r.failed_keys:
                    assert bytes(dst[i]) == bytes(src[i])
        h.submit_load(Job(3, keys, tuple(range(n))))  # and it serves again
        r = wait(h, 3, timeout=30)
        assert r.ok, r
        assert all(bytes(dst[i]) == bytes(src[i]) for i in range(n))
    finally:
        h.close()
        server.kill()


def test_nixl_client_against_a_server_without_nixl_loads_over_zmq(caplog):
    srv = start_server(capacity=16 << 20)
    src = Arena.allocate(2, 4096)
    src[0][:] = os.urandom(4096)
    a = open_tier("p2p", {"host": "127.0.0.1", "port": srv.port}, TierContext(src, NS))
    dst = Arena.allocate(2, 4096)
    h = open_tier("p2p", {"host": "127.0.0.1", "port": srv.port, "backend": "nixl", "timeout": 5.0},
                  TierContext(dst, NS))
    try:
        a.submit_store(Job(1, (b"k",), (0,)))
        assert wait(a, 1).ok
        h.submit_load(Job(2, (b"k",), (1,)))
        assert wait(h, 2).ok and bytes(dst[1]) == bytes(src[0])
        assert "does not serve NIXL" in caplog.text and "over ZMQ" in caplog.text
    finally:
        a.close()
        h.close()
        srv.stop()


def test_nixl_strict_client_against_a_server_without_nixl_is_refused_clearly():
    srv = start_server(capacity=16 << 20)
    h = open_tier("p2p", {"host": "127.0.0.1", "port": srv.port, "backend": "nixl", "timeout": 5.0,
                          "nixl_strict": True}, TierContext(Arena.allocate(2, 4096), NS))
    try:
        h.submit_load(Job(1, (b"k",), (0,)))
        r = wait(h, 1)
        assert not r.ok and "kvtiers p2p serve --nixl" in r.error
    finally:
        h.close()
        srv.stop()
