"""No p2p client can lock another out, each checked against a real ``kvtiers p2p serve``
process: an attacker holding many idle sessions or many connections that never say HELLO,
from one address (or one CurveZMQ key), leaves a legitimate client from another able to join
and be served; the server's descriptors stay bounded; idle sessions are reaped with their
connections; and one client's ``max_bytes`` cannot fail or flush another client's stores.
Past ``--max-connections`` the documented connection is closed (the largest holder's oldest,
or the newcomer); a refused connection is closed after ``--handshake-timeout``; ``ipc://``
peers are told apart by user id. Descriptor counts are medians of several samples, and the
handshake timeout is long where it must not be what closes connections.

Loopback has all of 127.0.0.0/8: an attacker connects from 127.0.0.2 and up (ZMQ's
``tcp://SOURCE:0;DEST`` form), the legitimate client from 127.0.0.1."""

from __future__ import annotations

import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

zmq = pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from test_p2p_attacks import BOUND_S, GOOD_NS, Good, fill, tier  # noqa: E402
from tier_helpers import resolve_lookup as resolve  # noqa: E402
from tier_helpers import server_stats  # noqa: E402
from tier_helpers import wait_job as wait  # noqa: E402

from kvtiers import Arena, Job, Lookup  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


def dealer(ctx, port: int, src: str, *, reconnect_s: float = 60.0, curve: tuple | None = None):
    """A DEALER connected to the server from address ``src`` (no HELLO sent)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, int(reconnect_s * 1000))
    if curve is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
    s.connect(f"tcp://{src}:0;127.0.0.1:{port}")
    return s


def hello(s, *, ns: str = GOOD_NS.digest, chunk: int = 64 * KiB, max_bytes: int | None = None) -> list:
    """Say HELLO on ``s`` and return the answer."""
    s.send(P.pack(P.HELLO, 1, P.VERSION, ns, chunk, max_bytes))
    assert s.poll(10000), "no answer to HELLO"
    return P.unpack(s.recv(), reply=True)


def hellos(ctx, port: int, src: str, n: int, *, curve: tuple | None = None,
           keep_refused: bool = True) -> tuple[list[list], list]:
    """``n`` attacker connections from ``src``, each saying HELLO: the answers, and the sockets
    kept open (those refused are closed at once unless ``keep_refused``)."""
    answers, held = [], []
    for _ in range(n):
        s = dealer(ctx, port, src, curve=curve)
        answers.append(hello(s))
        if answers[-1][0] == P.OK or keep_refused:
            held.append(s)
        else:  # refused: its connection would be pending (see the test of silent connections)
            s.close(0)
    return answers, held


@contextmanager
def served(extra: list[str] | None = None, log=None, capacity: int = 16 * MiB) -> Iterator[tuple]:
    """A ``kvtiers p2p serve`` process (16 MiB), a ZMQ context and a list for the good clients:
    all closed and stopped at the end."""
    srv = start_server(capacity=capacity, extra=extra, stderr=log)
    ctx = zmq.Context()
    good: list[Good] = []
    try:
        yield srv, ctx, good
    finally:
        for g in good:
            g.close()
        ctx.destroy(0)
        srv.stop()


def fds(pid: int, samples: int = 7, gap: float = 0.05) -> int:
    """The server's open descriptors: the median of ``samples`` counts ``gap`` seconds apart
    (a connection being accepted or closed shows in one count, not in the median)."""
    proc, counts = psutil.Process(pid), []
    for i in range(samples):
        if i:
            time.sleep(gap)
        counts.append(proc.num_fds())
    return statistics.median_low(counts)


def settle_fds(pid: int, most: int, timeout: float = 10.0) -> int:
    """The server's open descriptors once they are at most ``most`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    n = fds(pid)
    while n > most and time.monotonic() < deadline:
        time.sleep(0.1)
        n = fds(pid)
    return n


