"""What the conformance suite asks of the obj tier outside an instance: a client built from
a tier's options (for ``conformance_corrupt``) and ``conformance_cleanup``, which deletes
every object of the suite's namespaces under the options' bucket and prefix."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from . import layout

#: the field every namespace of the conformance suite has in its description
SUITE_FIELD = "kvtiers_conformance"
DELETE_BATCH = 1000  #: S3's limit on keys per DeleteObjects


@contextlib.asynccontextmanager
async def client_for(config: dict) -> AsyncIterator[Any]:
    """An S3 client on the endpoint, region, credentials and timeouts of the tier options
    ``config`` (a session of the running loop's own)."""
    from . import client as c

    endpoint = config.get("endpoint_url") or config.get("endpoint_override")
    key_id, secret = config.get("aws_access_key_id"), config.get("aws_secret_access_key")
    session = c.get_session()
    unsigned = key_id is None and await session.get_credentials() is None
    cfg = c.client_config(
        max_pool_connections=2, connect_timeout=float(config.get("connect_timeout", 3.0)),
        read_timeout=float(config.get("read_timeout", 10.0)), max_attempts=3,
        addressing_style=config.get("addressing_style") or ("path" if endpoint else "auto"), unsigned=unsigned,
    )  # fmt: skip
    kwargs: dict[str, Any] = {"region_name": config.get("region") or "us-east-1", "config": cfg}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    if key_id is not None:
        kwargs.update(aws_access_key_id=key_id, aws_secret_access_key=secret)
    async with session.create_client("s3", **kwargs) as cl:
        yield cl


def run_own_loop(fn: Callable[[], Awaitable[Any]], timeout: float = 120.0) -> Any:
    """Run the coroutine ``fn()`` on a loop of its own, whatever loop the caller runs."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, fn()).result(timeout=timeout)


async def _suite_namespaces(cl: Any, bucket: str, prefix: str) -> list[str]:
    """Digests under ``prefix`` whose namespace document describes a namespace of the suite."""
    top = f"{prefix}/" if prefix else ""
    digests = []
    async for page in cl.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=top, Delimiter="/"):
        for p in page.get("CommonPrefixes", []):
            digest = p["Prefix"][len(top):].rstrip("/")
            try:
                r = await cl.get_object(Bucket=bucket, Key=layout.config_name(prefix, digest))
                async with r["Body"] as body:
                    doc = json.loads(await body.read())
            except Exception:  # no document, or not ours to read: not the suite's
                continue
            if isinstance(doc, dict) and SUITE_FIELD in (doc.get("fields") or {}):
                digests.append(digest)
    return digests


def cleanup(config: dict) -> int:
    """Delete every object under ``<prefix>/<digest>/`` of each namespace of the suite in
    the bucket of ``config``; return how many were deleted."""
    bucket = config["bucket"]
    prefix = layout.normalise_prefix(config.get("prefix", "kvtiers"))

    async def run() -> int:
        n = 0
        async with client_for(config) as cl:
            for digest in await _suite_namespaces(cl, bucket, prefix):
                pages = cl.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=layout.namespace_dir(prefix, digest))
                names = [o["Key"] async for page in pages for o in page.get("Contents", [])]
                for i in range(0, len(names), DELETE_BATCH):  # listed first: no listing of a changing prefix
                    batch = [{"Key": k} for k in names[i:i + DELETE_BATCH]]
                    await cl.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
                    n += len(batch)
        return n

    return run_own_loop(run)
