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
(:mod:`kvtiers.commands.bench.harness`) runs tier and baseline interleaved and compares medians.

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
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import click

from kvtiers import Baseline
from kvtiers.commands.bench.tier import Size, bench_command

from .wakepipe import WakePipe


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

    from .client import GET_BATCH, WINDOW
    from .protocol import parse_endpoint

    eps = [parse_endpoint(u) for u in tier.peers]
    if not eps or not all(ep.loopback and ep.url.startswith("tcp://") for ep in eps):
        return None
    arena = tier.ctx.arena
    proc, endpoint = _start_raw(len(arena) * arena.slot_bytes + chunk_bytes)  # a round's chunks and one more
    raw = _RawClient(endpoint, chunk_bytes, proc)
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
    # in flight as the tier: WINDOW PUTs; GETs of GET_BATCH keys, as many as the server allows
    gets = max((p.max_inflight for p in tier._client.peers.values() if p.ready), default=16)
    return Baseline(name=name, put=raw.put, get=raw.nixl_get if nixl else raw.get, concurrency=WINDOW,
                    load_concurrency=GET_BATCH * min(WINDOW, gets), close=close)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class _RawClient:
    """One DEALER owned by a thread of its own (as the tier's client owns its sockets), with
    coroutine calls for the harness: requests are pipelined and matched to replies by request
    id; gets made in the same loop turn go out in one request of up to ``GET_BATCH`` keys,
    answered chunk by chunk (as the tier batches its GETs); each chunk is received straight
    into the caller's buffer (``recv_into`` the arena slot) by the thread, which hands the
    finished calls back to the loop in batches. Calls fail if the raw peer's process exits."""

    def __init__(self, endpoint: str, chunk_bytes: int, proc: subprocess.Popen) -> None:
        import zmq

        self.proc = proc
        self.size = str(chunk_bytes).encode()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outbox: deque[tuple[list[Any], deque]] = deque()  # (frames, [(out, future)] in reply order)
        self.waiting: dict[bytes, deque[tuple[memoryview | None, asyncio.Future]]] = {}
        self.batch: list[tuple[bytes, memoryview, asyncio.Future]] = []
        self.rids = itertools.count(1)
        self.agent: Any = None
        self._wake = WakePipe()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="kvtiers-p2p-rawbench", daemon=True)
        self.thread.start()

    # -- the loop side -------------------------------------------------------------------
    def _send(self, frames: list[Any], calls: deque) -> None:
        self.loop = asyncio.get_running_loop()
        self.outbox.append((frames, calls))
        self._wake.wake()

    async def _ask(self, frames: list[Any], out: memoryview | None = None) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._send([frames[0], b"%d" % next(self.rids), *frames[1:]], deque([(out, fut)]))
        return await fut

    def _flush(self) -> None:
        from .client import GET_BATCH

        batch, self.batch = self.batch, []
        for i in range(0, len(batch), GET_BATCH):
            part = batch[i : i + GET_BATCH]
            self._send([b"mget", b"%d" % next(self.rids), *(k for k, _, _ in part)],
                       deque((out, fut) for _, out, fut in part))

    @staticmethod
    def _finish(done: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
        for fut, got, err in done:
            if fut.done():
                continue
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(got)

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        s = self.sock
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        check = 0.0
        while not self._stop:
            # NIXL agents run without a progress thread: the target progresses UCX while it
            # waits for writes, as the tier's client does
            nixl = self.agent is not None and bool(self.waiting)
            poller.poll(1 if nixl else 200)
            if nixl:
                self.agent.get_new_notifs()
            self._wake.drain()
            while self.outbox:
                frames, calls = self.outbox.popleft()
                self.waiting[frames[1]] = calls
                s.send_multipart(frames)
            done: list[tuple[asyncio.Future, Any, BaseException | None]] = []
            while True:
                try:
                    rid = s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                q = self.waiting.get(rid)
                if q is None:
                    while s.getsockopt(zmq.RCVMORE):
                        s.recv()
                    continue
                out, fut = q.popleft()
                if not q:
                    del self.waiting[rid]
                done.append((fut, s.recv_into(out) if out is not None else s.recv(), None))
            now = time.monotonic()
            if now > check:
                check = now + 0.2
                if self.proc.poll() is not None:  # the raw peer is gone: fail what waits for it
                    why = RuntimeError(f"the raw peer exited with status {self.proc.returncode}")
                    done += [(fut, None, why) for q in self.waiting.values() for _, fut in q]
                    self.waiting.clear()
            if done and self.loop is not None:
                self.loop.call_soon_threadsafe(self._finish, done)
        s.close(0)
        self.ctx.term()

    async def ping(self) -> None:
        if await self._ask([b"ping", self.size]) != b"ok":
            raise RuntimeError("raw peer did not answer")

    async def put(self, key: bytes, data: memoryview) -> None:
        if await self._ask([b"put", self.size, key, data]) != b"ok":
            raise RuntimeError("raw peer refused a put")

    async def get(self, key: bytes, out: memoryview) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.batch.append((key, out, fut))
        if len(self.batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        n = await fut
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
        self._stop = True
        self._wake.wake()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10)
        self._wake.close()
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
    # one round's chunks and one more: from the second round of each chunk size on, a PUT
    # reuses a buffer an eviction freed, as in a peer cache that has filled up, instead of
    # faulting in fresh memory (which more than halves the push rate of a fresh server)
    server = start_server(capacity=per_round + biggest, extra=["--nixl"] if "nixl" in backends else None)
    click.get_current_context().call_on_close(server.stop)
    _warm(server.port, kw["chunk_bytes"], per_round)
    return {b: {"host": "127.0.0.1", "port": server.port, "timeout": 120.0, "backend": b} for b in backends}


def _warm(port: int, sizes: Sequence[int], per_round: int) -> None:
    """Push one round's bytes of each chunk size to the server, unmeasured, so its buffer
    pools are faulted in before the first round, as the raw peer's are (a fresh server's
    first pushes fault fresh memory in at about half the rate)."""
    from kvtiers import Arena, Job, Namespace, TierContext, open_tier

    for size in sorted(set(sizes)):
        n = max(1, per_round // size)
        arena = Arena.allocate(min(n, 64), size)
        h = open_tier("p2p", {"host": "127.0.0.1", "port": port, "timeout": 120.0},
                      TierContext(arena, Namespace({"kvtiers-bench": "warm-up", "chunk": size})))
        try:
            for job, first in enumerate(range(0, n, len(arena))):
                keys = tuple(b"warm-%d" % i for i in range(first, min(n, first + len(arena))))
                h.submit_store(Job(job, keys, tuple(range(len(keys)))))
                deadline = time.monotonic() + 120
                while not (done := h.get_finished_jobs()):
                    if time.monotonic() > deadline:
                        raise RuntimeError("bench p2p: the server did not take the warm-up pushes")
                    time.sleep(0.001)
                if not done[0].ok:
                    raise RuntimeError(f"bench p2p: warm-up push failed: {done[0].error}")
        finally:
            h.close()


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
