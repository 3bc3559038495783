"""``kvtiers bench p2p``: loads and pushes through the p2p tier against raw ZMQ.

One run starts two child processes on loopback: a peer server (``kvtiers_p2p.server``) and
a raw ZMQ ROUTER (:mod:`kvtiers_p2p.rawpeer`). For each chunk size, each round pushes
``total`` bytes of fresh keys through the tier (``submit_store``, one job) and the same
bytes as plain DEALER sends answered by one ack each, at the same window of messages in
flight; then it loads them back (``submit_load``: GET, chunks received into the arena slots
and xxh3-checked) and pulls as many chunks of the same size from the raw peer with plain
``recv_into`` into the same slots. Tier and baseline alternate which goes first from round
to round; medians over rounds are compared. With ``--backend nixl`` (or ``both``) the server
also serves NIXL, the tier loads over NIXL (stores stay on ZMQ), and the load baseline is raw
NIXL UCX WRITEs of the same chunks from the raw peer's registered memory into memory this
process registered.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import zmq

from kvtiers import Arena, Job, Namespace, TierContext, open_tier

from . import client as C
from .spawn import start_server


def _wait(handle: Any, job_id: int, timeout: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for r in handle.get_finished_jobs():
            if r.job_id == job_id:
                return r
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench job {job_id} did not finish in {timeout:g} s")
        time.sleep(0.0005)


def _start_raw() -> tuple[subprocess.Popen, str]:
    fd, path = tempfile.mkstemp(prefix="kvtiers-p2p-raw-")
    os.close(fd)
    os.unlink(path)
    proc = subprocess.Popen([sys.executable, "-m", "kvtiers_p2p.rawpeer", "tcp://127.0.0.1:0", path,
                             str(os.getpid())], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("raw ZMQ peer did not start")
        time.sleep(0.02)
    with open(path) as f:
        endpoint = f.read().strip()
    os.unlink(path)
    return proc, endpoint


class _Raw:
    """The plain DEALER side of the baseline."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.setsockopt(zmq.RCVHWM, 256)
        self.s.connect(endpoint)

    def pull(self, arena: Arena, n: int) -> None:
        self.s.send_multipart([b"pull", str(arena.slot_bytes).encode(), str(n).encode()])
        for i in range(n):
            self.s.recv()
            got = self.s.recv_into(arena[i])
            if got != arena.slot_bytes:
                raise RuntimeError(f"raw pull got {got} bytes")

    def push(self, arena: Arena, n: int) -> None:
        sent = acked = 0
        size = str(arena.slot_bytes).encode()
        while acked < n:
            while sent < n and sent - acked < C.WINDOW:
                self.s.send_multipart([b"push", size, arena[sent]])
                sent += 1
            self.s.recv()
            acked += 1

    def nixl_pull(self, nx: Any, n: int) -> None:
        """``n`` raw NIXL writes of one chunk each into ``nx``'s registered staging."""
        self.s.send_multipart([b"nixlpull", str(nx.stride).encode(), str(n).encode(), nx.agent.get_agent_metadata(),
                               str(nx.base).encode(), str(nx.n).encode(), str(nx.stride).encode()])
        if self.s.recv() != b"ok":
            raise RuntimeError("raw NIXL pull failed")

    def close(self) -> None:
        self.s.close(0)
        self.ctx.term()


