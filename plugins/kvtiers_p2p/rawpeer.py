"""The baseline of ``kvtiers bench p2p``: plain ZMQ over the same DEALER/ROUTER pattern,
without the protocol.

- ``[b"pull", size, n]``: ``n`` messages of ``size`` bytes, ``n`` distinct chunks (as the
  tier loads distinct keys), sent zero-copy from memory.
- ``[b"nixlpull", size, n, agent metadata, base, slots, stride]``: ``n`` NIXL UCX WRITEs of
  distinct registered chunks into the client's registered memory, then ``[b"ok"]``.
- ``[b"push", size, data]``: received with ``recv_into`` a pre-faulted buffer (as a peer
  cache must keep what it is sent), answered ``[b"ok"]``.

Both sides thus receive into memory of their own, as the tier does. Run as
``python -m kvtiers_p2p.rawpeer BIND ENDPOINT_FILE PARENT_PID``."""

from __future__ import annotations

import mmap
import os
import signal
import sys

import zmq


def main(argv: list[str]) -> None:
    bind, endpoint_file, parent = argv[0], argv[1], int(argv[2])
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1024)
    s.bind(bind)
    with open(endpoint_file + ".tmp", "w") as f:
        f.write(s.getsockopt_string(zmq.LAST_ENDPOINT) + "\n")
    os.replace(endpoint_file + ".tmp", endpoint_file)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    payloads: dict[int, list[zmq.Frame]] = {}
    pools: dict[int, list[memoryview]] = {}
    nx = None
    nsrc: dict[int, memoryview] = {}
    turn = 0
    while not stop and os.getppid() == parent:
        if not s.poll(200):
            continue
        ident, op, size = s.recv(), s.recv(), int(s.recv())
        if op == b"pull":
            n = int(s.recv())
            frames = payloads.setdefault(size, [])
            while len(frames) < n:  # n distinct chunks, as the tier loads n distinct keys
                frames.append(zmq.Frame(os.urandom(size)))
            for i in range(n):  # sent zero-copy from memory, as the server does
                s.send_multipart([ident, b"c", frames[i]], copy=False)
        elif op == b"nixlpull":  # raw NIXL UCX: n WRITEs of a registered buffer into the client's memory
            n, md, base, slots, stride = int(s.recv()), s.recv(), int(s.recv()), int(s.recv()), int(s.recv())
            if nx is None:
                from .nixl_path import NixlServer

                nx = NixlServer()
            src = nsrc.get(size)
            if src is None or len(src) < n * size:  # n distinct chunks in registered memory
                flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
                src = nsrc[size] = memoryview(mmap.mmap(-1, n * size, flags=flags))
                src[:] = os.urandom(len(src))
                nx.register(src)
            peer = nx.add_peer(md)
            handles = [nx.write(src[i * size : (i + 1) * size], peer, base + (i % slots) * stride) for i in range(n)]
            states = [nx.state(h) if h is not None else "ERR" for h in handles]
            while "PROC" in states:
                states = [nx.state(h) if st == "PROC" else st for h, st in zip(handles, states, strict=True)]
            s.send_multipart([ident, b"ok" if all(st == "DONE" for st in states) else b"err"])
        elif op == b"push":
            pool = pools.get(size)
            if pool is None:
                flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
                m = mmap.mmap(-1, 64 * size, flags=flags)
                pool = pools[size] = [memoryview(m)[i * size : (i + 1) * size] for i in range(64)]
            turn = (turn + 1) % 64
            s.recv_into(pool[turn])
            s.send_multipart([ident, b"ok"])
        while s.getsockopt(zmq.RCVMORE):
            s.recv()
    s.close(0)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