def watched(ctx, port: int, src: str) -> tuple:
    """A DEALER from ``src`` that does not reconnect, and a monitor of its disconnection."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, -1)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.connect(f"tcp://{src}:0;127.0.0.1:{port}")
    return s, mon


def closed(mon, timeout: float) -> bool:
    """Whether the connection ``mon`` watches was closed (now, or within ``timeout`` seconds)."""
    from zmq.utils.monitor import recv_monitor_message

    end = time.monotonic() + timeout
    while True:
        if mon.poll(max(0, int((end - time.monotonic()) * 1000))):
            if recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED:
                return True
        elif time.monotonic() >= end:
            return False


def test_idle_sessions_of_one_address_do_not_lock_out_another():
    with served() as (srv, ctx, good):  # the defaults: 64 clients, 32 sessions per peer
        # 64 idle sessions from one address: no more than its share get in
        answers, _held = hellos(ctx, srv.port, "127.0.0.2", 64, keep_refused=False)
        ok = [a for a in answers if a[0] == P.OK]
        refused = [a for a in answers if a[0] == P.ERR]
        assert len(ok) == 32, len(ok)
        assert all(a[2] == P.E_FULL and "32 sessions from 127.0.0.2" in a[3] for a in refused), refused[:1]
        good.append(Good(srv.port))  # another address joins and is served
        for _ in range(2):
            assert good[0].round() < BOUND_S


def _curve_keys(tmp_path) -> tuple[dict, dict]:
    import zmq.auth
    from click.testing import CliRunner
    from kvtiers_p2p.cli import p2p

    keys = tmp_path / "keys"
    for name in ("server", "bad", "good"):
        assert CliRunner().invoke(p2p, ["keygen", str(keys), "--name", name]).exit_code == 0
    (keys / "clients").mkdir()
    for name in ("bad", "good"):
        (keys / "clients" / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    bad = (server_public, *zmq.auth.load_certificate(str(keys / "bad.key_secret")))
    extra = ["--curve-secret", str(keys / "server.key_secret"), "--allow", str(keys / "clients")]
    good = {"curve_server_key": str(keys / "server.key"), "curve_secret_file": str(keys / "good.key_secret")}
    return {"extra": extra, "bad": bad}, good


@pytest.mark.parametrize("curve", [False, True], ids=["by-address", "by-curve-key"])
def test_a_full_server_makes_room_for_a_peer_below_its_share(tmp_path, curve):
    """The attacker fills the server; a HELLO from a peer holding fewer sessions takes the
    place of the attacker's least recently active one. With CurveZMQ the peer is the client
    key, so an attacker on the same address as the good client (127.0.0.1) is told apart."""
    extra, src, key, opts = ["--max-clients", "8", "--max-sessions-per-peer", "8"], "127.0.0.2", None, {}
    if curve:
        if not zmq.has("curve"):
            pytest.skip("this libzmq has no CurveZMQ")
        setup, opts = _curve_keys(tmp_path)
        extra, src, key = extra + setup["extra"], "127.0.0.1", setup["bad"]
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    with served(extra, log) as (srv, ctx, good):
        answers, _held = hellos(ctx, srv.port, src, 10, curve=key)
        for i, a in enumerate(answers):
            assert (a[0] == P.OK) if i < 8 else (a[0] == P.ERR and a[2] == P.E_FULL), (i, a)
        good.append(Good(srv.port, **opts))
        for _ in range(2):
            assert good[0].round() < BOUND_S
    assert server_stats(log)["reaped"] >= 1


def test_silent_connections_are_capped_per_address_and_keep_nobody_out():
    # a handshake timeout far longer than the test: only the limits close connections here
    extra = ["--max-connections", "40", "--max-pending-per-peer", "12", "--handshake-timeout", "120"]
    with served(extra) as (srv, ctx, good):
        good.append(Good(srv.port))
        good[0].round()
        base = fds(srv.pid)  # the good client's connection among them
        # connections that never say HELLO, reconnecting when closed
        silent = [dealer(ctx, srv.port, "127.0.0.2", reconnect_s=0.2) for _ in range(100)]
        time.sleep(1.5)
        # medians of 7 counts; +1: one connection accepted and not yet closed may outlive a few counts
        assert fds(srv.pid) <= base + 12 + 1, "one address's connections without HELLO are not capped"
        assert good[0].round() < BOUND_S
        for src in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):  # three more addresses: past --max-connections
            silent += [dealer(ctx, srv.port, src, reconnect_s=0.2) for _ in range(20)]
        time.sleep(1.5)
        assert fds(srv.pid) <= base - 1 + 40 + 1, "more connections than --max-connections"
        good.append(Good(srv.port))  # a new connection from another address still gets in
        for g in good:
            assert g.round() < BOUND_S


def test_past_max_connections_the_largest_holder_loses_its_oldest_connection():
    """docs/p2p.md: past ``--max-connections`` a new connection closes the oldest connection
    without a session of the address holding the most of them, when that address holds more
    than the newcomer's; else the new one is closed. The handshake timeout is far longer than
    the test, so no connection goes for want of a HELLO."""
    extra = ["--max-connections", "8", "--max-pending-per-peer", "16", "--handshake-timeout", "120"]
    with served(extra) as (srv, ctx, good):
        base = fds(srv.pid)
        held = []
        for _ in range(8):  # one at a time, so the first is the oldest
            held.append(watched(ctx, srv.port, "127.0.0.2"))
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while fds(srv.pid) != base + 8:  # all 8 accepted, none closed
            assert time.monotonic() < deadline, f"{fds(srv.pid) - base} connections open, not 8"
        # a ninth from the same address: the newcomer is closed, the others stay
        extra_sock, extra_mon = watched(ctx, srv.port, "127.0.0.2")
        assert closed(extra_mon, 10.0), "the newcomer of the largest holder was not closed"
        assert not any(closed(mon, 0) for _, mon in held), "an older connection was closed for the newcomer"
        # one from another address: 127.0.0.2's oldest connection goes, the newcomer is served
        good.append(Good(srv.port))
        assert good[0].round() < BOUND_S
        assert closed(held[0][1], 10.0), "127.0.0.2's oldest connection was not closed"
        time.sleep(0.3)
        assert not any(closed(mon, 0) for _, mon in held[1:]), "another than the oldest was closed"
        assert good[0].round() < BOUND_S
        for s, mon in [*held, (extra_sock, extra_mon)]:
            s.disable_monitor()
            mon.close(0)


def test_a_refused_connection_is_closed_after_the_handshake_timeout():
    """docs/p2p.md: a connection without a session, refused ones too, is closed
    ``--handshake-timeout`` seconds after it was accepted."""
    with served(["--max-sessions-per-peer", "1", "--handshake-timeout", "2"]) as (srv, ctx, _):
        first = dealer(ctx, srv.port, "127.0.0.2")
        assert hello(first)[0] == P.OK
        s, mon = watched(ctx, srv.port, "127.0.0.2")
        t0 = time.monotonic()
        answer = hello(s)
        assert answer[0] == P.ERR and answer[2] == P.E_FULL, answer
        assert not closed(mon, 1.0), "a refused connection was closed well before the handshake timeout"
        assert closed(mon, 4.0), "a refused connection was not closed after the handshake timeout"
        assert 1.5 < time.monotonic() - t0
        first.send(P.pack(P.LOOKUP, 2, [b"k"]))  # the session's own connection stays
        assert first.poll(5000) and P.unpack(first.recv(), reply=True)[0] == P.OK
        s.disable_monitor()
        mon.close(0)


IPC_CLIENT = """
import importlib, os, pkgutil, sys, time
from kvtiers import Arena, Job, Namespace, TierContext, open_tier
from kvtiers.registry import get_registry
import kvtiers_p2p
get_registry().tier_info("p2p")
import kvtiers
# the SDK's and the tier's lazy imports (opening a tier reaches kvtiers.metrics), done now
sdk = [m for m in pkgutil.iter_modules(kvtiers.__path__, "kvtiers.") if m.name not in
       ("kvtiers.engine", "kvtiers.commands", "kvtiers.integrations")]
