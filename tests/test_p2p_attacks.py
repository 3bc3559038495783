"""Attacks on the p2p server and the ``serve`` block, each with real processes and sockets:
a client that never reads (head-of-line freeze), peers pinning an engine's arena, memory
past ``--capacity`` through many chunk sizes, namespaces outside a client key's tenants,
connections that never say HELLO, and the small ones (IPv6, keygen, reply headers). Each
checks that the attack fails and that a well-behaved client keeps being served."""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest

zmq = pytest.importorskip("zmq")

from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.server import BindError, PeerServer  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from kvtiers_p2p.store import MemoryStore  # noqa: E402
from kvtiers_p2p.tenants import load_allowlist  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

NS = Namespace({"test": "p2p-attacks"})
GOOD_NS = Namespace({"test": "p2p-attacks-good"})
MiB = 1 << 20
BOUND_S = 5.0  #: what a well-behaved client's store + lookup + load may take while under attack (generous)
OVERHEAD_MIB = 48  #: RSS a server may use past its capacity (docs/p2p.md, Security)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def tier(port: int, arena: Arena, ns: Namespace = NS, **opts):
    return open_tier("p2p", {"host": "127.0.0.1", "port": port, **opts}, TierContext(arena, ns))


def fill(arena: Arena, seed: int) -> None:
    for i in range(len(arena)):
        arena[i][:] = zlib.crc32(b"%d-%d" % (seed, i)).to_bytes(4, "little") * (arena.slot_bytes // 4)


class Good:
    """A well-behaved client: each round stores a new key, looks it up and loads it back."""

    def __init__(self, port: int, size: int = 64 << 10, **opts) -> None:
        self.arena = Arena.allocate(2, size)
        fill(self.arena, 7)
        self.h = tier(port, self.arena, GOOD_NS, **opts)
        self.jobs = iter(range(1, 1 << 30))

    def round(self) -> float:
        t0 = time.monotonic()
        k = b"good-%d" % next(self.jobs)
        jid = next(self.jobs)
        self.h.submit_store(Job(jid, (k,), (0,)))
        assert wait(self.h, jid).ok
        assert resolve(self.h, [k]) == [Lookup.HIT]
        jid = next(self.jobs)
        self.arena[1][:] = b"\0" * self.arena.slot_bytes
        self.h.submit_load(Job(jid, (k,), (1,)))
        assert wait(self.h, jid).ok and bytes(self.arena[1]) == bytes(self.arena[0])
        return time.monotonic() - t0

    def close(self) -> None:
        self.h.close()


def raw(ctx, port: int, *, ns: str = NS.digest, chunk: int = MiB, max_bytes=None, reconnect_s: float = 0.1):
    """A DEALER that handshakes and then reads nothing it is not asked to (RCVHWM 1)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RECONNECT_IVL, int(reconnect_s * 1000))
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(P.pack(P.HELLO, 1, P.VERSION, ns, chunk, max_bytes))
    assert s.poll(10000), "no answer to HELLO"
    return s, P.unpack(s.recv(), reply=True)


def disconnected(sock, timeout: float) -> bool:
    """Whether ``sock``'s connection drops within ``timeout`` seconds (its monitor says so)."""
    from zmq.utils.monitor import recv_monitor_message

    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if mon.poll(100) and recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
                return True
        return False
    finally:
        sock.disable_monitor()
        mon.close(0)


# -- 1. a client that never reads freezes nobody --------------------------------------------


def test_a_client_that_never_reads_freezes_nobody_and_is_disconnected(tmp_path):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    srv = start_server(capacity=256 * MiB, extra=["--stall-timeout", "8"], stderr=log)
    ctx = zmq.Context()
    arena = Arena.allocate(32, MiB)
    fill(arena, 1)
    keys = [b"big-%d" % i for i in range(32)]
    seeder = tier(srv.port, arena)
    good = None
    try:
        seeder.submit_store(Job(1, tuple(keys), tuple(range(32))))
        assert wait(seeder, 1).ok
        bad, ok = raw(ctx, srv.port)
        assert ok[0] == P.OK
        for rid in range(10, 26):  # 16 GETs of 32 MiB each it never reads, then lookups
            bad.send(P.pack(P.GET, rid, keys))
        for rid in range(100, 300):
            bad.send(P.pack(P.LOOKUP, rid, keys))
        time.sleep(1.0)  # its pipe is full now
        good = Good(srv.port)  # a new client's HELLO is answered ...
        for _ in range(3):  # ... and it is served, well before the stall timeout
            assert good.round() < BOUND_S
        assert resolve(seeder, keys[:4]) == [Lookup.HIT] * 4
        time.sleep(9.0)  # past the stall timeout: disconnected (it reads nothing, so it does not notice)
        assert good.round() < BOUND_S
        bad.close()
    finally:
        seeder.close()
        if good is not None:
            good.close()
        ctx.destroy(0)
        srv.stop()
    assert server_stats(log)["disconnected"] >= 1


# -- 2. peers cannot pin an engine's arena -------------------------------------------------


def test_peers_that_never_read_cannot_pin_the_engines_arena():
    torch = pytest.importorskip("torch")
    from kvtiers.engine.manager import TieringManager

    blocks, bpc = 64, 2

    def kv(seed):
        g = torch.Generator().manual_seed(seed)
        return {"kv": [[torch.rand((blocks, 64, 64), generator=g) for _ in range(2)]]}

    src = kv(1)  # a chunk is 2 blocks x 2 x 64 x 64 floats = 64 KiB: 32 slots in 2 MiB
    mgr = TieringManager.from_config({"host_bytes": 2 * MiB, "blocks_per_chunk": bpc,
                                      "serve": {"bind": "tcp://127.0.0.1:0", "stall_timeout": 8,
                                                "max_queued_bytes": MiB}}, src,
                                     namespace_fields={"model": "m"})
    slots = len(mgr.arena)
    port = int(mgr.serve.endpoint.rsplit(":", 1)[1])
    stop = threading.Event()

    def engine_loop():
        while not stop.is_set():
            mgr.poll()
            time.sleep(0.001)

    ctx = zmq.Context()
    loop = threading.Thread(target=engine_loop)
    attackers = []
    peer = None
    try:
        keys = [b"ready-%d" % i for i in range(slots)]
        (res,) = mgr.wait([mgr.store(keys, list(range(2 * slots)))])
        assert res.ok
        loop.start()
        for _ in range(2):  # two peers GET every ready key, 16 times over, and never read
            s, ok = raw(ctx, port, ns=mgr.namespace.digest, chunk=mgr.arena.slot_bytes)
            assert ok[0] == P.OK, ok
            for rid in range(10, 26):
                s.send(P.pack(P.GET, rid, keys))
            attackers.append(s)
        time.sleep(1.5)
        assert mgr.cache.pinned_slots() <= slots // 2, "peers pinned more than their share of the arena"
        new = [b"new-%d" % i for i in range(slots // 2)]
        (res,) = mgr.wait([mgr.store(new, list(range(slots)))], timeout=30)
        assert res.ok and not res.skipped_keys, res  # the engine still stores
        arena = Arena.allocate(4, mgr.arena.slot_bytes)
        peer = tier(port, arena, mgr.namespace)
        t0 = time.monotonic()
        peer.submit_load(Job(1, (new[0],), (0,)))
        r = wait(peer, 1)
        assert r.ok and time.monotonic() - t0 < BOUND_S, r
        deadline = time.monotonic() + 30
        serve = mgr.serve  # they read nothing: past the stall (or heartbeat) timeout both go, the good peer stays
        while len(serve.sessions) > 1:
            assert time.monotonic() < deadline, (mgr.serve.stats, mgr.serve.stalled, len(mgr.serve.sessions))
            time.sleep(0.2)
        time.sleep(0.5)
        assert mgr.cache.pinned_slots() == 0
    finally:
        stop.set()
        if loop.is_alive():
            loop.join()
        for s in attackers:
            s.close()
        if peer is not None:
            peer.close()
        mgr.close()
        ctx.destroy(0)


# -- 3. memory stays within --capacity ------------------------------------------------------


def test_many_chunk_sizes_stay_within_capacity_and_tiny_chunks_are_refused(tmp_path):
    cap = 64
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    # every chunk size from one address (the per-peer cap raised to the server's 8): its memory is what is measured
    srv = start_server(capacity=cap * MiB, stderr=log, extra=["--max-chunk-sizes-per-peer", "8"])
    ctx = zmq.Context()
    try:
        good = Good(srv.port)
        good.round()
        base = rss_mib(srv.pid)
        refused, held = 0, []
        for i in range(60):  # 60 namespaces, each with its own chunk size of about 1 MiB, one PUT each
            size = MiB + 4096 * (i + 1)
            s, ok = raw(ctx, srv.port, ns=f"{i:016x}", chunk=size)
            if ok[0] == P.ERR:
                assert ok[2] == P.E_FULL and "chunk sizes" in ok[3], ok
                refused += 1
            else:
                data = os.urandom(size)
                s.send_multipart([P.pack(P.PUT, 2, b"k", P.checksum(data)), data])
                assert s.poll(10000)
                reply = P.unpack(s.recv(), reply=True)
                assert reply[0] == P.OK, reply
            held.append(s)  # its session stays: so does its namespace and chunk size
        assert refused == 60 - (8 - 1)  # --max-chunk-sizes 8, one of them the good client's
        assert rss_mib(srv.pid) - base < cap + OVERHEAD_MIB, (base, rss_mib(srv.pid))
        t0 = time.monotonic()
        s, ok = raw(ctx, srv.port, ns="00000000000000ff", chunk=1)  # 1-byte chunks: refused, not mapped
        assert ok[0] == P.ERR and ok[2] == P.E_TOO_SMALL and time.monotonic() - t0 < BOUND_S
        s.close()
        assert good.round() < BOUND_S
        assert rss_mib(srv.pid) - base < cap + OVERHEAD_MIB
        good.close()
    finally:
        ctx.destroy(0)
        srv.stop()


def test_a_namespace_forgets_its_chunk_size_when_it_empties(tmp_path):
    srv = start_server(capacity=8 * MiB)
    ctx = zmq.Context()
    try:
        s, ok = raw(ctx, srv.port, ns="00000000000000aa", chunk=8192)
        assert ok[0] == P.OK
        s.send(P.pack(P.BYE, 2))
        s.close()
        deadline = time.monotonic() + 10
        while True:  # no chunk and no session left: the next client may pick another size
            s, ok = raw(ctx, srv.port, ns="00000000000000aa", chunk=16384)
            s.close()
            if ok[0] == P.OK or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert ok[0] == P.OK, ok
    finally:
        ctx.destroy(0)
        srv.stop()


def test_store_keeps_a_namespaces_share_against_anothers_pushes():
    store = MemoryStore(8 * 4096)
    for i in range(4):
        buf, _ = store.reserve("a", 4096, None, {"a", "b"})
        store.commit("a", b"a%d" % i, buf, 0)
    for i in range(40):  # namespace b pushes ten times its share
        buf, _ = store.reserve("b", 4096, None, {"a", "b"})  # both in use (a server with tenants)
        store.commit("b", b"b%d" % i, buf, 0)
    assert all(store.has("a", b"a%d" % i) for i in range(4)), "b's pushes evicted a below its share"
    assert sum(store.has("b", b"b%d" % i) for i in range(40)) == 4
    assert store.mapped <= store.capacity


# -- 4. tenants: a client key reads and writes only its namespaces ---------------------------


def test_allowlist_binds_client_keys_to_their_namespaces(tmp_path):
    from click.testing import CliRunner
    from kvtiers_p2p.cli import p2p

    keys, allow = tmp_path / "keys", tmp_path / "allow.txt"
    ns_a, ns_b = Namespace({"tenant": "a"}), Namespace({"tenant": "b"})
    run = CliRunner().invoke
    assert run(p2p, ["keygen", str(keys)]).exit_code == 0
    for name, ns in (("a", ns_a), ("b", ns_b)):
        r = run(p2p, ["keygen", str(keys), "--name", name, "--allow", str(allow), "--namespace", ns.digest])
        assert r.exit_code == 0, r.output
    assert set(load_allowlist(str(allow)).values()) == {frozenset({ns_a.digest}), frozenset({ns_b.digest})}
    srv = start_server(extra=["--curve-secret", str(keys / "server.key_secret"), "--allow", str(allow)])
    common = {"timeout": 3.0, "curve_server_key": str(keys / "server.key")}
    arena = Arena.allocate(2, 4096)
    arena[0][:] = b"A" * 4096
    a = tier(srv.port, arena, ns_a, **common, curve_secret_file=str(keys / "a.key_secret"))
    b_in_a = tier(srv.port, Arena.allocate(2, 4096), ns_a, **common, curve_secret_file=str(keys / "b.key_secret"))
    b = tier(srv.port, Arena.allocate(2, 4096), ns_b, **common, curve_secret_file=str(keys / "b.key_secret"))
    try:
        a.submit_store(Job(1, (b"mine",), (0,)))
        assert wait(a, 1).ok
        b_in_a.submit_load(Job(1, (b"mine",), (0,)))  # b's key claiming a's namespace: refused
        r = wait(b_in_a, 1)
        assert not r.ok and "not among this client key's namespaces" in (r.error or ""), r
        b_in_a.submit_store(Job(2, (b"mine",), (1,)))  # nor can it plant a chunk there
        assert not wait(b_in_a, 2).ok
        b.submit_store(Job(1, (b"theirs",), (0,)))  # in its own namespace it is served
        assert wait(b, 1).ok
        a.submit_load(Job(2, (b"mine",), (1,)))
        assert wait(a, 2).ok and bytes(arena[1]) == b"A" * 4096
    finally:
        for h in (a, b_in_a, b):
            h.close()
        srv.stop()


# -- 5. connections that never say HELLO, and malformed frames, are closed ------------------


def test_connections_without_hello_are_capped_and_closed(tmp_path):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    srv = start_server(capacity=16 * MiB, extra=["--max-connections", "40", "--handshake-timeout", "2"], stderr=log)
    ctx = zmq.Context()
    idle = []
    try:
        good = Good(srv.port)
        fds0 = len(os.listdir(f"/proc/{srv.pid}/fd"))
        for _ in range(120):  # ZMTP handshakes, no HELLO; no quick reconnects
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 60000)
            s.connect(f"tcp://127.0.0.1:{srv.port}")
            idle.append(s)
        time.sleep(1.0)
        assert len(os.listdir(f"/proc/{srv.pid}/fd")) < fds0 + 40 + 8
        assert good.round() < BOUND_S
        time.sleep(4.0)  # past the HELLO deadline: all of them are closed
        assert len(os.listdir(f"/proc/{srv.pid}/fd")) <= fds0 + 10  # of the 40 it kept, none is left
        with open(f"/proc/{srv.pid}/stat") as f:
            cpu0 = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        time.sleep(2.0)
        with open(f"/proc/{srv.pid}/stat") as f:
            cpu1 = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        assert (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK") < 1.0, "the server spins with the connections gone"
        assert good.round() < BOUND_S
        bad, ok = raw(ctx, srv.port)  # a malformed frame: banned and disconnected
        assert ok[0] == P.OK
        bad.send(b"\xc1garbage")
        assert disconnected(bad, 10)
        bad.close()
        good.close()
    finally:
        for s in idle:
            s.close()
        ctx.destroy(0)
        srv.stop()
    assert server_stats(log)["malformed"] >= 1


# -- 6. the small ones ------------------------------------------------------------------------


def test_ipv6_loopback_works_or_is_a_one_line_error():
    try:
        srv = start_server(bind="tcp://[::1]:0", capacity=8 * MiB)
    except RuntimeError as e:  # no IPv6 on this host
        assert "\n" not in str(e)
        return
    try:
        arena = Arena.allocate(2, 4096)
        arena[0][:] = b"6" * 4096
        h = open_tier("p2p", {"host": "::1", "port": srv.port}, TierContext(arena, NS))
        try:
            h.submit_store(Job(1, (b"v6",), (0,)))
            assert wait(h, 1).ok
            h.submit_load(Job(2, (b"v6",), (1,)))
            assert wait(h, 2).ok and bytes(arena[1]) == bytes(arena[0])
        finally:
            h.close()
        with pytest.raises(BindError, match=r"^cannot bind tcp://\[::1\]:\d+: ") as e:  # in use
            PeerServer(f"tcp://[::1]:{srv.port}", MemoryStore(MiB))
        assert "\n" not in str(e.value)
    finally:
        srv.stop()


def test_keygen_keeps_a_key_pair_unless_forced_and_writes_the_secret_0600(tmp_path):
    from click.testing import CliRunner
    from kvtiers_p2p.cli import p2p

    run = CliRunner().invoke
    old = os.umask(0o022)
    try:
        assert run(p2p, ["keygen", str(tmp_path)]).exit_code == 0
    finally:
        os.umask(old)
    secret = tmp_path / "server.key_secret"
    assert oct(os.stat(secret).st_mode & 0o777) == "0o600"
    before = secret.read_bytes()
    r = run(p2p, ["keygen", str(tmp_path)])
    assert r.exit_code != 0 and "--force" in r.output and secret.read_bytes() == before
    assert run(p2p, ["keygen", str(tmp_path), "--force"]).exit_code == 0
    assert secret.read_bytes() != before and oct(os.stat(secret).st_mode & 0o777) == "0o600"
    import zmq.auth

    public, sec = zmq.auth.load_certificate(str(secret))
    assert len(public) == 40 and len(sec) == 40


def test_client_bounds_reply_headers():
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.unpack(P.pack(P.OK, 1, [b"k" * 60] * 20000), reply=True)  # ~1.3 MiB of "evicted keys"
    assert P.unpack(P.pack(P.OK, 1, [b"k" * 64] * P.MAX_BATCH), reply=True)[0] == P.OK


def test_zero_copy_pushes_to_a_silent_peer_fail_in_time_and_the_tier_recovers():
    import signal

    srv = start_server(capacity=256 * MiB)
    arena = Arena.allocate(64, MiB)  # 1 MiB chunks go out of their slots zero-copy
    fill(arena, 3)
    h = tier(srv.port, arena, timeout=2.0)
    try:
        h.submit_store(Job(1, (b"warm",), (0,)))
        assert wait(h, 1).ok
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h.submit_store(Job(2, tuple(b"silent-%d" % i for i in range(64)), tuple(range(64))))
            r = wait(h, 2, timeout=30)
            # ZMQ held some chunks in the silent peer's pipe: the socket was reset to let go of the slots
            assert not r.ok and time.monotonic() - t0 < 2.0 + 1.0 + BOUND_S, r
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        jid = 3
        while True:  # served again once it wakes up (after the reconnect)
            h.submit_store(Job(jid, (b"after",), (0,)))
            if wait(h, jid).ok:
                break
            assert time.monotonic() < deadline
            jid += 1
    finally:
        h.close()
        srv.stop()
