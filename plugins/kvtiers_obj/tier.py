"""The ``obj`` tier: KV chunks as objects in an S3-compatible bucket.

Built on :class:`kvtiers.AsyncTier` (job tracking, concurrency limit, per-operation
timeouts, non-blocking lookup with positive and negative caches); this module supplies the
coroutines. Object names and the object format are in :mod:`kvtiers_obj.layout`. The
aiobotocore client lives on the SDK's I/O loop; the plugin module imports without
aiobotocore, and opening a tier without it is a clear error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from kvtiers import AsyncTier, ConfigError, TierError, hookimpl
from kvtiers.types import Namespace, TierContext, check_keys

from . import layout
from .capacity import PIN_SHARE, LruBytes, Pins

log = logging.getLogger("kvtiers.obj")

MIN_PART_SIZE = 5 << 20  # S3's smallest part (all but the last)
PART_PARALLEL = 4  # parts of one chunk in flight at once (uploads and ranged GETs)
PIECE = 1 << 20
PROBE_TIMEOUT = 3.0  # a HEAD for lookup unanswered this long counts as a miss


def _tname() -> str:
    return "tier 'obj'"


class S3Timeout(ConnectionError):
    """An S3 operation that got no answer in time; the message names the operation, the
    object, the endpoint and the bound. (Not a ``TimeoutError``: that would read as the
    base class's own deadline and lose the message.)"""


class OtherChunkSize(ValueError):
    """The key's object holds a valid chunk of another size (an arena of another slot size
    on the same namespace): not this instance's to load, replace or delete."""


async def run_all(coros: Sequence[Awaitable[Any]], limit: int) -> list[Any]:
    """Run ``coros`` at most ``limit`` at a time; on the first error or on cancellation,
    cancel the others and wait for them before raising (so none touches a buffer later)."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[Any]) -> Any:
        async with sem:
            return await c

    tasks = [asyncio.ensure_future(one(c)) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Target:
    """The virtual object ``payload || trailer`` being read: writes pieces at offsets."""

    def __init__(self, out: memoryview) -> None:
        self.out = out
        self.n = len(out)
        self.trailer = bytearray(layout.TRAILER_BYTES)
        self.size = layout.object_size(self.n)

    def write_at(self, off: int, chunk: bytes | memoryview) -> None:
        mv = memoryview(chunk)
        end = off + len(mv)
        if end > self.size:
            raise layout.CorruptObject(f"object is longer than {self.size} bytes")
        if off < self.n:
            k = min(end, self.n) - off
            self.out[off : off + k] = mv[:k]
            mv, off = mv[k:], off + k
        if len(mv):
            t = off - self.n
            self.trailer[t : t + len(mv)] = mv


def _bounds(payload: int, size: int, step: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of an object of ``size`` bytes holding ``payload`` bytes, ``step``
    apart; the trailer rides with the last piece (S3 parts may be larger than ``step``)."""
    out = [(o, min(o + step, payload)) for o in range(0, payload, step)]
    out[-1] = (out[-1][0], size)
    return out


def _slices(parts: Sequence[memoryview | bytes], start: int, end: int) -> list[memoryview]:
    """The pieces of the concatenation of ``parts`` covering ``[start, end)``, no copies."""
    out = []
    pos = 0
    for p in parts:
        mv = memoryview(p)
        lo, hi = max(start, pos), min(end, pos + len(mv))
        if lo < hi:
            out.append(mv[lo - pos : hi - pos])
        pos += len(mv)
    return out


class ObjTier(AsyncTier):
    """Chunks in an S3-compatible bucket under ``prefix/<namespace digest>/``.

    Options (see docs/obj.md): ``bucket`` (required), ``prefix``, ``endpoint_url``
    (alias ``endpoint_override``), ``region``, ``aws_access_key_id`` /
    ``aws_secret_access_key`` (else the default credential chain; with none found requests
    go unsigned), ``addressing_style`` (``path``/``virtual``/``auto``; default ``path``
    with an ``endpoint_url``, else ``auto``), ``max_concurrency``, ``part_size`` (multipart
    upload and ranged GETs above it), ``connect_timeout``, ``read_timeout``,
    ``max_attempts``, ``op_timeout`` (bound on one chunk's store or load), ``create_bucket``,
    ``max_bytes`` (LRU deletion by this instance), ``backend`` (``aiobotocore`` or ``nixl``;
    NIXL's canary runs in a child process first, and if it crashes or hangs the tier uses
    aiobotocore with one warning, or with ``nixl_strict`` fails to open). ``data_path`` and
    the gauge ``kvtiers_tier_data_path{tier, path}`` say which path is in use.
    """

    levels = frozenset({"core", "durable", "shared", "bounded"})

    def __init__(
        self,
        ctx: TierContext,
        *,
        bucket: str,
        prefix: str = "kvtiers",
        endpoint_url: str | None = None,
        endpoint_override: str | None = None,
        region: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        addressing_style: Literal["path", "virtual", "auto"] | None = None,
        max_concurrency: int = 16,
        part_size: int = 16 << 20,
        connect_timeout: float = 3.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        op_timeout: float = 30.0,
        create_bucket: bool = False,
        max_bytes: int | None = None,
        backend: Literal["aiobotocore", "nixl"] = "aiobotocore",
        nixl_strict: bool = False,
    ) -> None:
        super().__init__(ctx)
        t = _tname()
        if endpoint_override is not None:
            if endpoint_url is not None and endpoint_url != endpoint_override:
                raise ConfigError(f"{t}: give endpoint_url or its alias endpoint_override, not two different ones")
            endpoint_url = endpoint_override
        if not 3 <= len(bucket) <= 63:
            raise ConfigError(f"{t}: option 'bucket' must be 3-63 characters, got {bucket!r}")
        try:
            self.prefix = layout.normalise_prefix(prefix)
        except ValueError as e:
            raise ConfigError(f"{t}: option 'prefix': {e}") from None
        if (aws_access_key_id is None) != (aws_secret_access_key is None):
            raise ConfigError(f"{t}: give both aws_access_key_id and aws_secret_access_key, or neither")
        if max_concurrency < 1:
            raise ConfigError(f"{t}: option 'max_concurrency' must be >= 1, got {max_concurrency}")
        if part_size < MIN_PART_SIZE:
            raise ConfigError(f"{t}: option 'part_size' must be >= {MIN_PART_SIZE} (S3's minimum), got {part_size}")
        timeouts = {"connect_timeout": connect_timeout, "read_timeout": read_timeout, "op_timeout": op_timeout}
        for name, v in timeouts.items():
            if v <= 0:
                raise ConfigError(f"{t}: option {name!r} must be > 0, got {v}")
        if max_attempts < 1:
            raise ConfigError(f"{t}: option 'max_attempts' must be >= 1, got {max_attempts}")
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"{t}: option 'max_bytes' must be >= 0, got {max_bytes}")
        if backend == "nixl":
            from .nixl_path import check_nixl

            check_nixl()  # raises TierError naming the missing piece
            from kvtiers_nixl import use_nixl

            if not use_nixl(t, fallback="aiobotocore", backend="OBJ", strict=nixl_strict):
                backend = "aiobotocore"
        from kvtiers_nixl import PathGauge

        self.data_path = backend
        self._path_gauge = PathGauge(ctx, backend)
        try:
            from . import client as c
        except ImportError as e:
            raise TierError(
                f"{t} needs aiobotocore ({e.name or e} is not installed): pip install 'kvtiers[obj]'"
            ) from None
        self._c = c
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.addressing_style = addressing_style or ("path" if endpoint_url else "auto")
        self.max_concurrency = max_concurrency
        self.part_size = part_size
        self.op_timeout = op_timeout
        self.max_bytes = max_bytes
        self.backend = backend
        self.digest = ctx.namespace.digest
        self.unsigned = False
        self._where = endpoint_url or f"AWS S3 ({region or 'default region'})"
        self._timeouts = (connect_timeout, read_timeout, max_attempts)
        self._creds = (aws_access_key_id, aws_secret_access_key)
        self._create_bucket = create_bucket
        self._client: Any = None
        self._client_cm: Any = None
        self._nixl: Any = None  # kvtiers_obj.nixl_path.NixlObjPath with backend "nixl"
        self._busy: dict[bytes, int] = {}  # key -> loads in flight (loop thread only)
        self._bg: set[asyncio.Task] = set()
        self._cap_lock = threading.Lock()
        self._lru = LruBytes(max_bytes) if max_bytes is not None else None
        # lifetime pins (pin/unpin hooks): at most PIN_SHARE of max_bytes, so eviction keeps the bound
        self.pins = Pins(None if max_bytes is None else int(PIN_SHARE * max_bytes))
        self._size = layout.object_size(ctx.arena.slot_bytes)  # every object this instance writes or loads
        self._warned_size = False
        open_bound = 3 * op_timeout + 10
        try:
            self.run_sync(asyncio.wait_for(self._open(), open_bound), timeout=open_bound + 5)
        except BaseException as e:
            try:
                self.run_sync(self._close_client(), timeout=10)
            except Exception:
                pass
            if isinstance(e, (asyncio.TimeoutError, concurrent.futures.TimeoutError)):
                raise TierError(
                    f"{t}: opening (credentials, bucket, namespace document) at {self._where} got no answer "
                    f"within {open_bound:g} s (3 x op_timeout + 10 s)"
                ) from None
            raise

    @classmethod
    def bench_baseline(cls, tier: ObjTier, chunk_bytes: int):
        """Plain put_object/get_object on ``tier``'s client, bucket and concurrency, for
        ``kvtiers bench tier obj`` (see :mod:`kvtiers_obj.bench`)."""
        from .bench import baseline

        return baseline(tier, chunk_bytes)

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace: Namespace, key: bytes) -> None:
        """Damage the stored object of ``key`` in place, as bit rot would: rewrite it with
        three payload bytes flipped, same length, same content type and user metadata (the
        trailer is left as it was, so a load must fail the key). ``config``: the options of
        an instance that stored ``key``; ``namespace``: its namespace. For the conformance
        suite (rule 4)."""
        from .conformance import client_for, run_own_loop

        prefix = layout.normalise_prefix(config.get("prefix", "kvtiers"))
        bucket = config["bucket"]
        name = layout.object_name(prefix, namespace.digest, key)

        async def damage() -> None:
            async with client_for(config) as cl:
                r = await cl.get_object(Bucket=bucket, Key=name)
                async with r["Body"] as b:
                    body = bytearray(await b.read())
                n = len(body) - layout.TRAILER_BYTES
                if n <= 0:
                    raise ValueError(f"s3://{bucket}/{name} is {len(body)} bytes: not a chunk object")
                for off in {0, n // 2, n - 1}:
                    body[off] ^= 0xFF
                extra = {"ContentType": r["ContentType"]} if r.get("ContentType") else {}
                await cl.put_object(Bucket=bucket, Key=name, Body=bytes(body), Metadata=r.get("Metadata") or {},
                                    **extra)

        run_own_loop(damage)

    @classmethod
    def conformance_cleanup(cls, config: dict) -> None:
        """After a conformance run: delete every object of the suite's namespaces (those
        whose document's fields hold ``kvtiers_conformance``) under the bucket and prefix of
        ``config``; nothing else is touched."""
        from .conformance import cleanup

        cleanup(config)

    def __repr__(self) -> str:
        return f"<ObjTier s3://{self.bucket}/{layout.namespace_dir(self.prefix, self.digest)} at {self._where}>"

    # -- opening ----------------------------------------------------------------------
    async def _open(self) -> None:
        c = self._c
        session = c.shared_session()
        key_id, secret = self._creds
        if key_id is None:
            self.unsigned = await c.chain_credentials(session) is None
        region = self.region or session.get_config_variable("region") or "us-east-1"
        self.region = region
        connect_timeout, read_timeout, max_attempts = self._timeouts
        cfg = c.client_config(
            max_pool_connections=self.max_concurrency * 2,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            addressing_style=self.addressing_style,
            unsigned=self.unsigned,
        )
        kwargs: dict[str, Any] = {"region_name": region, "config": cfg}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if key_id is not None:
            kwargs["aws_access_key_id"] = key_id
            kwargs["aws_secret_access_key"] = secret
        try:
            self._client_cm = session.create_client("s3", **kwargs)
            self._client = await self._client_cm.__aenter__()
        except (c.BotoCoreError, ValueError) as e:
            raise ConfigError(f"{_tname()}: cannot create an S3 client for {self._where}: {e}") from None
        await self._check_bucket()
        await self._check_namespace()
        if self._lru is not None:
            await self._seed_capacity()
        if self.backend == "nixl":
            from .nixl_path import NixlObjPath

            self._nixl = NixlObjPath(
                bucket=self.bucket, endpoint_url=self.endpoint_url, region=region,
                credentials=self._creds, addressing_style=self.addressing_style,
                slot_bytes=self.ctx.arena.slot_bytes, max_concurrency=self.max_concurrency, part_size=self.part_size,
            )  # fmt: skip

    def _translate(self, e: BaseException, what: str) -> Exception:
        """A one-line ConfigError/TierError for an error met while opening."""
        c, t = self._c, _tname()
        if isinstance(e, S3Timeout):
            return TierError(f"{t}: {what}: {e}")
        if isinstance(e, c.ClientError):
            status, code = c.http_status(e), c.error_code(e)
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                hint = (
                    "no credentials were found, so requests went unsigned; set aws_access_key_id/aws_secret_access_key"
                    if self.unsigned
                    else "check aws_access_key_id / aws_secret_access_key (or the AWS credential chain)"
                )
                why = code or status
                return TierError(f"{t}: access denied to bucket {self.bucket!r} at {self._where} ({why}): {hint}")
            msg = e.response.get("Error", {}).get("Message", "")
            return TierError(f"{t}: {what} at {self._where} failed: {code or status} {msg}".rstrip())
        return TierError(f"{t}: cannot reach {self._where} ({what}): {type(e).__name__}: {e}")

    async def _call(self, fn: Callable[..., Awaitable[Any]], **kwargs: Any) -> Any:
        """``fn(**kwargs)`` (a client method) within ``op_timeout``; see :meth:`_timed`."""
        target = f"s3://{kwargs.get('Bucket', self.bucket)}/{kwargs.get('Key', '')}".rstrip("/")
        return await self._timed(fn.__name__, target, fn(**kwargs), self.op_timeout)

    async def _timed(self, what: str, target: str, aw: Awaitable[Any], budget: float) -> Any:
        """Await ``aw`` for at most ``budget`` seconds. No answer in time, ours or botocore's
        (read or connect timeout after its attempts), is an :class:`S3Timeout` naming
        ``what``, ``target``, the endpoint and the bound that ran out."""
        try:
            return await asyncio.wait_for(aw, budget)
        except asyncio.TimeoutError:
            bound = f"{budget:.3g} s (op_timeout={self.op_timeout:g} s)"
        except Exception as e:
            kind = self._c.timeout_kind(e)
            if kind is None:
                raise
            connect, read, attempts = self._timeouts
            bound = f"{kind}_timeout={read if kind == 'read' else connect:g} s, {attempts} attempt(s)"
        raise S3Timeout(f"{what} of {target} at {self._where} timed out: no answer within {bound}")

    def _job_budget(self) -> float:
        """The bound on one key's store or load: a little under ``op_timeout``, so this
        tier's timeout, which says what timed out, fires before the base class's."""
        return self.op_timeout - min(1.0, 0.2 * self.op_timeout)

    async def _check_bucket(self) -> None:
        c, cl = self._c, self._client
        try:
            await self._call(cl.head_bucket, Bucket=self.bucket)
            return
        except Exception as e:
            if not (isinstance(e, c.ClientError) and (c.http_status(e) == 404 or c.error_code(e) == "NoSuchBucket")):
                raise self._translate(e, "checking the bucket") from None
        if not self._create_bucket:
            raise ConfigError(
                f"{_tname()}: bucket {self.bucket!r} does not exist at {self._where} "
                "(create it, or set \"create_bucket\": true)"
            )
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1" and not self.endpoint_url:
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            await self._call(cl.create_bucket, **kwargs)
            log.info("obj: created bucket %s at %s", self.bucket, self._where)
        except Exception as e:
            if c.error_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._translate(e, f"creating bucket {self.bucket!r}") from None

    async def _check_namespace(self) -> None:
        c, cl = self._c, self._client
        name = layout.config_name(self.prefix, self.digest)
        ns = self.ctx.namespace
        for _ in range(3):
            try:
                r = await self._call(cl.get_object, Bucket=self.bucket, Key=name)
                async with r["Body"] as body:
                    raw = await self._timed("reading", f"s3://{self.bucket}/{name}", body.read(), self.op_timeout)
            except Exception as e:
                if not c.is_missing(e):
                    raise self._translate(e, f"reading s3://{self.bucket}/{name}") from None
            else:
                try:
                    ns.check_document(raw, where=f"s3://{self.bucket}/{name}")
                except ValueError as e:
                    raise ConfigError(f"{_tname()}: {e}") from None
                return
            try:
                await self._call(
                    cl.put_object,
                    Bucket=self.bucket,
                    Key=name,
                    Body=ns.document_bytes(),
                    ContentType="application/json",
                    IfNoneMatch="*",
                )
                return
            except Exception as e:
                if not c.is_exists(e):
                    raise self._translate(e, f"writing s3://{self.bucket}/{name}") from None
        raise TierError(f"{_tname()}: s3://{self.bucket}/{name} could not be read or written")

    async def _seed_capacity(self) -> None:
        """Fill the LRU from one listing of the namespace, oldest first."""
        found: list[tuple[Any, str, bytes, int]] = []
        pfx = layout.namespace_dir(self.prefix, self.digest)
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=pfx):
                for o in page.get("Contents", []):
                    key = layout.key_from_name(o["Key"])
                    if key is not None and int(o.get("Size", 0)) == self._size:  # others' sizes: not ours
                        found.append((o.get("LastModified"), o["Key"], key, int(o.get("Size", 0))))
        except Exception as e:
            raise self._translate(e, f"listing s3://{self.bucket}/{pfx}") from None
        found.sort(key=lambda f: (f[0] is None, f[0], f[1]))
        with self._cap_lock:
            for _, _, key, size in found:
                self._lru.add(key, size)

    # -- helpers ------------------------------------------------------------------------
    def _name(self, key: bytes) -> str:
        return layout.object_name(self.prefix, self.digest, key)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _drop(self, keys: Sequence[bytes], reason: str) -> list[bytes]:
        """Delete the objects of ``keys``; report those deleted through ``ctx.removed``."""
        done: list[bytes] = []

        async def one(k: bytes) -> None:
            try:
                await self._call(self._client.delete_object, Bucket=self.bucket, Key=self._name(k))
                done.append(k)
            except Exception as e:
                log.warning("obj: could not delete %s chunk %s: %s", reason, k.hex(), e)

        await asyncio.gather(*(one(k) for k in keys))
        if self._lru is not None:
            with self._cap_lock:
                for k in keys:
                    self._lru.discard(k)
        with self._cap_lock:  # a chunk deleted as corrupt holds no pin (an evicted one never had one)
            self.pins.remove(done)
        if done:  # MISS from now on, also for a job in flight that holds them; to ctx.removed
            self.evicted(done, reason)
        kept = [k for k in keys if k not in done]
        if kept:
            self.forget(kept)
        return done

    async def _record(self, key: bytes, size: int) -> None:
        """Note ``key`` as most recently used; evict over ``max_bytes``."""
        if self._lru is None:
            return
        with self._cap_lock:
            self._lru.add(key, size)
            self.pins.expire()  # count the pins whose time is over (they no longer hold either way)
            victims = self._lru.victims(busy=set(self._busy) | {key}, held=self.pins.held)
        if victims:
            await self._drop(victims, "evicted")

    async def _head_size(self, name: str) -> int | None:
        try:
            r = await self._client.head_object(Bucket=self.bucket, Key=name)
        except Exception as e:
            if self._c.is_missing(e):
                return None
            raise
        return int(r["ContentLength"])

    # -- the AsyncTier coroutines ---------------------------------------------------------
    async def exists(self, key: bytes) -> bool:
        """HEAD the chunk: present with this arena's object size (a chunk of another size is
        a miss); a server that fails or does not answer within ``PROBE_TIMEOUT`` answers
        ``False`` (a miss for ``negative_ttl``, then asked again)."""
        self._path_gauge.report()
        try:
            head = self._head_size(self._name(key))
            return await asyncio.wait_for(head, min(self.op_timeout, PROBE_TIMEOUT)) == self._size
        except Exception as e:
            log.debug("obj: HEAD %s failed: %s", key.hex(), e)
            return False

    def _where_is(self, key: bytes) -> str:
        return f"s3://{self.bucket}/{self._name(key)}"

    async def put(self, key: bytes, data: memoryview) -> None:
        self._path_gauge.report()
        await self._timed("store", self._where_is(key), self._put(key, data), self._job_budget())

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        self._path_gauge.report()
        return await self._timed("load", self._where_is(key), self._get_into(key, out), self._job_budget())

    async def _put(self, key: bytes, data: memoryview) -> None:
        size = layout.object_size(len(data))
        if self.max_bytes is not None and size > self.max_bytes:
            raise ValueError(f"chunk of {size} bytes exceeds max_bytes={self.max_bytes}")
        with self._lock:
            known = key in self._present
        if known:  # write-once: stored or seen by this instance
            await self._record(key, size)
            return
        name = self._name(key)
        found = await self._head_size(name)
        if found == size:
            await self._record(key, size)
            return
        if found is not None:  # another object blocks the write-once PUT
            other = await self._other_size(name, key, found)
            if other is not None:
                raise OtherChunkSize(
                    f"s3://{self.bucket}/{name} holds this key as a chunk of {other} bytes, this arena's slots are "
                    f"{len(data)} bytes (another slot size on the same namespace): left alone"
                )
            await self._drop([key], "corrupt")  # short, long or from another namespace
        trailer = layout.make_trailer(key, data, self.digest)
        if self._nixl is not None:
            await self._nixl.write(name, data, trailer)
        elif len(data) > self.part_size:
            await self._put_multipart(name, [data, trailer], size)
        else:
            body = self._c.ChunkBody([data, trailer])
            try:
                await self._client.put_object(Bucket=self.bucket, Key=name, Body=body, IfNoneMatch="*")
            except Exception as e:
                if not self._c.is_exists(e):  # someone else stored it first: fine
                    raise
        await self._record(key, size)

    async def _put_multipart(self, name: str, parts: Sequence[memoryview | bytes], size: int) -> None:
        cl = self._client
        up = await cl.create_multipart_upload(Bucket=self.bucket, Key=name)
        upload_id = up["UploadId"]
        completed = False
        try:
            n = size - layout.TRAILER_BYTES
            bounds = [(i, lo, hi) for i, (lo, hi) in enumerate(_bounds(n, size, self.part_size), 1)]

            async def part(num: int, lo: int, hi: int) -> dict:
                body = self._c.ChunkBody(_slices(parts, lo, hi))
                r = await cl.upload_part(Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=num, Body=body)
                return {"ETag": r["ETag"], "PartNumber": num}

            done = await run_all([part(*b) for b in bounds], PART_PARALLEL)
            try:
                await cl.complete_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": done}, IfNoneMatch="*"
                )
                completed = True
            except Exception as e:
                if not self._c.is_exists(e):
                    raise
        finally:
            if not completed:
                self._spawn(self._abort(name, upload_id))

    async def _abort(self, name: str, upload_id: str) -> None:
        try:
            await self._call(self._client.abort_multipart_upload, Bucket=self.bucket, Key=name, UploadId=upload_id)
        except Exception as e:  # a bucket lifecycle rule cleans up what is left
            log.debug("obj: abort of upload %s for %s failed: %s", upload_id, name, e)

    async def _get_into(self, key: bytes, out: memoryview) -> bool:
        name = self._name(key)
        target = _Target(out)
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            if self._nixl is not None:
                found = await self._get_nixl(key, name, target)
            elif target.n > self.part_size:
                found = await self._get_ranged(name, target)
            else:
                found = await self._get_range(name, target, 0, target.size, ranged=False)
            if not found:
                return False
            layout.check_trailer(key, out, target.trailer, self.digest)
        except layout.CorruptObject as e:
            if isinstance(e, layout.SizeMismatch):
                other = await self._other_size(name, key, e.size)
                if other is not None:  # not corrupt: a chunk of another size, not ours to touch
                    self._note_other_size(name, other)
                    return False
            log.warning("obj: chunk %s in s3://%s/%s is corrupt (%s): deleting it", key.hex(), self.bucket, name, e)
            await self._drop([key], "corrupt")
            raise layout.CorruptObject(str(e)) from None
        finally:
            n = self._busy.pop(key) - 1
            if n:
                self._busy[key] = n
        await self._record(key, target.size)
        return True

    async def _other_size(self, name: str, key: bytes, size: int | None) -> int | None:
        """The payload size of the chunk of another size stored as ``name`` (``size``: the
        object's size, when known), or ``None`` if the object is not one (corrupt, from
        another namespace, gone). Errors asking are raised: nothing is deleted on a guess."""
        if size is None:
            size = await self._head_size(name)
        if size is None or size <= layout.TRAILER_BYTES or size == self._size:
            return None
        try:
            r = await self._client.get_object(Bucket=self.bucket, Key=name,
                                              Range=f"bytes={size - layout.TRAILER_BYTES}-{size - 1}")
        except Exception as e:
            if self._c.is_missing(e) or self._c.error_code(e) == "InvalidRange":
                return None
            raise
        async with r["Body"] as body:
            tail = await body.read()
        n = layout.tail_payload_length(key, tail, self.digest)
        return n if n is not None and layout.object_size(n) == size else None

    def _note_other_size(self, name: str, payload: int) -> None:
        msg = ("obj: s3://%s/%s holds a chunk of %d bytes, this arena's slots are %d bytes: another slot size "
               "on the same namespace; such chunks are misses here and left alone (put the chunk size in the "
               "namespace so the two use different prefixes)")
        args = (self.bucket, name, payload, self.ctx.arena.slot_bytes)
        if not self._warned_size:
            self._warned_size = True
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    async def _get_nixl(self, key: bytes, name: str, target: _Target) -> bool:
        """Load through NIXL; a failed transfer is classified by a HEAD (missing -> ``False``,
        wrong size -> corrupt, else the error stands)."""
        from .nixl_path import TransferFailed

        try:
            target.trailer[:] = await self._nixl.read(name, target.out)
        except TransferFailed:
            size = await self._head_size(name)
            if size is None:
                return False
            if size != target.size:
                raise layout.SizeMismatch(f"object is {size} bytes, expected {target.size}", size) from None
            raise
        return True

    async def _get_range(self, name: str, target: _Target, lo: int, hi: int, ranged: bool = True) -> bool:
        """GET ``[lo, hi)`` of ``name`` into ``target``; ``False`` if the object is missing."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": name}
        if ranged:
            kwargs["Range"] = f"bytes={lo}-{hi - 1}"
        try:
            r = await self._client.get_object(**kwargs)
        except Exception as e:
            if self._c.is_missing(e):
                return False
            if self._c.error_code(e) == "InvalidRange":
                raise layout.SizeMismatch("object is shorter than expected") from None
            raise
        async with r["Body"] as body:
            total = r.get("ContentRange", "").rpartition("/")[2] if ranged else ""
            length = int(r["ContentLength"])
            if total.isdigit() and int(total) != target.size:
                raise layout.SizeMismatch(f"object is {total} bytes, expected {target.size}", int(total))
            if length != hi - lo:
                raise layout.SizeMismatch(f"object is {length} bytes, expected {hi - lo}", None if ranged else length)
            await self._stream(body, target, lo, hi)
        return True

    async def _stream(self, body: Any, target: _Target, off: int, end: int) -> None:
        """Copy the response body into ``target`` piece by piece, as it arrives."""
        content = getattr(getattr(body, "raw_stream", None), "content", None)
        while True:
            chunk = await (content.readany() if content is not None else body.read(PIECE))
            if not chunk:
                break
            if off + len(chunk) > end:
                raise layout.CorruptObject(f"object is longer than {target.size} bytes")
            target.write_at(off, chunk)
            off += len(chunk)
        if off != end:
            raise layout.CorruptObject(f"object ended after {off} bytes, expected {end}")

    async def _get_ranged(self, name: str, target: _Target) -> bool:
        """Parallel ranged GETs of ``part_size`` each; the first also checks the size."""
        first, *rest = _bounds(target.n, target.size, self.part_size)
        if not await self._get_range(name, target, *first):
            return False

        async def one(lo: int, hi: int) -> None:
            if not await self._get_range(name, target, lo, hi):
                raise layout.CorruptObject("object vanished while it was read")

        await run_all([one(lo, hi) for lo, hi in rest], PART_PARALLEL)
        return True

    async def delete(self, key: bytes) -> None:
        """Delete ``key``'s object (not reported through ``ctx.removed``: the caller asked)."""
        await self._call(self._client.delete_object, Bucket=self.bucket, Key=self._name(key))
        self.forget([key])
        if self._lru is not None:
            with self._cap_lock:
                self._lru.discard(key)

    async def _close_client(self) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=10)
        nixl, self._nixl = self._nixl, None
        if nixl is not None:
            await nixl.aclose()
        cm, self._client_cm, self._client = self._client_cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def aclose(self) -> None:
        await self._close_client()

    # -- extra hooks ----------------------------------------------------------------------
    @hookimpl
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Keep ``keys`` (stored here) from this instance's ``max_bytes`` eviction for
        ``seconds`` (None: until unpinned); refused whole for keys not stored here or past
        ``PIN_SHARE`` of ``max_bytes``. Keys this instance does not know yet are asked for
        with one HEAD each (at most ``op_timeout``). Another instance on the same prefix does
        not see these pins (each bounds what it sees: docs/pins.md)."""
        keys = list(dict.fromkeys(check_keys(keys)))
        with self._cap_lock:
            if self._lru is not None:
                unknown = [k for k in keys if k not in self._lru]
            else:
                with self._lock:
                    unknown = [k for k in keys if k not in self._present]
        if unknown:
            try:
                found = self.run_sync(asyncio.wait_for(self._exist_all(unknown), self.op_timeout),
                                      timeout=self.op_timeout + 5)
            except Exception as e:  # a pin is refused, never raised, for a server that fails
                what = str(e) or type(e).__name__
                return f"obj tier: could not tell whether {len(unknown)} key(s) are stored here: {what}"
            absent = [k for k, f in zip(unknown, found, strict=True) if not f]
            if absent:
                return f"obj tier: {len(absent)} of {len(keys)} key(s) not stored here (first {absent[0].hex()[:16]})"
        with self._cap_lock:
            why = self.pins.add(keys, self._size, seconds)
            if why is None and self._lru is not None:
                for k in keys:  # a pin is a use: pinned keys start away from the old end eviction searches
                    self._lru.add(k, self._size)
        return why

    async def _exist_all(self, keys: Sequence[bytes]) -> list[bool]:
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(k: bytes) -> bool:
            async with sem:
                return await self.exists(k)

        return list(await asyncio.gather(*(one(k) for k in keys)))

    @hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        with self._cap_lock:
            self.pins.remove(keys)

    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` recently used for ``max_bytes`` eviction."""
        keys = check_keys(keys)
        if self._lru is not None:
            with self._cap_lock:
                self._lru.touch(keys)
