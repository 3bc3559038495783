"""The TCP connections of a peer server's ROUTER socket, so it can close one.

ZMQ gives a bound ROUTER no way to drop one peer: queued replies (and the chunks they
reference) would stay until that peer goes away by itself. :class:`Connections` watches the
socket's monitor (``ACCEPTED``/``DISCONNECTED`` carry each connection's file descriptor),
learns which connection a session's messages came from (``zmq.SRCFD`` of a message's
routing-id frame; a descriptor reused by a new connection before the old one's
``DISCONNECTED`` arrives is told apart by the order of events), and closes a connection by
shutting its socket down; libzmq then
closes it as if the peer had gone, dropping what was queued for it. A descriptor is shut
down only while it is still the socket that was accepted (same inode), so a descriptor
reused by a later connection is never touched.

Each connection is tagged with its peer as it is accepted: the IP address ``getpeername``
gives for the accepted descriptor (TCP), or the user id of the other process
(``SO_PEERCRED``, ``ipc://``). A ROUTER hides the TCP peer from the messages it delivers,
and ZMQ's ``Peer-Address`` message property only comes with a message, so it cannot count
connections that never send one; the monitor's ``ACCEPTED`` event comes with the
descriptor before any byte is read.

Connections without a session (they have not said HELLO, were refused, or their session
ended) are *pending*, each closed ``hello_timeout`` seconds after it was accepted or its
session ended (a refused client reconnects and asks again). Of those that never said
HELLO, at most ``per_peer`` per peer address: one more is closed at once. Past ``limit``
connections in all, a new one closes the oldest pending connection of the peer holding the
most pending ones, when that peer holds more than the newcomer's peer (else the new one is
closed): one peer's connections never keep another's out.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("kvtiers.p2p")

FD_RESERVE = 64  #: descriptors kept free for everything but connections (files, pipes, NIXL)


@dataclass
class Conn:
    fd: int
    ino: int
    since: float
    peer: str = "?"  # the peer's address (see peer_address)
    ident: bytes | None = None  # the routing id of its session, once it said HELLO
    seen: bool = True  # its ACCEPTED event was handled (False: learnt from a message first)
    closing: bool = False  # shut down by this side: its DISCONNECTED event is on its way
    spoke: bool = False  # it said HELLO (answered or refused)


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def peer_address(fd: int) -> str:
    """Who is at the other end of connection ``fd``: its IP address (TCP), ``uid N`` (a
    Unix socket, from ``SO_PEERCRED``), or ``?`` when the descriptor is gone."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return "?"
    try:
        if s.family == socket.AF_UNIX:
            cred = s.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_PEERCRED", 17), struct.calcsize("3i"))
            return f"uid {struct.unpack('3i', cred)[1]}"
        return str(s.getpeername()[0])
    except OSError:
        return "?"
    finally:
        s.close()


def fd_limit() -> int:
    """This process's soft limit on open file descriptors (raised to the hard one first)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1024


class Connections:
    """The connections of ``sock`` (a ROUTER), by file descriptor."""

    def __init__(self, sock: zmq.Socket, *, limit: int, hello_timeout: float, per_peer: int = 16) -> None:
        self.limit = max(1, min(limit, fd_limit() - FD_RESERVE))
        self.hello_timeout = hello_timeout
        self.per_peer = per_peer
        self.open: dict[int, Conn] = {}
        self.closed = 0  # connections this side closed
        self.mon = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def events(self) -> list[bytes]:
        """Handle the monitor's events; returns the routing ids of sessions whose
        connection went away."""
        gone: list[bytes] = []
        while True:
            try:
                ev = recv_monitor_message(self.mon, zmq.NOBLOCK)
            except zmq.Again:
                return gone
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                ino = _inode(fd)
                old = self.open.get(fd)
                if old is not None and old.ino == ino:
                    old.seen = True  # learnt from its first message already
                    continue
                if ino is None:
                    continue  # closed already
                conn = self.open[fd] = Conn(fd, ino, time.monotonic(), peer_address(fd))
                self._admit(conn)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                conn = self.open.get(fd)
                if conn is None or not conn.seen:
                    continue  # the descriptor's previous connection: this one is not accepted yet
                del self.open[fd]
                if conn.ident is not None:
                    gone.append(conn.ident)

    def _admit(self, conn: Conn) -> None:
        """Close the new connection ``conn``, or another pending one, when over a limit."""
        pending = [c for c in self.open.values() if c.ident is None and not c.closing]
        if sum(c.peer == conn.peer and not c.spoke for c in pending) > self.per_peer:
            self.close(conn.fd, f"more than {self.per_peer} connections without HELLO from {conn.peer}")
            return
        mine = sum(c.peer == conn.peer for c in pending)
        if sum(not c.closing for c in self.open.values()) <= self.limit:
            return
        top, most = Counter(c.peer for c in pending).most_common(1)[0]
        if top != conn.peer and most > mine:
            old = min((c for c in pending if c.peer == top), key=lambda c: c.since)
            self.close(old.fd, f"more than {self.limit} connections: {top} holds the most without a session")
        else:
            self.close(conn.fd, f"more than {self.limit} connections")

    def _conn(self, fd: int | None) -> Conn | None:
        """The connection ``fd`` is now (learnt here when its ACCEPTED event is still on its way)."""
        if fd is None or fd < 0:
            return None
        conn = self.open.get(fd)
        ino = _inode(fd)
        if conn is None or conn.ino != ino:
            if ino is None:
                return None
            conn = self.open[fd] = Conn(fd, ino, time.monotonic(), peer_address(fd), seen=False)
        return conn

    def hello(self, fd: int | None) -> str | None:
        """A HELLO came on connection ``fd``: its peer address; ``None`` when this side is
        closing it (the HELLO is ignored)."""
        if fd is None or fd < 0:
            return "?"
        conn = self._conn(fd)
        if conn is None or conn.closing:
            return None
        conn.spoke = True
        return conn.peer

    def bind(self, fd: int | None, ident: bytes) -> None:
        """The session ``ident`` speaks on connection ``fd`` (its HELLO came from there)."""
        conn = self._conn(fd)
        if conn is not None:
            conn.ident = ident

    def unbind(self, fd: int | None, ident: bytes) -> None:
        """The session ``ident`` ended with its connection still open: the connection is
        pending again (closed ``hello_timeout`` from now without a new HELLO)."""
        conn = self.open.get(fd) if fd is not None else None
        if conn is not None and conn.ident == ident:
            conn.ident = None
            conn.since = time.monotonic()

    def close(self, fd: int | None, why: str) -> bool:
        """Shut connection ``fd`` down (libzmq then drops it and what is queued for it)."""
        conn = self.open.get(fd) if fd is not None else None
        if conn is None or _inode(fd) != conn.ino:
            return False
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()
        self.closed += 1
        conn.closing = True
        log.info("p2p server: closed a connection: %s", why)
        return True

    def expire(self, now: float) -> None:
        """Close pending connections ``hello_timeout`` after they were accepted or their session ended."""
        for conn in [c for c in self.open.values() if c.ident is None and now - c.since > self.hello_timeout]:
            self.close(conn.fd, f"no HELLO within {self.hello_timeout:g} s")
            conn.since = now  # once shut down, its DISCONNECTED event removes it

    def stop(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.mon.close(0)
