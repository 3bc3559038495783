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

The work is split by responsibility; this class checks the engine's arguments and composes:

- :mod:`.stores`: stores into the arena and their cascade to the tiers;
- :mod:`.loads`: lookups, load waves and promotions from the tiers;
- :mod:`.transfers`: transfer ids, device copies in flight, results not collected yet;
- :mod:`.tiers`: the tiers, their jobs and timeouts, and the fault accounting of tier calls;
- :mod:`.events`: cache events on their way to the listeners;
- :mod:`.services`: the services plugins attach through their config blocks, and the guard
  around each call into one (a service that raises or hangs never breaks the engine);
- :mod:`.build`: the parts built from a config (:meth:`TieringManager.from_config`).
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..encryption.tenants import check_tenant, note_tenant
from ..registry import TierHandle, open_tier
from ..types import Arena, Namespace, TierContext, check_keys
from .build import build_from_config
from .costs import LoadCosts
from .events import EventBus, log
from .hostcache import HostCache
from .loads import LoadPath
from .pins import LifetimePins, PinResult, check_ttl, parse_pin_options
from .policies import make_policy
from .services import ServiceSet
from .stores import StorePath, chunk_limit
from .tiers import Tier, TierSet
from .transfers import TransferBook, split_blocks
from .types import CacheEvent, LookupResult, ManagerStats, PathStats, Request, TransferResult

__all__ = ["CacheEvent", "LookupResult", "ManagerStats", "PathStats", "Request", "TieringManager", "TransferResult"]

