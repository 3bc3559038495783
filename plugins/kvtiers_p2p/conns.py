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

Connections that never say HELLO are closed ``hello_timeout`` seconds after they were
accepted; past ``limit`` connections, a new one is closed at once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
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
    ident: bytes | None = None  # the routing id of its session, once it said HELLO
    seen: bool = True  # its ACCEPTED event was handled (False: learnt from a message first)


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


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

    def __init__(self, sock: zmq.Socket, *, limit: int, hello_timeout: float) -> None:
        self.limit = max(1, min(limit, fd_limit() - FD_RESERVE))
        self.hello_timeout = hello_timeout
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
                self.open[fd] = Conn(fd, ino, time.monotonic())
                if len(self.open) > self.limit:
                    self.close(fd, f"more than {self.limit} connections")
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                conn = self.open.get(fd)
                if conn is None or not conn.seen:
                    continue  # the descriptor's previous connection: this one is not accepted yet
                del self.open[fd]
                if conn.ident is not None:
                    gone.append(conn.ident)

    def bind(self, fd: int | None, ident: bytes) -> None:
        """The session ``ident`` speaks on connection ``fd`` (its HELLO came from there)."""
        if fd is None or fd < 0:
            return
        conn = self.open.get(fd)
        ino = _inode(fd)
        if conn is None or conn.ino != ino:  # its ACCEPTED event is still on its way
            if ino is None:
                return
            conn = self.open[fd] = Conn(fd, ino, time.monotonic(), seen=False)
        conn.ident = ident

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
        log.info("p2p server: closed a connection: %s", why)
        return True

    def expire(self, now: float) -> None:
        """Close connections that said no HELLO within ``hello_timeout`` of being accepted."""
        for conn in [c for c in self.open.values() if c.ident is None and now - c.since > self.hello_timeout]:
            self.close(conn.fd, f"no HELLO within {self.hello_timeout:g} s")
            conn.since = now  # once shut down, its DISCONNECTED event removes it

    def stop(self, sock: zmq.Socket) -> None:
        sock.disable_monitor()
        self.mon.close(0)
