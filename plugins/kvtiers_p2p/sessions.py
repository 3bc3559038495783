"""The peer server's sessions and namespace table: who may hold a session or a namespace.

:class:`ServerLimits` is what one server allows; :class:`Session` one client's session.
:class:`SessionTable` is part of :class:`kvtiers_p2p.server.PeerServer` (kept apart for its
size): the per-peer caps on sessions, namespaces and chunk sizes, which session a full server
reaps and which namespaces a HELLO reclaims (see the module docstring of
:mod:`kvtiers_p2p.server`), and the ``max_bytes`` quota of a namespace.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvtiers.p2p")


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


class SessionTable:
    """Admission and the namespace table of :class:`~kvtiers_p2p.server.PeerServer` (uses its
    ``sessions``, ``ns_chunk``, ``ns_owner``, ``ns_used``, ``limits``, ``store`` and ``curve``)."""

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
        None (least recently used first: every client is trusted, docs/p2p-security.md)."""
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


def _who(peer: str) -> str:
    """A peer as a refusal names it."""
    return "this client key" if peer.startswith("key ") else peer