for m in [*sdk, *pkgutil.walk_packages(kvtiers_p2p.__path__, "kvtiers_p2p.")]:
    try:
        importlib.import_module(m.name)
    except ImportError:
        pass
# everything it runs is loaded: become the other user (its connection's SO_PEERCRED is that uid)
uid, gid = int(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
assert (os.getuid(), os.geteuid(), os.getgid()) == (uid, uid, gid)
arena = Arena.allocate(2, 65536)
arena[0][:] = b"u" * 65536
t = open_tier("p2p", {"peers": [sys.argv[1]], "timeout": 5.0}, TierContext(arena, Namespace({"test": "ipc"})))
def done(j):
    while True:
        for r in t.get_finished_jobs():
            return r
        time.sleep(0.001)
t.submit_store(Job(1, (b"ipc-key",), (0,)))
r = done(1)
assert r.ok, r.error
t.submit_load(Job(2, (b"ipc-key",), (1,)))
assert done(2).ok and bytes(arena[1]) == bytes(arena[0])
t.close()
print("served as uid", os.getuid())
"""


def test_ipc_peers_are_identified_by_user_id():
    """docs/p2p.md: on ``ipc://`` a connection's peer is the other process's user id
    (``SO_PEERCRED``): one user's sessions fill that user's share only."""
    sock_dir, url, srv, ctx = _ipc_server_with_full_share()
    ctx.destroy(0)
    srv.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


def test_ipc_another_user_is_served_when_ones_share_is_full():
    """With this user's share full, another user (the system's ``nobody``) is still served.
    The client imports kvtiers as root, from wherever this checkout is (a directory other
    users cannot enter included), then drops to ``nobody`` before it connects: the
    connection is that user's, and it needs nothing it could not read."""
    if os.getuid() != 0:
        pytest.skip("needs root: the second user's client drops from root to nobody")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this system has no 'nobody' user to be the second user")
    sock_dir, url, srv, ctx = _ipc_server_with_full_share()
    try:
        os.chmod(f"{sock_dir}/p2p.sock", 0o777)
        argv = [sys.executable, "-c", IPC_CLIENT, url, str(nobody.pw_uid), str(nobody.pw_gid)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=sock_dir)
        assert out.returncode == 0 and f"served as uid {nobody.pw_uid}" in out.stdout, out.stderr[-2000:]
    finally:
        ctx.destroy(0)
        srv.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _ipc_server_with_full_share():
    """A server on an ``ipc://`` socket allowing 2 sessions per peer, and this user's share
    full: 2 sessions held and a third refused naming this uid. Returns the socket's
    directory, the url, the server and the context holding the sessions."""
    # not under pytest's 0700 directories (the session's TMPDIR): the other user connects
    sock_dir = tempfile.mkdtemp(prefix="kvtiers-ipc-", dir=os.environ.get("KVTIERS_TESTS_OUTER_TMPDIR"))
    os.chmod(sock_dir, 0o755)
    url = f"ipc://{sock_dir}/p2p.sock"
    srv = start_server(bind=url, capacity=16 * MiB, extra=["--max-sessions-per-peer", "2"])
    ctx = zmq.Context()
    try:
        answers, held = [], []
        for _ in range(3):
            held.append(ctx.socket(zmq.DEALER))
            held[-1].setsockopt(zmq.LINGER, 0)
            held[-1].connect(url)
            answers.append(hello(held[-1]))
        assert [a[0] for a in answers] == [P.OK, P.OK, P.ERR], answers
        assert f"maximum of 2 sessions from uid {os.getuid()}" in answers[2][3], answers[2]
    except BaseException:
        ctx.destroy(0)
        srv.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    return sock_dir, url, srv, ctx


