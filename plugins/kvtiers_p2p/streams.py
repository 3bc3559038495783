"""The peer server's GET streams: chunks sent round robin, over ZMQ or as NIXL writes.

:class:`StreamSender` is part of :class:`kvtiers_p2p.server.PeerServer` (kept apart for its
size): each :class:`Stream` sends up to ``BURST`` chunks before the next one's turn; a GETN
stream posts NIXL writes ahead of what it announced and keeps the source of a write its client
cancelled until NIXL is done with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import protocol as P
from .sessions import Session

BURST = 8  #: chunks one GET stream may send before the next stream's turn
NIXL_AHEAD = 16  #: NIXL writes a GETN stream keeps posted ahead of what it announced, at most
#: ... and a write ahead of a stream's next chunk only while the server's writes in flight (all
#: streams) are fewer bytes. On one host UCX does the copy itself (CMA): more writes posted only
#: delay each one's announcement, and the client's check of it (16 ahead per stream loaded 1 MiB
#: chunks on 4 streams at 0.96-0.98x of raw NIXL, this budget at 1.07-1.10x). 8 MiB is still
#: many times a NIC's bandwidth-delay product.
NIXL_INFLIGHT_BYTES = 8 << 20
NOT_READY = object()  #: what _nixl_source returns for a chunk that cannot be written yet (not pinned yet)


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


class StreamSender:
    """Sending the GET streams of :class:`~kvtiers_p2p.server.PeerServer` (uses its ``sock``,
    ``store``, ``nixl``, ``streams``, ``stalled`` and ``stats``)."""

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
