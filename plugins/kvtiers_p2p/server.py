"""The peer server: a ZMQ ROUTER answering LOOKUP, GET and PUT from a chunk store.

One thread runs :meth:`PeerServer.serve_forever`. Every frame is checked before use: a
malformed header or a frame count that does not fit its op drops the request, ends the
sender's session, closes its connection and ignores its routing id for ``ban_s``; the
server keeps serving everyone else. Limits: the largest frame (ZMQ ``MAXMSGSIZE``: a bigger
frame disconnects its sender inside libzmq), connections, clients, namespaces and chunk
sizes, GET streams in flight per client, the ZMTP handshake and the HELLO after it, and the
idle time of a session.

No client can lock another out: sessions are capped per peer (its address; its CurveZMQ
key where CurveZMQ is on), connections without a session per peer address
(:mod:`kvtiers_p2p.conns`); a full server gives a HELLO from a peer holding fewer sessions
than the largest holder that holder's least recently active session; a session idle for
``idle_timeout`` is reaped with its connection. Namespaces and chunk sizes are charged to
the peer that first said HELLO for the namespace and capped per peer the same way: a peer
at its cap reclaims its own least recently used namespace that no session uses, and a
full table gives a peer holding at least two fewer than the largest holder one of that
holder's (see :meth:`PeerServer._room_for`); a reclaimed namespace's chunks are evicted.
A client's ``max_bytes`` never shrinks what another client of its namespace asked for (see
:meth:`PeerServer.quota`).

No client can hold up another: each session has its own queue of replies its pipe had no
room for (at most ``max_queued``); a client whose pipe is full is skipped, and one that
reads nothing for ``stall_timeout`` seconds is disconnected, its streams cancelled.
``python -m kvtiers_p2p serve`` runs one (what ``kvtiers p2p serve`` and the tests start).

This module holds the serve loop, replies, disconnects and :func:`run`; :class:`PeerServer`
takes the session and namespace table from :mod:`kvtiers_p2p.sessions`, the request handlers
from :mod:`kvtiers_p2p.handlers` and the GET streams from :mod:`kvtiers_p2p.streams`.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from . import protocol as P
from .conns import Connections
from .handlers import E_NO_FAULTS, RequestHandlers
from .sessions import ServerLimits, Session, SessionTable
from .store import MemoryStore
from .streams import BURST, NIXL_AHEAD, NIXL_INFLIGHT_BYTES, NOT_READY, Stream, StreamSender

__all__ = ["BURST", "E_NO_FAULTS", "NIXL_AHEAD", "NIXL_INFLIGHT_BYTES", "NOT_READY", "AuthConfigError", "BindError",
           "PeerServer", "ServerLimits", "Session", "Stream", "loopback_refusal", "run"]

log = logging.getLogger("kvtiers.p2p")


class AuthConfigError(ValueError):
    """A bind the server refuses: off loopback without CurveZMQ, or bad key files."""


class BindError(ValueError):
    """The address cannot be bound (in use, no such interface, IPv6 off)."""


def loopback_refusal(url: str) -> str:
    return (
        f"refusing to serve on {url}: it is reachable from other hosts and no authentication is configured. "
        "Bind tcp://127.0.0.1:PORT, or configure CurveZMQ: run `kvtiers p2p keygen DIR` and start with "
        "--curve-secret DIR/server.key_secret --allow DIR/clients (a directory holding each allowed client's "
        "public .key file); clients set curve_server_key and curve_secret_file"
    )


class PeerServer(SessionTable, RequestHandlers, StreamSender):
    """A ROUTER socket bound to ``bind`` serving ``store``.

    ``namespace``/``chunk_bytes``, when given, pin what clients must say in HELLO (an engine
    serving its own arena); otherwise the first HELLO of a namespace fixes its chunk size.
    ``curve_secret`` (a secret certificate file from ``kvtiers p2p keygen``) and ``allow_dir``
    (the public certificates of allowed clients) turn on CurveZMQ; without them a bind off
    loopback raises :class:`AuthConfigError`.
    """

    def __init__(self, bind: str, store: Any, *, limits: ServerLimits = ServerLimits(),
                 namespace: str | None = None, chunk_bytes: int | None = None, curve_secret: str | None = None,
                 allow_dir: str | None = None, nixl: bool = False, test_faults: bool = False) -> None:  # fmt: skip
        ep = P.parse_endpoint(bind)
        if (curve_secret is None) != (allow_dir is None):
            raise AuthConfigError("CurveZMQ needs both --curve-secret and --allow")
        if not ep.loopback and curve_secret is None:
            raise AuthConfigError(loopback_refusal(bind))
        self.store = store
        self.limits = limits
        self.namespace = namespace
        self.pinned_chunk = chunk_bytes
        self.test_faults = test_faults  # accept CORRUPT (tests only; see _corrupt)
        self.instance = secrets.token_hex(8)  # clients notice a restart by a new instance id
        self.sessions: dict[bytes, Session] = {}
        self.banned: OrderedDict[bytes, float] = OrderedDict()
        self.ns_chunk: dict[str, int] = {}  # namespace -> its chunk size
        self.ns_owner: dict[str, str] = {}  # namespace -> the peer it is charged to (its first HELLO's)
        self.ns_used: dict[str, float] = {}  # namespace -> when a session last used it
        self.streams: deque[Stream] = deque()
        self._gone: set[bytes] = set()
        self.waiting: dict[bytes, Session] = {}  # sessions with replies queued (Session.outbox)
        self.stalled: dict[bytes, float] = {}  # routing id -> since when its pipe has been full
        self.tenants: dict[str, frozenset[str] | None] | None = None  # CurveZMQ key -> namespaces (None: any)
        self._fd: int | None = None  # the connection of the message being handled
        self.conns: Connections | None = None
        self.stats = {"malformed": 0, "refused": 0, "chunks_sent": 0, "chunks_stored": 0, "disconnected": 0,
                      "reaped": 0, "reclaimed": 0}
        self._stop = False
        self.nixl = None
        self.orphans: list[tuple] = []  # (write, source, stream, pos) of ended GETNs: kept until NIXL is done
        self.draining: list[tuple[bytes, int, list[Any]]] = []  # cancelled GETNs: (ident, rid, writes)
        if nixl:
            from .nixl_path import NixlServer

            self.nixl = NixlServer()
            if store is not None:  # a store registers its slabs as it maps them
                store.on_slab = self.nixl.register
        self.ctx = zmq.Context()
        self._auth = None
        self.curve = curve_secret is not None
        try:
            self.sock = self.ctx.socket(zmq.ROUTER)
            s = self.sock
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            max_frame = max(chunk_bytes or limits.max_chunk_bytes, P.MAX_HEADER)
            s.setsockopt(zmq.MAXMSGSIZE, max_frame)
            s.setsockopt(zmq.HANDSHAKE_IVL, int(limits.handshake_timeout * 1000))
            s.setsockopt(zmq.SNDHWM, 128)  # messages queued per client: one that reads nothing stalls soon
            s.setsockopt(zmq.RCVHWM, 64)  # PUTs libzmq holds per connection before we read them
            s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
            if ep.host.startswith("["):
                s.setsockopt(zmq.IPV6, 1)
            self._setup_socket(s)
            if curve_secret is not None:
                self._setup_curve(curve_secret, allow_dir)
            self.conns = Connections(s, limit=limits.max_connections, hello_timeout=limits.handshake_timeout,
                                     per_peer=limits.max_pending_per_peer)
            try:
                s.bind(bind)
            except zmq.ZMQError as e:
                raise BindError(f"cannot bind {bind}: {e.strerror}") from None
            self.endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise

    def _setup_curve(self, secret_file: str, allow_dir: str | None) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        if not zmq.has("curve"):
            raise AuthConfigError("this libzmq has no CurveZMQ support")
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as e:
            raise AuthConfigError(f"--curve-secret {secret_file}: {e}") from None
        if not secret:
            raise AuthConfigError(f"--curve-secret {secret_file}: holds no secret key (use the .key_secret file)")
        if not allow_dir or not (os.path.isdir(allow_dir) or os.path.isfile(allow_dir)):
            raise AuthConfigError(f"--allow {allow_dir}: not a directory of client public keys nor an allowlist file")
        if os.path.isfile(allow_dir):  # keys bound to namespaces (kvtiers_p2p.tenants)
            from .tenants import AllowlistAuth, load_allowlist

            self.tenants = load_allowlist(allow_dir)
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        if self.tenants is not None:
            self._auth.configure_curve_callback(domain="*", credentials_provider=AllowlistAuth(self.tenants))
        else:
            self._auth.configure_curve(domain="*", location=allow_dir)
        self.sock.curve_secretkey = secret
        self.sock.curve_publickey = public
        self.sock.curve_server = True

    def _setup_socket(self, sock: zmq.Socket) -> None:
        """Socket options of a subclass, set before the bind (the serve block bounds queued bytes)."""

    # -- the loop ------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler or another thread)."""
        self._stop = True

    def serve_forever(self, *, watch: Any = None, poll_ms: int = 100) -> None:
        """Serve until :meth:`stop`, or until ``watch()`` returns False (checked twice a second)."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        mon = self.conns.mon
        poller.register(mon, zmq.POLLIN)
        next_check = 0.0
        stuck = False  # the last round sent nothing it had to send (full pipes, pins or writes pending)
        while not self._stop:
            timeout = (1 if stuck else 0) if self._sendable() else poll_ms
            events = dict(poller.poll(timeout))
            if mon in events:
                for ident in self.conns.events():
                    self._drop(ident)
            if self.sock in events:
                self._receive_some()
            progressed = self._flush()
            if self.draining:
                self._drain()
            if self.streams:
                progressed = self._pump() or progressed
            stuck = not progressed and not self._nixl_pending()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                self._expire(now)
                if watch is not None and not watch():
                    break

    def _reply(self, ident: bytes, *frames: Any) -> None:
        """Send a reply now, or queue it behind the client's earlier ones when its pipe is
        full (at most ``max_queued``: one more disconnects it). A client without a session
        whose pipe is full loses the reply."""
        sess = self.sessions.get(ident)
        if sess is None:
            self._send(ident, *frames)
        elif sess.outbox or not self._send(ident, *frames):
            if len(sess.outbox) >= self.limits.max_queued:
                self._kick(ident, f"it left {len(sess.outbox)} replies unread")
            else:
                sess.outbox.append(frames)
                self.waiting[ident] = sess
        self._forget_gone()

    def _flush(self) -> bool:
        """Send what each client's queue holds, as far as its pipe takes it; True when any was sent."""
        progressed = False
        for ident, sess in list(self.waiting.items()):
            box = sess.outbox
            while box and self._send(ident, *box[0]):
                box.popleft()
                progressed = True
            if not box:
                self.waiting.pop(ident, None)
        self._forget_gone()
        return progressed

    def _kick(self, ident: bytes, why: str) -> None:
        """Disconnect a client: end its session and streams, close its connection, ignore
        what it still sends for ``ban_s``."""
        sess = self.sessions.get(ident)
        log.info("p2p server: disconnecting client %s: %s", ident.hex(), why)
        self.stats["disconnected"] += 1
        self._drop(ident)
        self._ban(ident)
        if sess is not None:
            self.conns.close(sess.fd, why)

    def _reap(self, ident: bytes, why: str) -> None:
        """End a session and close its connection (no ban: its client may say HELLO again)."""
        sess = self.sessions.get(ident)
        if sess is None:
            return
        log.info("p2p server: reaping the session of %s (%s): %s", ident.hex(), sess.peer, why)
        self.stats["reaped"] += 1
        self._drop(ident)
        self.conns.close(sess.fd, why)

    def _ban(self, ident: bytes) -> None:
        self.banned[ident] = time.monotonic() + self.limits.ban_s
        while len(self.banned) > 4096:
            self.banned.popitem(last=False)

    def _forget_gone(self) -> None:
        while self._gone:
            self._drop(self._gone.pop())

    def _receive_some(self) -> None:
        sock = self.sock
        for _ in range(256):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frame.bytes
            try:
                self._fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:  # libzmq knows no descriptor for this message
                self._fd = None
            try:
                self._handle(ident)
            except P.ProtocolError as e:
                self._misbehaved(ident, str(e))
            finally:
                while sock.getsockopt(zmq.RCVMORE):  # the rest of a message we did not use
                    sock.recv(copy=False)

    def _misbehaved(self, ident: bytes, why: str) -> None:
        self.stats["malformed"] += 1
        log.info("p2p server: dropping connection %s: %s", ident.hex(), why)
        self._drop(ident)
        self._ban(ident)
        self.conns.close(self._fd, f"malformed frame: {why}")

    def _drop(self, ident: bytes) -> None:
        sess = self.sessions.pop(ident, None)
        if sess is not None and self.conns is not None:
            self.conns.unbind(sess.fd, ident)  # a connection left without a session is pending again
        self.waiting.pop(ident, None)
        self.stalled.pop(ident, None)
        if any(st.session.ident == ident for st in self.streams):
            for st in self.streams:
                if st.session.ident == ident:
                    self._ended(st)
            self.streams = deque(st for st in self.streams if st.session.ident != ident)

    def _expire(self, now: float) -> None:
        if self.orphans:
            self._reap_orphans()
        idle = [i for i, s in self.sessions.items() if now - s.last_seen > self.limits.idle_timeout and not s.streams]
        for ident in idle:
            self._reap(ident, f"idle for {self.limits.idle_timeout:g} s")
        for ident, since in list(self.stalled.items()):
            if now - since > self.limits.stall_timeout:
                if ident in self.sessions:
                    self._kick(ident, f"it read nothing for {self.limits.stall_timeout:g} s")
                else:
                    self.stalled.pop(ident, None)
        self.conns.expire(now)
        while self.banned and next(iter(self.banned.values())) < now:
            self.banned.popitem(last=False)

    def close(self) -> None:
        """Close the socket and the context (pending replies are dropped)."""
        sock = getattr(self, "sock", None)
        if sock is not None:
            if self.conns is not None:
                self.conns.stop(sock)
                self.conns = None
            sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self.nixl is not None and not self.orphans and not self.draining:  # writes still running keep it
            self.nixl.close()
        self.ctx.term()



