"""The ``mooncake`` tier: KV chunks in a Mooncake Store pool, a cluster-wide KV pool.

Built on :class:`kvtiers.AsyncTier` (jobs, the concurrency limit, per-job deadlines,
non-blocking lookup with positive and negative caches, evictions through ``self.evicted``);
this module supplies the batch coroutines. Mooncake's calls block, so each batch runs on
one of ``max_concurrency`` threads of the instance; lookups go to one probe thread that
asks ``batch_is_exist`` for every key waiting at once.

Data path: the arena is registered once (``register_buffer``) with a small registered area
of trailer cells beside it; a store is one ``batch_put_from_multi_buffers`` of ``[slot,
trailer]`` pairs straight from the slots, a load one ``batch_get_into_multi_buffers``
straight into them; no staging copy. Names and framing: :mod:`kvtiers_mooncake.layout`.

Mooncake's semantics on the contract: a ``put`` to a key that exists keeps the old value and
succeeds (rule 7); a full pool (-200) is retried with a short backoff within the job's
deadline; an object whose holder died (-800) fails its key and answers MISS for a moment;
evictions by the master are found by loads (-704 for a key this instance knew) and by a
periodic ``batch_is_exist`` over the keys it stored, and reported through ``self.evicted``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from kvtiers import AsyncTier, ConfigError, hookimpl
from kvtiers.types import Namespace, TierContext, check_keys

from . import client as mc
from . import layout
from .client import address

log = logging.getLogger("kvtiers.mooncake")

BACKOFF_S = (0.02, 0.5)  # a full pool (-200): first and longest pause between tries
SUSPECT_S = 2.0  # a key whose transfer failed (-800) answers MISS this long
WATCH_MAX_KEYS = 1 << 20  # keys whose presence the watcher follows (the oldest drop out)
MARKS_MAX = 1 << 16  # keys remembered as another size's or as suspect (-800); then forgotten
LEASE_GIVE_UP_S = 30.0  # a remove refused for a lease (-706) is retried this long, then forced


class _Cells:
    """Registered 40-byte cells for trailers, handed out per key of a batch."""

    def __init__(self, count: int) -> None:
        size = max(mmap.PAGESIZE, -(-count * layout.TRAILER_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.mem = mmap.mmap(-1, size)
        self.view = memoryview(self.mem)
        self.addr = address(self.view)
        self.size = size
        self.free = collections.deque(range(count))
        self.lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        with self.lock:
            if n > len(self.free):
                raise RuntimeError(f"no trailer cell free for {n} key(s) ({len(self.free)} free)")
            return [self.free.popleft() for _ in range(n)]

    def give(self, cells: Sequence[int]) -> None:
        with self.lock:
            self.free.extend(cells)

    def cell(self, i: int) -> memoryview:
        o = i * layout.TRAILER_BYTES
        return self.view[o:o + layout.TRAILER_BYTES]

    def close(self) -> None:
        try:
            self.view.release()
            self.mem.close()
        except BufferError:  # a view still referenced somewhere: the mapping goes with it
            pass


class MooncakeTier(AsyncTier):
    """Chunks as objects ``kvtiers/<namespace digest>/<key hex>`` in a Mooncake Store pool.

    Options, in Mooncake's terms (see docs/mooncake.md): ``master_server_address``
    (``host:port`` of ``mooncake_master``, required), ``metadata_server`` (default
    ``P2PHANDSHAKE``), ``protocol`` (``tcp`` or ``rdma``), ``device_name`` (RDMA devices),
    ``local_hostname`` (the address other clients reach this one at), ``global_segment_size``
    (bytes this client contributes to the pool; 0: none, e.g. with a ``kvtiers mooncake
    serve`` process holding the memory), ``local_buffer_size``; and ours: ``timeout`` (bound
    on one job), ``max_concurrency`` (batches in flight), ``replicas`` (copies per object),
    ``max_bytes`` (this instance removes its oldest chunks over it), ``watch_interval`` /
    ``watch_batch`` (the eviction watcher: each stored key is asked about at most once per
    ``watch_interval`` s, at most ``watch_batch`` keys a second; every question Mooncake
    answers grants the object a lease (``default_kv_lease_ttl``) that blocks its eviction, so
    the interval is kept well above the lease).
    """

    levels = frozenset({"core", "shared", "durable", "bounded"})

    def __init__(
        self,
        ctx: TierContext,
        *,
        master_server_address: str,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: Literal["tcp", "rdma"] = "tcp",
        device_name: str = "",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 16 << 20,
        timeout: float = 30.0,
        max_concurrency: int = 4,
        replicas: int = 1,
        max_bytes: int | None = None,
        watch_interval: float = 30.0,
        watch_batch: int = 4096,
    ) -> None:
        super().__init__(ctx)
        t = "tier 'mooncake'"
        host, _, port = master_server_address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{t}: option 'master_server_address' must be host:port, got {master_server_address!r}")
        for name, v in (("global_segment_size", global_segment_size), ("local_buffer_size", local_buffer_size)):
            if v < 0:
                raise ConfigError(f"{t}: option {name!r} must be >= 0, got {v}")
        if timeout <= 0:
            raise ConfigError(f"{t}: option 'timeout' must be > 0, got {timeout}")
        if max_concurrency < 1:
            raise ConfigError(f"{t}: option 'max_concurrency' must be >= 1, got {max_concurrency}")
        if replicas < 1:
            raise ConfigError(f"{t}: option 'replicas' must be >= 1, got {replicas}")
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"{t}: option 'max_bytes' must be >= 0, got {max_bytes}")
        if watch_interval <= 0 or watch_batch < 1:
            raise ConfigError(f"{t}: options 'watch_interval' must be > 0 and 'watch_batch' >= 1, "
                              f"got {watch_interval} and {watch_batch}")
        store_mod = mc.load_store_module()  # TierError naming what is missing
        self.setup = mc.Setup(master_server_address, metadata_server, protocol, device_name, local_hostname,
                              global_segment_size, local_buffer_size)
        self.op_timeout = timeout
        self.max_concurrency = max_concurrency
        self.max_bytes = max_bytes
        self.watch_interval = watch_interval
        self.watch_batch = watch_batch
        self.digest = ctx.namespace.digest
        self.slot_bytes = ctx.arena.slot_bytes
        self.size = layout.object_size(self.slot_bytes)
        self._config = store_mod.ReplicateConfig()
        self._config.replica_num = replicas
        self._client = mc.acquire(self.setup)  # TierError if the master cannot be reached
        self._store = self._client.store
        self._buf = ctx.arena.buffer
        self._addr = address(self._buf)
        self._cells: _Cells | None = None
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvtiers-mooncake")
        self._probe_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtiers-mooncake-probe")
        self._registered: list[int] = []  # registrations (shared with other instances over the same arena)
        try:
            self._registered.append(self._client.register(self._addr, len(self._buf), "the arena"))
            self._cells = _Cells(2 * len(ctx.arena) + 64)
            self._registered.append(self._client.register(self._cells.addr, self._cells.size, "the trailer cells"))
        except BaseException:
            self._teardown()
            raise
        self._track_lock = threading.Lock()
        # key -> (generation, when last stored or asked about), oldest first
        self._tracked: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
        self._gen = 0
        self._lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> bytes (max_bytes)
        self._lru_bytes = 0
        self._unremoved: dict[bytes, float] = {}  # evicted here, remove refused for a lease: first try
        self._foreign: set[bytes] = set()  # keys holding a chunk of another size: misses here
        self._suspect: dict[bytes, float] = {}  # key -> until when it answers MISS (-800)
        self._probe_wait: dict[bytes, list[asyncio.Future]] = {}
        self._probe_scheduled = False
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)

    def __repr__(self) -> str:
        return f"<MooncakeTier {layout.PREFIX}/{self.digest}/ on master {self.setup.master_server_address}>"

    # -- classmethods for the suite and the bench ------------------------------------------
    @classmethod
    def unavailable(cls) -> str | None:
        """What this machine lacks to open the tier (``kvtiers tiers`` shows it), or ``None``."""
        return mc.missing()

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        """A master and a ``serve`` process holding 2 GiB (sized for ``kvtiers bench tier``'s
        default rounds, :data:`kvtiers_mooncake.pool.SHARED_SEGMENT`), started once per
        process (killed when it exits); instances contribute no memory of their own, so
        ``durable`` checks a new instance against what the serve process holds."""
        from .pool import shared_test_pool

        pool = shared_test_pool()
        return {"master_server_address": pool.master.address, "global_segment_size": 0, "timeout": 10.0}

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace: Namespace, key: bytes) -> None:
        """Damage the stored object of ``key`` as bit rot would: rewrite it (``upsert``, same
        length) with three payload bytes flipped and its trailer as it was, so a load must fail
        the key (rule 4). ``config``: the options of an instance that stored it."""
        from .pool import corrupt

        corrupt(config, layout.object_name(namespace.digest, key))

    @classmethod
    def bench_baseline(cls, tier: MooncakeTier, chunk_bytes: int):
        """Raw ``batch_put_from`` / ``batch_get_into`` of one key per call on ``tier``'s client
        and registered arena, as many in flight as its ``max_concurrency``."""
        from .bench import baseline

        return baseline(tier._store, tier._config, tier.digest, tier.max_concurrency)

    # -- threads ---------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[..., Any], *args: Any, pool: ThreadPoolExecutor | None = None) -> Any:
        """``fn(stop, *args)`` on a thread of the instance. A Mooncake call cannot be stopped
        once started: on cancellation ``stop`` is set (backoff loops end) and this waits for the
        call to return before cancelling, so nothing touches a slot after its job is reported."""
        stop = threading.Event()
        fut = asyncio.wrap_future((pool or self._pool).submit(fn, stop, *args))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            stop.set()
            while not fut.done():
                try:
                    await asyncio.wait({fut})
                except asyncio.CancelledError:
                    continue
            raise

    def _budget_end(self) -> float:
        """When a store stops retrying a full pool: a little before the job's deadline."""
        return time.monotonic() + self.op_timeout - min(1.0, 0.2 * self.op_timeout)

    # -- stores ----------------------------------------------------------------------------
    async def put(self, key: bytes, data: memoryview) -> None:
        """One key (the base class calls this for one-key jobs): :meth:`put_many` of one."""
        bad = await self.put_many([(key, data)])
        if bad:
            raise RuntimeError(bad[key])

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        """One key: :meth:`get_many_into` of one (``False``: not stored)."""
        bad = await self.get_many_into([(key, out)])
        if not bad:
            return True
        if bad[key] is False:
            return False
        raise RuntimeError(bad[key])

    async def put_many(self, items: Sequence[tuple[bytes, memoryview]]) -> dict[bytes, Any] | None:
        if self.max_bytes is not None and self.size > self.max_bytes:
            return {k: f"chunk of {self.size} bytes exceeds max_bytes={self.max_bytes}" for k, _ in items}
        cells = self._cells.take(len(items))
        try:
            bad = await self._in_thread(self._put_batch, items, cells, self._budget_end())
        finally:
            self._cells.give(cells)
        ok = [k for k, _ in items if k not in bad]
        if ok:
            self._stored(ok)
        return bad or None

    def _put_batch(self, stop: threading.Event, items: Sequence[tuple[bytes, memoryview]], cells: list[int],
                   until: float) -> dict[bytes, str]:
        """(thread) Write the trailers and put every item; retry a full pool with backoff."""
        store, cl, n = self._store, self._cells, self.slot_bytes
        names, ptrs = [], []
        for (key, view), c in zip(items, cells, strict=True):
            cl.cell(c)[:] = layout.make_chunk_trailer(key, view, self.digest)
            names.append(layout.object_name(self.digest, key))
            ptrs.append([address(view), cl.addr + c * layout.TRAILER_BYTES])
        todo = list(range(len(items)))
        bad: dict[bytes, str] = {}
        pause = BACKOFF_S[0]
        first_full = None
        while todo:
            rcs = store.batch_put_from_multi_buffers([names[i] for i in todo], [ptrs[i] for i in todo],
                                                     [[n, layout.TRAILER_BYTES]] * len(todo), self._config)
            full = []
            for i, rc in zip(todo, rcs, strict=True):
                if rc == mc.NO_AVAILABLE_HANDLE:
                    full.append(i)
                elif rc < 0:
                    bad[items[i][0]] = f"put failed: {mc.code_name(rc)}"
            if not full:
                break
            first_full = first_full or time.monotonic()
            if stop.is_set() or time.monotonic() + pause > until:
                waited = time.monotonic() - first_full
                for i in full:
                    bad[items[i][0]] = (f"pool full: {mc.code_name(mc.NO_AVAILABLE_HANDLE)} for {waited:.1f} s "
                                        "(the master evicts asynchronously; no space freed in time)")
                break
            stop.wait(pause)
            pause = min(pause * 2, BACKOFF_S[1])
            todo = full
        return bad

    def _stored(self, keys: Sequence[bytes]) -> None:
        """Keys now in the pool through this instance: watch them, count them for max_bytes."""
        now = time.monotonic()
        with self._track_lock:
            for k in keys:
                self._gen += 1
                self._tracked[k] = (self._gen, now)
                self._tracked.move_to_end(k)
                self._unremoved.pop(k, None)
                self._foreign.discard(k)
            while len(self._tracked) > WATCH_MAX_KEYS:
                self._tracked.popitem(last=False)
        self._count(keys, add=True)

    def _count(self, keys: Sequence[bytes], add: bool) -> None:
        """max_bytes: note ``keys`` used (``add``: stored), evict the oldest over the bound."""
        if self.max_bytes is None:
            return
        victims = []
        with self._track_lock:
            lru = self._lru
            for k in keys:
                if k in lru:
                    lru.move_to_end(k)
                elif add:
                    lru[k] = self.size
                    self._lru_bytes += self.size
            while self._lru_bytes > self.max_bytes and len(lru) > 1:  # oldest first; the newest stays
                k, size = next(iter(lru.items()))
                del lru[k]
                self._lru_bytes -= size
                self._tracked.pop(k, None)
                victims.append(k)
        if victims:
            self.evicted(victims, "evicted")  # MISS from now on; to ctx.removed
            self._probe_pool.submit(self._remove, victims, False)

    def _remove(self, keys: Sequence[bytes], force: bool) -> None:
        """(probe thread) Remove objects; those refused for a lease are retried by the watcher."""
        try:
            rcs = self._store.batch_remove([layout.object_name(self.digest, k) for k in keys], force)
        except Exception as e:
            log.warning("mooncake: remove of %d key(s) failed: %s", len(keys), e)
            return
        now = time.monotonic()
        with self._track_lock:
            for k, rc in zip(keys, rcs, strict=True):
                if rc == mc.OBJECT_HAS_LEASE and not force:
                    self._unremoved.setdefault(k, now)
                else:
                    self._unremoved.pop(k, None)

    # -- loads -----------------------------------------------------------------------------
    async def get_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> dict[bytes, Any] | None:
        cells = self._cells.take(len(items))
        try:
            bad, gone, corrupt = await self._in_thread(self._get_batch, items, cells, self._budget_end())
        finally:
            self._cells.give(cells)
        if gone:
            self.evicted(gone, "evicted by the pool")
        if corrupt:
            self.evicted(corrupt, "corrupt")
            self._probe_pool.submit(self._remove, corrupt, True)
        ok = [k for k, _ in items if k not in bad]
        if ok:
            self._count(ok, add=False)
        return bad or None

    def _get_batch(self, stop: threading.Event, items: Sequence[tuple[bytes, memoryview]],
                   cells: list[int], until: float) -> tuple[dict[bytes, Any], list[bytes], list[bytes]]:
        """(thread) Load every item and check its trailer. Returns the failed keys with their
        reasons, the keys the pool lost (known here, now not found) and the corrupt ones."""
        cl = self._cells
        names = [layout.object_name(self.digest, k) for k, _ in items]
        ptrs = [[address(v), cl.addr + c * layout.TRAILER_BYTES] for (_, v), c in zip(items, cells, strict=True)]
        rcs = self._get_with_leases(stop, names, ptrs, until)
        bad: dict[bytes, Any] = {}
        gone, corrupt = [], []
        with self._lock:
            present = self._present
            known = {k for k, _ in items if k in present}
        for (key, view), c, name, rc in zip(items, cells, names, rcs, strict=True):
            if rc == self.size:
                try:
                    layout.check_chunk_trailer(key, view, cl.cell(c), self.digest)
                except layout.CorruptChunk as e:
                    log.warning("mooncake: chunk %s is corrupt (%s): removing it", key.hex(), e)
                    bad[key] = f"corrupt: {e}"
                    corrupt.append(key)
                continue
            if rc == mc.OBJECT_NOT_FOUND:
                with self._track_lock:
                    watched = self._tracked.pop(key, None) is not None
                if key in known or watched:
                    gone.append(key)
                    bad[key] = "evicted by the pool (not found)"
                else:
                    bad[key] = False  # missing
                continue
            bad[key] = self._why_not(key, name, rc)
        return bad, gone, corrupt

    def _get_with_leases(self, stop: threading.Event, names: list[str], ptrs: list[list[int]],
                         until: float) -> list[int]:
        """(thread) ``batch_get_into_multi_buffers`` of every object, and again, in batches half
        as big each time (down to one key), of those whose lease ran out before their transfer
        ended (-707: a batch that takes longer than the master's ``default_kv_lease_ttl``, e.g.
        64 MiB on a slow link; its bytes cannot be trusted, the object may be there still),
        until none is left or the job's budget ends. Returns the last code per object."""
        store, sizes = self._store, [self.slot_bytes, layout.TRAILER_BYTES]
        rcs = list(store.batch_get_into_multi_buffers(names, ptrs, [sizes] * len(names)))
        todo = [i for i, rc in enumerate(rcs) if rc == mc.LEASE_EXPIRED]
        step = len(todo)
        while todo and not stop.is_set() and time.monotonic() < until:
            step = max(1, step // 2)
            for a in range(0, len(todo), step):
                part = todo[a:a + step]
                got = store.batch_get_into_multi_buffers([names[i] for i in part], [ptrs[i] for i in part],
                                                         [sizes] * len(part))
                for i, rc in zip(part, got, strict=True):
                    rcs[i] = rc
            todo = [i for i in todo if rcs[i] == mc.LEASE_EXPIRED]
        return rcs

    def _why_not(self, key: bytes, name: str, rc: int) -> str:
        """(thread) The reason for a load that did not return the object: another size (a
        miss here from now on), a transfer that failed (its holder may be gone), or the code."""
        size = self._store.get_size(name) if rc in (mc.INVALID_PARAMS, mc.TRANSFER_FAIL) or rc >= 0 else -1
        if size >= 0 and size != self.size:
            with self._track_lock:
                if len(self._foreign) >= MARKS_MAX:
                    self._foreign.clear()  # forgotten keys fail once more, then are marked again
                self._foreign.add(key)
                self._tracked.pop(key, None)
            self.forget([key])
            return (f"object is {size} bytes, this arena's chunks are {self.size} (slot {self.slot_bytes} + "
                    f"{layout.TRAILER_BYTES}-byte trailer): a chunk of another size, left alone")
        if rc == mc.TRANSFER_FAIL:
            now = time.monotonic()
            with self._track_lock:
                if len(self._suspect) >= MARKS_MAX:
                    self._suspect = {k: t for k, t in self._suspect.items() if t > now}
                self._suspect[key] = now + SUSPECT_S
            self.forget([key])
            return f"load failed: {mc.code_name(rc)} (the segment holding it may be gone)"
        return f"load failed: {mc.code_name(rc)}"

    # -- lookups ---------------------------------------------------------------------------
    async def exists(self, key: bytes) -> bool:
        """Whether the pool holds ``key`` (one ``batch_is_exist`` for every key waiting); a
        chunk of another size, a key whose transfer just failed, or an error answers ``False``."""
        with self._track_lock:
            if key in self._foreign:
                return False
            until = self._suspect.get(key)
            if until is not None:
                if time.monotonic() < until:
                    return False
                del self._suspect[key]
        fut = self._loop.create_future()
        self._probe_wait.setdefault(key, []).append(fut)
        if not self._probe_scheduled:
            self._probe_scheduled = True
            self._loop.call_soon(self._flush_probes)
        return await fut

    def _flush_probes(self) -> None:
        self._probe_scheduled = False
        waiting, self._probe_wait = self._probe_wait, {}
        keys = list(waiting)
        names = [layout.object_name(self.digest, k) for k in keys]

        def done(f: asyncio.Future) -> None:
            try:
                rcs = f.result()
            except BaseException as e:  # noqa: BLE001 - an error is a miss
                log.debug("mooncake: batch_is_exist failed: %s", e)
                rcs = [0] * len(keys)
            for k, rc in zip(keys, rcs, strict=True):
                for w in waiting[k]:
                    if not w.done():
                        w.set_result(rc == 1)

        try:
            cf = self._probe_pool.submit(self._store.batch_is_exist, names)
        except RuntimeError:  # closed meanwhile: every key a miss
            cf = concurrent.futures.Future()
            cf.set_result([0] * len(keys))
        asyncio.wrap_future(cf).add_done_callback(done)

    # -- the eviction watcher --------------------------------------------------------------
    async def _watch(self) -> None:
        """Every second (or ``watch_interval``, if shorter), ask the pool about up to
        ``watch_batch`` keys this instance stored and last asked about ``watch_interval`` s ago
        or more, oldest first, and report those gone; retry removes refused for a lease."""
        while True:
            await asyncio.sleep(min(1.0, self.watch_interval))
            try:
                await asyncio.wrap_future(self._probe_pool.submit(self._watch_once))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the watcher never dies
                log.debug("mooncake: watcher round failed: %s", e)

    def _watch_once(self) -> None:
        """(probe thread) One round of the watcher."""
        now = time.monotonic()
        due = now - self.watch_interval
        with self._track_lock:
            batch = []
            for k, (gen, asked) in self._tracked.items():
                if asked > due or len(batch) >= self.watch_batch:
                    break
                batch.append((k, gen))
            for k, gen in batch:
                self._tracked[k] = (gen, now)
                self._tracked.move_to_end(k)
            retry = [k for k, t0 in self._unremoved.items() if now - t0 < LEASE_GIVE_UP_S]
            force = [k for k, t0 in self._unremoved.items() if now - t0 >= LEASE_GIVE_UP_S]
        if retry:
            self._remove(retry, False)
        if force:
            self._remove(force, True)
        if not batch:
            return
        rcs = self._store.batch_is_exist([layout.object_name(self.digest, k) for k, _ in batch])
        gone = []
        with self._track_lock:
            for (k, gen), rc in zip(batch, rcs, strict=True):
                if rc == 0 and self._tracked.get(k, (None,))[0] == gen:  # not stored again meanwhile
                    del self._tracked[k]
                    if k in self._lru:
                        self._lru_bytes -= self._lru.pop(k)
                    gone.append(k)
        if gone:
            self.evicted(gone, "evicted by the pool")

    # -- deletes and close -------------------------------------------------------------------
    async def delete(self, key: bytes) -> None:
        """Remove ``key`` from the pool (a lease is no obstacle: the remove is forced)."""
        await self._in_thread(lambda stop: self._store.batch_remove([layout.object_name(self.digest, key)], True))
        self.forget([key])
        with self._track_lock:
            self._tracked.pop(key, None)
            if key in self._lru:
                self._lru_bytes -= self._lru.pop(key)

    async def aclose(self) -> None:
        self._watcher.cancel()
        with self._track_lock:
            pending = list(self._unremoved)
            self._unremoved.clear()
        if pending:  # evicted here, refused for a lease: forced now, so close never waits for one
            await asyncio.wrap_future(self._probe_pool.submit(self._remove, pending, True))
        await self._loop.run_in_executor(None, self._teardown)

    def _teardown(self) -> None:
        self._pool.shutdown(wait=True)
        self._probe_pool.shutdown(wait=True)
        for reg in self._registered:
            self._client.unregister(reg)
        self._registered.clear()
        if self._cells is not None:
            self._cells.close()
        mc.release(self._client)

    # -- extra hooks -------------------------------------------------------------------------
    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` recently used for ``max_bytes`` eviction."""
        keys = check_keys(keys)
        if self.max_bytes is not None:
            with self._track_lock:
                for k in keys:
                    if k in self._lru:
                        self._lru.move_to_end(k)