def test_idle_sessions_are_reaped_with_their_connections(tmp_path):
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115
    # 3 s idle: the twelve sessions must still be open when they are counted (at 1 s, a CI run
    # under the other worker's engines took so long over them that all had been reaped already)
    with served(["--idle-timeout", "3"], log) as (srv, ctx, good):
        good.append(Good(srv.port))
        good[0].round()
        base = fds(srv.pid)
        answers, _held = hellos(ctx, srv.port, "127.0.0.2", 12)  # sessions that then say nothing (no reconnect)
        assert all(a[0] == P.OK for a in answers), answers
        assert fds(srv.pid) >= base + 12
        assert settle_fds(srv.pid, base + 1, timeout=20) <= base + 1, "idle sessions keep their connections"
        assert good[0].round() < BOUND_S  # an idle good client is reaped too, reconnects and is served
    assert server_stats(log)["reaped"] >= 12


def test_one_clients_max_bytes_cannot_fail_or_flush_anothers_stores():
    with served() as (srv, ctx, _good):
        tiny = dealer(ctx, srv.port, "127.0.0.1")  # a client of the namespace whose cap is below a chunk
        assert hello(tiny, max_bytes=4 * KiB)[0] == P.OK
        one = dealer(ctx, srv.port, "127.0.0.1")  # and one whose cap holds one chunk
        assert hello(one, max_bytes=64 * KiB)[0] == P.OK
        arena = Arena.allocate(8, 64 * KiB)
        fill(arena, 5)
        other = tier(srv.port, arena, GOOD_NS)  # no cap of its own
        try:
            keys = tuple(b"mine-%d" % i for i in range(8))
            other.submit_store(Job(1, keys, tuple(range(8))))
            r = wait(other, 1)
            assert r.ok, r.error  # was: "a chunk of 65536 bytes never fits the capacity"
            assert resolve(other, list(keys)) == [Lookup.HIT] * 8  # and none of them was evicted for the caps
            want = [bytes(arena[i]) for i in range(8)]
            for i in range(8):
                arena[i][:] = bytes(64 * KiB)
            other.submit_load(Job(2, keys, tuple(range(8))))
            assert wait(other, 2).ok
            assert [bytes(arena[i]) for i in range(8)] == want
        finally:
            other.close()
