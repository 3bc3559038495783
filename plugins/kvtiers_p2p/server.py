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
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import protocol as P
from .conns import Connections
from .store import MIN_CHUNK_BYTES, MemoryStore

log = logging.getLogger("kvtiers.p2p")

E_NO_FAULTS = "no-test-faults"  #: the ERR code of a CORRUPT sent to a server without ``test_faults``

BURST = 8  #: chunks one GET stream may send before the next stream's turn
NIXL_AHEAD = 16  #: NIXL writes a GETN stream keeps posted ahead of what it announced, at most
#: ... and a write ahead of a stream's next chunk only while the server's writes in flight (all
#: streams) are fewer bytes. On one host UCX does the copy itself (CMA): more writes posted only
#: delay each one's announcement, and the client's check of it (16 ahead per stream loaded 1 MiB
#: chunks on 4 streams at 0.96-0.98x of raw NIXL, this budget at 1.07-1.10x). 8 MiB is still
#: many times a NIC's bandwidth-delay product.
NIXL_INFLIGHT_BYTES = 8 << 20
NOT_READY = object()  #: what _nixl_source returns for a chunk that cannot be written yet (not pinned yet)


@dataclass(frozen=True)
class ServerLimits:
    """What one server allows (``kvtiers p2p serve`` options of the same names)."""

    max_clients: int = 64  #: sessions at once; one more HELLO is refused with ``full``
    max_inflight: int = 16  #: GET streams in flight per client; one more is refused with ``busy``
    max_chunk_bytes: int = 64 << 20  #: the largest chunk; frames above it disconnect the sender
    handshake_timeout: float = 5.0  #: seconds a connection may take for the ZMTP handshake
    idle_timeout: float = 300.0  #: a session silent this long is dropped (the client says HELLO again)
    ban_s: float = 60.0  #: a connection that sent a malformed frame is ignored this long
    max_connections: int = 256  #: connections at once (with or without a session); more are closed at once
    stall_timeout: float = 10.0  #: a client whose pipe stays full this long (it reads nothing) is disconnected
    max_queued: int = 64  #: replies queued per client behind its full pipe; one more disconnects it
    max_namespaces: int = 64  #: namespaces at once; a HELLO for one more is refused with ``full``
    max_chunk_sizes: int = 8  #: distinct chunk sizes at once; a HELLO for one more is refused with ``full``
    max_namespaces_per_peer: int = 32  #: namespaces charged to one peer (the peer that first said HELLO for each)
    max_chunk_sizes_per_peer: int = 4  #: distinct chunk sizes of the namespaces charged to one peer
    max_sessions_per_peer: int = 32  #: sessions of one peer (address; CurveZMQ key with CurveZMQ) at once
    max_pending_per_peer: int = 16  #: connections that have not said HELLO from one address at once


@dataclass
class Session:
    ident: bytes
    ns: str
    chunk_bytes: int
    max_bytes: int | None
    last_seen: float
    streams: int = 0
    nixl: tuple[str, int, int, int] | None = None  # remote agent, staging base, count, stride
    fd: int | None = None  # its connection (see kvtiers_p2p.conns)
    outbox: deque = field(default_factory=deque)  # replies its full pipe had no room for
    pins: int = 0  # serve block: arena slots pinned for its GETs
    peer: str = "?"  # whose session it is: the peer's address, or its CurveZMQ key (see PeerServer._peer)


@dataclass
class Stream:
    """A GET being answered chunk by chunk."""

    session: Session
    rid: int
    keys: list[bytes]
    pos: int = 0
    sent: list[Any] = field(default_factory=list)
    stage: list[int] | None = None  # GETN: the client's slot index per key
    posted: dict[int, tuple] = field(default_factory=dict)  # GETN: position -> ("w", write, source) |
    #                                                          ("ok", xxh3) | ("miss",)


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