CLOSE_GRACE = 5.0  # seconds tiers' close() get after close's timeout, before they are abandoned
CLOSE_DRAIN = 1.0  # seconds close waits for device copies after abandoning tier jobs
SERVICE_CLOSE_MIN = 1.0  # seconds services' close() get at least, when the pending work used up the timeout
_KEPT_ARENAS: list[Any] = []  # host arenas an abandoned tier job or service may still touch: never freed


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object. The store and load
    paths hold the transfer book and the tier set, which call them back; strong callbacks made
    reference cycles that only the garbage collector freed, and with them a closed manager's
    host arena and DMA engine (for weights, a model's tensors): memory kept until a collection
    that a serving process may not run for long. The manager holds the paths while it lives."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


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
        layout: Any = None,
        pins: Mapping[str, Any] | None = None,
        recompute_when_faster: bool = True,
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
        # the KV layout (kvtiers.engine.layout.KVLayout): per-group blocks, windows and SSM state
        self.layout = layout
        if layout is not None and any(g.kind == "sliding" for g in layout.groups) and not tokens_per_chunk:
            raise ValueError("a layout with a sliding-window group needs tokens_per_chunk (tokens_per_block)")
        self._events = EventBus()
        self.cache = HostCache(
            len(arena), make_policy(eviction_policy, len(arena)), store_threshold=store_threshold,
            on_evict=self._events.host_evicted,
        )
        # lifetime pins (pin/unpin, kvtiers.engine.pins): at most max_share of the slots, so eviction keeps room
        max_ttl, max_share = parse_pin_options(pins)
        self.pins = LifetimePins(int(max_share * len(arena)), max_ttl=max_ttl)
        self.cache.held = self.pins.held
        self.stats = ManagerStats()
        self._events.counts = self.stats.events  # chunk keys per (kind, medium), as listeners saw them
        # the parts share the cache, the stats and the event bus; each owns the rest of its state
        self._tiers = TierSet(self.stats)
        self._transfers = TransferBook(dma, self.cache, self.stats, self.chunk_bytes)
        self._loads = LoadPath(self.cache, self._tiers, self._transfers, self._events, self.stats, self.chunk_bytes)
        self._stores = StorePath(self.cache, self._tiers, self._transfers, self._loads, self._events, self.stats,
                                 self.chunk_bytes)
        self._stores.wave_timeout = tier_job_timeout  # a later store wave waits this long for a free slot
        #: the reuse ceiling of the chunk keys offered to :meth:`store` and :meth:`load` (kvtiers.engine.reuse)
        self.reuse = self._stores.reuse
        # what a completed device copy or tier job means is up to the path that started it
        # (called weakly: the paths hold the book and the tier set, see _weakly)
        self._transfers.on_copied("store", _weakly(self._stores.copied))
        self._transfers.on_copied("load", _weakly(self._loads.copied))
        self._tiers.on_job_end("store", _weakly(self._stores.tier_stored))
        self._tiers.on_job_end("load", _weakly(self._loads.promoted))
        self._tiers.on_job_lost(_weakly(self._loads.lost))
        #: load or recompute (kvtiers.engine.costs): each tier's load time and the engine's prefill time,
        #: learned while serving; a lookup does not offer a tier's chunks whose load would lose
        self.costs = LoadCosts(enabled=bool(recompute_when_faster))
        self._tiers.on_load_timed = self.costs.observe_load
        self._loads.costs = self.costs
        self._loads.tokens_per_chunk = tokens_per_chunk
        self.kv_events: Any = None  # the KVEventBridge once KV events are published (kvtiers.engine.kvevents)
        self.metrics: Any = None  # the ManagerMetrics once metrics are attached (kvtiers.metrics)
        # services a plugin attached through a config block it registered (register_manager_blocks),
        # by block name, e.g. "serve" (kvtiers_p2p: peers read this host cache): poll() each step, close()
        self._services = ServiceSet()
        self.services: dict[str, Any] = self._services.services
        self._closed = False

    @property
    def serve(self) -> Any:
        """The service of the config's ``serve`` block (peers read this host cache over p2p,
        docs/p2p.md), or None."""
        return self.services.get("serve")

    @property
    def service_errors(self) -> dict[tuple[str, str], int]:
        """Calls into services that raised, by ``(service, phase)`` (``phase``: ``"poll"`` or
        ``"close"``): the metric ``kvtiers_service_errors_total``."""
        return self._services.errors

    @property
    def tiers(self) -> list[Tier]:
        """The secondary tiers in lookup order (``name``, ``handle``)."""
        return self._tiers.tiers

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
        dma: Callable[[Any, Any, int], Any] | None = None,
    ) -> TieringManager:
        """Build the arena, the DMA engine and every tier from a JSON config (ours or
        vLLM's ``kv_connector_extra_config``; a mapping, JSON text or a file path).

        ``kv_caches``: group name -> per layer -> list of device tensors ``[num_blocks, ...]``
        (see :class:`kvtiers.engine.layout.KVLayout`). ``namespace_fields``: what else changes a
        chunk's bytes (model, dtype, parallel layout, hash seed); the layout description,
        ``blocks_per_chunk`` and the chunk size are added. ``tokens_per_block``: the
        engine's block size in tokens (needed for token limits and vLLM's ``block_size``); each
        attention group's block shape must have a dimension of that many tokens.

        ``dma``: build the DMA engine yourself: ``dma(layout, host, blocks_per_chunk)`` is called
        with the KV layout, the host arena (:class:`kvtiers.engine.arena.HostArena`) and the
        blocks per chunk, and returns an object with ``submit_store(transfer_id, chunks)``,
        ``submit_load(transfer_id, chunks)`` and ``poll() -> [transfer_id]`` (``chunks``: one
        ``(device block ids, slot)`` per chunk; every id reported by ``poll`` exactly once, never
        blocking) and optionally ``close()``. ``kv_caches`` may then be None when ``layout`` is given.
        """
        return build_from_config(
            cls, config, kv_caches, layout=layout, namespace_fields=namespace_fields,
            tokens_per_block=tokens_per_block, num_workers=num_workers, pin=pin, tier_job_timeout=tier_job_timeout,
            dma=dma,
        )

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
        final = self._tiers.unique_name(name or handle.name, explicit=bool(name))
        handle.ctx.add_removed_listener(self._events.tier_removed(final))
        self._tiers.append(final, handle)
        return handle

    # -- listeners ---------------------------------------------------------------------
    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Call ``fn(event)`` for every :class:`CacheEvent`, on the engine thread, inside
        manager calls. A listener that raises is logged and kept."""
        self._events.add_listener(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        self._events.remove_listener(fn)

    # -- engine API --------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], *, tenant: str | None = None) -> LookupResult:
        """How many leading chunks of ``keys`` can be loaded, and from where. Never
        blocks; ``retry`` is set while the next chunk is being promoted or stored, or a
        tier answered RETRY for it.

        ``tenant`` (here, in :meth:`store` and in :meth:`load`; optional): whose chunks
        ``keys`` are. An encrypted tier with tenant keys seals and opens them with that
        tenant's key, bound to the tenant, or does not offload them for a tenant without one
        (docs/security.md#tenants). Give each tenant's chunks keys of their own (a salt in
        the chunk keys, like vLLM's ``cache_salt``): the host arena is shared."""
        keys = check_keys(keys)
        self._note_tenant(keys, tenant)
        self._progress()
        result = self._loads.lookup(keys, tenant)
        self._events.flush()
        return result

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed the KV of ``tokens`` prompt tokens in ``seconds`` (a prefill, or
        the prefill share of a step). With the tiers' load times, this is what :meth:`lookup` weighs
        to leave out a tier's chunks that would load slower than they recompute
        (``recompute_when_faster``, docs/configuration.md). Needs ``tokens_per_chunk``."""
        self.costs.observe_prefill(operator.index(tokens), float(seconds))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used, in the host cache and in every tier (eviction order)."""
        keys = check_keys(keys)
        for key in keys:
            self.cache.touch(key)
        self._tiers.touch(keys)

    def pin(self, keys: Sequence[bytes], *, ttl: float | None = None, hard: bool = False,
            tiers: Sequence[str] | None = None) -> PinResult:
        """Keep the chunks ``keys`` (a prefix: a system prompt) from eviction for ``ttl`` seconds
        (a soft pin, at most the ``max_ttl`` option) or, with ``hard=True``, until :meth:`unpin`:
        in the host cache and in each tier of ``tiers`` (default: every tier) that implements the
        optional ``pin`` hook. Each medium pins all the keys or refuses with a reason (its pinned
        share would pass its cap) in the :class:`~kvtiers.engine.pins.PinResult`; pinning a key
        again keeps the later end. A bad ``ttl`` or tier name, and keys that neither the host
        cache holds nor a tier pinned, are a ``ValueError`` of one line (nothing stays pinned).
        docs/pins.md."""
        keys = tuple(dict.fromkeys(check_keys(keys)))
        seconds = check_ttl(ttl, hard, self.pins.max_ttl)
        names = [t.name for t in self._tiers.tiers]
        if tiers is not None:
            unknown = [n for n in tiers if n not in names]
            if unknown:
                raise ValueError(f"pin: unknown tier {unknown[0]!r} (tiers: {', '.join(names) or 'none'})")
            names = list(tiers)
        self._progress()
        asked: dict[str, str | None] = {}
        for tier in self._tiers.tiers:
            if tier.name in names:
                try:
                    asked[tier.name] = tier.handle.pin(keys, seconds)
                except Exception as e:  # a tier's fault is its refusal, never the engine's
                    self._tiers.failed(tier, "pin", e)
                    asked[tier.name] = f"{type(e).__name__}: {e}"
        absent = [k for k in keys if k not in self.cache]
        if absent and not any(why is None for why in asked.values()):
            for tier in self._tiers.tiers:  # (none pinned; unpin is harmless)
                if tier.name in asked:
                    tier.handle.unpin(keys)
            why = "; ".join(f"{n}: {w}" for n, w in asked.items())
            raise ValueError(f"pin: {len(absent)} of {len(keys)} key(s) are stored nowhere that could pin them "
                             f"(first {absent[0].hex()[:16]}): not in the host cache{'; ' + why if why else ''}")
        for name, why in asked.items():
            self.pins.tier_counts[name, "pinned" if why is None else "refused"] += len(keys)
        host = self.pins.add(keys, seconds)
        until = None if seconds is None else self.pins.clock() + seconds
        return PinResult(keys, until, host, asked)

    def unpin(self, keys: Sequence[bytes], *, tiers: Sequence[str] | None = None) -> int:
        """End the lifetime pins of ``keys`` (soft or hard) in the host cache and in the tiers
        (``tiers``: default every tier); returns how many the host cache held."""
        keys = tuple(check_keys(keys))
        n = self.pins.remove(keys)
        for tier in self._tiers.tiers:
            if tiers is None or tier.name in tiers:
                try:
                    tier.handle.unpin(keys)
                    self.pins.tier_counts[tier.name, "unpinned"] += len(keys)
                except Exception as e:
                    self._tiers.failed(tier, "unpin", e)
        return n

    def store(self, keys: Sequence[bytes], device_blocks: Sequence[Any], request: Request | None = None,
              *, first_chunk: int = 0, state_slots: Sequence[int] | None = None,
              tenant: str | None = None) -> int | None:
        """Copy the chunks ``keys`` from ``device_blocks`` into the arena, then to every
        secondary tier. Returns the transfer id (reported by :meth:`get_finished` once
        the device blocks may be reused), or ``None`` for a cancelled request.

        ``device_blocks``: one sequence of ``blocks_per_chunk`` block ids per key, or one
        flat sequence of them. ``first_chunk``: the index of ``keys[0]`` in the request's
        token sequence (for the token limits of ``request``). A store longer than the arena
        has free slots runs in waves, as loads do: it is reported once its last wave is on the
        host; chunks that found no slot at all (every slot pinned by other transfers) are
        ``skipped_keys`` and the result's ``error`` says so.

        Hybrid models (see :mod:`kvtiers.engine.hybrid`): ``device_blocks`` may map each
        attention group's name to its blocks; ``state_slots``: one engine state slot per chunk,
        holding the SSM state after that chunk's last token (needed when the layout has SSM groups).
        ``tenant``: see :meth:`lookup`."""
        keys = check_keys(keys)
        blocks = self._chunk_specs(keys, device_blocks, load=False, state_slots=state_slots)
        self._note_tenant(keys, tenant)
        if request is not None and request.cancelled:
            return None
        self._progress()
        self._events.note_store(keys, request, first_chunk)  # self-describing KV events: tokens, block hashes
        limit = chunk_limit(request, max_offload_tokens=self.max_offload_tokens,
                            offload_prompt_only=self.offload_prompt_only, tokens_per_chunk=self.tokens_per_chunk)
        tid = self._stores.store(keys, blocks, request, limit, first_chunk, tenant)
        self._events.flush()
        return tid

    def load(self, keys: Sequence[bytes], device_blocks: Sequence[Any], request: Request | None = None,
             *, state_slot: int | None = None, tenant: str | None = None) -> int | None:
        """Copy the chunks ``keys`` into ``device_blocks``: from the arena, after promoting
        each chunk the arena lacks from the first tier that has it. Returns the transfer id,
        or ``None`` for a cancelled request. Chunks no tier has, or whose promotion
        fails, are reported as failed keys (recompute them). A load longer than the arena
        has free slots for runs in waves: each wave promotes what fits, copies it to the
        device and unpins it before the next. ``tenant``: see :meth:`lookup`."""
        keys = check_keys(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("load: duplicate keys")
        blocks = self._chunk_specs(keys, device_blocks, load=True, state_slot=state_slot)
        self._note_tenant(keys, tenant)
        if request is not None and request.cancelled:
            return None
        self._progress()
        self._stores.offered(keys, tenant, request)  # a load offers its chunks too: reuse ceiling, admission counts
        tr = self._transfers.start("load", keys, request, tenant)
        tr.blocks = dict(zip(keys, blocks, strict=True))
        self._loads.start_wave(tr, list(keys))
        self._events.flush()
        return tr.tid

    def _note_tenant(self, keys: tuple[bytes, ...], tenant: str | None) -> None:
        """Tell every encrypted tier that ``keys`` are ``tenant``'s (kvtiers.encryption.tenants)."""
        if check_tenant(tenant) is None:
            return
        for tier in self._tiers.tiers:
            note_tenant(tier.handle, keys, tenant)

    def _chunk_specs(self, keys: tuple[bytes, ...], device_blocks: Any, *, load: bool,
                     state_slots: Sequence[int] | None = None, state_slot: int | None = None) -> list[Any]:
        """What the DMA engine copies per chunk: plain block ids, or per group for hybrids."""
        layout = self.layout
        if layout is None or not (layout.is_hybrid or isinstance(device_blocks, Mapping)
                                  or state_slots is not None or state_slot is not None):
            if isinstance(device_blocks, Mapping) or state_slots is not None or state_slot is not None:
                raise ValueError("block ids per group and state slots need the manager's KV layout "
                                 "(TieringManager(layout=...) or from_config)")
            return split_blocks(keys, device_blocks, self.blocks_per_chunk)
        from .hybrid import chunk_specs

        tpb = self.tokens_per_chunk // self.blocks_per_chunk if self.tokens_per_chunk else None
        return chunk_specs(layout, keys, device_blocks, self.blocks_per_chunk, load=load, state_slots=state_slots,
                           state_slot=state_slot, tokens_per_block=tpb)

    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call (stores: the device blocks may be
        reused; loads: the device blocks hold the chunks not listed as failed). Drives
        every pending copy and tier job; never blocks, never raises for tier faults."""
        self._progress()
        finished = self._transfers.finished
        out = list(finished.values())
        finished.clear()
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
        finished = self._transfers.finished
        while True:
            self._progress()
            if all(t in finished for t in ids):
                return [finished.pop(t) for t in ids]
            if deadline is not None and time.monotonic() > deadline:
                left = [t for t in ids if t not in finished]
                raise TimeoutError(f"transfers {left} not finished after {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def pending(self) -> int:
        """Transfers and tier jobs not finished yet."""
        return self._transfers.pending() + self._loads.pending() + self._stores.pending() + self._tiers.pending()

    def close(self, timeout: float = 30.0) -> None:
        """Finish what is in flight (up to ``timeout`` seconds), then close the services, the
        DMA engine, every tier and the arena. Idempotent.

        Bounded: returns within ``timeout`` + :data:`CLOSE_GRACE` + :data:`CLOSE_DRAIN`
        seconds (plus the DMA engine's own close) even when a tier's job or its ``close()``
        never returns: tiers close in threads of their own, given what is left of
        ``timeout`` plus ``CLOSE_GRACE``. Tier jobs still unreported then are abandoned: the
        loads waiting for them report their keys failed with an error saying so, their slots
        stay pinned, and the arena is kept, never freed, so a tier thread that wakes up later
        writes memory nobody reuses (rule 6; docs/engine.md).

        Services (``services``) close at the same time as the tiers, each in a thread of its
        own, given what is left of ``timeout`` (at least :data:`SERVICE_CLOSE_MIN` s, and
        as long as the tiers take): one whose ``close()`` raises is reported and counted
        (:attr:`service_errors`) and the rest closes; one whose ``close()`` has not returned
        by then is abandoned with a warning, and the arena is kept as for abandoned tier jobs."""
        if self._closed:
            return
        t0 = time.monotonic()
        deadline = t0 + timeout
        while self.pending() and time.monotonic() < deadline:
            self._progress()
            time.sleep(0.001)
        if self.pending():
            log.warning("kvtiers: closing with %d transfer(s) or tier job(s) unfinished", self.pending())
        self._closed = True
        # services (before the arena goes: they release the pins they hold) and tiers close together
        services = self._services.start_close()
        services_end = max(deadline, time.monotonic() + SERVICE_CLOSE_MIN)
        self._tiers.close(max(0.0, deadline - time.monotonic()) + CLOSE_GRACE)
        self._services.wait(services, services_end)
        self._tiers.poll()  # rule 9: results of jobs finished by close
        abandoned = self._tiers.abandon(f"abandoned at close: not reported within {time.monotonic() - t0:.3g} s")
        self._stores.close()  # store waves still waiting for slots: the rest is skipped
        drain = time.monotonic() + CLOSE_DRAIN  # the device copies of loads those failures ended
        while self._transfers.pending() and time.monotonic() < drain:
            self._transfers.poll_dma()
            time.sleep(0.001)
        self._events.flush()
        self._events.close()  # KV event publisher, metrics server: after the last events
        close = getattr(self.dma, "close", None)
        if close is not None:
            close()
        if self.host is not None and (abandoned or self._services.abandoned):
            _KEPT_ARENAS.append(self.host)
            log.warning("kvtiers: %d tier job(s) and %d service(s) abandoned at close; the host arena (%d bytes) is "
                        "kept, not freed, for as long as the process lives", len(abandoned),
                        len(self._services.abandoned), len(self.arena) * self.arena.slot_bytes)
        elif self.host is not None:
            self.host.close()

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _progress(self) -> None:
        """Poll the DMA engine and every tier; advance whatever finished."""
        self._transfers.poll_dma()
        self._tiers.poll()
        self._stores.poll()  # store waves waiting for slots the tiers just released
        self._services.poll()  # one that raises is reported, closed and dropped
        self._tiers.check_lost(self.tier_job_timeout)
        self._events.flush()

