"""The raw baseline of ``kvtiers bench tier mooncake``: Mooncake's own zero-copy calls.

``batch_put_from`` / ``batch_get_into`` of one key per call, on the tier's own client and its
registered arena (the same slots, no trailer, no checks), as many calls in flight as the
tier's ``max_concurrency``: what an engine gets calling Mooncake directly. The tier hands
over what the baseline uses (``MooncakeTier.bench_baseline``); this module does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtiers.types import Baseline

from . import client as mc
from .client import address

RAW_PREFIX = "kvtiers-bench-raw"


def baseline(store: Any, config: Any, digest: str, concurrency: int) -> Baseline:
    """Plain put/get through ``store`` (a tier's set-up ``MooncakeDistributedStore``, whose
    arena is registered) with replica config ``config``, objects named under ``digest``,
    ``concurrency`` calls in flight."""
    written: set[str] = set()

    def name(key: bytes) -> str:
        return f"{RAW_PREFIX}/{digest}/{key.hex()}"

    def put(key: bytes, data: memoryview) -> None:
        n = name(key)
        rc = store.batch_put_from([n], [address(data)], [len(data)], config)[0]
        if rc != 0:
            raise RuntimeError(f"raw batch_put_from of {n} failed: {mc.code_name(rc)}")
        written.add(n)

    def get(key: bytes, out: memoryview) -> None:
        n = name(key)
        rc = store.batch_get_into([n], [address(out)], [len(out)])[0]
        if rc != len(out):
            raise RuntimeError(f"raw batch_get_into of {n} failed: {mc.code_name(rc)}")

    def close(keys: Sequence[bytes]) -> None:
        if written:
            store.batch_remove(sorted(written), True)
            written.clear()

    return Baseline(name=f"raw batch_put_from/batch_get_into, 1 key per call, {concurrency} in flight",
                    put=put, get=get, concurrency=concurrency, close=close)


def loopback_tcp(chunk_bytes: int, total_bytes: int = 256 << 20) -> dict[str, float]:
    """Raw TCP between two processes on loopback, for context next to Mooncake over tcp:
    GB/s of sending ``chunk_bytes`` messages (each acknowledged, as a put is) and of receiving
    them (each asked for, as a get is), ``total_bytes`` each way, one connection."""
    import multiprocessing as mp
    import socket
    import time

    n = max(1, total_bytes // chunk_bytes)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_tcp_peer, args=(port, chunk_bytes, n), daemon=True)
    peer.start()
    conn, _ = listener.accept()
    listener.close()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    try:
        t0 = time.perf_counter()
        for _ in range(n):  # puts: a chunk out, one byte back
            conn.sendall(view)
            conn.recv(1)
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):  # gets: one byte out, a chunk back
            conn.sendall(b"g")
            got = 0
            while got < chunk_bytes:
                got += conn.recv_into(view[got:])
        get_s = time.perf_counter() - t0
    finally:
        conn.close()
        peer.join(10)
    return {"put_gbps": n * chunk_bytes / put_s / 1e9, "get_gbps": n * chunk_bytes / get_s / 1e9}


def _tcp_peer(port: int, chunk_bytes: int, n: int) -> None:
    import socket

    s = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    for _ in range(n):
        got = 0
        while got < chunk_bytes:
            got += s.recv_into(view[got:])
        s.sendall(b"k")
    for _ in range(n):
        s.recv(1)
        s.sendall(view)
    s.close()


if __name__ == "__main__":
    for size in (1 << 20, 4 << 20):
        r = loopback_tcp(size)
        print(f"raw TCP loopback, {size >> 20} MiB: put {r['put_gbps']:.2f} GB/s, get {r['get_gbps']:.2f} GB/s")
