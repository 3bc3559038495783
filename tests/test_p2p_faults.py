"""Faults of the p2p tier with real processes: a peer killed mid-transfer, a peer restarted,
a silent (stopped) peer, eight client processes at once (each on both data paths, ZMQ and
NIXL), and hostile frames from raw sockets while a well-behaved client keeps being served."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import zlib

import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

NS = Namespace({"test": "p2p-faults"})
POISON = b"\xde\xad\xbe\xef"


def fill(arena: Arena, seed: int) -> list[bytes]:
    out = []
    for i in range(len(arena)):
        data = zlib.crc32(b"%d-%d" % (seed, i)).to_bytes(4, "little") * (arena.slot_bytes // 4)
        arena[i][:] = data
        out.append(data)
    return out


def tier(server, arena: Arena, **opts):
    """A p2p tier on ``server``'s data path."""
    config = {"host": "127.0.0.1", "port": server.port, "backend": server.backend, **opts}
    return open_tier("p2p", config, TierContext(arena, NS))



def store(h, keys, slots, job_id):
    h.submit_store(Job(job_id, tuple(keys), tuple(slots)))
    r = wait(h, job_id)
    assert r.ok, r.error
    return r


@pytest.fixture(params=["zmq", "nixl"])
def server(request):
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    srv = start_server(capacity=512 << 20, extra=["--nixl"] if request.param == "nixl" else None)
    srv.backend = request.param
    yield srv
    srv.kill() if srv.proc.poll() is None else None


def test_peer_killed_mid_transfer_fails_keys_in_time_never_wrong_bytes(server):
    n, size = 96, 1 << 20
    src = Arena.allocate(n, size)
    data = fill(src, 1)
    keys = [b"kill-%d" % i for i in range(n)]
    a = tier(server, src)
    store(a, keys, range(n), 1)
    a.close()
    dst = Arena.allocate(n, size)
    dst.buffer[:] = POISON * (len(dst.buffer) // 4)
    b = tier(server, dst, timeout=5.0)
    try:
        t0 = time.monotonic()
        b.submit_load(Job(2, tuple(keys), tuple(range(n))))
        while bytes(dst[0][:4]) == POISON and time.monotonic() - t0 < 10:
            pass  # the first chunk landed: the transfer is under way
        os.kill(server.pid, signal.SIGKILL)
        r = wait(b, 2, timeout=20)
        assert time.monotonic() - t0 < 5.0 + 3.0, "keys did not fail within the tier's timeout"
        assert r.failed_keys, "the whole load finished before the kill; nothing was tested"
        for i, k in enumerate(keys):
            if k not in r.failed_keys:
                assert bytes(dst[i]) == data[i], f"key {k!r} reported loaded with wrong bytes"
    finally:
        b.close()


def test_peer_restarted_reconnects_and_answers_miss_until_stored_again(server):
    arena = Arena.allocate(8, 64 << 10)
    data = fill(arena, 2)
    keys = [b"restart-%d" % i for i in range(4)]
    h = tier(server, arena, timeout=5.0)
    try:
        store(h, keys, range(4), 1)
        assert resolve(h, keys) == [Lookup.HIT] * 4
        port = server.port
        server.kill()
        again = start_server(bind=f"tcp://127.0.0.1:{port}", capacity=64 << 20,
                             extra=["--nixl"] if server.backend == "nixl" else None)
        try:
            deadline = time.monotonic() + 15
            while resolve(h, keys) != [Lookup.MISS] * 4:
                assert time.monotonic() < deadline, "keys of the dead peer still answer HIT after its restart"
                time.sleep(0.1)
            h.submit_load(Job(2, tuple(keys), (4, 5, 6, 7)))
            assert set(wait(h, 2).failed_keys) == set(keys)
            store(h, keys, range(4), 3)
            assert resolve(h, keys) == [Lookup.HIT] * 4
            arena.buffer[4 * arena.slot_bytes :] = b"\0" * (4 * arena.slot_bytes)
            h.submit_load(Job(4, tuple(keys), (4, 5, 6, 7)))
            assert wait(h, 4).ok
            assert [bytes(arena[4 + i]) for i in range(4)] == data[:4]
        finally:
            again.stop()
    finally:
        h.close()


def test_silent_peer_is_bounded(server):
    arena = Arena.allocate(8, 64 << 10)
    fill(arena, 3)
    keys = [b"silent-%d" % i for i in range(4)]
    # on the NIXL path a load given up on also waits for its fence (the server may still write)
    fence = 1.0 if server.backend == "nixl" else 0.0
    h = tier(server, arena, timeout=2.0, lookup_timeout=1.0, nixl_fence_timeout=fence)
    try:
        store(h, keys, range(4), 1)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h.submit_load(Job(2, tuple(keys), (4, 5, 6, 7)))
            h.submit_store(Job(3, (b"silent-new",), (0,)))
            results = {}
            while len(results) < 2:
                assert time.monotonic() - t0 < 2.0 + fence + 4.0, "a silent peer held jobs past the timeout"
                results.update((r.job_id, r) for r in h.get_finished_jobs())
                time.sleep(0.01)
            assert set(results[2].failed_keys) == set(keys) and not results[3].ok
            assert "did not answer in time" in (results[2].error or "")
            t1 = time.monotonic()
            assert resolve(h, [b"silent-unknown"]) == [Lookup.MISS]
            assert time.monotonic() - t1 < 1.0 + 4.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        store(h, [b"silent-after"], [0], 4)  # served again once it wakes up
    finally:
        h.close()


CLIENT = r"""
import sys, time, zlib
from kvtiers import Arena, Job, Namespace, TierContext, open_tier
port, me, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
n, size = 32, 256 << 10
arena = Arena.allocate(2 * n, size)
for i in range(n):
    arena[i][:] = zlib.crc32(b"%d-%d" % (me, i)).to_bytes(4, "little") * (size // 4)
h = open_tier("p2p", {"host": "127.0.0.1", "port": port, "backend": backend},
              TierContext(arena, Namespace({"test": "p2p-faults"})))
keys = tuple(b"c%d-%d" % (me, i) for i in range(n))
def wait(j):
    t = time.monotonic()
    while time.monotonic() - t < 60:
        for r in h.get_finished_jobs():
            return r
        time.sleep(0.002)
    sys.exit("timeout")
for rnd in range(3):
    h.submit_store(Job(2 * rnd, keys, tuple(range(n))))
    assert wait(2 * rnd).ok
    h.submit_load(Job(2 * rnd + 1, keys, tuple(range(n, 2 * n))))
    r = wait(2 * rnd + 1)
    assert r.ok, r.error
    assert all(bytes(arena[i]) == bytes(arena[n + i]) for i in range(n)), "wrong bytes"
h.close()
print("ok")
"""


def run_clients(port: int, backend: str, timeout: float, env: dict | None = None) -> list[tuple[int, str, str]]:
    """:data:`CLIENT` in 8 processes at once against the server on ``port``: each one's
    return code, stdout and stderr (any still running after ``timeout`` s is killed)."""
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(i), backend], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def test_eight_client_processes_at_once(server):
    for rc, out, err in run_clients(server.port, server.backend, 120):
        assert rc == 0 and out.strip() == "ok", err[-2000:]
    assert server.proc.poll() is None


