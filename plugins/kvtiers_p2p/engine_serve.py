"""An engine serving its own host cache to peers: the ``serve`` block of a manager config.

``{"serve": {"bind": "tcp://127.0.0.1:5710"}}`` makes the :class:`TieringManager` answer
other instances' LOOKUPs and GETs from its arena (read-only: PUTs are refused). The server
runs on a thread of its own; the host cache belongs to the engine thread, so lookups and
pins are queued to it and done in the manager's ``poll``/``get_finished`` (every engine
step): a chunk's slot is pinned there, its bytes are copied into the ZMQ message (and their
xxh3 taken) on the server thread, then the pin is released on the engine thread again. A
chunk evicted or dropped meanwhile stays valid until its pin is gone.

Peers cannot take the arena: a GET pins at most ``PIN_AHEAD`` chunks ahead of what it has
sent, a peer at most ``max_pins`` slots, and all peers together at most ``pin_share`` of
the arena, so the engine's own stores always find slots. A peer whose pipe is full holds at
most one pin: the chunks pinned ahead for it are released, and its GETs ask again (every
``STALL_RETRY_S``) for one pin in all until its pipe takes a chunk, so peers that read
nothing cannot keep the other peers' GETs from every pin. What ZMQ queues for one peer is bounded by
``max_queued_bytes`` (its send high-water mark in chunks), and a peer that reads nothing
for ``stall_timeout`` seconds is disconnected.

With ``"nixl": true`` the arena is also registered with NIXL, and clients with ``backend:
"nixl"`` get each pinned chunk written straight into their slot; the pin is released once
NIXL reports the write over.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import zmq

from kvtiers.errors import ConfigError

from . import protocol as P
from .server import NOT_READY, PeerServer, ServerLimits, Session, Stream

SERVE_OPTIONS = {"bind", "curve_secret", "allow", "max_clients", "max_inflight", "idle_timeout",
                 "handshake_timeout", "nixl", "max_connections", "stall_timeout", "max_pins", "pin_share",
                 "max_queued_bytes", "nixl_strict", "max_sessions_per_peer", "max_pending_per_peer"}
LIMIT_OPTIONS = ("max_clients", "max_inflight", "idle_timeout", "handshake_timeout", "max_connections",
                 "stall_timeout", "max_sessions_per_peer", "max_pending_per_peer")
E_READONLY = "read-only"
PIN_AHEAD = 16  #: chunks a GET stream has pinned ahead of the one it sends
STALL_RETRY_S = 0.05  #: how often a GET to a peer whose pipe was full asks for pins again
_WAIT = object()  #: a stream's slot the engine thread has not pinned (or found missing) yet


class ArenaServer(PeerServer):
    """A peer server whose chunks are the ready entries of a manager's host cache."""

    def __init__(self, manager: Any, bind: str, *, limits: ServerLimits = ServerLimits(),
                 curve_secret: str | None = None, allow_dir: str | None = None, nixl: bool = False,
                 max_pins: int = 64, pin_share: float = 0.5, max_queued_bytes: int = 64 << 20) -> None:  # fmt: skip
        if not 0 < pin_share <= 1:
            raise ValueError(f"pin_share must be in (0, 1], got {pin_share}")
        if max_pins < 1 or max_queued_bytes < 1:
            raise ValueError("max_pins and max_queued_bytes must be positive")
        self.mgr = manager
        self.arena = manager.arena
        self.max_pins = max_pins
        self.pin_cap = max(1, int(len(manager.arena) * pin_share))  #: slots all peers may hold pinned
        self.pins_out = 0  # slots asked for and not released yet (server thread)
        self.max_queued_bytes = max_queued_bytes
        self.to_engine: deque[tuple] = deque()  # server thread -> engine thread
        self.from_engine: deque[tuple[bytes, bytes]] = deque()  # lookup answers, engine -> server
        self._handoff = threading.Lock()  # a stream's pins vs. its end
        super().__init__(bind, None, limits=limits, namespace=manager.namespace.digest,
                         chunk_bytes=manager.arena.slot_bytes, curve_secret=curve_secret, allow_dir=allow_dir,
                         nixl=nixl)
        if self.nixl is not None:
            self.nixl.register(self.arena.buffer)
        self._thread = threading.Thread(target=self._run, name="kvtiers-p2p-serve", daemon=True)
        self._thread.start()

    # -- server thread -------------------------------------------------------------------
    def _setup_socket(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.SNDHWM, max(4, self.max_queued_bytes // self.arena.slot_bytes))

    def _run(self) -> None:
        try:
            self.serve_forever(poll_ms=2)
        finally:
            if self.conns is not None:
                self.conns.stop(self.sock)
                self.conns = None
            self.sock.close(0)

    def _sendable(self) -> bool:
        return bool(self.streams or self.waiting or self.from_engine)

    def _flush(self) -> bool:
        while self.from_engine:
            ident, frame = self.from_engine.popleft()
            self._reply(ident, frame)
        return super()._flush()

    def _lookup(self, sess: Session, rid: int, keys: list[bytes]) -> None:
        self.to_engine.append(("lookup", sess.ident, rid, keys))

    def _get(self, st: Stream) -> None:
        st.slots = [_WAIT] * len(st.keys)  # filled by the engine thread: a pinned slot or None per key
        st.asked = 0  # positions asked to be pinned so far
        st.unreleased = set()  # positions asked for whose pin (or its budget) is not released yet
        st.held = {}  # NIXL: position -> pinned slot a write reads; unpinned when it is over
        st.dead = False
        st.gen = 0  # bumped when the pins asked for are given back: older pin requests are void
        st.retry_at = 0.0  # its pipe was full: ask for pins again from then on
        self.streams.append(st)
        self._ask(st)

    def _ask(self, st: Stream) -> None:
        """Ask the engine thread to pin the stream's next chunks, within the pin budgets."""
        sess = st.session
        cap = 1 if sess.ident in self.stalled else self.max_pins  # a full pipe: one pin probes it
        n = min(PIN_AHEAD - (st.asked - st.pos), len(st.keys) - st.asked, self.pin_cap - self.pins_out,
                cap - sess.pins)
        if n <= 0:
            return
        a = st.asked
        st.asked += n
        st.unreleased.update(range(a, a + n))
        self.pins_out += n
        sess.pins += n
        self.to_engine.append(("pin", st, a, a + n, st.gen))

    def _give_back(self, st: Stream) -> None:
        """The peer's pipe is full: release what ``st`` has pinned ahead (ZMQ path), ask again later."""
        with self._handoff:
            st.gen += 1
            slots = st.slots
            for p in range(st.pos, st.asked):
                if slots[p] is not None and slots[p] is not _WAIT:
                    self.to_engine.append(("unpin", slots[p]))
                slots[p] = _WAIT
        for p in range(st.pos, st.asked):
            self._released(st, p)
        st.asked = st.pos
        st.retry_at = time.monotonic() + STALL_RETRY_S

    def _released(self, st: Stream, p: int) -> None:
        """Position ``p`` of ``st`` holds no pin any more (sent, missing, or its write is over)."""
        if p in st.unreleased:
            st.unreleased.discard(p)
            self.pins_out -= 1
            st.session.pins -= 1

    def _ended(self, st: Stream) -> None:
        with self._handoff:
            st.dead = True
            slots, st.slots = st.slots, []
        for s in slots or ():
            if s is not None and s is not _WAIT:
                self.to_engine.append(("unpin", s))
        for p in [p for p in st.unreleased if p not in st.held]:
            self._released(st, p)
        super()._ended(st)  # NIXL writes in flight keep their pins until they are over

    def _put(self, sess: Session, rid: int, key: bytes, digest: int) -> None:
        self.sock.recv(copy=False)
        self._error(sess.ident, rid, E_READONLY, "this engine serves its host cache read-only")

    def _nixl_source(self, st: Stream, p: int) -> tuple[Any, int] | None:
        if p >= st.asked:
            self._ask(st)
        slot = st.slots[p] if p < st.asked else _WAIT
        if slot is _WAIT:
            return NOT_READY
        if slot is None:
            self._released(st, p)
            return None
        st.slots[p] = None  # the write holds the pin now; _ended leaves it to _nixl_done
        st.held[p] = slot
        data = self.arena[slot]
        return data, P.checksum(data)

    def _nixl_done(self, st: Stream, p: int) -> None:
        slot = st.held.pop(p, None)
        if slot is not None:
            self.to_engine.append(("unpin", slot))
        self._released(st, p)

    def _chunk(self, st: Stream) -> bool | None:
        slots = st.slots
        if not slots:
            return True  # ended
        if st.stage is not None:
            if st.asked - st.pos < PIN_AHEAD:
                self._ask(st)
            return self._chunk_nixl(st)
        if st.asked - st.pos < PIN_AHEAD and (st.asked > st.pos or time.monotonic() >= st.retry_at):
            self._ask(st)
        slot = slots[st.pos] if st.pos < st.asked else _WAIT
        if slot is _WAIT:
            return None  # the engine thread has not pinned it yet, or the pin budget is spent
        if slot is None:
            ok = self._send(st.session.ident, P.pack(P.MISSING, st.rid, st.pos))
            if ok:
                self._released(st, st.pos)
            return ok
        data = self.arena[slot]
        head = P.pack(P.CHUNK, st.rid, st.pos, P.checksum(data))
        try:  # copied into the message: the pin can go as soon as this returns
            self.sock.send_multipart([st.session.ident, head, data], zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.stalled.setdefault(st.session.ident, time.monotonic())
            self._give_back(st)
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._gone.add(st.session.ident)
        if self.stalled:
            self.stalled.pop(st.session.ident, None)
        self.to_engine.append(("unpin", slot))
        slots[st.pos] = None
        self._released(st, st.pos)
        self.stats["chunks_sent"] += 1
        return True

    @property
    def served(self) -> int:
        """Chunks sent to peers (over ZMQ, or written with NIXL and announced)."""
        return self.stats["chunks_sent"]

    # -- engine thread -------------------------------------------------------------------
    def poll(self) -> None:
        """Answer what the server thread queued (called by the manager on the engine thread)."""
        cache = self.mgr.cache
        q = self.to_engine
        while q:
            item = q.popleft()
            kind = item[0]
            if kind == "unpin":
                cache.unpin(item[1])
            elif kind == "lookup":
                _, ident, rid, keys = item
                self.from_engine.append((ident, P.pack(P.OK, rid, bytes(cache.state(k) == "ready" for k in keys))))
            elif kind == "pin":
                _, st, a, b, gen = item
                with self._handoff:
                    if not st.dead and st.gen == gen:
                        slots, keys = st.slots, st.keys
                        for p in range(a, b):
                            k = keys[p]
                            slots[p] = cache.pin(k) if cache.state(k) == "ready" else None

    def close(self) -> None:
        """Stop the server thread, then release every pin it still held (engine thread)."""
        self.stop()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(10)
        elif getattr(self, "sock", None) is not None:
            self.sock.close(0)
        for st in list(self.streams):
            self._ended(st)
        self.streams.clear()
        if self.orphans:
            self.wait_orphans()
            for _w, _, st, p in self.orphans:  # still writing after the wait: keep them pinned
                st.held.pop(p, None)
        self.poll()
        if self.nixl is not None and not self.orphans:  # a write still running keeps the agent
            self.nixl.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.ctx.term()


def serve_arena(manager: Any, options: Mapping[str, Any]) -> ArenaServer:
    """Start serving ``manager``'s host cache as the ``serve`` block ``options`` says."""
    unknown = set(options) - SERVE_OPTIONS
    if unknown:
        known = ", ".join(sorted(SERVE_OPTIONS))
        raise ConfigError(f"config: serve: unknown option {sorted(unknown)[0]!r} (known: {known})")
    lim = {k: options[k] for k in LIMIT_OPTIONS if k in options}
    nixl = options.get("nixl", False)
    strict = options.get("nixl_strict", False)
    for name, flag in (("nixl", nixl), ("nixl_strict", strict)):
        if type(flag) is not bool:
            raise ConfigError(f"config: serve: {name} must be true or false, got {flag!r}")
    if nixl:  # NIXL's canary first: if it crashes, serve over ZMQ only (or, strict, refuse)
        from kvtiers_nixl import use_nixl

        from kvtiers import TierError

        try:
            nixl = use_nixl("serve block", fallback="ZMQ", strict=strict)
        except TierError as e:
            raise ConfigError(f"config: serve: {e}") from None
    extra = {k: options[k] for k in ("max_pins", "pin_share", "max_queued_bytes") if k in options}
    for k, v in {**lim, **extra}.items():
        if type(v) not in (int, float) or v <= 0:
            raise ConfigError(f"config: serve: {k} must be a positive number, got {v!r}")
    try:
        return ArenaServer(manager, options.get("bind", "tcp://127.0.0.1:5710"), limits=ServerLimits(**lim),
                           curve_secret=options.get("curve_secret"), allow_dir=options.get("allow"), nixl=nixl,
                           **extra)
    except (ValueError, zmq.ZMQError, ImportError, RuntimeError) as e:
        raise ConfigError(f"config: serve: {e}") from None
