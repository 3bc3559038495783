"""The obj tier's raw baseline for ``kvtiers bench tier obj`` (alias ``kvtiers bench obj``).

The baseline is what a plain user of the same S3 client would write: ``put_object`` of the
chunk's bytes and ``get_object`` + ``read()``, on the tier's own aiobotocore client (same
endpoint, connection pool and retry settings) with as many calls in flight as the tier's
``max_concurrency``, under a prefix of its own. The tier adds its write-once HEAD, the
trailer checksum on store and its verification on load. The harness
(:mod:`kvtiers.commands.bench.harness`) runs both interleaved; afterwards everything the run wrote is
deleted. ``--backend both`` measures the aiobotocore and NIXL backends in the same rounds
against the same baseline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import click

from kvtiers import Baseline
from kvtiers.commands.bench.tier import bench_command


def baseline(tier: Any, chunk_bytes: int) -> Baseline:
    """Plain ``put_object`` / ``get_object`` on ``tier``'s client and bucket."""
    prefix = f"{tier.prefix + '/' if tier.prefix else ''}bench-baseline/{uuid.uuid4().hex[:8]}"
    written: set[str] = set()

    def name(key: bytes) -> str:
        return f"{prefix}/{key.hex()}"

    async def put(key: bytes, data: memoryview) -> None:
        n = name(key)
        written.add(n)
        await tier._client.put_object(Bucket=tier.bucket, Key=n, Body=bytes(data))

    async def get(key: bytes, out: memoryview) -> None:
        resp = await tier._client.get_object(Bucket=tier.bucket, Key=name(key))
        async with resp["Body"] as body:
            data = await body.read()
        if len(data) != len(out):
            raise RuntimeError(f"baseline object {name(key)} is {len(data)} bytes, expected {len(out)}")
        out[:] = data

    def close(_tier_keys: Sequence[bytes]) -> None:  # the harness deletes those through tier.delete
        async def go() -> None:
            sem = asyncio.Semaphore(tier.max_concurrency)

            async def rm(coro: Any) -> None:
                async with sem:
                    try:
                        await coro
                    except Exception:
                        pass

            await asyncio.gather(*(rm(tier._client.delete_object(Bucket=tier.bucket, Key=n)) for n in written))

        tier.run_sync(go(), timeout=300)

    return Baseline(name="aiobotocore put_object/get_object+read, same client and concurrency", put=put, get=get,
                    concurrency=tier.max_concurrency, close=close)


def _variants(kw: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    backend = kw.pop("backend")
    if backend == "config":
        return None
    names = ["aiobotocore", "nixl"] if backend == "both" else [backend]
    return {b: {"backend": b} for b in names}


def _label_backends(report: dict[str, Any]) -> None:
    """Rows of a ``--backend`` run carry ``backend`` (the variant's name), as before."""
    for row in report["results"]:
        if row.get("variant"):
            row["backend"] = row["variant"]


bench_obj = bench_command(
    "obj", "obj",
    "Store and load throughput of the obj tier against plain aiobotocore put/get of the same sizes at the "
    "same concurrency, on the same server, in one run. The same harness as 'kvtiers bench tier obj'.",
    default_chunk=("4MiB",), default_chunks=16,
    extra=[click.option("--backend", type=click.Choice(["config", "aiobotocore", "nixl", "both"]), default="config",
                        show_default=True,
                        help="Tier backend(s) to measure; 'both' runs aiobotocore and nixl in one run.")],
    variants_from=_variants, post=_label_backends,
)
