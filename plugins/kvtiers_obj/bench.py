"""Store/load throughput of the obj tier against plain aiobotocore on the same server.

One run: an arena of ``chunks`` slots of ``chunk_bytes`` random bytes; each round stores
them through the tier (fresh keys, one job, the tier's ``max_concurrency``), then puts the
same bytes with plain ``put_object`` calls at the same concurrency, then loads them through
the tier and gets them back with plain ``get_object`` + ``read()``. Tier and baseline
alternate which goes first from round to round; the medians over rounds are compared.
Everything written is deleted at the end. With ``backends`` (``--backend both``) one tier
per backend is opened on the same server and each takes its turn in every round against the
same baseline; the results then hold one row per op and backend (key ``backend``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import numpy as np

from kvtiers import Arena, Job, Namespace, TierContext, open_tier


def _wait(handle: Any, job_id: int, timeout: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        for r in handle.get_finished_jobs():
            if r.job_id == job_id:
                return r
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench job {job_id} did not finish in {timeout:g} s")
        time.sleep(0.002)  # an engine polls once per step; a tighter loop only steals the GIL


def run_bench(
    config: dict, *, chunk_bytes: int = 4 << 20, chunks: int = 16, rounds: int = 3, backends: list[str] | None = None
) -> dict:
    """Run the interleaved bench; return ``{"results": [...], ...}`` (see module doc).
    ``backends``: the tier backends to measure (default: the one in ``config``)."""
    if chunk_bytes <= 0 or chunk_bytes % 4096:
        raise ValueError(f"--chunk-bytes must be a positive multiple of 4096, got {chunk_bytes}")
    if rounds < 1 or chunks < 1:
        raise ValueError("--rounds and --chunks must be >= 1")
    arena = Arena.allocate(chunks, chunk_bytes)
    rng = np.random.default_rng(0)
    np.frombuffer(arena.buffer, dtype=np.uint8)[:] = rng.integers(0, 256, len(arena.buffer), dtype=np.uint8)
    ctx = TierContext(arena, Namespace({"kvtiers_bench": "obj", "chunk_bytes": chunk_bytes}))
    backends = backends or [config.get("backend", "aiobotocore")]
    handles: dict[str, Any] = {}
    try:
        for b in backends:
            handles[b] = open_tier("obj", {**config, "backend": b}, ctx)
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    handle = handles[backends[0]]
    tier = handle.tier
    conc = tier.max_concurrency
    run_id = uuid.uuid4().hex[:8]
    base_prefix = f"{tier.prefix + '/' if tier.prefix else ''}bench-baseline/{run_id}"
    client = tier._client  # same connection pool settings, a plain API
    payloads = [bytes(arena[i]) for i in range(chunks)]  # what a plain user would hand to put_object

    async def plain(op: str, r: int) -> None:
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                name = f"{base_prefix}/{r}/{i}"
                if op == "store":
                    await client.put_object(Bucket=tier.bucket, Key=name, Body=payloads[i])
                else:
                    resp = await client.get_object(Bucket=tier.bucket, Key=name)
                    async with resp["Body"] as body:
                        data = await body.read()
                    if len(data) != chunk_bytes:
                        raise RuntimeError(f"baseline object {name} is {len(data)} bytes")

        await asyncio.gather(*(one(i) for i in range(chunks)))

    job_ids = iter(range(1, 1 << 30))

    def ours(op: str, r: int, b: str) -> float:
        h = handles[b]
        keys = tuple(_key(run_id, b, r, i) for i in range(chunks))
        jid = next(job_ids)
        t0 = time.perf_counter()
        (h.submit_store if op == "store" else h.submit_load)(Job(jid, keys, tuple(range(chunks))))
        res = _wait(h, jid)
        dt = time.perf_counter() - t0
        if not res.ok:
            raise RuntimeError(f"tier ({b}) {op} failed: {res.error}")
        return dt

    def theirs(op: str, r: int, _: str) -> float:
        t0 = time.perf_counter()
        tier.run_sync(plain(op, r))
        return time.perf_counter() - t0

    total = chunks * chunk_bytes
    times: dict[str, dict[str, list[float]]] = {op: {w: [] for w in [*backends, "base"]} for op in ("store", "load")}
    try:
        for r in range(rounds):
            for op in ("store", "load"):
                order = [*((b, ours) for b in backends), ("base", theirs)]
                if r % 2:
                    order.reverse()
                for who, fn in order:
                    times[op][who].append(fn(op, r, who))
    finally:
        _cleanup(handles, client, tier, run_id, base_prefix, rounds, chunks)
    results = []
    for op in ("store", "load"):
        base = [total / t / 1e9 for t in times[op]["base"]]
        b = statistics.median(base)
        for who in backends:
            gbps = [total / t / 1e9 for t in times[op][who]]
            g = statistics.median(gbps)
            results.append({
                "op": op, "backend": who, "chunk_bytes": chunk_bytes, "gbps": round(g, 4),
                "baseline_gbps": round(b, 4), "ratio": round(g / b, 3) if b else None,
                "rounds_gbps": [round(x, 4) for x in gbps], "rounds_baseline_gbps": [round(x, 4) for x in base],
            })  # fmt: skip
    return {
        "results": results,
        "baseline": "aiobotocore put_object/get_object+read, same client settings and concurrency",
        "chunks": chunks, "rounds": rounds, "concurrency": conc, "endpoint": tier.endpoint_url,
    }  # fmt: skip


def _key(run_id: str, backend: str, r: int, i: int) -> bytes:
    return f"bench-{run_id}-{backend}-{r}-{i}".encode()


def _cleanup(handles: dict, client: Any, tier: Any, run_id: str, base_prefix: str, rounds: int, chunks: int) -> None:
    async def go() -> None:
        sem = asyncio.Semaphore(tier.max_concurrency)

        async def rm(coro: Any) -> None:
            async with sem:
                try:
                    await coro
                except Exception:
                    pass

        jobs = []
        for r in range(rounds):
            for i in range(chunks):
                for b, h in handles.items():
                    jobs.append(rm(h.tier.delete(_key(run_id, b, r, i))))
                jobs.append(rm(client.delete_object(Bucket=tier.bucket, Key=f"{base_prefix}/{r}/{i}")))
        await asyncio.gather(*jobs)

    try:
        tier.run_sync(go(), timeout=120)
    finally:
        for h in handles.values():
            h.close()


def format_table(report: dict) -> str:
    """The human-readable table ``kvtiers bench obj`` prints."""
    lines = [f"{'op':<6} {'backend':<12} {'chunk_bytes':>11} {'obj GB/s':>9} {'aiobotocore GB/s':>17} {'ratio':>7}"]
    for r in report["results"]:
        lines.append(
            f"{r['op']:<6} {r['backend']:<12} {r['chunk_bytes']:>11} {r['gbps']:>9.3f} {r['baseline_gbps']:>17.3f}"
            f" {r['ratio']:>6.2f}x"
        )
    lines.append(
        f"median of {report['rounds']} interleaved rounds, {report['chunks']} chunks per round, "
        f"concurrency {report['concurrency']}, endpoint {report['endpoint']}"
    )
    return "\n".join(lines)
