"""The optional NIXL data path of the p2p tier (``backend: "nixl"``, ``kvtiers p2p serve --nixl``).

Control stays on ZMQ; the chunk bytes of a load move with NIXL's UCX backend (RDMA where
present, shared memory or TCP on one host): the client registers its whole arena, the server
WRITEs each chunk straight into the slot the load names, then says so over ZMQ with the
chunk's xxh3 (``CHUNK`` without a data frame), and the client checks the bytes where they
landed. Stores stay on ZMQ on both paths.

NIXL cannot abort a WRITE once posted, so rule 6 (no write into a slot after its job is
reported) is kept by the client holding a load's job open until the server has *settled*
every slot it was asked to write: a CHUNK or MISSING for it, or the server's DONE, which
after a CANCEL comes only once every write it posted has finished. A server process that
is gone settles its slots too (on one host the client watches it with a pidfd). See
:class:`kvtiers_p2p.client.PeerClient` for the fence around a silent server.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
from kvtiers_nixl import installed, make_agent, teardown

log = logging.getLogger("kvtiers.p2p")


def available() -> str | None:
    """``None`` when NIXL with a UCX backend can be used, else why not."""
    return installed()


def _agent(prefix: str, owner_close: Any = None) -> Any:
    """An agent with the UCX backend and no progress thread (:func:`kvtiers_nixl.make_agent`):
    NIXL's spins a whole core even when idle (measured: 3.0 s of CPU in 3 s); the writer
    progresses its transfers when it polls them, the client when it waits for loads."""
    return make_agent(prefix, "UCX", owner_close=owner_close)


def address(buf: Any) -> int:
    """The address of a writable buffer."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class NixlClient:
    """The client's agent with the tier's whole arena registered (I/O thread only)."""

    def __init__(self, arena: Any) -> None:
        self.agent = _agent("kvtiers-p2p-client", owner_close=self._close_at_exit)
        self.user: threading.Thread | None = None  # the thread that uses the agent (set by progress)
        self.arena = arena  # registered memory must outlive the registration
        self.stride = arena.slot_bytes
        self.n = len(arena)
        self.base = address(arena.buffer)
        self.reg = self.agent.register_memory([(self.base, self.n * self.stride, 0, "")], "DRAM", ["UCX"])

    def hello(self) -> dict[str, Any]:
        """What HELLO carries so the server can write into the arena's slots."""
        return {"md": self.agent.get_agent_metadata(), "base": self.base, "n": self.n, "stride": self.stride}

    def progress(self) -> None:
        """Let UCX progress (no progress thread): incoming writes need it on some transports."""
        self.user = threading.current_thread()
        try:
            self.agent.get_new_notifs()
        except Exception as e:
            log.debug("p2p nixl: progress failed: %s", e)

    def close(self) -> None:
        """Deregister the arena and destroy the agent (on the thread that used it)."""
        agent, self.agent = self.agent, None
        teardown(agent, regs=[(self.reg, ["UCX"])])

    def _close_at_exit(self) -> None:
        if self.user is None or not self.user.is_alive():  # never under the feet of a live I/O thread
            self.close()


class NixlServer:
    """The server's agent: registers the memory it serves from, writes chunks into clients' slots."""

    def __init__(self) -> None:
        self.agent = _agent("kvtiers-p2p-server", owner_close=self._close_at_exit)
        self.user: threading.Thread | None = None  # the thread that writes (set by write)
        self.regs: list[Any] = []
        self.peers: dict[bytes, str] = {}  # metadata -> remote agent name
        self.inflight_bytes = 0  #: bytes of the writes posted and not yet seen over (DONE or ERR)
        self.inflight_peak = 0  #: the most ``inflight_bytes`` has been

    def register(self, buf: Any) -> None:
        """Register a slab of the store's pool (called as it is mapped)."""
        self.regs.append(self.agent.register_memory([(address(buf), len(buf), 0, "")], "DRAM", ["UCX"]))

    def add_peer(self, md: bytes) -> str:
        name = self.peers.get(md)
        if name is None:
            name = self.agent.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[md] = name
        return name

    def close(self) -> None:
        """Remove the clients' agents, deregister the slabs and destroy the agent (call it
        once no write is in flight, on the server's thread)."""
        agent, self.agent = self.agent, None
        teardown(agent, remotes=list(self.peers.values()), regs=[(r, ["UCX"]) for r in self.regs])
        self.regs, self.peers = [], {}

    def _close_at_exit(self) -> None:
        if self.user is None or not self.user.is_alive():
            self.close()

    def write(self, buf: Any, peer: str, remote_addr: int) -> Write | None:
        """Post a WRITE of ``buf`` to ``remote_addr`` of ``peer``; None if NIXL refused it."""
        self.user = threading.current_thread()
        agent = self.agent
        handle = None
        try:
            local = agent.get_xfer_descs([(address(buf), len(buf), 0)], "DRAM")
            remote = agent.get_xfer_descs([(remote_addr, len(buf), 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, peer, backends=["UCX"])
            if agent.transfer(handle) != "ERR":
                self.inflight_bytes += len(buf)
                self.inflight_peak = max(self.inflight_peak, self.inflight_bytes)
                return Write(agent, handle, self, len(buf))
        except Exception as e:  # e.g. the client went away (NIXL_ERR_REMOTE_DISCONNECT): a failed write
            log.debug("p2p nixl: write to %s failed: %s", peer, e)
        if handle is not None:
            try:
                handle.release()
            except Exception as e:
                log.debug("p2p nixl: release failed: %s", e)
        return None


class Write:
    """A posted NIXL WRITE; :meth:`poll` may be called by anyone, any number of times."""

    __slots__ = ("_agent", "_handle", "_owner", "_nbytes", "state")

    def __init__(self, agent: Any, handle: Any, owner: NixlServer, nbytes: int) -> None:
        self._agent, self._handle, self.state = agent, handle, "PROC"
        self._owner, self._nbytes = owner, nbytes

    def poll(self) -> str:
        """``PROC`` while in flight, then ``DONE`` or ``ERR`` (the handle released once)."""
        if self.state == "PROC":
            try:
                state = self._agent.check_xfer_state(self._handle)
            except Exception:
                state = "ERR"
            if state != "PROC":
                self.state = "DONE" if state == "DONE" else "ERR"
                self._owner.inflight_bytes -= self._nbytes
                try:
                    self._handle.release()
                except Exception as e:
                    log.debug("p2p nixl: release failed: %s", e)
        return self.state
