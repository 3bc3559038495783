"""The optional NIXL data path of the p2p tier (``backend: "nixl"``, ``kvtiers p2p serve --nixl``).

Control stays on ZMQ; the chunk bytes of a load move with NIXL's UCX backend (RDMA where
present, shared memory or TCP on one host): the server WRITEs each chunk into memory the
client registered, then says so over ZMQ with the chunk's xxh3 (``CHUNK`` without a data
frame), and the client checks the bytes where they landed.

They land in a registered *staging* area, not in the arena slot: NIXL cannot abort a
transfer once posted, so a load that times out (a slow peer) could otherwise be written into
a slot the engine already reuses (rule 6). The client copies a checked chunk into its slot
(one memcpy, as the ZMQ path's ``recv_into`` out of ZMQ's buffer), and the staging buffers
of a request that timed out are quarantined, never reused, until the server answers them.
Stores stay on ZMQ on both paths.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import numpy as np

log = logging.getLogger("kvtiers.p2p")

STAGING_BYTES = 256 << 20  #: staging per client (at least 16 chunks, at most 256)


def available() -> str | None:
    """``None`` when NIXL with a UCX backend can be used, else why not."""
    try:
        from nixl_cu12._api import nixl_agent  # noqa: F401
    except ImportError as e:
        return f"nixl-cu12 is not installed ({e}); pip install 'kvtiers[nixl]'"
    return None


def _agent(prefix: str) -> Any:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs INFO lines to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    agent = nixl_agent(f"{prefix}-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=[]))
    if "UCX" not in agent.get_plugin_list():
        raise RuntimeError("this nixl-cu12 has no UCX plugin")
    agent.create_backend("UCX", {})
    return agent


def address(buf: Any) -> int:
    """The address of a writable buffer."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class NixlClient:
    """The client's agent and its registered staging area (I/O thread only)."""

    def __init__(self, slot_bytes: int) -> None:
        self.agent = _agent("kvtiers-p2p-client")
        self.stride = slot_bytes
        self.n = max(16, min(256, STAGING_BYTES // slot_bytes))
        self.stage = np.zeros(self.n * slot_bytes, dtype=np.uint8)
        self.base = int(self.stage.ctypes.data)
        self.reg = self.agent.register_memory([(self.base, self.stage.nbytes, 0, "")], "DRAM", ["UCX"])
        self.free = list(range(self.n - 1, -1, -1))
        self.quarantined = 0

    def hello(self) -> dict[str, Any]:
        """What HELLO carries so the server can write into the staging area."""
        return {"md": self.agent.get_agent_metadata(), "base": self.base, "n": self.n, "stride": self.stride}

    def view(self, i: int) -> memoryview:
        return memoryview(self.stage)[i * self.stride : (i + 1) * self.stride]

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.pop() for _ in range(n)]

    def give(self, idx: list[int]) -> None:
        self.free.extend(idx)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.reg, ["UCX"])
        except Exception as e:  # a transfer still writing: the memory stays registered
            log.debug("p2p nixl: deregister failed: %s", e)
        self.agent = None


class NixlServer:
    """The server's agent: registers store memory, writes chunks into clients' staging."""

    def __init__(self) -> None:
        self.agent = _agent("kvtiers-p2p-server")
        self.regs: list[Any] = []
        self.peers: dict[bytes, str] = {}  # metadata -> remote agent name

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

    def write(self, buf: Any, peer: str, remote_addr: int) -> Any:
        """Post a WRITE of ``buf`` to ``remote_addr`` of ``peer``; returns its handle."""
        agent = self.agent
        local = agent.get_xfer_descs([(address(buf), len(buf), 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, len(buf), 0)], "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer, backends=["UCX"])
        state = agent.transfer(handle)
        if state == "ERR":
            handle.release()
            return None
        return handle

    def state(self, handle: Any) -> str:
        """``DONE`` (released), ``PROC`` or ``ERR`` (released)."""
        try:
            state = self.agent.check_xfer_state(handle)
        except Exception:
            state = "ERR"
        if state != "PROC":
            try:
                handle.release()
            except Exception as e:
                log.debug("p2p nixl: release failed: %s", e)
        return state