class PeerServer:
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

    def _sendable(self) -> bool:
        return bool(self.streams or self.waiting)

    def _nixl_pending(self) -> bool:
        return self.nixl is not None and (bool(self.draining) or any(st.posted for st in self.streams))

    def _drain(self) -> None:
        """Answer each cancelled GETN with DONE once no write it posted can still land."""
        left = []
        for ident, rid, writes in self.draining:
            if any(w.poll() == "PROC" for w in writes):
                left.append((ident, rid, writes))
            else:
                self._reply(ident, P.pack(P.DONE, rid))
        self.draining = left

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

    # -- what a subclass serving other memory overrides ------------------------------------
    def _lookup(self, sess: Session, rid: int, keys: list[bytes]) -> None:
        has = self.store.has
        self._reply(sess.ident, P.pack(P.OK, rid, bytes(has(sess.ns, k) for k in keys)))

    def _get(self, st: Stream) -> None:
        self.streams.append(st)

    def _ended(self, st: Stream) -> None:
        """A stream was cancelled or its client dropped before it was sent out."""
        for p, posted in st.posted.items():
            if posted[0] == "w":  # NIXL cannot abort it: keep its source until it is done
                self.orphans.append((posted[1], posted[2], st, p))
        st.posted.clear()

    def _chunk(self, st: Stream) -> bool | None:
        """Send the chunk of ``st.keys[st.pos]`` (or MISSING); False: the pipe is full,
        None: not ready yet (try again later)."""
        if st.stage is not None:
            return self._chunk_nixl(st)
        got = self.store.get(st.session.ns, st.keys[st.pos])
        if got is None:
            return self._send(st.session.ident, P.pack(P.MISSING, st.rid, st.pos))
        return self._send_chunk(st.session.ident, P.pack(P.CHUNK, st.rid, st.pos, got[1]), got)

    def _send(self, ident: bytes, *frames: Any) -> bool:
        try:
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stalled.setdefault(ident, time.monotonic())
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client is gone
            if e.errno == zmq.EHOSTUNREACH:
                self._gone.add(ident)  # dropped by the caller, once it is done iterating
                return True
            raise
        if self.stalled:
            self.stalled.pop(ident, None)
        return True

    def _nixl_source(self, st: Stream, p: int) -> tuple[Any, int] | None:
        """The buffer and xxh3 of ``st.keys[p]`` for a NIXL write, or None (missing). The
        caller keeps the buffer referenced until the write is over (see :meth:`_nixl_done`)."""
        item = self.store.get(st.session.ns, st.keys[p])
        if item is None:
            return None
        item[3] = True  # evicted meanwhile: the pool reuses the buffer only once our reference is gone
        return item[0], item[1]

    def _nixl_done(self, st: Stream, p: int) -> None:
        """The NIXL write of ``st.keys[p]`` is over (or was never posted): its source may go."""

    def _chunk_nixl(self, st: Stream) -> bool | None:
        """GETN: post NIXL writes a few keys ahead, then announce each one once it is done."""
        peer, base, _, stride = st.session.nixl
        for p in range(st.pos, min(len(st.keys), st.pos + NIXL_AHEAD)):
            if p in st.posted:
                continue
            if p > st.pos and self.nixl.inflight_bytes >= NIXL_INFLIGHT_BYTES:
                break  # each stream's next chunk is always posted: every stream moves
            src = self._nixl_source(st, p)
            if src is NOT_READY:
                break
            write = None if src is None else self.nixl.write(src[0], peer, base + st.stage[p] * stride)
            if write is None:
                if src is not None:
                    self._nixl_done(st, p)
                st.posted[p] = ("miss",)
            else:
                st.posted[p] = ("w", write, src)
        cur = st.posted.get(st.pos)
        if cur is None:
            return None
        if cur[0] == "w":
            state = cur[1].poll()
            if state == "PROC":
                return None
            self._nixl_done(st, st.pos)
            cur = st.posted[st.pos] = ("ok", cur[2][1]) if state == "DONE" else ("miss",)
        if cur[0] == "ok":
            head = P.pack(P.CHUNK, st.rid, st.pos, cur[1])
        else:
            head = P.pack(P.MISSING, st.rid, st.pos)
        ok = self._send(st.session.ident, head)
        if ok:
            del st.posted[st.pos]
            if cur[0] == "ok":
                self.stats["chunks_sent"] += 1
        return ok

    def _send_chunk(self, ident: bytes, head: bytes, item: list[Any]) -> bool:
        """Send a stored chunk zero-copy; its buffer is not reused until ZMQ is done with
        it (see :mod:`kvtiers_p2p.store`)."""
        try:
            item[3] = True
            self.sock.send_multipart([ident, head, item[0]], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stalled.setdefault(ident, time.monotonic())
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self._gone.add(ident)
                return True
            raise
        if self.stalled:
            self.stalled.pop(ident, None)
        self.stats["chunks_sent"] += 1
        return True

    def _error(self, ident: bytes, rid: int, code: str, message: str) -> None:
        self.stats["refused"] += 1
        self._reply(ident, P.pack(P.ERR, rid, code, message))

    def _more(self) -> bool:
        return bool(self.sock.getsockopt(zmq.RCVMORE))

    def _handle(self, ident: bytes) -> None:
        """Handle one message whose routing id was just received; its frames are read
        one by one, so a PUT's chunk goes straight into a store buffer."""
        if not self._more():
            raise P.ProtocolError("a message needs a header frame")
        head = self.sock.recv(copy=False)
        until = self.banned.get(ident)
        if until is not None:
            if until > time.monotonic():
                return
            del self.banned[ident]
        hdr = P.unpack(head.buffer)
        op, rid = hdr[0], hdr[1]
        if op not in P.REQUEST_OPS:
            raise P.ProtocolError(f"unknown op {op}")
        if op == P.PUT:
            if not self._more():
                raise P.ProtocolError("PUT without a chunk frame")
        elif self._more():
            raise P.ProtocolError(f"{P.REQUEST_OPS[op]} with more than one frame")
        if op == P.HELLO:
            return self._hello(ident, rid, hdr, head)
        if op == P.CORRUPT:  # no session: the caller (conformance_corrupt) knows no chunk size
            return self._corrupt(ident, rid, hdr)
        sess = self.sessions.get(ident)
        if sess is None:
            if op not in (P.BYE, P.CANCEL):
                self._error(ident, rid, P.E_HELLO, "no session: send HELLO first (or the session idled out)")
            return
        self.ns_used[sess.ns] = sess.last_seen = time.monotonic()
        if op == P.LOOKUP:
            P.expect_len(hdr, 3, "LOOKUP")
            self._lookup(sess, rid, P.check_keys(hdr[2]))
        elif op == P.GET or op == P.GETN:
            P.expect_len(hdr, 3 if op == P.GET else 4, P.REQUEST_OPS[op])
            keys = P.check_keys(hdr[2])
            stage = None
            if op == P.GETN:
                if sess.nixl is None:
                    return self._error(ident, rid, P.E_NONIXL, "GETN without NIXL in the handshake")
                stage = hdr[3]
                n = sess.nixl[2]
                if type(stage) is not list or len(stage) != len(keys) or not all(
                        type(i) is int and 0 <= i < n for i in stage):
                    raise P.ProtocolError(f"GETN slot indexes must be {len(keys)} ints in [0, {n})")
            if sess.streams >= self.limits.max_inflight:
                return self._error(ident, rid, P.E_BUSY, f"more than {self.limits.max_inflight} GETs in flight")
            sess.streams += 1
            self._get(Stream(sess, rid, keys, stage=stage))
        elif op == P.PUT:
            P.expect_len(hdr, 4, "PUT")
            self._put(sess, rid, P.check_key(hdr[2]), P.check_hash(hdr[3]))
        elif op == P.CANCEL:
            P.expect_len(hdr, 3, "CANCEL")
            target = hdr[2]
            for st in list(self.streams):
                if st.session is sess and st.rid == target:
                    self.streams.remove(st)
                    sess.streams -= 1
                    writes = [x[1] for x in st.posted.values() if x[0] == "w"]
                    self._ended(st)
                    if st.stage is not None:  # GETN: DONE says no write of it can land any more
                        self.draining.append((ident, st.rid, writes))
        elif op == P.BYE:
            self._drop(ident)

    def _hello(self, ident: bytes, rid: int, hdr: list, head: Any = None) -> None:
        addr = self.conns.hello(self._fd)
        if addr is None:  # its connection is being closed
            return
        if len(hdr) not in (6, 7):
            raise P.ProtocolError(f"HELLO header has {len(hdr)} items, expected 6 or 7")
        _, _, version, ns, chunk, max_bytes = hdr[:6]
        extra = hdr[6] if len(hdr) == 7 else {}
        if not isinstance(extra, dict):
            raise P.ProtocolError("HELLO: the 7th item must be a map")
        if type(version) is not int or type(ns) is not str or not 0 < len(ns) <= 64:
            raise P.ProtocolError("HELLO: bad version or namespace")
        if type(chunk) is not int or chunk <= 0 or (max_bytes is not None and (type(max_bytes) is not int
                                                                                or max_bytes < 0)):
            raise P.ProtocolError("HELLO: bad chunk size or max_bytes")
        if version != P.VERSION:
            return self._error(ident, rid, P.E_VERSION, f"protocol version {version} not served (server speaks "
                                                        f"{P.VERSION})")
        if self.namespace is not None and ns != self.namespace:
            return self._error(ident, rid, P.E_MISMATCH,
                               f"namespace mismatch: client {ns}, server {self.namespace}")
        if self.tenants is not None:
            user = head.get("User-Id") if head is not None else None
            allowed = self.tenants.get(user or "", frozenset())
            if allowed is not None and ns not in allowed:
                return self._error(ident, rid, P.E_FORBIDDEN,
                                   f"namespace {ns} is not among this client key's namespaces on the server")
        if chunk < MIN_CHUNK_BYTES:
            return self._error(ident, rid, P.E_TOO_SMALL,
                               f"chunk of {chunk} bytes is below the server's minimum of {MIN_CHUNK_BYTES}")
        if self.store is not None:
            self._forget_unused()
        want = self.pinned_chunk or self.ns_chunk.get(ns)
        if want is not None and chunk != want:
            return self._error(ident, rid, P.E_MISMATCH,
                               f"chunk size mismatch in namespace {ns}: client {chunk} bytes, server {want} bytes")
        if chunk > self.limits.max_chunk_bytes:
            return self._error(ident, rid, P.E_TOO_BIG,
                               f"chunk of {chunk} bytes exceeds the server's {self.limits.max_chunk_bytes}")
        peer = self._peer(addr, head)
        victim, reclaim = None, []  # a session to reap, namespaces to reclaim: only once the HELLO is answered OK
        if ident not in self.sessions:
            refusal, victim = self._admit(peer)
            if refusal is not None:
                return self._error(ident, rid, P.E_FULL, refusal)
        if self.store is not None and ns not in self.ns_chunk:
            refusal, reclaim = self._room_for(ns, chunk, peer, ident)
            if refusal is not None:
                return self._error(ident, rid, P.E_FULL, refusal)
        nixl = None
        if "nixl" in extra:
            x = extra["nixl"]
            if not isinstance(x, dict) or type(x.get("md")) is not bytes or not all(
                    type(x.get(k)) is int and x.get(k) > 0 for k in ("base", "n", "stride")):
                raise P.ProtocolError("HELLO: malformed nixl descriptor")
            if x["stride"] < chunk:
                raise P.ProtocolError("HELLO: nixl slot stride smaller than a chunk")
            if self.nixl is None:
                return self._error(ident, rid, P.E_NONIXL,
                                   "this server does not serve NIXL: start it with `kvtiers p2p serve --nixl`")
            try:
                nixl = (self.nixl.add_peer(x["md"]), x["base"], x["n"], x["stride"])
            except Exception as e:
                return self._error(ident, rid, P.E_NONIXL, f"NIXL refused the client's agent: {e}")
        if victim is not None:
            self._reap(victim[0], victim[1])
        if reclaim:
            self._reclaim(reclaim, ident, f"room for a namespace of {peer}")
        self.ns_chunk.setdefault(ns, chunk)
        self.ns_owner.setdefault(ns, peer)
        self.ns_used[ns] = time.monotonic()
        sess = self.sessions.get(ident)
        if sess is not None and sess.ns == ns:  # a repeated HELLO: keep its streams and queued replies
            sess.max_bytes, sess.last_seen, sess.nixl = max_bytes, time.monotonic(), nixl
        else:
            self._drop(ident)
            self.sessions[ident] = Session(ident, ns, chunk, max_bytes, time.monotonic(), nixl=nixl, fd=self._fd,
                                           peer=peer)
            self.conns.bind(self._fd, ident)
        info = {"version": P.VERSION, "instance": self.instance, "max_inflight": self.limits.max_inflight,
                "max_batch": P.MAX_BATCH, "nixl": nixl is not None, "pid": os.getpid(), "boot": P.boot_id()}
        self._reply(ident, P.pack(P.OK, rid, info))

    def _peer(self, addr: str, head: Any) -> str:
        """Who a HELLO comes from, for the per-peer limits: with CurveZMQ its client key
        (authenticated; many clients may share an address), else its connection's address."""
        if not self.curve:
            return addr
        user = head.get("User-Id") if head is not None else None
        return f"key {user}" if user else addr

    def _admit(self, peer: str) -> tuple[str | None, tuple[bytes, str] | None]:
        """Why a new session of ``peer`` is refused (or None), and the session to reap for
        it (its routing id and why, or None). A full server reaps the least recently active
        session of the peer holding the most sessions for a peer holding at least two
        fewer, so a peer within its share always gets in."""
        lim = self.limits
        count: dict[str, int] = {}
        for s in self.sessions.values():
            count[s.peer] = count.get(s.peer, 0) + 1
        mine = count.get(peer, 0)
        if mine >= lim.max_sessions_per_peer:
            return f"server has its maximum of {lim.max_sessions_per_peer} sessions from {_who(peer)}", None
        if len(self.sessions) < lim.max_clients:
            return None, None
        top = max(count, key=count.__getitem__)
        if count[top] <= mine + 1:
            return f"server has its maximum of {lim.max_clients} clients", None
        victim = min((s for s in self.sessions.values() if s.peer == top), key=lambda s: (s.streams > 0, s.last_seen))
        return None, (victim.ident, f"the server is full and {top} holds the most sessions ({count[top]})")

    def _forget_unused(self) -> None:
        """Forget the namespaces holding no chunk and no session, with their chunk sizes."""
        live = self.store.namespaces() | {s.ns for s in self.sessions.values()}
        for old in [n for n in self.ns_chunk if n not in live]:
            del self.ns_chunk[old]
            self.ns_owner.pop(old, None)
            self.ns_used.pop(old, None)

    def _room_for(self, ns: str, chunk: int, peer: str, ident: bytes) -> tuple[str | None, list[str]]:
        """Why a HELLO of ``peer`` for the new namespace ``ns`` of ``chunk``-byte chunks is
        refused (or None), and the namespaces to reclaim for it (their chunks evicted, their
        sessions reaped). A namespace is charged to the peer that first said HELLO for it.

        - ``peer`` at its cap of namespaces (or of chunk sizes) reclaims its own least
          recently used namespace (or all its namespaces of its least recently used size)
          that no session uses; else it is refused.
        - A full table (namespaces or sizes) reclaims, for a peer holding at least two fewer
          than the largest holder, that holder's least recently used namespace (or size)
          no other peer has a session in, as a full server does with sessions.

        So one peer holds at most its caps, and a peer within its share always gets a new
        namespace. ``ident``'s own session (it is switching namespaces) counts as gone."""
        lim = self.limits
        users: dict[str, set[str]] = {}  # namespace -> peers with a session in it
        for s in self.sessions.values():
            if s.ident != ident:
                users.setdefault(s.ns, set()).add(s.peer)
        gone: list[str] = []

        def held(p: str) -> list[str]:
            return [n for n, o in self.ns_owner.items() if o == p and n not in gone]

        def sizes(p: str) -> set[int]:
            return {self.ns_chunk[n] for n in held(p)}

        def used(names: list[str]) -> float:
            return max(self.ns_used.get(n, 0.0) for n in names)

        def spare(p: str, own: bool) -> list[str]:
            """``p``'s namespaces that may go, least recently used first: none in use (own),
            or none another peer uses (for a newcomer; those without a session first)."""
            ok = [n for n in held(p) if not users.get(n) or (not own and users[n] <= {p})]
            return sorted(ok, key=lambda n: (bool(users.get(n)), self.ns_used.get(n, 0.0)))

        def spare_size(p: str, own: bool) -> list[str]:
            """All namespaces of ``p``'s least recently used chunk size that may go (own: of
            ``p``'s namespaces; else of every namespace of that size, all charged to ``p``)."""
            free = set(spare(p, own))
            groups: dict[int, list[str]] = {}
            for n, c in self.ns_chunk.items():
                if n not in gone and c != chunk and (not own or self.ns_owner.get(n) == p):
                    groups.setdefault(c, []).append(n)
            ok = [g for c, g in groups.items() if c in sizes(p) and all(n in free for n in g)]
            return min(ok, key=used) if ok else []

        who = _who(peer)
        if len(held(peer)) >= lim.max_namespaces_per_peer:
            own = spare(peer, own=True)
            if not own:
                return f"server has its maximum of {lim.max_namespaces_per_peer} namespaces from {who}", []
            gone.append(own[0])
        if chunk not in sizes(peer) and len(sizes(peer)) >= lim.max_chunk_sizes_per_peer:
            own = spare_size(peer, own=True)
            if not own:
                return f"server has its maximum of {lim.max_chunk_sizes_per_peer} chunk sizes from {who}", []
            gone += own
        if len(self.ns_chunk) - len(gone) >= lim.max_namespaces:
            mine = len(held(peer))
            tops = sorted({o for o in self.ns_owner.values() if o != peer}, key=lambda p: -len(held(p)))
            take = next((c[0] for p in tops if len(held(p)) >= mine + 2 for c in [spare(p, own=False)] if c), None)
            if take is None:
                return f"server has its maximum of {lim.max_namespaces} namespaces", []
            gone.append(take)
        live_sizes = {c for n, c in self.ns_chunk.items() if n not in gone}
        if chunk not in live_sizes and len(live_sizes) >= lim.max_chunk_sizes:
            mine = len(sizes(peer))
            tops = sorted({o for o in self.ns_owner.values() if o != peer}, key=lambda p: -len(sizes(p)))
            take = next((g for p in tops if len(sizes(p)) >= mine + 2 for g in [spare_size(p, own=False)] if g), None)
            if take is None:
                return f"server has its maximum of {lim.max_chunk_sizes} distinct chunk sizes", []
            gone += take
        return None, gone

    def _reclaim(self, names: list[str], ident: bytes, why: str) -> None:
        """Reclaim namespaces (see :meth:`_room_for`): reap their sessions but ``ident``'s,
        evict their chunks, forget them."""
        for n in names:
            for s in [s for s in self.sessions.values() if s.ns == n and s.ident != ident]:
                self._reap(s.ident, f"its namespace {n} was reclaimed for {why}")
            dropped = self.store.drop(n)
            log.info("p2p server: reclaimed namespace %s of %s (%d chunks evicted) for %s", n,
                     self.ns_owner.get(n, "?"), dropped, why)
            self.ns_chunk.pop(n, None)
            self.ns_owner.pop(n, None)
            self.ns_used.pop(n, None)
            self.stats["reclaimed"] += 1

    def _active_ns(self) -> set[str] | None:
        """With tenants, the namespaces with a session (eviction keeps their share); else
        None (least recently used first: every client is trusted, docs/p2p.md)."""
        if self.tenants is None:
            return None
        return {s.ns for s in self.sessions.values()}

    def quota(self, ns: str) -> int | None:
        """The cap of a namespace: the largest ``max_bytes`` of its connected clients, and
        none while any of them asks for none. A client's cap never shrinks what another
        asked for, so one client's setting cannot fail or flush another's stores; the
        server's ``capacity`` is never changed by a client."""
        cap = None
        for s in self.sessions.values():
            if s.ns == ns:
                if s.max_bytes is None:
                    return None
                cap = s.max_bytes if cap is None else max(cap, s.max_bytes)
        return cap

    def _put(self, sess: Session, rid: int, key: bytes, digest: int) -> None:
        store, size = self.store, sess.chunk_bytes
        if store.has(sess.ns, key):  # idempotent: keep the copy we have
            store.get(sess.ns, key)
            n = len(self.sock.recv(copy=False))
            if n != size:
                return self._error(sess.ident, rid, P.E_MALFORMED, f"chunk of {n} bytes, the namespace's are {size}")
            return self._reply(sess.ident, P.pack(P.OK, rid, []))
        quota = self.quota(sess.ns)
        got = store.reserve(sess.ns, size, quota, self._active_ns())
        if got is None:
            self.sock.recv(copy=False)
            limit = store.capacity if quota is None else min(quota, store.capacity)
            return self._error(sess.ident, rid, P.E_CAPACITY, f"no room for a chunk of {size} bytes (capacity "
                                                              f"{limit} bytes, the rest still being sent)"
                               if size <= limit else f"a chunk of {size} bytes never fits the capacity")
        buf, evicted = got
        n = self.sock.recv_into(buf)
        if n != size or self._more():
            store.release(sess.ns, buf)
            if self._more():
                raise P.ProtocolError("PUT with more than two frames")
            return self._error(sess.ident, rid, P.E_MALFORMED, f"chunk of {n} bytes, the namespace's are {size}")
        if P.checksum(buf) != digest:  # damaged on the way: never keep it
            store.release(sess.ns, buf)
            return self._error(sess.ident, rid, P.E_CORRUPT, "chunk arrived with a wrong xxh3")
        store.commit(sess.ns, key, buf, digest)
        self.stats["chunks_stored"] += 1
        self._reply(sess.ident, P.pack(P.OK, rid, evicted[: P.MAX_BATCH]))  # the client's HITs of the rest expire

    def _corrupt(self, ident: bytes, rid: int, hdr: list) -> None:
        """CORRUPT (servers started with ``test_faults`` only): flip the first, middle and
        last byte of a stored chunk in place and keep its xxh3, as bit rot in memory would,
        so a later GET sends bytes the client rejects. Answers the offsets flipped (none
        when the key is not stored). A GET already sending this buffer may send damaged
        bytes too, which its client rejects the same way."""
        P.expect_len(hdr, 4, "CORRUPT")
        ns, key = hdr[2], P.check_key(hdr[3])
        if type(ns) is not str or not 0 < len(ns) <= 64:
            raise P.ProtocolError("CORRUPT: bad namespace")
        if not self.test_faults:
            return self._error(ident, rid, E_NO_FAULTS, "CORRUPT refused: this server was not started with "
                                                        "--test-faults (fault injection is for tests only)")
        item = self.store.get(ns, key)
        if item is None:
            return self._reply(ident, P.pack(P.OK, rid, []))
        buf, size = item[0], item[2]
        offsets = sorted({0, size // 2, size - 1})
        for off in offsets:
            buf[off] ^= 0x5A
        self.stats["corrupted"] = self.stats.get("corrupted", 0) + 1
        log.warning("p2p server: CORRUPT damaged key %s of namespace %s (test fault)", key.hex(), ns)
        self._reply(ident, P.pack(P.OK, rid, offsets))

    def _pump(self) -> bool:
        """Send the next chunk of each stream, round robin; False when none could be sent."""
        try:
            return self._pump_streams()
        finally:
            self._forget_gone()

    def _pump_streams(self) -> bool:
        progressed = False
        for _ in range(len(self.streams)):
            st = self.streams[0]
            if st.pos >= len(st.keys):
                if not self._send(st.session.ident, P.pack(P.DONE, st.rid)):
                    self.streams.rotate(-1)
                    continue
                self.streams.popleft()
                st.session.streams -= 1
                progressed = True
                continue
            for _ in range(BURST):  # a few chunks per stream per round: less loop per chunk
                ok = self._chunk(st)
                if not ok:
                    break
                st.pos += 1
                progressed = True
                if st.pos >= len(st.keys):
                    break
            if self.streams and self.streams[0] is st:
                self.streams.rotate(-1)
        return progressed

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

    def _reap_orphans(self) -> None:
        left = []
        for o in self.orphans:
            if o[0].poll() == "PROC":
                left.append(o)
            else:
                self._nixl_done(o[2], o[3])
        self.orphans = left

    def wait_orphans(self, limit: float = 5.0) -> None:
        """Wait (at most ``limit`` s) for NIXL writes of ended GETNs, so their sources can go."""
        end = time.monotonic() + limit
        self._reap_orphans()
        while self.orphans and time.monotonic() < end:
            time.sleep(0.001)
            self._reap_orphans()

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


def _who(peer: str) -> str:
    """A peer as a refusal names it."""
    return "this client key" if peer.startswith("key ") else peer


def parse_size(text: str | int) -> int:
    """``1048576``, ``512K``, ``4MiB``, ``8GiB``, ``1.5G`` -> bytes (binary units)."""
    import re

    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512K, 4MiB, 8GiB)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()])


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

