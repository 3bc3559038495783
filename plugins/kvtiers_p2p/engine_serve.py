"""An engine serving its own host cache to peers: the ``serve`` block of a manager config.

``{"serve": {"bind": "tcp://127.0.0.1:5710"}}`` makes the :class:`TieringManager` answer
other instances' LOOKUPs and GETs from its arena (read-only: PUTs are refused). The server
runs on a thread of its own; the host cache belongs to the engine thread, so lookups and
pins are queued to it and done in the manager's ``poll``/``get_finished`` (every engine
step): a chunk's slot is pinned there, its bytes are copied into the ZMQ message (and their
xxh3 taken) on the server thread, then the pin is released on the engine thread again. A
chunk evicted or dropped meanwhile stays valid until its pin is gone.

With ``"nixl": true`` the arena is also registered with NIXL, and clients with ``backend:
"nixl"`` get each pinned chunk written straight into their slot; the pin is released once
NIXL reports the write over.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

import zmq

from kvtiers.errors import ConfigError

from . import protocol as P
from .server import PeerServer, ServerLimits, Session, Stream

SERVE_OPTIONS = {"bind", "curve_secret", "allow", "max_clients", "max_inflight", "idle_timeout",
                 "handshake_timeout", "nixl", "nixl_strict"}
E_READONLY = "read-only"


class ArenaServer(PeerServer):
    """A peer server whose chunks are the ready entries of a manager's host cache."""

    def __init__(self, manager: Any, bind: str, *, limits: ServerLimits = ServerLimits(),
                 curve_secret: str | None = None, allow_dir: str | None = None,
                 nixl: bool = False) -> None:  # fmt: skip
        self.mgr = manager
        self.arena = manager.arena
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
    def _run(self) -> None:
        try:
            self.serve_forever(poll_ms=2)
        finally:
            self.sock.close(0)

    def _sendable(self) -> bool:
        return bool(self.streams or self.outbox or self.from_engine)

    def _flush(self) -> bool:
        while self.from_engine:
            ident, frame = self.from_engine.popleft()
            self._reply(ident, frame)
        return super()._flush()

    def _lookup(self, sess: Session, rid: int, keys: list[bytes]) -> None:
        self.to_engine.append(("lookup", sess.ident, rid, keys))

    def _get(self, st: Stream) -> None:
        st.slots = None  # filled by the engine thread: a pinned slot or None per key
        st.held = {}  # NIXL: position -> pinned slot a write reads; unpinned when it is over
        self.streams.append(st)
        self.to_engine.append(("get", st))

    def _ended(self, st: Stream) -> None:
        with self._handoff:
            st.dead = True
            slots, st.slots = st.slots, []
        for s in slots or ():
            if s is not None:
                self.to_engine.append(("unpin", s))
        super()._ended(st)  # NIXL writes in flight keep their pins until they are over

    def _put(self, sess: Session, rid: int, key: bytes, digest: int) -> None:
        self.sock.recv(copy=False)
        self._error(sess.ident, rid, E_READONLY, "this engine serves its host cache read-only")

    def _nixl_source(self, st: Stream, p: int) -> tuple[Any, int] | None:
        slot = st.slots[p]
        if slot is None:
            return None
        st.slots[p] = None  # the write holds the pin now; _ended leaves it to _nixl_done
        st.held[p] = slot
        data = self.arena[slot]
        return data, P.checksum(data)

    def _nixl_done(self, st: Stream, p: int) -> None:
        slot = st.held.pop(p, None)
        if slot is not None:
            self.to_engine.append(("unpin", slot))

    def _chunk(self, st: Stream) -> bool | None:
        slots = st.slots
        if slots is None:
            return None  # the engine thread has not pinned them yet
        if not slots:
            return True  # ended
        if st.stage is not None:
            return self._chunk_nixl(st)
        slot = slots[st.pos]
        if slot is None:
            return self._send(st.session.ident, P.pack(P.MISSING, st.rid, st.pos))
        data = self.arena[slot]
        head = P.pack(P.CHUNK, st.rid, st.pos, P.checksum(data))
        try:  # copied into the message: the pin can go as soon as this returns
            self.sock.send_multipart([st.session.ident, head, data], zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._gone.add(st.session.ident)
        self.to_engine.append(("unpin", slot))
        slots[st.pos] = None
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
            elif kind == "get":
                st = item[1]
                with self._handoff:
                    if not getattr(st, "dead", False):
                        st.slots = [cache.pin(k) if cache.state(k) == "ready" else None for k in st.keys]

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
    lim = {k: options[k] for k in ("max_clients", "max_inflight", "idle_timeout", "handshake_timeout") if k in options}
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
    try:
        return ArenaServer(manager, options.get("bind", "tcp://127.0.0.1:5710"), limits=ServerLimits(**lim),
                           curve_secret=options.get("curve_secret"), allow_dir=options.get("allow"), nixl=nixl)
    except (ValueError, zmq.ZMQError, ImportError, RuntimeError) as e:
        raise ConfigError(f"config: serve: {e}") from None
