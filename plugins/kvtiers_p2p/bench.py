"""The p2p tier's raw baseline for ``kvtiers bench tier p2p``, and ``kvtiers bench p2p``.

The baseline is plain ZMQ over the same pattern and the same kind of socket as the tier: one
DEALER (on the SDK's I/O loop, as many requests in flight as the tier keeps per peer) sends
each chunk to a ROUTER in another process on loopback (:mod:`kvtiers_p2p.rawpeer`), which
receives it into a pooled, pre-faulted buffer (``recv_into``) and acks it, and asks for each
chunk back, which the raw peer sends zero-copy and the DEALER receives into the slot. No
handshake, header, checksum, job tracking or deadline: what the tier adds. For a tier with
``backend: "nixl"`` the baseline's loads are raw NIXL UCX WRITEs of the raw peer's buffers
straight into the arena slots (registered with an agent of the bench's own), one plain ZMQ
request and reply each; its stores stay raw ZMQ, as the tier's do. The harness
(:mod:`kvtiers.tierbench`) runs tier and baseline interleaved and compares medians.

``kvtiers bench p2p`` is the harness with the tier fixed: it starts a peer server in a child
process (``--nixl`` too when asked), and ``--backend zmq|nixl|both`` measures each data path
in a harness run of its own, against its own baseline, in one command.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import click

from kvtiers.tierbench import Baseline
from kvtiers.tierbench_cli import Size, bench_command


def _start_raw(capacity: int) -> tuple[subprocess.Popen, str]:
    """Start :mod:`kvtiers_p2p.rawpeer` on a free loopback port; its process and address."""
    fd, path = tempfile.mkstemp(prefix="kvtiers-p2p-raw-")
    os.close(fd)
    os.unlink(path)
    proc = subprocess.Popen([sys.executable, "-m", "kvtiers_p2p.rawpeer", "tcp://127.0.0.1:0", path,
                             str(os.getpid()), str(capacity)], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    try:
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the bench's raw ZMQ peer did not start")
            time.sleep(0.02)
        with open(path) as f:
            return proc, f.read().strip()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def baseline(tier: Any, chunk_bytes: int) -> Baseline | None:
    """Plain ZMQ DEALER/ROUTER put/get of ``tier``'s chunks to a raw peer in another process
    on loopback (raw NIXL WRITEs for loads when ``tier`` uses NIXL), as many requests in
    flight as the tier keeps per peer. None when ``tier``'s peers are not on loopback TCP:
    the raw peer would not be on the same kind of socket."""
    from kvtiers.ioloop import get_loop

    from .client import WINDOW
    from .protocol import parse_endpoint

    eps = [parse_endpoint(u) for u in tier.peers]
    if not eps or not all(ep.loopback and ep.url.startswith("tcp://") for ep in eps):
        return None
    arena = tier.ctx.arena
    proc, endpoint = _start_raw(2 * len(arena) * arena.slot_bytes + chunk_bytes)
    raw = _RawClient(endpoint, chunk_bytes, tier.timeout)  # a request fails as late as the tier's would
    loop = get_loop()
    nixl = getattr(tier._client, "nx", None) is not None
    try:  # connected before it is measured, as the tier is (its handshake)
        asyncio.run_coroutine_threadsafe(raw.ping(), loop).result(60)
        if nixl:
            asyncio.run_coroutine_threadsafe(raw.nixl_hello(arena), loop).result(60)
    except BaseException:
        _stop(proc)
        raise

    def close(_keys: Sequence[bytes]) -> None:
        try:
            asyncio.run_coroutine_threadsafe(raw.close(), loop).result(30)
        finally:
            _stop(proc)

    if nixl:
        name = "raw ZMQ DEALER/ROUTER stores, raw NIXL UCX WRITEs into the arena for loads, another process"
    else:
        name = "raw ZMQ DEALER/ROUTER send/recv_into to another process on loopback"
    return Baseline(name=name, put=raw.put, get=raw.nixl_get if nixl else raw.get, concurrency=WINDOW, close=close)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class _RawClient:
    """One DEALER on the SDK's I/O loop, requests pipelined, replies matched by request id:
    what a plain asyncio user of pyzmq writes. Chunks are received with ``recv_into`` the
    caller's buffer (the arena slot)."""

    def __init__(self, endpoint: str, chunk_bytes: int, timeout: float) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.size = str(chunk_bytes).encode()
        self.ctx: Any = None
        self.sock: Any = None
        self.reader: Any = None
        self.waiting: dict[bytes, tuple[memoryview | None, asyncio.Future]] = {}
        self.rids = itertools.count(1)
        self.agent: Any = None

    def _open(self) -> Any:
        if self.sock is None:
            import zmq
            import zmq.asyncio

            self.ctx = zmq.asyncio.Context()
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.endpoint)
            self.reader = asyncio.ensure_future(self._read())
        return self.sock

    async def _read(self) -> None:
        import zmq

        s = self.sock
        while True:
            rid = await s.recv()
            entry = self.waiting.pop(rid, None)
            if entry is None:  # the answer to a request given up on
                while s.getsockopt(zmq.RCVMORE):
                    await s.recv()
                continue
            out, fut = entry
            try:
                got = await (s.recv_into(out) if out is not None else s.recv())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            else:
                fut.set_result(got)

    async def _ask(self, frames: list[Any], out: memoryview | None = None) -> Any:
        s = self._open()
        rid = b"%d" % next(self.rids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = (out, fut)
        await s.send_multipart([frames[0], rid, *frames[1:]])
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            self.waiting.pop(rid, None)
            raise TimeoutError(f"the raw peer did not answer in {self.timeout:g} s") from None

    async def ping(self) -> None:
        if await self._ask([b"ping", self.size]) != b"ok":
            raise RuntimeError("raw peer did not answer")

    async def put(self, key: bytes, data: memoryview) -> None:
        if await self._ask([b"put", self.size, key, data]) != b"ok":
            raise RuntimeError("raw peer refused a put")

    async def get(self, key: bytes, out: memoryview) -> None:
        n = await self._ask([b"get", key], out)
        if n != len(out):
            raise RuntimeError(f"raw peer sent {n} bytes for a chunk of {len(out)}")

    async def nixl_hello(self, arena: Any) -> None:
        """Register the arena with an agent of the bench's own; introduce it to the raw peer."""
        from .nixl_path import _agent, address

        self.address = address
        self.agent = _agent("kvtiers-p2p-rawbench")
        self.reg = self.agent.register_memory([(address(arena.buffer), len(arena.buffer), 0, "")], "DRAM", ["UCX"])
        if await self._ask([b"nhello", self.agent.get_agent_metadata()]) != b"ok":
            raise RuntimeError("raw peer refused NIXL")

    async def nixl_get(self, key: bytes, out: memoryview) -> None:
        if await self._ask([b"nget", key, b"%d" % self.address(out)]) != b"ok":
            raise RuntimeError("raw NIXL write failed")

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.sock is not None:
            self.sock.close(0)
            self.ctx.term()
        if self.agent is not None:
            self.agent.deregister_memory(self.reg, ["UCX"])
            self.agent = None


# -- kvtiers bench p2p ---------------------------------------------------------------------


def _runs(kw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``--backend`` -> one harness run per data path; without ``--config``, a peer server
    started here for the command (stopped when it ends)."""
    backend = kw.pop("backend")
    total = kw.pop("total")
    if total is not None:
        kw["total_bytes"] = total
    backends = ["zmq", "nixl"] if backend == "both" else [backend]
    if "nixl" in backends:
        from .nixl_path import available

        why = available()
        if why is not None:
            raise click.UsageError(f"--backend nixl: {why}")
    if kw["config_text"] or kw["config_file"]:
        return {b: {"backend": b} for b in backends}
    from .spawn import start_server

    biggest = max(kw["chunk_bytes"])
    per_round = kw["chunks"] * biggest if kw["chunks"] else max(kw["total_bytes"], biggest)
    server = start_server(capacity=2 * per_round + biggest, extra=["--nixl"] if "nixl" in backends else None)
    click.get_current_context().call_on_close(server.stop)
    return {b: {"host": "127.0.0.1", "port": server.port, "timeout": 120.0, "backend": b} for b in backends}


def _label(report: dict[str, Any]) -> None:
    """Rows carry ``backend`` (the run's label) and ``baseline_kind``, as before the harness."""
    for part in ("results", "concurrency"):
        for row in report[part]:
            row["backend"] = row.get("variant")
            raw_nixl = row["backend"] == "nixl" and row["op"] == "load"
            row["baseline_kind"] = "raw nixl ucx write" if raw_nixl else "raw zmq"
    for part in ("lookup", "submit_latency_us"):
        for row in report[part]:
            row["backend"] = row.get("variant")


bench_p2p = bench_command(
    "p2p", "p2p",
    "Loads and stores (pushes) through the p2p tier from a peer server in another process over "
    "loopback, against raw ZMQ DEALER/ROUTER send/recv of the same bytes (and raw NIXL UCX writes "
    "for NIXL loads) in the same run. The harness of 'kvtiers bench tier p2p', with a server started "
    "for the run unless --config names one.",
    default_total="128MiB",
    extra=[
        click.option("--backend", type=click.Choice(["zmq", "nixl", "both"]), default="zmq", show_default=True,
                     help="Data path(s): each measured in a run of its own; nixl loads against raw NIXL UCX writes."),
        click.option("--total", type=Size(), default=None, hidden=True, help="Alias of --total-bytes."),
    ],
    runs_from=_runs, post=_label,
)