_item = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=80),
                  st.text(max_size=12), st.lists(st.binary(max_size=80), max_size=6),
                  st.dictionaries(st.text(max_size=4), st.integers(0, 2**32), max_size=3))
_header = st.builds(lambda op, rid, rest: msgpack.packb([op, rid, *rest]),
                    st.one_of(st.sampled_from(sorted(P.REQUEST_OPS)), st.integers(-3, 40)),
                    st.one_of(st.integers(0, 2**63), st.integers(-5, -1), st.just(2**64 - 1)),
                    st.lists(_item, max_size=6))
_frame = st.one_of(_header, st.binary(max_size=300), _header.map(lambda b: b[: len(b) // 2]))
_message = st.lists(_frame, min_size=1, max_size=5)


def test_hostile_frames_never_take_the_server_down(tmp_path):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    server = start_server(capacity=64 << 20, stderr=log)
    server.backend = "zmq"  # the frames attack the control protocol, the same on both paths
    ctx = zmq.Context()
    arena = Arena.allocate(4, 64 << 10)
    data = fill(arena, 4)
    good = tier(server, arena, timeout=10.0)
    jobs = iter(range(1, 1 << 30))
    hello = P.pack(P.HELLO, 1, P.VERSION, NS.digest, arena.slot_bytes, None)

    def served() -> None:
        k = b"good-%d" % next(jobs)
        store(good, [k], [0], next(jobs))
        jid = next(jobs)
        arena[1][:] = b"\0" * arena.slot_bytes
        good.submit_load(Job(jid, (k,), (1,)))
        assert wait(good, jid).ok and bytes(arena[1]) == data[0]

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_message, st.booleans())
    def fuzz(frames, handshake_first):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)  # delivered before ctx.term() returns
        s.connect(f"tcp://127.0.0.1:{server.port}")
        if handshake_first:
            s.send(hello)
        s.send_multipart(frames)
        if handshake_first and frames:  # after a HELLO, a PUT-shaped header with a wrong-size chunk
            s.send_multipart([P.pack(P.PUT, 9, b"k", 0), os.urandom(100)])
        s.close()

    try:
        served()
        fuzz()
        # not ZMTP at all: raw TCP garbage, and a frame over the size limit
        for blob in (b"\xff" * 64, os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
                raw.sendall(blob)
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 2000)
        big.connect(f"tcp://127.0.0.1:{server.port}")
        big.send_multipart([hello])
        big.send_multipart([P.pack(P.PUT, 2, b"big", 0), b"\0" * (80 << 20)])  # > --max-chunk-bytes 64MiB
        big.close()
        # well-formed but refused requests get an ERR naming why, and the connection stays usable
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{server.port}")
        s.send_multipart([P.pack(P.PUT, 1, b"k", 0), b"x" * 10])  # before HELLO
        assert s.poll(10000) and P.unpack(s.recv(), reply=True)[2] == P.E_HELLO
        s.send(hello)
        assert s.poll(10000) and P.unpack(s.recv(), reply=True)[0] == P.OK
        s.send_multipart([P.pack(P.PUT, 3, b"k", 0), b"x" * 10])  # not the namespace's chunk size
        assert s.poll(10000) and P.unpack(s.recv(), reply=True)[2] == P.E_MALFORMED
        s.close()
        served()  # the well-behaved client is still served, correctly
        assert server.proc.poll() is None, "the server died"
        for _ in range(5):
            served()
    finally:
        good.close()
        ctx.term()
        server.stop()
    log.seek(0)
    text = log.read()
    stats = server_stats(log)
    assert server.proc.returncode == 0, text[-2000:]
    # the hostile frames did reach the server and were refused, not served
    assert stats["malformed"] >= 20 and stats["refused"] >= 2, stats