def run_bench(chunk_sizes: list[int], *, total: int = 128 << 20, rounds: int = 3,
              backends: tuple[str, ...] = ("zmq",)) -> dict:
    """Run the interleaved bench; return ``{"results": [...], ...}`` (see the module doc).
    ``backends``: ``zmq`` and/or ``nixl`` (loads against raw NIXL UCX writes)."""
    for size in chunk_sizes:
        if size <= 0 or size % 4096:
            raise ValueError(f"--chunk-bytes must be a positive multiple of 4096, got {size}")
        if total < size:
            raise ValueError(f"--total {total} is smaller than a chunk of {size} bytes")
    nixl = "nixl" in backends
    if nixl:
        from .nixl_path import available

        why = available()
        if why is not None:
            raise ValueError(f"--backend nixl: {why}")
    capacity = 2 * total + max(chunk_sizes)
    server = start_server(capacity=capacity, extra=["--nixl"] if nixl else None)
    raw_proc, raw_endpoint = _start_raw()
    raw = _Raw(raw_endpoint)
    results = []
    try:
        for size in chunk_sizes:
            n = total // size
            arena = Arena.allocate(n, size)
            rng = np.random.default_rng(size)
            np.frombuffer(arena.buffer, dtype=np.uint8)[:] = rng.integers(0, 256, len(arena.buffer), dtype=np.uint8)
            ctx = TierContext(arena, Namespace({"kvtiers_bench": "p2p", "chunk_bytes": size}))
            for backend in backends:
                handle = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "timeout": 120.0,
                                           "backend": backend}, ctx)
                try:
                    results += _measure(handle, raw, arena, n, rounds, backend)
                finally:
                    handle.close()
    finally:
        raw.close()
        raw_proc.terminate()
        raw_proc.wait(10)
        server.stop()
    return {
        "results": results,
        "baseline": "raw ZMQ DEALER/ROUTER to another process, receivers recv_into memory of their own: "
                    "pull into the same arena slots; push at the same window, one ack per message",
        "rounds": rounds, "total_bytes": total, "endpoint": "tcp://127.0.0.1 (loopback)",
    }  # fmt: skip


def _measure(handle: Any, raw: _Raw, arena: Arena, n: int, rounds: int, backend: str) -> list[dict]:
    size = arena.slot_bytes
    nx = None
    if backend == "nixl":  # the raw baseline's destination: registered memory of an agent of our own
        from .nixl_path import NixlClient

        nx = NixlClient(size)
    jobs = iter(range(1, 1 << 30))
    times: dict[str, dict[str, list[float]]] = {op: {"p2p": [], "raw": []} for op in ("store", "load")}
    for r in range(rounds):
        keys = tuple(f"bench-{size}-{r}-{i}-{os.getpid()}".encode() for i in range(n))
        for op in ("store", "load"):
            def ours(op: str = op, keys: tuple = keys) -> float:
                jid = next(jobs)
                t0 = time.perf_counter()
                (handle.submit_store if op == "store" else handle.submit_load)(Job(jid, keys, tuple(range(n))))
                res = _wait(handle, jid)
                dt = time.perf_counter() - t0
                if not res.ok:
                    raise RuntimeError(f"p2p {op} failed: {res.error}")
                return dt

            def theirs(op: str = op) -> float:
                t0 = time.perf_counter()
                if op == "load" and nx is not None:
                    raw.nixl_pull(nx, n)
                else:
                    (raw.push if op == "store" else raw.pull)(arena, n)
                return time.perf_counter() - t0

            order = [("p2p", ours), ("raw", theirs)]
            if r % 2:
                order.reverse()
            for who, fn in order:
                times[op][who].append(fn())
    if nx is not None:
        nx.close()
    out = []
    for op in ("store", "load"):
        mine = [n * size / t / 1e9 for t in times[op]["p2p"]]
        base = [n * size / t / 1e9 for t in times[op]["raw"]]
        g, b = statistics.median(mine), statistics.median(base)
        out.append({
            "op": op, "backend": backend, "chunk_bytes": size, "chunks": n, "gbps": round(g, 4),
            "baseline_kind": "raw nixl ucx write" if (nx is not None and op == "load") else "raw zmq",
            "baseline_gbps": round(b, 4), "ratio": round(g / b, 3) if b else None,
            "rounds_gbps": [round(x, 4) for x in mine], "rounds_baseline_gbps": [round(x, 4) for x in base],
        })  # fmt: skip
    return out


def format_table(report: dict) -> str:
    """The human-readable table ``kvtiers bench p2p`` prints."""
    lines = [f"{'op':<6} {'backend':<8} {'chunk_bytes':>11} {'p2p GB/s':>9} {'raw GB/s':>9} {'ratio':>7}  baseline"]
    for r in report["results"]:
        lines.append(f"{r['op']:<6} {r['backend']:<8} {r['chunk_bytes']:>11} {r['gbps']:>9.3f} "
                     f"{r['baseline_gbps']:>9.3f} {r['ratio']:>6.2f}x  {r['baseline_kind']}")
    lines.append(f"median of {report['rounds']} interleaved rounds, {report['total_bytes']} bytes per round and "
                 f"size, {report['endpoint']}")
    return "\n".join(lines)
