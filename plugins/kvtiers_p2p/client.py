"""The client side of the p2p tier: one I/O thread owning a DEALER socket per peer.

The engine thread hands work over through :meth:`PeerClient.call` (a queue and a wake-up
pipe, so no ZMQ socket is ever touched by two threads). The I/O thread handshakes each peer
when its connection comes up (and again after a reconnect), sends batched LOOKUP/GET and
PUT requests inside the peer's in-flight window, receives each chunk straight into its arena
slot (``recv_into``) and checks its xxh3 there, and enforces every request's deadline. A peer
that disconnects fails its requests at once; a peer that goes silent fails them at their
deadline (with a CANCEL sent); either way a load tries the next peer that may hold the key.

On the NIXL path the server writes into the slots itself and NIXL cannot abort a posted
write, so a GETN that fails (deadline, disconnect, close) is *fenced* before its keys fail
or move to another peer: it waits for the server's DONE (sent after a CANCEL once every
write it posted has finished), for the server's process to be gone (pidfd, same host), or
for ``fence_timeout`` seconds past the failure (``None``: no limit; the job then stays
unreported, and a manager treats it as lost with its slots pinned). Only the last case can
let a write from a server silent that long land late; it is logged.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtiers.types import Arena, JobResult

from . import protocol as P
from .inflight import HELLO_RETRY_S, Item, Peer, Probe, Request
from .wakepipe import WakePipe

log = logging.getLogger("kvtiers.p2p")

GET_BATCH = 64  #: keys per GET request
LOOKUP_BATCH = 1024
WINDOW = 64  #: requests in flight per peer (GETs also within the server's max_inflight)
ZERO_COPY_MIN = 256 << 10  #: a PUT's chunk this big is sent from its slot (zero-copy), smaller ones copied
UNSENT_GRACE_S = 1.0  #: a failed PUT whose chunk ZMQ still holds this long resets the peer's socket


class PeerClient:
    """The I/O thread of one tier instance; see the module docstring.

    Callbacks run on the I/O thread: ``on_result(JobResult)``, ``on_found(keys, found)``
    with ``found`` mapping key -> peers holding it, ``on_stored(key, peer)``,
    ``on_evicted(keys)``, ``on_missing(key, peer)`` and ``on_restart(peer)``.
    """

    def __init__(self, arena: Arena, *, namespace: str, chunk_bytes: int, max_bytes: int | None,
                 lookup_timeout: float, curve: tuple[bytes, bytes, bytes] | None,
                 callbacks: dict[str, Callable[..., None]], nixl: bool = False,
                 fence_timeout: float | None = 15.0) -> None:  # fmt: skip
        self.arena = arena
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self.lookup_timeout = lookup_timeout
        self.curve = curve
        self.cb = callbacks
        self.nx = None
        self.nixl_fallback = True  # a peer serving no NIXL is loaded from over ZMQ (False: refused, nixl_strict)
        if nixl:  # made here so a failure is an error at open; used on the I/O thread only
            from .nixl_path import NixlClient

            self.nx = NixlClient(arena)
        self.fence_timeout = fence_timeout
        self.fencing: dict[int, Request] = {}  # getn rid -> request whose slots the server may still write
        self._pidfds: dict[str, int] = {}  # server instance -> pidfd (servers on this host)
        self.late_fences = 0  # fences given up on with the server still silent
        self.peers: dict[str, Peer] = {}
        self.unsent: list[tuple[Request, bool, str | None, float]] = []  # puts over whose slot ZMQ still reads
        self._rids = itertools.count(1)
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = WakePipe()
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.poller.register(self._wake.fd, zmq.POLLIN)
        self._closing = False
        self._next_tick = 0.0
        self._thread: Any = None
        self.owner = os.urandom(8).hex()  #: this instance's token on the servers' pins (docs/pins.md)

    # -- from the engine thread ----------------------------------------------------------
    def start(self, name: str) -> None:
        import threading

        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread soon."""
        self._commands.append(fn)
        self._wake.wake()

    def close(self, timeout: float = 10.0) -> None:
        """Fail what is pending, close every socket, join the thread."""
        def stop() -> None:
            self._closing = True

        self.call(stop)
        if self._thread is not None:
            self._thread.join(timeout)
        self._wake.close()

    # -- the I/O thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closing:
                self._step()
            self._drain_fences()
        except Exception:  # a bug here must not hang the engine: fail everything
            log.exception("p2p client thread failed")
        finally:
            for peer in list(self.peers.values()):
                self._remove_peer(peer, "tier closed", bye=True)
            for req in list(self.fencing.values()):  # their servers had their chance in _drain_fences
                self._settle(req, late=not self._gone(req.instance))
            while self._commands:  # late submits: they still finish (as failures)
                try:
                    self._commands.popleft()()
                except Exception:
                    log.exception("p2p client: late command failed")
            self.ctx.term()
            self._puts_over(force=True)  # every socket is closed: ZMQ holds no slot any more
            for fd in self._pidfds.values():
                os.close(fd)
            if self.nx is not None:
                self.nx.close()

    def _step(self) -> None:
        """One round of the I/O loop: wait for events, run commands, receive, expire, send."""
        events = dict(self.poller.poll(self._poll_timeout()))
        if self._wake.fd in events:
            self._wake.drain()
        while self._commands:
            self._commands.popleft()()
        for peer in list(self.peers.values()):
            if peer.mon is not None and peer.mon in events:
                self._monitor(peer)
            if peer.sock is not None and peer.sock in events:
                self._receive(peer)
        now = time.monotonic()
        if self.unsent:
            self._puts_over(now)
        self._expire(now)
        if now >= self._next_tick:
            self._next_tick = now + 0.5
            tick = self.cb.get("on_tick")
            if tick is not None:
                tick()
        for peer in list(self.peers.values()):
            self._pump(peer)
        if self.nx is not None and self._loading():
            self.nx.progress()

    def _loading(self) -> bool:
        """Whether a GETN is in flight or fenced (the server may be writing into our slots)."""
        return bool(self.fencing) or any(p.gets for p in self.peers.values())

    def _drain_fences(self, limit: float = 5.0) -> None:
        """Closing: fail what is queued, cancel the GETNs in flight and give their servers up
        to ``limit`` seconds (or their fence) to settle the slots they may still write."""
        if self.nx is None:
            return
        for peer in self.peers.values():
            queued, peer.queue = list(peer.queue), deque()
            for req in queued:
                self._fail_request(peer, req, "tier closed")
            for req in [r for r in peer.inflight.values() if r.kind == "getn"]:
                self._end(peer, req)
                self._cancel(peer, req)
                self._fail_request(peer, req, "tier closed")
        end = time.monotonic() + limit
        while self.fencing and time.monotonic() < end:
            self._step()

    def _poll_timeout(self) -> int:
        if self._commands:
            return 0
        if self.unsent:
            return 1  # trackers are no socket events
        if self.nx is not None and self._loading():
            return 1  # UCX is progressed from this loop while writes may be arriving
        now = time.monotonic()
        nearest = now + 0.1
        for r in self.fencing.values():
            nearest = min(nearest, r.fence)
        for peer in self.peers.values():
            for r in peer.inflight.values():
                nearest = min(nearest, r.deadline)
            if peer.queue:
                nearest = min(nearest, peer.queue[0].deadline)
            if peer.error is not None and peer.hello_rid is None and peer.retry_at > now:
                nearest = min(nearest, peer.retry_at)  # refused: its next HELLO on time, not up to 0.1 s late
        return max(0, int((nearest - now) * 1000) + 1)

    # -- peers ---------------------------------------------------------------------------
    def set_peers(self, urls: list[str]) -> None:
        """(I/O thread) connect new peers, drop the ones no longer listed."""
        for url in list(self.peers):
            if url not in urls:
                self._remove_peer(self.peers.pop(url), f"peer {url} removed from the peer list")
        for url in urls:
            if url not in self.peers:
                self.peers[url] = peer = Peer(url)
                self._open(peer)

    def _open(self, peer: Peer) -> None:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        s.setsockopt(zmq.SNDHWM, 256)
        s.setsockopt(zmq.RCVHWM, 256)
        s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        s.setsockopt(zmq.MAXMSGSIZE, max(self.chunk_bytes, P.MAX_REPLY_HEADER))
        if "[" in peer.url:  # an IPv6 literal: libzmq needs IPv6 on the socket
            s.setsockopt(zmq.IPV6, 1)
        if self.curve is not None:
            server_key, public, secret = self.curve
            s.curve_serverkey = server_key
            s.curve_publickey = public
            s.curve_secretkey = secret
        peer.mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        s.connect(peer.url)
        peer.sock = s
        self.poller.register(s, zmq.POLLIN)
        self.poller.register(peer.mon, zmq.POLLIN)

    def _close_socket(self, peer: Peer) -> None:
        if peer.sock is not None:
            self.poller.unregister(peer.sock)
            self.poller.unregister(peer.mon)
            peer.sock.disable_monitor()
            peer.mon.close(0)
            peer.sock.close()
            peer.sock = peer.mon = None
        peer.ready = peer.connected = False

    def _remove_peer(self, peer: Peer, why: str, bye: bool = False) -> None:
        if bye and peer.ready and peer.sock is not None:
            try:  # so the server ends our session (and its max_bytes cap) now, not at its idle timeout
                if peer.pinned:  # and our pins, which end with the tier instance (rule 13)
                    peer.sock.send(P.pack(P.UNPIN, next(self._rids), None, self.owner), zmq.NOBLOCK)
                peer.sock.send(P.pack(P.BYE, next(self._rids)), zmq.NOBLOCK)
                peer.sock.setsockopt(zmq.LINGER, 200)
            except zmq.ZMQError:
                pass
        self._fail_peer(peer, why, queued=True)
        self._close_socket(peer)

    def _monitor(self, peer: Peer) -> None:
        while peer.mon is not None:
            try:
                ev = recv_monitor_message(peer.mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.connected = True
                peer.ready = False
                peer.hello_rid = None
                self._hello(peer)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                peer.connected = False
                peer.ready = False
                peer.hello_rid = None
                self._fail_peer(peer, f"peer {peer.url} disconnected", queued=False)

    def _hello(self, peer: Peer) -> None:
        rid = next(self._rids)
        hello = [P.HELLO, rid, P.VERSION, self.namespace, self.chunk_bytes, self.max_bytes]
        if self.nx is not None and peer.nixl:
            hello.append({"nixl": self.nx.hello()})
        req = Request("hello", rid, time.monotonic() + 5.0, [P.pack(*hello)])
        try:
            peer.sock.send_multipart(req.frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # the connection went away again; the next handshake retries
        req.sent = True
        peer.inflight[rid] = req
        peer.hello_rid = rid

    # -- submitting (I/O thread) ---------------------------------------------------------
    def load(self, items: list[Item]) -> None:
        """Fetch each item from its first candidate peer; fall back to the next on a miss."""
        groups: dict[str, list[Item]] = {}
        for it in items:
            while it.candidates and it.candidates[0] not in self.peers:
                it.candidates.pop(0)
            if not it.candidates:
                self._finish(it, False, "not found on any peer")
                continue
            groups.setdefault(it.candidates[0], []).append(it)
        for url, group in groups.items():
            peer = self.peers[url]
            for i in range(0, len(group), GET_BATCH):
                part = group[i : i + GET_BATCH]
                rid = next(self._rids)
                keys = [it.key for it in part]
                if self.nx is None or not peer.nixl:
                    req = Request("get", rid, part[0].job.deadline, [P.pack(P.GET, rid, keys)], items=part)
                else:  # the server writes each chunk into its slot
                    frames = [P.pack(P.GETN, rid, keys, [it.slot for it in part])]
                    req = Request("getn", rid, part[0].job.deadline, frames, items=part)
                peer.queue.append(req)

    def store(self, items: list[Item], url: str | None) -> None:
        if url is None or url not in self.peers:
            for it in items:
                self._finish(it, False, "no peer to store to")
            return
        peer = self.peers[url]
        for it in items:  # the header (with the chunk's xxh3) is made as it is sent: see _pump
            rid = next(self._rids)
            peer.queue.append(Request("put", rid, it.job.deadline, [None, self.arena[it.slot]], items=[it]))

    def probe(self, keys: list[bytes]) -> None:
        live = [p for p in self.peers.values() if p.error is None]
        if not live:
            self.cb["on_found"](keys, {})
            return
        probe = Probe(keys, 0)
        deadline = time.monotonic() + self.lookup_timeout
        for peer in live:
            for i in range(0, len(keys), LOOKUP_BATCH):
                part = keys[i : i + LOOKUP_BATCH]
                rid = next(self._rids)
                probe.waiting += 1
                peer.queue.append(Request("lookup", rid, deadline, [P.pack(P.LOOKUP, rid, part)], keys=part,
                                          probe=probe))

    def pin(self, url: str, keys: list[bytes], seconds: float | None, deadline: float,
            done: Callable[[Any], None]) -> None:  # fmt: skip
        """PIN ``keys`` on the peer ``url`` for this client's owner token; ``done`` gets the
        server's answer (``{"new": [...]}`` or ``{"why": ...}``) or why it failed (a str)."""
        peer = self.peers.get(url)
        if peer is None:
            return done(f"peer {url} is not among the tier's peers")
        if peer.ready and not peer.pins:
            return done(f"peer {url} keeps no pins (a server from before pins, or an engine's serve block)")
        rid = next(self._rids)
        peer.pinned = True
        peer.queue.append(Request("pin", rid, deadline, [P.pack(P.PIN, rid, keys, seconds, self.owner)], keys=keys,
                                  done=done))

    def unpin(self, keys: list[bytes] | None, deadline: float, done: Callable[[], None] | None = None) -> None:
        """UNPIN ``keys`` (``None``: every pin of this client) on each peer this client pinned
        on; ``done`` is called once every peer answered or failed."""
        peers = [p for p in self.peers.values() if p.pinned]
        left = [len(peers)]

        def one(_: Any) -> None:
            left[0] -= 1
            if left[0] == 0 and done is not None:
                done()

        if not peers and done is not None:
            done()
        for peer in peers:
            rid = next(self._rids)
            peer.queue.append(Request("unpin", rid, deadline, [P.pack(P.UNPIN, rid, keys, self.owner)], done=one))

    # -- sending -------------------------------------------------------------------------
    def _pump(self, peer: Peer) -> None:
        if not peer.ready:
            if peer.error is not None:  # refused: what waits for the peer fails with the refusal ...
                self._fail_waiting(peer, peer.error)
            if peer.connected and peer.hello_rid is None and peer.sock is not None \
                    and time.monotonic() >= peer.retry_at:
                self._hello(peer)  # ... and HELLO is said again: the first try found no pipe, timed out or was refused
            return
        while peer.queue and len(peer.inflight) < WINDOW:
            req = peer.queue[0]
            if req.kind in ("pin", "unpin") and not peer.pins:  # an older server would drop us for the op
                peer.queue.popleft()
                if req.done is not None:
                    req.done(f"peer {peer.url} keeps no pins (a server from before pins, or an engine's serve block)")
                continue
            if req.kind in ("get", "getn"):
                if all(it.done for it in req.items):
                    peer.queue.popleft()
                    continue
                if peer.gets >= peer.max_inflight:
                    return
            elif req.frames[0] is None:  # a PUT: its xxh3 now, while the previous chunks are on their way
                it = req.items[0]
                req.frames[0] = P.pack(P.PUT, req.rid, it.key, P.checksum(req.frames[1]))
            try:
                if req.kind == "put" and len(req.frames[1]) >= ZERO_COPY_MIN:  # sent from the slot itself
                    req.tracker = peer.sock.send_multipart(req.frames, zmq.NOBLOCK, copy=False, track=True)
                else:
                    peer.sock.send_multipart(req.frames, zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            peer.queue.popleft()
            req.sent = True
            req.frames = req.frames[:1]  # copied into ZMQ, or held by it until req.tracker is done
            peer.inflight[req.rid] = req
            req.peer = peer
            if req.kind in ("get", "getn"):
                peer.gets += 1
                req.instance = peer.instance

    # -- receiving -----------------------------------------------------------------------
    def _discard_rest(self, sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv(copy=False)

    def _receive(self, peer: Peer) -> None:
        for _ in range(512):
            sock = peer.sock
            if sock is None:
                return
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                hdr = P.unpack(head, reply=True)
                self._answer(peer, hdr)
            except P.ProtocolError as e:
                log.warning("p2p: malformed reply from %s: %s", peer.url, e)
            if peer.sock is not None:
                self._discard_rest(peer.sock)

    def _answer(self, peer: Peer, hdr: list) -> None:
        op, rid = hdr[0], hdr[1]
        req = peer.inflight.get(rid)
        fenced = req is None
        if fenced:  # a GETN given up on: what landed still counts; DONE or ERR settles it
            req = self.fencing.get(rid)
            if req is None or req.peer is not peer:
                return  # a late answer to a request that timed out or was cancelled
            if op not in (P.CHUNK, P.MISSING, P.DONE, P.ERR):
                raise P.ProtocolError(f"unexpected reply op {op} to a cancelled GETN")
        if op == P.CHUNK:
            self._chunk(peer, req, hdr)
        elif op == P.MISSING:
            P.expect_len(hdr, 3, "MISSING")
            idx = hdr[2]
            if req.kind not in ("get", "getn") or type(idx) is not int or not 0 <= idx < len(req.items):
                raise P.ProtocolError("MISSING for no asked key")
            req.answered.add(idx)
            it = req.items[idx]
            self.cb["on_missing"](it.key, peer.url)
            self._retry(it, "not found on any peer")  # the server will not write its slot
        elif fenced:
            return self._settle(req)
        elif op == P.DONE:
            self._end(peer, req)
            for i, it in enumerate(req.items):
                if i not in req.answered:
                    self._retry(it, f"peer {peer.url} ended the GET without key")
        elif op == P.OK:
            P.expect_len(hdr, 3, "OK")
            self._end(peer, req)
            self._ok(peer, req, hdr[2])
        elif op == P.ERR:
            P.expect_len(hdr, 4, "ERR")
            code, msg = str(hdr[2]), str(hdr[3])
            self._end(peer, req)
            self._refused(peer, req, code, msg)
        else:
            raise P.ProtocolError(f"unknown reply op {op}")
        if fenced and len(req.answered) == len(req.items):
            self._settle(req)

    def _chunk(self, peer: Peer, req: Request, hdr: list) -> None:
        """A CHUNK: on GET its bytes follow and are received into the slot; on GETN they
        were written there already. Either way they are checked in the slot."""
        P.expect_len(hdr, 4, "CHUNK")
        idx, digest = hdr[2], P.check_hash(hdr[3])
        if req.kind not in ("get", "getn") or type(idx) is not int or not 0 <= idx < len(req.items) \
                or idx in req.answered:
            raise P.ProtocolError("CHUNK for no asked key")
        req.answered.add(idx)
        it = req.items[idx]
        if it.done:
            return
        out = self.arena[it.slot]
        if req.kind == "get":
            if not peer.sock.getsockopt(zmq.RCVMORE):
                return
            n = peer.sock.recv_into(out)
            if n != len(out):
                return self._retry(it, f"peer {peer.url} sent {n} bytes for a chunk of {len(out)}")
        if P.checksum(out) != digest:
            via = " (nixl)" if req.kind == "getn" else ""
            return self._retry(it, f"xxh3 mismatch on a chunk from {peer.url}{via}")
        self._finish(it, True, None, len(out))

    def _fence(self, req: Request, why: str) -> None:
        """A sent GETN failed: hold its unanswered keys until the server settles their slots."""
        req.why = why
        req.fence = time.monotonic() + (self.fence_timeout if self.fence_timeout is not None else float("inf"))
        self.fencing[req.rid] = req
        if len(req.answered) == len(req.items) or self._gone(req.instance):
            self._settle(req)

    def _settle(self, req: Request, late: bool = False) -> None:
        """The server will write no more slots of ``req``: its unanswered keys move on."""
        if self.fencing.pop(req.rid, None) is None:
            return
        why = req.why
        if late:
            self.late_fences += 1
            log.warning("p2p: peer %s still silent %s s after a GETN failed (%s); failing its keys, though "
                        "a NIXL write it posted could still land in their slots", getattr(req.peer, "url", "?"),
                        self.fence_timeout, why)
        for i, it in enumerate(req.items):
            if i not in req.answered:
                self._retry(it, why)

    def _gone(self, instance: str | None) -> bool:
        """Whether the server process of ``instance`` is known to have exited (same host only)."""
        fd = self._pidfds.get(instance) if instance is not None else None
        return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def _without_nixl(self, peer: Peer, why: str) -> None:
        """The peer serves no NIXL (e.g. its canary failed): load from it over ZMQ from now on,
        queued GETNs (none sent yet) included, and handshake again without NIXL."""
        log.warning("p2p: peer %s does not serve NIXL (%s); loading from it over ZMQ", peer.url, why)
        peer.nixl = False
        for req in peer.queue:
            if req.kind == "getn":
                req.kind, req.frames = "get", [P.pack(P.GET, req.rid, [it.key for it in req.items])]
        peer.hello_rid = None
        self._hello(peer)

    def _watch(self, body: dict) -> None:
        """Open a pidfd on a server on this host (HELLO's ``pid`` and ``boot``), to know when it is gone."""
        inst, pid = body.get("instance"), body.get("pid")
        if self.nx is None or type(inst) is not str or type(pid) is not int or inst in self._pidfds:
            return
        if body.get("boot") != P.boot_id() or pid == os.getpid():
            return
        try:
            self._pidfds[inst] = os.pidfd_open(pid)
        except OSError:  # gone already, or no pidfds here: fences then rely on answers and the timeout
            pass

    def _ok(self, peer: Peer, req: Request, body: Any) -> None:
        if req.kind == "hello":
            if not isinstance(body, dict):
                raise P.ProtocolError("HELLO answer is not a map")
            if self.nx is not None and peer.nixl and body.get("nixl") is not True:
                raise P.ProtocolError("the server did not accept NIXL")
            inst = body.get("instance")
            self._watch(body)
            if peer.instance is not None and inst != peer.instance:
                self.cb["on_restart"](peer.url)
            peer.instance = inst
            mi = body.get("max_inflight")
            peer.max_inflight = mi if type(mi) is int and mi > 0 else 1
            peer.error = None
            peer.backoff = HELLO_RETRY_S[0]
            peer.pins = body.get("pins") is True
            peer.ready = True
        elif req.kind == "lookup":
            if not isinstance(body, bytes) or len(body) != len(req.keys):
                raise P.ProtocolError("LOOKUP answer does not match the keys")
            for k, b in zip(req.keys, body, strict=True):
                if b:
                    req.probe.found.setdefault(k, []).append(peer.url)
            self._probe_done(req.probe)
        elif req.kind == "pin":
            if not isinstance(body, dict) or not (type(body.get("why")) is str or type(body.get("new")) is list):
                req.done(f"peer {peer.url} answered PIN with something else than a reason or the keys pinned")
                raise P.ProtocolError("PIN answer is not {'why': str} or {'new': [key, ...]}")
            req.done(body)
        elif req.kind == "unpin":
            req.done(body)
        elif req.kind == "put":
            it = req.items[0]
            evicted = body if isinstance(body, list) else []
            evicted = [k for k in evicted if type(k) is bytes]
            self._put_over(req, True, None)
            self.cb["on_stored"](it.key, peer.url)
            if evicted:
                self.cb["on_evicted"](evicted)

    def _refused(self, peer: Peer, req: Request, code: str, msg: str) -> None:
        if req.kind == "hello" and code == P.E_NONIXL and peer.nixl and self.nx is not None and self.nixl_fallback:
            self._without_nixl(peer, msg)
            return
        if req.kind == "hello":  # jobs for the peer fail with the refusal until a HELLO is answered OK
            error = f"peer {peer.url} refused the handshake: {msg}"
            if error != peer.error:
                log.warning("p2p: %s", error)
            peer.error = error
            peer.retry_at = time.monotonic() + peer.backoff  # a full server may have room by then
            log.debug("p2p: peer %s refused the handshake: HELLO again in %.2f s", peer.url, peer.backoff)
            peer.backoff = min(peer.backoff * 2, HELLO_RETRY_S[1])
            self._fail_peer(peer, error, queued=True)
            return
        if code == P.E_HELLO:  # the server forgot us (idle, restart): handshake again, retry
            peer.ready = False
            if peer.hello_rid is None:
                self._hello(peer)
            if req.kind in ("get", "getn", "pin", "unpin"):  # refused: nothing was written or pinned
                req.sent, req.answered = False, set()
                peer.queue.appendleft(req)
                return
        why = f"peer {peer.url}: {msg}"
        if req.kind in ("pin", "unpin"):
            req.done(why)
        elif req.kind == "lookup":
            self._probe_done(req.probe)
        elif req.kind in ("get", "getn"):
            for it in req.items:
                self._retry(it, why)
        else:
            for it in req.items:
                self._finish(it, False, why)

    def _end(self, peer: Peer, req: Request) -> None:
        if peer.inflight.pop(req.rid, None) is not None and req.kind in ("get", "getn"):
            peer.gets -= 1
        if req.rid == peer.hello_rid:
            peer.hello_rid = None

    # -- failure -------------------------------------------------------------------------
    def _fail_request(self, peer: Peer, req: Request, why: str) -> None:
        if req.kind in ("pin", "unpin"):
            req.done(why)
        elif req.kind == "lookup":
            self._probe_done(req.probe)
        elif req.kind in ("get", "getn"):
            if req.kind == "getn" and req.sent:
                return self._fence(req, why)
            for it in req.items:
                self._retry(it, why)
        elif req.kind == "put":
            self._put_over(req, False, why)

    def _put_over(self, req: Request, ok: bool, why: str | None) -> None:
        """A PUT is answered or failed: report its key once ZMQ reads its slot no more (rule 6).

        An acknowledged PUT is reported at once: the server received every byte of the
        chunk, so ZMQ has read them all from the slot and reads it no more (its tracker may
        say so only later: it still holds a reference until its I/O thread lets the message
        go). A failed one waits for the tracker: ZMQ may still be sending from the slot."""
        if not ok and req.tracker is not None and not req.tracker.done:
            self.unsent.append((req, ok, why, time.monotonic()))
            return
        for it in req.items:
            self._finish(it, ok, why, len(self.arena[it.slot]) if ok else 0)

    def _puts_over(self, now: float = 0.0, force: bool = False) -> None:
        """Report the PUTs whose chunks ZMQ let go of; a failed one it still holds after
        ``UNSENT_GRACE_S`` (a silent peer's full pipe) resets that peer's socket, which drops it."""
        left, stuck = [], []
        for entry in self.unsent:
            req, ok, why, since = entry
            if force or req.tracker.done:
                req.tracker = None
                self._put_over(req, ok, why)
            else:
                left.append(entry)
                if not ok and now - since > UNSENT_GRACE_S and req.peer is not None:
                    stuck.append(req.peer)
        self.unsent = left
        if stuck:
            self._reset_unsent(stuck)

    def _reset_unsent(self, peers: list[Peer]) -> None:
        """Close and reopen these peers' sockets: ZMQ drops the chunks it still held."""
        for peer in dict.fromkeys(peers):
            if peer.sock is None:
                continue
            log.warning("p2p: peer %s took no chunk for %s s: reconnecting", peer.url, UNSENT_GRACE_S)
            self._fail_peer(peer, f"peer {peer.url} disconnected", queued=False)
            peer.sock.setsockopt(zmq.LINGER, 0)
            self._close_socket(peer)
            if not self._closing and self.peers.get(peer.url) is peer:
                self._open(peer)

    def _fail_peer(self, peer: Peer, why: str, *, queued: bool) -> None:
        reqs = list(peer.inflight.values())
        peer.inflight.clear()
        peer.gets = 0
        peer.hello_rid = None
        if queued:
            reqs += list(peer.queue)
            peer.queue.clear()
        for req in reqs:
            self._fail_request(peer, req, why)

    def _fail_waiting(self, peer: Peer, why: str) -> None:
        """Fail what is queued for a peer that refused us, and what is in flight to it, but
        its HELLO: the answer to that one may let us in."""
        reqs = [r for r in peer.inflight.values() if r.rid != peer.hello_rid]
        for req in reqs:
            self._end(peer, req)
        reqs += list(peer.queue)
        peer.queue.clear()
        for req in reqs:
            self._fail_request(peer, req, why)

    def _cancel(self, peer: Peer, req: Request) -> None:
        if req.kind in ("get", "getn") and peer.sock is not None:
            try:
                peer.sock.send(P.pack(P.CANCEL, next(self._rids), req.rid), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _expire(self, now: float) -> None:
        for req in list(self.fencing.values()):
            if self._gone(req.instance):
                self._settle(req)
            elif now >= req.fence:
                self._settle(req, late=True)
        for peer in list(self.peers.values()):
            late = [r for r in peer.inflight.values() if r.deadline <= now]
            for req in late:
                self._end(peer, req)
                self._cancel(peer, req)
                self._fail_request(peer, req, f"peer {peer.url} did not answer in time")
            if any(r.deadline <= now for r in peer.queue):
                keep = deque()
                for req in peer.queue:
                    if req.deadline <= now:
                        self._fail_request(peer, req, f"peer {peer.url} not reachable in time")
                    else:
                        keep.append(req)
                peer.queue = keep

    def _retry(self, it: Item, why: str) -> None:
        """Try the item's next candidate peer, or fail it."""
        if it.done:
            return
        if it.candidates:
            it.candidates.pop(0)
        if it.candidates and not self._closing and time.monotonic() < it.job.deadline \
                and it.candidates[0] in self.peers:
            self.load([it])
        else:
            self._finish(it, False, why)

    def _finish(self, it: Item, ok: bool, why: str | None, nbytes: int = 0) -> None:
        if it.done:
            return
        it.done = True
        job = it.job
        if ok:
            job.nbytes += nbytes
        else:
            job.failed.append(it.key)
            if why and why not in job.errors:
                job.errors.append(why)
        job.left -= 1
        if job.left == 0:
            self.cb["on_result"](JobResult(job.job_id, tuple(job.failed), job.nbytes,
                                           time.perf_counter() - job.t0, "; ".join(job.errors) or None))

    def _probe_done(self, probe: Probe) -> None:
        probe.waiting -= 1
        if probe.waiting == 0:
            self.cb["on_found"](probe.keys, probe.found)
