"""The way back to the device: lookups, load waves, and promotions from the tiers.

A lookup asks the host cache, then the tiers in order. A load runs in waves: each wave pins
the slots of the chunks the arena has, promotes the others from the first tier that has
them into new slots, and once nothing is being filled copies the pinned slots to the
device and unpins them. Chunks that find no free slot wait for the next wave.

Slots being filled (by a store's device copy or a promotion) have loads waiting on them;
:meth:`LoadPath.filled` is told when a fill ends, from whichever path filled the slot.
"""

from __future__ import annotations

import time
from collections import defaultdict

from ..types import Lookup
from .costs import LoadCosts
from .events import HOST, EventBus, log
from .hostcache import LOADING, READY, HostCache
from .tiers import Tier, TierJob, TierSet
from .transfers import Transfer, TransferBook
from .types import LookupResult, ManagerStats

__all__ = ["LoadPath"]


class LoadPath:
    """Lookups and loads, and the loads waiting for slots being filled.

    Owns the loads waiting for their wave's fills (by transfer id) and, per key being
    filled, the loads waiting for it; shares the host cache, the tiers, the transfer book,
    the event bus and the stats with the manager's other parts.
    """

    def __init__(self, cache: HostCache, tiers: TierSet, book: TransferBook, events: EventBus,
                 stats: ManagerStats, chunk_bytes: int) -> None:
        self._cache = cache
        self._tiers = tiers
        self._book = book
        self._events = events
        self._stats = stats
        self._chunk_bytes = chunk_bytes
        self._waiting: dict[int, Transfer] = {}  # loads waiting for fills
        self._waiters: dict[bytes, list[Transfer]] = defaultdict(list)  # key being filled -> loads
        self.costs: LoadCosts | None = None  # load or recompute (kvtiers.engine.costs): set by the manager
        self.tokens_per_chunk: int | None = None

    def pending(self) -> int:
        """Loads waiting for fills."""
        return len(self._waiting)

    def lookup(self, keys: tuple[bytes, ...], tenant: str | None) -> LookupResult:
        """How many leading chunks of ``keys`` (``tenant``'s) can be loaded, and from where."""
        sources: list[str | None] = [None] * len(keys)
        pending = [False] * len(keys)
        ask: list[int] = []
        for i, key in enumerate(keys):
            st = self._cache.state(key)
            if st == READY:
                sources[i] = HOST
            elif st is not None:
                pending[i] = True
            else:
                ask.append(i)
        # only what could extend the prefix is worth asking: up to the first pending key
        first_pending = next((i for i, p in enumerate(pending) if p), len(keys))
        ask = [i for i in ask if i < first_pending]
        for tier in self._tiers.tiers:
            if not ask:
                break
            answers = self._tiers.lookup(tier, [keys[i] for i in ask], tenant=tenant)
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
        if self.costs is not None and out:
            end = self.costs.cut(out, self.tokens_per_chunk, HOST, self._tiers.loading())
            if end < len(out):  # a tier's load would lose: the engine recomputes from there
                out, retry = out[:end], False
        return LookupResult(len(out), tuple(out), retry)

    def start_wave(self, tr: Transfer, keys: list[bytes]) -> None:
        """Pin the slots of ``keys`` in the host cache, promote the others, and copy to the
        device once they are filled. Keys that find no free slot wait for the next wave;
        a wave that can pin nothing fails them (all slots are busy: recompute)."""
        missing: list[bytes] = []
        for key in keys:
            st = self._cache.state(key)
            if st is None:
                missing.append(key)
                continue
            tr.pins[key] = self._cache.pin(key)
            tr.sources[key] = HOST
            self._cache.touch(key)
            if st != READY:
                tr.waiting.add(key)
                self._waiters[key].append(tr)
        if missing:
            self._promote(tr, missing)
        if tr.deferred and not tr.pins:
            self._stats.host_full += len(tr.deferred)
            tr.failed.update(tr.deferred)
            tr.deferred = []
        self._waiting[tr.tid] = tr
        self._maybe_copy_in(tr)

    def filled(self, key: bytes, ok: bool, reason: str) -> None:
        """A store copy or a promotion into the slot of ``key`` ended."""
        if ok:
            self._cache.mark_ready(key)
            self._events.emit("stored", (key,), HOST, reason)
        else:
            self._cache.drop(key)
        for tr in self._waiters.pop(key, ()):
            tr.waiting.discard(key)
            if not ok:
                tr.failed.add(key)
                self._cache.unpin(tr.pins.pop(key))
            self._maybe_copy_in(tr)

    # -- handlers the manager registers with the transfer book and the tiers ---------------
    def copied(self, tr: Transfer) -> None:
        """A wave's arena -> device copy completed."""
        tr.copied.update(tr.pins)
        n = len(tr.pins)
        self._stats.paths[f"{HOST}->device"].add(n * self._chunk_bytes, n, tr.dma_started or tr.t0,
                                                 time.perf_counter())
        self._wave_done(tr)

    def promoted(self, tj: TierJob, failed: set[bytes]) -> None:
        """A promotion job ended: release its pins and end the fills of its keys."""
        job = tj.job
        if tj.lost:  # its keys were failed already; the slots were kept pinned until now
            for s in job.slots:
                self._cache.unpin(s)
            return
        for key, slot in zip(job.keys, job.slots, strict=True):
            self._cache.unpin(slot)
            self.filled(key, key not in failed, "promoted")

    def lost(self, tj: TierJob, error: str | None = None) -> None:
        """A promotion job timed out or was abandoned: fail its keys (its slots stay pinned
        until it ends); ``error`` becomes the error of the loads waiting for them."""
        for key in tj.job.keys:
            for tr in self._waiters.get(key, ()):
                tr.error = tr.error or error
            self.filled(key, False, "lost")

    # -- internals -----------------------------------------------------------------------
    def _promote(self, tr: Transfer, keys: list[bytes]) -> None:
        """Start tier loads for ``keys`` (absent from the host cache) into new slots."""
        route: dict[bytes, Tier] = {}
        ask = list(keys)
        for tier in self._tiers.tiers:
            if not ask:
                break
            answers = self._tiers.lookup(tier, ask, tenant=tr.tenant)
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
            slot = self._cache.allocate(key, LOADING) if not tr.deferred else None
            if slot is None:
                tr.deferred.append(key)
                continue
            tr.pins[key] = self._cache.pin(key)  # the load's pin; allocate's pin is the job's
            tr.sources[key] = tier.name
            tr.waiting.add(key)
            self._waiters[key].append(tr)
            per_tier[id(tier)].append((key, slot))
        for tier in self._tiers.tiers:
            items = per_tier.get(id(tier))
            if items:
                self._tiers.submit(tier, "load", items, tenant=tr.tenant)

    def _maybe_copy_in(self, tr: Transfer) -> None:
        """Start the arena -> device copy of a load once nothing is being filled for it."""
        if tr.waiting or tr.tid not in self._waiting:
            return
        del self._waiting[tr.tid]
        if tr.request is not None and tr.request.cancelled:
            tr.failed.update(tr.deferred)
            tr.deferred = []
            self._book.finish(tr)
            return
        chunks = [(tr.blocks[k], s) for k, s in tr.pins.items()]
        if not chunks:
            self._wave_done(tr)
            return
        try:
            self._book.copy(tr, chunks)
        except Exception as e:
            log.error("kvtiers: device copy of load %d failed to start: %s: %s", tr.tid, type(e).__name__, e)
            tr.error = f"{type(e).__name__}: {e}"
            tr.failed.update(tr.pins)
            tr.failed.update(tr.deferred)
            tr.deferred = []
            self._book.finish(tr)
            return
        self._book.poll_dma()

    def _wave_done(self, tr: Transfer) -> None:
        """A load's wave is on the device: unpin it, start the next wave or finish."""
        if not tr.deferred or (tr.request is not None and tr.request.cancelled):
            self._book.finish(tr)
            return
        for slot in tr.pins.values():
            self._cache.unpin(slot)
        tr.pins = {}
        keys, tr.deferred = tr.deferred, []
        self.start_wave(tr, keys)
