"""The tiering manager: what an inference engine calls.

Stores land in the host arena first (a device -> arena copy by the DMA engine), then
cascade to every secondary tier. Lookups ask the host cache, then the tiers in order, and
answer the engine's real question: how many leading chunks can be loaded, and from where.
Loads promote each chunk missing from the arena from the first tier that has it (chunks
of one request may come from different tiers), then copy arena -> device.

Everything runs on the engine's thread, driven by its calls: :meth:`TieringManager.get_finished`
(which an engine calls every step), :meth:`~TieringManager.lookup`, ``store`` and ``load``
poll the DMA engine and every tier's ``get_finished_jobs``. A failed or lost tier job
degrades to a miss (the engine recomputes); tier exceptions are logged, never raised into
the engine's loop. Listeners (:meth:`~TieringManager.add_listener`) receive
:class:`CacheEvent` s for chunks stored and removed, per medium (``"host"`` or a tier
name), on the engine thread.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..registry import TierHandle, open_tier
from ..types import Arena, Job, JobResult, Lookup, Namespace, TierContext, check_keys
from .hostcache import LOADING, READY, STORING, HostCache
from .policies import make_policy
from .types import CacheEvent, LookupResult, ManagerStats, PathStats, Request, TransferResult

__all__ = ["CacheEvent", "LookupResult", "ManagerStats", "PathStats", "Request", "TieringManager", "TransferResult"]

log = logging.getLogger("kvtiers.engine.manager")

HOST = "host"


@dataclass(eq=False)
class _Transfer:
    tid: int
    kind: str
    keys: tuple[bytes, ...]
    request: Request | None
    t0: float
    blocks: dict[bytes, Sequence[int]] = field(default_factory=dict)
    pins: dict[bytes, int] = field(default_factory=dict)  # key -> pinned slot
    waiting: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)
    skipped: list[bytes] = field(default_factory=list)
    sources: dict[bytes, str] = field(default_factory=dict)
    deferred: list[bytes] = field(default_factory=list)  # loads: no slot yet, next wave
    copied: set[bytes] = field(default_factory=set)  # loads: on the device after earlier waves
    dma_started: float | None = None
    error: str | None = None


@dataclass(eq=False)
class _TierJob:
    tier: _Tier
    kind: str  # "store" | "load"
    job: Job
    t0: float
    lost: bool = False


@dataclass(eq=False)
class _Tier:
    name: str
    handle: TierHandle
    jobs: dict[int, _TierJob] = field(default_factory=dict)
    warned: bool = False


class TieringManager:
    """The host cache, the DMA engine and the secondary tiers behind one engine API.

    Most engines build it with :meth:`from_config`. The constructor takes the parts for
    engines (and tests) that build them themselves: ``arena`` (a :class:`kvtiers.Arena`),
    ``dma`` (an object with ``submit_store(tid, chunks)``, ``submit_load(tid, chunks)``
    and ``poll() -> [tid]``, like :class:`kvtiers.engine.dma.DmaEngine`), and optionally ``host``
    (closed with the manager).
    """

    def __init__(
        self,
        *,
        arena: Arena,
        dma: Any,
        blocks_per_chunk: int = 1,
        chunk_bytes: int | None = None,
        tokens_per_chunk: int | None = None,
        eviction_policy: str = "lru",
        store_threshold: int = 1,
        offload_prompt_only: bool = True,
        max_offload_tokens: int | None = None,
        namespace: Namespace | None = None,
        host: Any = None,
        tier_job_timeout: float = 30.0,
    ) -> None:
        self.arena = arena
        self.dma = dma
        self.host = host
        self.blocks_per_chunk = operator.index(blocks_per_chunk)
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else arena.slot_bytes
        self.tokens_per_chunk = tokens_per_chunk
        self.offload_prompt_only = offload_prompt_only
        self.max_offload_tokens = max_offload_tokens
        self.namespace = namespace if namespace is not None else Namespace({})
        self.tier_job_timeout = tier_job_timeout
        self.cache = HostCache(
            len(arena), make_policy(eviction_policy, len(arena)), store_threshold=store_threshold,
            on_evict=self._on_host_evict,
        )
        self.tiers: list[_Tier] = []
        self.stats = ManagerStats()
        self._listeners: list[Callable[[CacheEvent], None]] = []
        self._events: deque[CacheEvent] = deque()  # appended from any thread, flushed on ours
        self._evicted: list[bytes] = []
        self._ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self._dma_ids = itertools.count(1)
        self._dma_pending: dict[int, _Transfer] = {}  # DMA transfer id -> transfer
        self._waiting: dict[int, _Transfer] = {}  # loads waiting for fills
        self._waiters: dict[bytes, list[_Transfer]] = defaultdict(list)  # key being filled -> loads
        self._store_fills: dict[int, list[tuple[bytes, int]]] = {}
        self._finished: dict[int, TransferResult] = {}
        self._closed = False

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        config: Any,
        kv_caches: Any,
        *,
        layout: Any = None,
        namespace_fields: Mapping[str, Any] | None = None,
        tokens_per_block: int | None = None,
        num_workers: int = 1,
        pin: bool | None = None,
        tier_job_timeout: float = 30.0,
    ) -> TieringManager:
        """Build the arena, the DMA engine and every tier from a JSON config (ours or
        vLLM's ``kv_connector_extra_config``; a mapping, JSON text or a file path).

        ``kv_caches``: group name -> per layer -> list of device tensors ``[num_blocks, ...]``
        (see :class:`kvtiers.engine.layout.KVLayout`). ``namespace_fields``: what else changes a
        chunk's bytes (model, dtype, parallel layout, hash seed); the layout description,
        ``blocks_per_chunk`` and the chunk size are added. ``tokens_per_block``: the
        engine's block size in tokens (needed for token limits and vLLM's ``block_size``).
        """
        from ..config import Config, load_config
        from ..errors import ConfigError
        from .arena import arena_size, create_host_arena, slot_bytes_for
        from .dma import DmaEngine
        from .layout import KVLayout

        cfg = config if isinstance(config, Config) else load_config(config)
        layout = layout if layout is not None else KVLayout.from_tensors(kv_caches)
        bpc = cfg.blocks_per_chunk
        tokens_per_chunk = None
        if cfg.block_size is not None:  # vLLM: tokens per offloaded block
            if not tokens_per_block:
                raise ConfigError("config: 'block_size' needs the engine's tokens_per_block to derive blocks_per_chunk")
            if cfg.block_size % tokens_per_block:
                raise ConfigError(
                    f"config: 'block_size' {cfg.block_size} is not a multiple of the engine's block size "
                    f"{tokens_per_block} tokens"
                )
            bpc = cfg.block_size // tokens_per_block
        if tokens_per_block:
            tokens_per_chunk = tokens_per_block * bpc
        chunk_bytes = layout.chunk_bytes(bpc)
        slot_bytes = slot_bytes_for(chunk_bytes)
        device_chunks = _device_blocks(kv_caches) // bpc
        num_slots = arena_size(
            cfg.host_bytes, slot_bytes, host_blocks_factor=cfg.host_blocks_factor,
            device_chunk_capacity=device_chunks, num_workers=num_workers,
        )
        fields = {**cfg.namespace, **dict(namespace_fields or {})}
        fields.update(layout=layout.describe(), blocks_per_chunk=bpc, chunk_bytes=chunk_bytes)
        namespace = Namespace(fields)
        host = create_host_arena(
            num_slots, slot_bytes, pin=pin, shared_memory=cfg.shared_memory, elastic=cfg.elastic,
            elastic_reserve_bytes=cfg.elastic_reserve_bytes,
        )
        mgr = None
        try:
            dma = DmaEngine(layout, kv_caches, host, bpc)
            mgr = cls(
                arena=host.arena, dma=dma, blocks_per_chunk=bpc, chunk_bytes=chunk_bytes,
                tokens_per_chunk=tokens_per_chunk, eviction_policy=cfg.eviction_policy,
                store_threshold=cfg.store_threshold, offload_prompt_only=cfg.offload_prompt_only,
                max_offload_tokens=cfg.max_offload_tokens, namespace=namespace, host=host,
                tier_job_timeout=tier_job_timeout,
            )
            for t in cfg.tiers:
                mgr.add_tier(t.type, t.options, name=t.name)
        except BaseException:
            if mgr is not None:
                mgr.close(timeout=5.0)
            else:
                host.close()
            raise
        return mgr

    def add_tier(self, tier: str | type | TierHandle, options: Mapping[str, Any] | None = None,
                 *, name: str | None = None) -> TierHandle:
        """Open a secondary tier on this manager's arena and namespace and append it (tiers
        are asked in the order they were added). ``tier`` is a registered type name, an
        import path ``pkg.module:Class``, a tier class, or an already open handle on this
        arena. ``name`` (default: the type, ``#2`` etc. appended when repeated) is the
        ``medium`` of its events and its ``source`` in lookups."""
        if isinstance(tier, TierHandle):
            if tier.ctx.arena is not self.arena:
                raise ValueError(f"tier {tier.name!r} was opened on another arena")
            handle = tier
        else:
            ctx = TierContext(self.arena, self.namespace)
            handle = open_tier(tier, options, ctx)
        base = name or handle.name
        taken = {t.name for t in self.tiers} | {HOST}
        final, n = base, 1
        while final in taken:
            if name:
                raise ValueError(f"tier name {name!r} is already used")
            n += 1
            final = f"{base}#{n}"
        handle.ctx.add_removed_listener(lambda keys, reason, _n=final: self._events.append(
            CacheEvent("removed", tuple(keys), _n, reason)))
        self.tiers.append(_Tier(final, handle))
        return handle

    # -- listeners ---------------------------------------------------------------------
    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call ``fn(event)`` for every :class:`CacheEvent`, on the engine thread, inside
        manager calls. A listener that raises is logged and kept."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        self._listeners.remove(fn)

    def _emit(self, kind: str, keys: Sequence[bytes], medium: str, reason: str | None) -> None:
        if keys:
            self._events.append(CacheEvent(kind, tuple(keys), medium, reason))

    def _flush_events(self) -> None:
        if self._evicted:
            self._emit("removed", self._evicted, HOST, "evicted")
            self._evicted = []
        while self._events:
            ev = self._events.popleft()
            for fn in list(self._listeners):
                try:
                    fn(ev)
                except Exception:
                    log.exception("kvtiers: cache event listener %r failed", fn)

    def _on_host_evict(self, key: bytes, slot: int) -> None:
        self._evicted.append(key)

    # -- engine API --------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """How many leading chunks of ``keys`` can be loaded, and from where. Never
        blocks; ``retry`` is set while the next chunk is being promoted or stored, or a
        tier answered RETRY for it."""
        keys = check_keys(keys)
        self._progress()
        sources: list[str | None] = [None] * len(keys)
        pending = [False] * len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            st = self.cache.state(key)
            if st == READY:
                sources[i] = HOST
            elif st is not None:
                pending[i] = True
            else:
                ask.append(i)
        # only what could extend the prefix is worth asking: up to the first pending key
        first_pending = next((i for i, p in enumerate(pending) if p), len(keys))
        ask = [i for i in ask if i < first_pending]
        for tier in self.tiers:
            if not ask:
                break
            answers = self._tier_lookup(tier, [keys[i] for i in ask])
            still = []
            for i, a in zip(ask, answers, strict=True):
                if a is Lookup.HIT:
                    sources[i] = tier.name
                else:
                    if a is Lookup.RETRY:
                        pending[i] = True
                    still.append(i)
            ask = still
        out: list[str] = []
        retry = False
        for i in range(len(keys)):
            if sources[i] is not None:
                out.append(sources[i])
                continue
            retry = pending[i]
            break
        self._flush_events()
        return LookupResult(len(out), tuple(out), retry)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used, in the host cache and in every tier (eviction order)."""
        keys = check_keys(keys)
        for key in keys:
            self.cache.touch(key)
        for tier in self.tiers:
            try:
                tier.handle.touch(keys)
            except Exception as e:
                self._tier_failed(tier, "touch", e)

    def store(self, keys: Sequence[bytes], device_blocks: Sequence[Any], request: Request | None = None,
              *, first_chunk: int = 0) -> int | None:
        """Copy the chunks ``keys`` from ``device_blocks`` into the arena, then to every
        secondary tier. Returns the transfer id (reported by :meth:`get_finished` once
        the device blocks may be reused), or ``None`` for a cancelled request.

        ``device_blocks``: one sequence of ``blocks_per_chunk`` block ids per key, or one
        flat sequence of them. ``first_chunk``: the index of ``keys[0]`` in the request's
        token sequence (for the token limits of ``request``)."""
        keys = check_keys(keys)
        blocks = self._split_blocks(keys, device_blocks)
        if request is not None and request.cancelled:
            return None
        self._progress()
        limit = self._chunk_limit(request)
        tr = _Transfer(next(self._ids), "store", keys, request, time.perf_counter())
        todo: list[tuple[bytes, Sequence[int], int]] = []
        for j, key in enumerate(keys):
            if (limit is not None and first_chunk + j >= limit) or key in self.cache:
                self.cache.touch(key)
                tr.skipped.append(key)
                continue
            if not self.cache.offer(key):
                tr.skipped.append(key)
                continue
            slot = self.cache.allocate(key, STORING)
            if slot is None:
                self.stats.host_full += 1
                tr.skipped.append(key)
                continue
            todo.append((key, blocks[j], slot))
        self.stats.skipped_stores += len(tr.skipped)
        if todo:
            tr.dma_started = time.perf_counter()
            dma_id = next(self._dma_ids)
            try:
                self.dma.submit_store(dma_id, [(b, s) for _, b, s in todo])
            except BaseException:
                for key, _, slot in todo:
                    self.cache.unpin(slot)
                    self.cache.drop(key)
                raise
            tr.pins = {key: slot for key, _, slot in todo}
            self._dma_pending[dma_id] = tr
            self._poll_dma()  # a synchronous engine is done already
        else:
            self._finish(tr)
        self._flush_events()
        return tr.tid

    def load(self, keys: Sequence[bytes], device_blocks: Sequence[Any], request: Request | None = None) -> int | None:
        """Copy the chunks ``keys`` into ``device_blocks``: from the arena, after promoting
        each chunk the arena lacks from the first tier that has it. Returns the transfer id,
        or ``None`` for a cancelled request. Chunks no tier has, or whose promotion
        fails, are reported as failed keys (recompute them). A load longer than the arena
        has free slots for runs in waves: each wave promotes what fits, copies it to the
        device and unpins it before the next."""
        keys = check_keys(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("load: duplicate keys")
        blocks = self._split_blocks(keys, device_blocks)
        if request is not None and request.cancelled:
            return None
        self._progress()
        tr = _Transfer(next(self._ids), "load", keys, request, time.perf_counter())
        tr.blocks = dict(zip(keys, blocks, strict=True))
        self._start_wave(tr, list(keys))
        self._flush_events()
        return tr.tid

    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call (stores: the device blocks may be
        reused; loads: the device blocks hold the chunks not listed as failed). Drives
        every pending copy and tier job; never blocks, never raises for tier faults."""
        self._progress()
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def poll(self) -> None:
        """Drive pending copies and tier jobs without collecting results."""
        self._progress()

    def wait(self, transfer_ids: Sequence[int], timeout: float | None = 60.0) -> list[TransferResult]:
        """Block until the given transfers finish; return their results (they are not
        returned again by :meth:`get_finished`). For tools and tests, not engine loops."""
        ids = [t for t in transfer_ids if t is not None]
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0002
        while True:
            self._progress()
            if all(t in self._finished for t in ids):
                return [self._finished.pop(t) for t in ids]
            if deadline is not None and time.monotonic() > deadline:
                left = [t for t in ids if t not in self._finished]
                raise TimeoutError(f"transfers {left} not finished after {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def pending(self) -> int:
        """Transfers and tier jobs not finished yet."""
        return len(self._dma_pending) + len(self._waiting) + sum(
            1 for t in self.tiers for j in t.jobs.values() if not j.lost)

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is in flight (up to ``timeout`` seconds), then close the DMA engine,
        every tier and the arena. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            self._progress()
            time.sleep(0.001)
        if self.pending():
            log.warning("kvtiers: closing with %d transfer(s) or tier job(s) unfinished", self.pending())
        self._closed = True
        for tier in self.tiers:
            try:
                tier.handle.close()
            except Exception as e:
                self._tier_failed(tier, "close", e)
        self._poll_tiers()  # rule 9: results of jobs finished by close
        self._flush_events()
        close = getattr(self.dma, "close", None)
        if close is not None:
            close()
        if self.host is not None:
            self.host.close()

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _split_blocks(self, keys: tuple[bytes, ...], device_blocks: Sequence[Any]) -> list[Sequence[int]]:
        bpc = self.blocks_per_chunk
        items = list(device_blocks)
        if len(items) == len(keys) and all(not _is_int(b) for b in items):
            out = [list(map(operator.index, b)) for b in items]
        elif len(items) == len(keys) * bpc and all(_is_int(b) for b in items):
            flat = [operator.index(b) for b in items]
            out = [flat[i * bpc : (i + 1) * bpc] for i in range(len(keys))]
        else:
            raise ValueError(
                f"device_blocks: expected {len(keys)} sequences of {bpc} block ids or "
                f"{len(keys) * bpc} block ids for {len(keys)} chunks, got {len(items)} items"
            )
        for b in out:
            if len(b) != bpc:
                raise ValueError(f"device_blocks: a chunk has {len(b)} block ids, expected {bpc}")
        return out

    def _chunk_limit(self, request: Request | None) -> int | None:
        limits = []
        if self.max_offload_tokens is not None:
            limits.append(self.max_offload_tokens)
        if request is not None:
            if request.max_offload_tokens is not None:
                limits.append(request.max_offload_tokens)
            if self.offload_prompt_only and request.num_prompt_tokens is not None:
                limits.append(request.num_prompt_tokens)
        if not limits:
            return None
        if not self.tokens_per_chunk:
            raise ValueError("token limits need tokens_per_chunk (give tokens_per_block to from_config)")
        return min(limits) // self.tokens_per_chunk

    def _tier_lookup(self, tier: _Tier, keys: list[bytes]) -> list[Lookup]:
        try:
            answers = tier.handle.lookup(keys)
            if answers is None or len(answers) != len(keys):
                raise TypeError(f"lookup answered {0 if answers is None else len(answers)} for {len(keys)} keys")
            return [a if isinstance(a, Lookup) else Lookup.MISS for a in answers]
        except Exception as e:
            self._tier_failed(tier, "lookup", e)
            return [Lookup.MISS] * len(keys)

    def _tier_failed(self, tier: _Tier, what: str, e: BaseException) -> None:
        self.stats.tier_errors[tier.name] += 1
        if not tier.warned:
            tier.warned = True
            log.warning("kvtiers: tier %s: %s failed (%s: %s); treated as a miss (further errors at debug level)",
                        tier.name, what, type(e).__name__, e)
        else:
            log.debug("kvtiers: tier %s: %s failed: %s: %s", tier.name, what, type(e).__name__, e)

    def _start_wave(self, tr: _Transfer, keys: list[bytes]) -> None:
        """Pin the slots of ``keys`` in the host cache, promote the others, and copy to the
        device once they are filled. Keys that find no free slot wait for the next wave;
        a wave that can pin nothing fails them (all slots are busy: recompute)."""
        missing: list[bytes] = []
        for key in keys:
            st = self.cache.state(key)
            if st is None:
                missing.append(key)
                continue
            tr.pins[key] = self.cache.pin(key)
            tr.sources[key] = HOST
            self.cache.touch(key)
            if st != READY:
                tr.waiting.add(key)
                self._waiters[key].append(tr)
        if missing:
            self._promote(tr, missing)
        if tr.deferred and not tr.pins:
            self.stats.host_full += len(tr.deferred)
            tr.failed.update(tr.deferred)
            tr.deferred = []
        self._waiting[tr.tid] = tr
        self._maybe_copy_in(tr)

    def _promote(self, tr: _Transfer, keys: list[bytes]) -> None:
        """Start tier loads for ``keys`` (absent from the host cache) into new slots."""
        route: dict[bytes, _Tier] = {}
        ask = list(keys)
        for tier in self.tiers:
            if not ask:
                break
            answers = self._tier_lookup(tier, ask)
            for key, a in zip(ask, answers, strict=True):
                if a is Lookup.HIT:
                    route[key] = tier
            ask = [k for k in ask if k not in route]
        per_tier: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
        for key in keys:
            tier = route.get(key)
            if tier is None:
                tr.failed.add(key)
                continue
            slot = self.cache.allocate(key, LOADING) if not tr.deferred else None
            if slot is None:
                tr.deferred.append(key)
                continue
            tr.pins[key] = self.cache.pin(key)  # the load's pin; allocate's pin is the job's
            tr.sources[key] = tier.name
            tr.waiting.add(key)
            self._waiters[key].append(tr)
            per_tier[id(tier)].append((key, slot))
        for tier in self.tiers:
            items = per_tier.get(id(tier))
            if items:
                self._submit_tier(tier, "load", items)

    def _submit_tier(self, tier: _Tier, kind: str, items: list[tuple[bytes, int]]) -> None:
        """Submit a tier job over ``items``; their slots carry one pin each for the job."""
        job = Job(next(self._job_ids), tuple(k for k, _ in items), tuple(s for _, s in items))
        try:
            (tier.handle.submit_store if kind == "store" else tier.handle.submit_load)(job)
        except Exception as e:
            self._tier_failed(tier, f"submit_{kind}", e)
            self._end_tier_job(_TierJob(tier, kind, job, time.perf_counter()),
                               JobResult(job.job_id, job.keys, error=f"{type(e).__name__}: {e}"))
            return
        tier.jobs[job.job_id] = _TierJob(tier, kind, job, time.perf_counter())

    def _cascade(self, items: list[tuple[bytes, int]]) -> None:
        """Send freshly stored chunks to every tier that does not have them yet."""
        for tier in self.tiers:
            answers = self._tier_lookup(tier, [k for k, _ in items])
            todo = [(k, s) for (k, s), a in zip(items, answers, strict=True) if a is not Lookup.HIT]
            if not todo:
                continue
            for key, _ in todo:
                self.cache.pin(key)
            self._submit_tier(tier, "store", todo)

    def _end_tier_job(self, tj: _TierJob, res: JobResult) -> None:
        job = tj.job
        failed = set(res.failed_keys) & set(job.keys)
        now = time.perf_counter()
        path = f"{HOST}->{tj.tier.name}" if tj.kind == "store" else f"{tj.tier.name}->{HOST}"
        ok = [k for k in job.keys if k not in failed]
        if ok:
            seconds = res.seconds if 0 < res.seconds <= now - tj.t0 + 1e-3 else now - tj.t0
            self.stats.paths[path].add(res.nbytes, len(ok), tj.t0, tj.t0 + seconds)
        if tj.lost:  # its keys were failed already; the slots were kept pinned until now
            for s in job.slots:
                self.cache.unpin(s)
            return
        if tj.kind == "store":
            for s in job.slots:
                self.cache.unpin(s)
            self._emit("stored", ok, tj.tier.name, None)
            return
        for key, slot in zip(job.keys, job.slots, strict=True):
            self.cache.unpin(slot)
            self._fill_done(key, key not in failed, "promoted")

    def _fill_done(self, key: bytes, ok: bool, reason: str) -> None:
        """A store copy or a promotion into the slot of ``key`` ended."""
        if ok:
            self.cache.mark_ready(key)
            self._emit("stored", (key,), HOST, reason)
        else:
            self.cache.drop(key)
        for tr in self._waiters.pop(key, ()):
            tr.waiting.discard(key)
            if not ok:
                tr.failed.add(key)
                self.cache.unpin(tr.pins.pop(key))
            self._maybe_copy_in(tr)

    def _maybe_copy_in(self, tr: _Transfer) -> None:
        """Start the arena -> device copy of a load once nothing is being filled for it."""
        if tr.waiting or tr.tid not in self._waiting:
            return
        del self._waiting[tr.tid]
        if tr.request is not None and tr.request.cancelled:
            tr.failed.update(tr.deferred)
            tr.deferred = []
            self._finish(tr)
            return
        chunks = [(tr.blocks[k], s) for k, s in tr.pins.items()]
        if not chunks:
            self._wave_done(tr)
            return
        tr.dma_started = time.perf_counter()
        dma_id = next(self._dma_ids)
        try:
            self.dma.submit_load(dma_id, chunks)
        except Exception as e:
            log.error("kvtiers: device copy of load %d failed to start: %s: %s", tr.tid, type(e).__name__, e)
            tr.error = f"{type(e).__name__}: {e}"
            tr.failed.update(tr.pins)
            tr.failed.update(tr.deferred)
            tr.deferred = []
            self._finish(tr)
            return
        self._dma_pending[dma_id] = tr
        self._poll_dma()

    def _finish(self, tr: _Transfer) -> None:
        now = time.perf_counter()
        cancelled = tr.request is not None and tr.request.cancelled
        nbytes = 0
        if tr.kind == "load":
            if cancelled:  # what a wave had not copied yet is not on the device
                tr.failed.update(k for k in tr.pins if k not in tr.copied)
            ok = [k for k in tr.keys if k in tr.copied and k not in tr.failed]
            nbytes = len(ok) * self.chunk_bytes
            for k in ok:
                self.stats.hits[tr.sources[k]] += 1
            self.stats.failed_loads += len(tr.failed)
        for slot in tr.pins.values():
            self.cache.unpin(slot)
        failed = tuple(k for k in tr.keys if k in tr.failed)
        sources = {k: v for k, v in tr.sources.items() if k not in tr.failed}
        self._finished[tr.tid] = TransferResult(
            tr.tid, tr.kind, tr.keys, failed, tuple(tr.skipped), sources, nbytes, now - tr.t0,
            tr.request.request_id if tr.request is not None else None, cancelled, tr.error,
        )

    def _progress(self) -> None:
        """Poll the DMA engine and every tier; advance whatever finished."""
        self._poll_dma()
        self._poll_tiers()
        self._check_lost()
        self._flush_events()

    def _poll_dma(self) -> None:
        if not self._dma_pending:
            return
        for dma_id in self.dma.poll():
            tr = self._dma_pending.pop(dma_id, None)
            if tr is None:
                log.warning("kvtiers: DMA engine reported unknown transfer %s", dma_id)
            elif tr.kind == "store":
                self._stored(tr)
            else:
                tr.copied.update(tr.pins)
                n = len(tr.pins)
                self.stats.paths[f"{HOST}->device"].add(n * self.chunk_bytes, n, tr.dma_started or tr.t0,
                                                        time.perf_counter())
                self._wave_done(tr)

    def _wave_done(self, tr: _Transfer) -> None:
        """A load's wave is on the device: unpin it, start the next wave or finish."""
        if not tr.deferred or (tr.request is not None and tr.request.cancelled):
            self._finish(tr)
            return
        for slot in tr.pins.values():
            self.cache.unpin(slot)
        tr.pins = {}
        keys, tr.deferred = tr.deferred, []
        self._start_wave(tr, keys)

    def _stored(self, tr: _Transfer) -> None:
        now = time.perf_counter()
        items = list(tr.pins.items())
        self.stats.stored_chunks += len(items)
        self.stats.paths[f"device->{HOST}"].add(len(items) * self.chunk_bytes, len(items), tr.dma_started or tr.t0, now)
        for key, _ in items:
            self._fill_done(key, True, "offloaded")
        self._cascade(items)  # pins the slots again for the tier jobs
        self._finish(tr)  # drops the copy's pins

    def _poll_tiers(self) -> None:
        for tier in self.tiers:
            if not tier.jobs and not tier.handle.closed:
                continue
            try:
                results = tier.handle.get_finished_jobs()
            except Exception as e:
                self._tier_failed(tier, "get_finished_jobs", e)
                continue
            for res in results:
                tj = tier.jobs.pop(getattr(res, "job_id", None), None)
                if tj is None:
                    self._tier_failed(tier, "get_finished_jobs", ValueError(f"unknown or repeated job {res!r}"))
                    continue
                self._end_tier_job(tj, res)

    def _check_lost(self) -> None:
        """Promotions a tier has not reported within ``tier_job_timeout``: fail their keys
        (the loads go on without them), keep their slots pinned until the tier reports."""
        now = time.perf_counter()
        for tier in self.tiers:
            for tj in tier.jobs.values():
                if tj.kind != "load" or tj.lost or now - tj.t0 < self.tier_job_timeout:
                    continue
                tj.lost = True
                self._tier_failed(tier, "submit_load", TimeoutError(
                    f"job {tj.job.job_id} not reported within {self.tier_job_timeout} s"))
                for key in tj.job.keys:
                    self._fill_done(key, False, "lost")


def _is_int(x: Any) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _device_blocks(kv_caches: Any) -> int:
    """The number of device blocks: dim 0 of the first KV tensor."""
    obj = kv_caches
    while not hasattr(obj, "shape"):
        if isinstance(obj, Mapping):
            obj = next(iter(obj.values()))
        else:
            obj = next(iter(obj))
    return int(obj.shape[0])


__all__ = [
    "CacheEvent",
    "LookupResult",
    "ManagerStats",
    "PathStats",
    "Request",
    "TieringManager",
    "TransferResult",
]