def run(bind: str, capacity: int, *, limits: ServerLimits = ServerLimits(), namespace: str | None = None,
        chunk_bytes: int | None = None, curve_secret: str | None = None, allow_dir: str | None = None,
        endpoint_file: str | None = None, exit_when_missing: str | None = None, parent_pid: int | None = None,
        announce: Any = None, nixl: bool = False, test_faults: bool = False) -> dict:  # fmt: skip
    """Run a standalone peer cache until SIGTERM/SIGINT (or until ``exit_when_missing`` is
    gone or ``parent_pid`` died). ``endpoint_file`` receives the bound address (useful with
    port 0), written atomically. Returns the server's counters (``stats``)."""
    server = PeerServer(bind, MemoryStore(capacity), limits=limits, namespace=namespace, chunk_bytes=chunk_bytes,
                        curve_secret=curve_secret, allow_dir=allow_dir, nixl=nixl, test_faults=test_faults)
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
        if endpoint_file:
            tmp = f"{endpoint_file}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(server.endpoint + "\n")
            os.replace(tmp, endpoint_file)
        if announce is not None:
            announce(server)

        def watch() -> bool:
            if exit_when_missing and not os.path.exists(exit_when_missing):
                return False
            return not (parent_pid and os.getppid() != parent_pid)

        server.serve_forever(watch=watch)
        stats = {**server.stats, "chunks": len(server.store), "bytes": server.store.bytes,
                 "evictions": server.store.evictions}
        if server.nixl is not None:
            stats.update(nixl_write_bytes_in_flight=server.nixl.inflight_bytes,
                         nixl_write_bytes_peak=server.nixl.inflight_peak)
        return stats
    finally:
        server.close()
