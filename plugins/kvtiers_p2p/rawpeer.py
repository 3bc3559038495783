"""The raw peer of the p2p tier's bench baseline: plain ZMQ over the same DEALER/ROUTER
pattern and loopback TCP as the tier, without the protocol (no handshake, header, checksum,
window or deadlines). Each request carries a request id ``rid`` its reply echoes:

- ``[b"put", rid, size, key, data]``: ``data`` received with ``recv_into`` a buffer of a
  pre-faulted pool (as a peer cache must keep what it is sent, and as the server does),
  kept under ``key`` (oldest first out past the capacity), answered ``[rid, b"ok"]``.
- ``[b"mget", rid, key, ...]``: per key ``[rid, the bytes kept under key]``, sent
  zero-copy (as the server does); an empty frame for a key it does not hold.
- ``[b"ping", rid, size]``: map the pool's buffers of ``size`` up to the capacity, answer
  ``[rid, b"ok"]`` (the bench connects, and the raw peer faults its memory in, before
  anything is measured).
- ``[b"nhello", rid, agent metadata]``: (NIXL) register the pool with an agent of our own,
  add the client's agent, answer ``[rid, b"ok"]``.
- ``[b"nget", rid, key, address]``: (NIXL) a UCX WRITE of the bytes kept under ``key`` to
  ``address`` of that agent's registered memory; ``[rid, b"ok"]`` once it is done (the
  writes of several requests overlap), ``[rid, b"err"]`` when it fails or the key is missing.

Run as ``python -m kvtiers_p2p.rawpeer BIND ENDPOINT_FILE PARENT_PID CAPACITY``; it writes
the address it bound to ENDPOINT_FILE and exits on SIGTERM or when its parent is gone.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

import zmq

SLAB_BYTES = 64 << 20  #: pool buffers are mapped this many bytes at a time (as the server's store)


class _Pool:
    """Chunks by key in buffers carved from pre-faulted mappings, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = 0
        self.keep: OrderedDict[bytes, memoryview] = OrderedDict()
        self.free: dict[int, list[memoryview]] = {}
        self.slabs: list[memoryview] = []
        self.mapped = 0
        self.on_slab: Any = None

    def take(self, size: int) -> memoryview:
        while self.keep and self.bytes + size > self.capacity:
            _, old = self.keep.popitem(last=False)
            self.bytes -= len(old)
            self.free.setdefault(len(old), []).append(old)
        if not self.free.get(size):
            self._map(size, max(1, min(SLAB_BYTES, self.capacity - self.mapped) // size))
        self.bytes += size
        return self.free[size].pop()

    def prefault(self, size: int) -> None:
        """Map buffers of ``size`` up to the capacity now, so none is faulted in while measured."""
        while self.mapped + size <= self.capacity:
            self._map(size, max(1, min(SLAB_BYTES, self.capacity - self.mapped) // size))

    def _map(self, size: int, n: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        slab = memoryview(mmap.mmap(-1, n * size, flags=flags))
        self.slabs.append(slab)
        self.mapped += len(slab)
        if self.on_slab is not None:
            self.on_slab(slab)
        self.free.setdefault(size, []).extend(slab[i * size : (i + 1) * size] for i in range(n))

    def put(self, key: bytes, buf: memoryview) -> None:
        old = self.keep.pop(key, None)
        if old is not None:
            self.bytes -= len(old)
            self.free.setdefault(len(old), []).append(old)
        self.keep[key] = buf


class _Nixl:
    """An agent of our own writing pool buffers into the client's registered memory."""

    def __init__(self, pool: _Pool) -> None:
        from .nixl_path import _agent, address

        self.address = address
        self.agent = _agent("kvtiers-p2p-raw")
        self.peer = ""
        for slab in pool.slabs:
            self.register(slab)
        pool.on_slab = self.register
        self.pending: list[tuple[list[bytes], Any]] = []  # ([identity, rid], transfer handle)

    def register(self, slab: memoryview) -> None:
        self.agent.register_memory([(self.address(slab), len(slab), 0, "")], "DRAM", ["UCX"])

    def hello(self, md: bytes) -> None:
        name = self.agent.add_remote_agent(md)
        self.peer = name.decode() if isinstance(name, bytes) else name

    def write(self, to: list[bytes], buf: memoryview, remote: int) -> bool:
        """Post a WRITE of ``buf`` to ``remote``; ``to`` (identity, rid) is answered once it ends."""
        a = self.agent
        src = a.get_xfer_descs([(self.address(buf), len(buf), 0)], "DRAM")
        dst = a.get_xfer_descs([(remote, len(buf), 0)], "DRAM")
        h = a.initialize_xfer("WRITE", src, dst, self.peer, backends=["UCX"])
        if a.transfer(h) == "ERR":
            h.release()
            return False
        self.pending.append((to, h))
        return True

    def finished(self) -> list[tuple[list[bytes], bool]]:
        """The requests whose writes ended since the last call, and whether each succeeded."""
        out, left = [], []
        for to, h in self.pending:
            try:
                st = self.agent.check_xfer_state(h)
            except Exception:
                st = "ERR"
            if st == "PROC":
                left.append((to, h))
            else:
                h.release()
                out.append((to, st == "DONE"))
        self.pending = left
        return out


def main(argv: list[str]) -> None:
    bind, endpoint_file, parent, capacity = argv[0], argv[1], int(argv[2]), int(argv[3])
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1024)
    s.setsockopt(zmq.RCVHWM, 1024)
    s.bind(bind)
    with open(endpoint_file + ".tmp", "w") as f:
        f.write(s.getsockopt_string(zmq.LAST_ENDPOINT) + "\n")
    os.replace(endpoint_file + ".tmp", endpoint_file)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    pool = _Pool(capacity)
    nx: _Nixl | None = None
    check = 0.0
    while not stop:
        if nx is not None and nx.pending:
            for to, ok in nx.finished():
                s.send_multipart([*to, b"ok" if ok else b"err"])
            busy = bool(nx.pending)
        else:
            busy = False
        now = time.monotonic()
        if now > check:
            check = now + 0.5
            if os.getppid() != parent:
                break
        if not s.poll(0 if busy else 200):
            continue
        ident, op = s.recv(), s.recv()
        rid = s.recv() if s.getsockopt(zmq.RCVMORE) else b""
        if op == b"put":
            size, key = int(s.recv()), s.recv()
            buf = pool.take(size)
            s.recv_into(buf)
            pool.put(key, buf)
            s.send_multipart([ident, rid, b"ok"])
        elif op == b"mget":
            while s.getsockopt(zmq.RCVMORE):
                buf = pool.keep.get(s.recv())
                s.send_multipart([ident, rid, b"" if buf is None else buf], copy=False)
        elif op == b"ping":
            pool.prefault(int(s.recv()))
            s.send_multipart([ident, rid, b"ok"])
        elif op == b"nhello":
            if nx is None:
                nx = _Nixl(pool)
            nx.hello(s.recv())
            s.send_multipart([ident, rid, b"ok"])
        elif op == b"nget" and nx is not None:
            key, remote = s.recv(), int(s.recv())
            buf = pool.keep.get(key)
            if buf is None or not nx.write([ident, rid], buf, remote):
                s.send_multipart([ident, rid, b"err"])
        else:
            s.send_multipart([ident, rid, b"err"])
        while s.getsockopt(zmq.RCVMORE):
            s.recv()
    s.close(0)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
