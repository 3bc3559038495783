"""The p2p tier and its server: options, several peers and peers changing at run time, the
handshake (mismatches named), security defaults (loopback, CurveZMQ), server limits, the
protocol checks and the CLI (the bench: test_p2p_bench.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.server import AuthConfigError, PeerServer  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from kvtiers_p2p.store import MemoryStore  # noqa: E402
from kvtiers_p2p.tier import peer_urls  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, ConfigError, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402
from kvtiers.commands.cli import main  # noqa: E402

NS = Namespace({"test": "p2p-tier"})


def tier(arena: Arena, ns: Namespace = NS, **opts):
    return open_tier("p2p", opts, TierContext(arena, ns))



@pytest.fixture(scope="module")
def two_servers():
    a, b = start_server(capacity=64 << 20), start_server(capacity=64 << 20)
    yield a, b
    a.stop()
    b.stop()


def test_options_in_vllm_shape_and_peers_list():
    assert peer_urls("10.0.0.1", 5710) == ["tcp://10.0.0.1:5710"]
    assert peer_urls(None, None, [{"host": "::1", "port": 1}, "tcp://h:2"]) == ["tcp://[::1]:1", "tcp://h:2"]
    with pytest.raises(ConfigError, match="host and port together"):
        peer_urls("h", None)
    with pytest.raises(ConfigError, match=r"peers\[0\]"):
        peer_urls(None, None, [{"host": "h"}])
    with pytest.raises(ConfigError, match="port"):
        tier(Arena.allocate(1, 4096), host="127.0.0.1", port="5710")


def test_several_peers_lookup_all_load_from_the_holder_and_change_at_run_time(two_servers, tmp_path):
    a, b = two_servers
    url_a, url_b = f"tcp://127.0.0.1:{a.port}", f"tcp://127.0.0.1:{b.port}"
    arena = Arena.allocate(32, 4096)
    for i in range(16):
        arena[i][:] = bytes([i]) * 4096
    keys = [b"multi-%d" % i for i in range(16)]
    both = tier(arena, peers=[url_a, {"host": "127.0.0.1", "port": b.port}])
    peers_file = tmp_path / "peers.json"
    peers_file.write_text(json.dumps([url_a]))
    only_a = tier(Arena.allocate(32, 4096), peers_file=str(peers_file), negative_ttl=0.1)
    try:
        both.submit_store(Job(1, tuple(keys), tuple(range(16))))
        assert wait(both, 1).ok
        assert resolve(both, keys) == [Lookup.HIT] * 16
        # rendezvous hashing spread the keys over both peers; a client of A alone sees A's share
        seen = resolve(only_a, keys)
        assert 0 < seen.count(Lookup.HIT) < 16
        peers_file.write_text(json.dumps([url_a, url_b]))  # a coordinator adds B
        deadline = time.monotonic() + 10
        while resolve(only_a, keys) != [Lookup.HIT] * 16:
            assert time.monotonic() < deadline, "the peers file change was not picked up"
            time.sleep(0.1)
        only_a.submit_load(Job(2, tuple(keys), tuple(range(16, 32))))
        assert wait(only_a, 2).ok
        assert all(bytes(only_a.ctx.arena[16 + i]) == bytes([i]) * 4096 for i in range(16))
        both.tier.set_peers([url_b])  # the documented call
        assert both.tier.peers == [url_b]
        both.submit_load(Job(3, tuple(keys), tuple(range(16, 32))))
        r = wait(both, 3)
        assert 0 < len(r.failed_keys) < 16  # A's share is no longer reachable
    finally:
        both.close()
        only_a.close()


@pytest.fixture(scope="module")
def pinned():
    srv = start_server(capacity=16 << 20, extra=["--namespace", NS.digest, "--chunk-bytes", "8192",
                                                 "--max-clients", "2", "--max-inflight", "2"])
    yield srv
    srv.stop()


def test_handshake_mismatch_is_refused_naming_both(pinned):
    h = tier(Arena.allocate(2, 4096), host="127.0.0.1", port=pinned.port, timeout=5.0)
    other = tier(Arena.allocate(2, 8192), Namespace({"other": 1}), host="127.0.0.1", port=pinned.port, timeout=5.0)
    try:
        h.submit_store(Job(1, (b"k",), (0,)))
        r = wait(h, 1)
        assert not r.ok and "client 4096 bytes, server 8192 bytes" in r.error
        other.submit_store(Job(1, (b"k",), (0,)))
        r = wait(other, 1)
        assert not r.ok and f"client {other.ctx.namespace.digest}, server {NS.digest}" in r.error
        status = next(iter(h.tier.peer_status().values()))
        assert "refused the handshake" in status["error"]
    finally:
        h.close()
        other.close()


def test_server_limits_clients_and_inflight(pinned):
    arena = Arena.allocate(2, 8192)
    first = [tier(arena, host="127.0.0.1", port=pinned.port) for _ in range(2)]
    third = None
    ctx = zmq.Context()
    try:
        for i, h in enumerate(first):
            h.submit_store(Job(1, (b"lim-%d" % i,), (0,)))
            assert wait(h, 1).ok
        # only now: connecting with the others, its HELLO could get in before the second's
        third = tier(Arena.allocate(2, 8192), host="127.0.0.1", port=pinned.port, timeout=5.0)
        third.submit_store(Job(1, (b"k",), (0,)))
        r = wait(third, 1)
        assert not r.ok and "maximum of 2 clients" in r.error
        third.close()
        first[1].close()
        time.sleep(0.5)  # BYE ends a session; now a raw client gets in and floods GETs
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{pinned.port}")
        s.send(P.pack(P.HELLO, 1, P.VERSION, NS.digest, 8192, None))
        assert P.unpack(s.recv(), reply=True)[0] == P.OK
        keys = [b"absent-%d" % i for i in range(P.MAX_BATCH)]
        for rid in range(2, 12):
            s.send(P.pack(P.GET, rid, keys))
        busy = done = 0
        while busy + done < 10:
            assert s.poll(20000), "the server stopped answering"
            hdr = P.unpack(s.recv(), reply=True)
            busy += hdr[0] == P.ERR and hdr[2] == P.E_BUSY
            done += hdr[0] == P.DONE
        assert busy >= 1 and done >= 2
        s.close()
    finally:
        for h in [*first, third]:
            if h is not None:
                h.close()
        ctx.term()


def test_off_loopback_bind_refuses_without_curve_and_says_how(capsys):
    with pytest.raises(AuthConfigError, match="kvtiers p2p keygen"):
        PeerServer("tcp://0.0.0.0:0", MemoryStore(1 << 20))
    with pytest.raises(AuthConfigError, match="--curve-secret"):
        PeerServer("tcp://*:0", MemoryStore(1 << 20))
    assert main(["p2p", "serve", "--bind", "tcp://0.0.0.0:0"]) == 2  # kvtiers: error: one line
    assert "no authentication is configured" in capsys.readouterr().err
    assert P.parse_endpoint("tcp://[::1]:5").loopback and P.parse_endpoint("tcp://localhost:5").loopback
    assert not P.parse_endpoint("tcp://10.0.0.1:5").loopback


def test_curve_keys_and_allowlist(tmp_path, capsys):
    keys = tmp_path / "keys"
    allow = tmp_path / "allow"
    assert main(["p2p", "keygen", str(keys)]) == 0
    assert main(["p2p", "keygen", str(keys), "--name", "client"]) == 0
    assert main(["p2p", "keygen", str(keys), "--name", "stranger"]) == 0
    assert oct(os.stat(keys / "client.key_secret").st_mode & 0o777) == "0o600"
    allow.mkdir()
    (allow / "client.key").write_bytes((keys / "client.key").read_bytes())
    srv = start_server(extra=["--curve-secret", str(keys / "server.key_secret"), "--allow", str(allow)])
    arena = Arena.allocate(2, 4096)
    arena[0][:] = b"c" * 4096
    common = {"host": "127.0.0.1", "port": srv.port, "timeout": 2.0, "curve_server_key": str(keys / "server.key")}
    good = tier(arena, **common, curve_secret_file=str(keys / "client.key_secret"))
    stranger = tier(Arena.allocate(2, 4096), **common, curve_secret_file=str(keys / "stranger.key_secret"))
    plain = tier(Arena.allocate(2, 4096), host="127.0.0.1", port=srv.port, timeout=2.0)
    try:
        good.submit_store(Job(1, (b"secret",), (0,)))
        assert wait(good, 1).ok
        good.submit_load(Job(2, (b"secret",), (1,)))
        assert wait(good, 2).ok and bytes(arena[1]) == b"c" * 4096
        for h in (stranger, plain):  # not on the allowlist / no keys at all: never served
            h.submit_load(Job(1, (b"secret",), (0,)))
        for h in (stranger, plain):
            assert not wait(h, 1).ok
    finally:
        for h in (good, stranger, plain):
            h.close()
        srv.stop()
    with pytest.raises(ConfigError, match="both curve_server_key and curve_secret_file"):
        tier(Arena.allocate(1, 4096), host="127.0.0.1", port=1, curve_server_key=str(keys / "server.key"))


def test_protocol_rejects_malformed_headers():
    for bad in (b"", b"\xc1", P.pack("x", 1), P.pack(1), P.pack(1, -1), b"\x91" * 10, b"\x00" * (P.MAX_HEADER + 1)):
        with pytest.raises(P.ProtocolError):
            P.unpack(bad)
    with pytest.raises(P.ProtocolError):
        P.check_keys([b"k"] * (P.MAX_BATCH + 1))
    with pytest.raises(P.ProtocolError):
        P.check_key(b"x" * 65)
    assert P.unpack(P.pack(P.GET, 7, [b"a"])) == [P.GET, 7, [b"a"]]


def test_store_never_reuses_a_buffer_a_send_still_holds():
    store = MemoryStore(2 * 4096)
    buf, evicted = store.reserve("ns", 4096, None)
    buf[:] = b"a" * 4096
    store.commit("ns", b"a", buf, P.checksum(buf))
    item = store.get("ns", b"a")
    item[3] = True
    in_flight = item[0]  # what pyzmq holds while a zero-copy send of it is queued
    del buf, item
    for k in (b"b", b"c"):  # evicts "a"
        b2, ev = store.reserve("ns", 4096, None)
        store.commit("ns", k, b2, 0)
    assert not store.has("ns", b"a")
    # the capacity is mapped, and one of its two buffers is being sent: one is left to use
    fresh = [store.reserve("ns", 4096, None)[0]]
    assert all(f is not in_flight for f in fresh) and bytes(in_flight) == b"a" * 4096
    assert store.reserve("ns", 4096, None) is None and store.mapped == 2 * 4096
    for f in fresh:
        store.release("ns", f)
    del in_flight, f, fresh  # the send is done: the buffer may come back now
    again = [store.reserve("ns", 4096, None)[0] for _ in range(2)]
    assert len({id(x) for x in again}) == 2
