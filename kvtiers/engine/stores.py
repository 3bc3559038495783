"""The way out of the device: stores into the host arena, then the cascade to every tier.

A store admits the chunks the host cache does not hold yet (within the request's token
limit and the cache's ``store_threshold``) into new slots and copies them device -> arena.
Once the copy completes, the chunks are ready in the host cache and each tier that does not
have them yet gets a store job reading their slots.

A store longer than the arena has free slots for runs in waves, as loads do: each wave
takes the slots it can get, copies its chunks, cascades them, and the next wave starts once
slots are free again (when the tiers have stored the previous wave, its slots become
evictable). A first wave that gets no slot at all (every slot pinned by other transfers)
skips its chunks; so does a later wave whose previous wave's slots are released without
freeing one, or that waited ``wave_timeout`` seconds. The store is reported once its last
wave is on the host: until then the engine keeps its device blocks.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

from ..types import Lookup
from .events import HOST, EventBus
from .hostcache import READY, STORING, HostCache
from .loads import LoadPath
from .reuse import ReuseEstimator
from .tiers import Tier, TierJob, TierSet
from .transfers import Transfer, TransferBook
from .types import ManagerStats, Request

__all__ = ["StorePath", "chunk_limit"]

WAVE_TIMEOUT = 30.0  # seconds a later store wave waits for a free slot before skipping its chunks


class StorePath:
    """Stores and their cascade to the tiers. A store's slots are pinned by its
    :class:`~kvtiers.engine.transfers.Transfer` and then by its tier jobs; the only state of its
    own is the stores waiting for slots for their next wave."""

    def __init__(self, cache: HostCache, tiers: TierSet, book: TransferBook, loads: LoadPath, events: EventBus,
                 stats: ManagerStats, chunk_bytes: int) -> None:
        self._cache = cache
        self._tiers = tiers
        self._book = book
        self._loads = loads  # told when a slot is filled: loads may wait on a chunk being stored
        self._events = events
        self._stats = stats
        self._chunk_bytes = chunk_bytes
        self._waiting: dict[int, Transfer] = {}  # stores between waves, by transfer id
        self._polling = False
        self.wave_timeout = WAVE_TIMEOUT
        # write-back admission (kvtiers.engine.admission): chunks in the host that tiers get when evicted
        self._dirty: dict[bytes, tuple[str | None, list[Tier]]] = {}  # key -> (tenant, write-back tiers)
        self._writing_back: set[bytes] = set()  # keys whose write-back job has not ended
        self._submitting = False  # inside a write-back's submit: a job ending at once must not start a wave
        write_back = weakref.WeakMethod(self._write_back)  # weakly: no cycle keeps a closed manager's arena
        cache.write_back = lambda key, slot: (fn := write_back()) is not None and fn(key, slot)
        cache.is_dirty = self._dirty.__contains__
        self.reuse = ReuseEstimator()  # the reuse ceiling of the keys offered (kvtiers.engine.reuse)

    def store(self, keys: tuple[bytes, ...], blocks: list[Sequence[int]], request: Request | None,
              limit: int | None, first_chunk: int, tenant: str | None) -> int:
        """Start the device -> arena copy of the chunks of ``keys`` worth storing; returns
        the transfer id. ``limit``: the chunk index (in the request) storing stops at.
        Chunks that find no free slot wait for the next wave (see the module docstring).
        ``tenant``: whose chunks; every wave's tier calls carry it."""
        tr = self._book.start("store", keys, request, tenant)
        self.offered(keys, tenant, request)
        admitted: list[bytes] = []
        for j, key in enumerate(keys):
            if (limit is not None and first_chunk + j >= limit) or key in self._cache:
                self._cache.touch(key)
                tr.skipped.append(key)
                continue
            if not self._cache.offer(key):
                tr.skipped.append(key)
                continue
            tr.blocks.setdefault(key, blocks[j])
            admitted.append(key)
        self._stats.skipped_stores += len(tr.skipped)
        tr.deferred = admitted
        state = self._wave(tr, give_up=True)
        if state == "done":
            self._book.finish(tr)
        elif state == "waiting":
            tr.wave_t0 = time.monotonic()
            self._waiting[tr.tid] = tr
        return tr.tid

    def poll(self) -> None:
        """Start the next wave of every store waiting for free slots (with a synchronous DMA
        engine, every wave that can start now). Called when a wave reached the host, when a
        tier store job ended, and by the manager each step (for ``wave_timeout``)."""
        if self._polling:  # a wave started from here completed synchronously: the loop below goes on
            return
        self._polling = True
        try:
            self._poll()
        finally:
            self._polling = False

    def _poll(self) -> None:
        for tid in list(self._waiting):
            while tid in self._waiting:
                tr = self._waiting.pop(tid)
                if tr.request is not None and tr.request.cancelled:
                    self._skip_rest(tr, None)
                    self._book.finish(tr)
                    break
                # while the tiers still read the previous wave's slots, those will come free: wait
                ours = any(self._cache.slot(k) is not None and self._cache.refs(self._cache.slot(k))
                           for k in tr.wave_keys)
                waited = time.monotonic() - tr.wave_t0
                state = self._wave(tr, give_up=not ours or waited >= self.wave_timeout, waited=waited)
                if state == "waiting":
                    self._waiting[tid] = tr
                    break
                if state == "done":
                    self._book.finish(tr)
                    break
                # started: a synchronous copy is done already and the store is waiting again

    def pending(self) -> int:
        """Stores waiting for slots for their next wave."""
        return len(self._waiting)

    def close(self) -> None:
        """The manager is closing: stores still waiting for a wave skip their other chunks."""
        for tr in list(self._waiting.values()):
            self._skip_rest(tr, f"not stored: the manager closed before a slot was free for "
                                f"{len(tr.deferred)} chunk(s)")
            self._book.finish(tr)
        self._waiting.clear()

    def _wave(self, tr: Transfer, *, give_up: bool, waited: float | None = None) -> str:
        """Allocate slots for as many of ``tr.deferred`` as possible and start their device
        copy: ``"started"``. With no slot free: ``"waiting"``, or with ``give_up`` the rest is
        skipped: ``"done"`` (finish the transfer), as when nothing was left to store."""
        todo: list[tuple[bytes, Sequence[int], int]] = []
        rest: list[bytes] = []
        for key in tr.deferred:
            if rest:
                rest.append(key)
                continue
            if key in self._cache:  # stored or promoted meanwhile
                tr.skipped.append(key)
                self._stats.skipped_stores += 1
                continue
            slot = self._cache.allocate(key, STORING)
            if slot is None:
                rest.append(key)
                continue
            todo.append((key, tr.blocks[key], slot))
        tr.deferred = rest
        if not todo:
            if not rest:
                return "done"
            if not give_up or (self._writing_back and (waited or 0.0) < self.wave_timeout):
                return "waiting"  # (write-backs in flight free their slots once the tiers report)
            after = "" if waited is None else f" after {waited:.3g} s"
            self._skip_rest(tr, f"host arena full: {len(rest)} chunk(s) not stored, every one of its "
                                f"{self._cache.num_slots} slots pinned by other transfers{after}")
            return "done"
        try:
            self._book.copy(tr, [(b, s) for _, b, s in todo])
        except BaseException:
            for key, _, slot in todo:
                self._cache.unpin(slot)
                self._cache.drop(key)
            raise
        tr.pins = {key: slot for key, _, slot in todo}
        self._book.poll_dma()  # a synchronous engine is done already
        return "started"

    def _skip_rest(self, tr: Transfer, error: str | None) -> None:
        """The chunks still deferred are not stored: skipped, counted, and said in ``error``."""
        if not tr.deferred:
            return
        if error is not None:
            self._stats.host_full += len(tr.deferred)
            tr.error = error
        self._stats.skipped_stores += len(tr.deferred)
        tr.skipped.extend(tr.deferred)
        tr.deferred = []

    # -- handlers the manager registers with the transfer book and the tiers ---------------
    def copied(self, tr: Transfer) -> None:
        """A store's device -> arena copy completed: the chunks are ready; cascade them."""
        now = time.perf_counter()
        items = list(tr.pins.items())
        self._stats.stored_chunks += len(items)
        self._stats.paths[f"device->{HOST}"].add(len(items) * self._chunk_bytes, len(items),
                                                 tr.dma_started or tr.t0, now)
        for key, _ in items:
            self._loads.filled(key, True, "offloaded")
        self._cascade(items, tr.tenant)  # pins the slots again for the tier jobs
        if not tr.deferred:
            self._book.finish(tr)  # drops the copy's pins
            return
        tr.wave_keys = [k for k, _ in items]
        for _, slot in items:  # the wave is on the host: its slots may go once the tiers have them
            self._cache.unpin(slot)
        tr.pins = {}
        tr.wave_t0 = time.monotonic()
        self._waiting[tr.tid] = tr
        self.poll()  # with no tier to wait for, the next wave can start now

    def tier_stored(self, tj: TierJob, failed: set[bytes]) -> None:
        """A tier store job ended: release its pins, report what the tier now holds."""
        for s in tj.job.slots:
            self._cache.unpin(s)
        if self._writing_back:
            self._writing_back.difference_update(tj.job.keys)
        self._events.emit("stored", [k for k in tj.job.keys if k not in failed], tj.tier.name, None)
        if self._waiting and not self._submitting:  # slots came free: a store waiting for a wave may go on
            self.poll()

    # -- admission (kvtiers.engine.admission) -------------------------------------------------
    def offered(self, keys: tuple[bytes, ...], tenant: str | None, request: Request | None = None) -> None:
        """The engine offered ``keys`` (it stores them, or loads them instead of computing them
        again): count them for the reuse ceiling and for each tier's ``min_offers``. A key
        ``request`` offered already is not counted again: a load that failed (no free slot, a
        tier's error) and the store of the recomputed chunk are one offer, else a busy arena
        would raise the ceiling and admit a chunk seen by one request."""
        if request is not None:
            seen = request.offered
            keys = tuple(k for k in keys if k not in seen)
            seen.update(keys)
            if not keys:
                return
        self.reuse.offer(keys)
        self._offer(keys, tenant)

    def _offer(self, keys: tuple[bytes, ...], tenant: str | None) -> None:
        """Count an offer of each of ``keys`` for every tier with ``min_offers``; a chunk
        already in the host arena whose offer met a tier's threshold goes down now (written
        through) or is marked for write-back."""
        for tier in self._tiers.tiers:
            adm = tier.admission
            if adm is None or adm.counter is None:
                continue
            met = [k for k in keys if adm.offer(k) and self._cache.state(k) == READY]
            if not met:
                continue
            if adm.write_back:
                for k in met:
                    self._mark_dirty(k, tenant, tier)
                continue
            answers = self._tiers.lookup(tier, met, tenant=tenant)
            todo = [(k, self._cache.pin(k)) for k, a in zip(met, answers, strict=True) if a is not Lookup.HIT]
            if todo:
                adm.admitted += len(todo)
                self._tiers.submit(tier, "store", todo, tenant=tenant)

    def _admit(self, tier: Tier, keys: list[bytes], tenant: str | None) -> list[bytes]:
        """Which of freshly stored ``keys`` go down to ``tier`` now; the rest are declined or
        wait for write-back."""
        adm = tier.admission
        if adm is None:
            return keys
        out = []
        for k in keys:
            if not adm.admits(k):
                adm.declined += 1
            elif adm.write_back:
                self._mark_dirty(k, tenant, tier)
            else:
                adm.admitted += 1
                out.append(k)
        return out

    def _mark_dirty(self, key: bytes, tenant: str | None, tier: Tier) -> None:
        entry = self._dirty.setdefault(key, (tenant, []))
        if tier not in entry[1]:
            entry[1].append(tier)
            assert tier.admission is not None
            tier.admission.deferred += 1
        if len(self._dirty) > 2 * self._cache.num_slots:  # keys dropped from the host without an eviction
            for k in [k for k in self._dirty if k not in self._cache]:
                del self._dirty[k]

    def _write_back(self, key: bytes, slot: int) -> bool:
        """The host cache is about to evict ``key``: send it to the write-back tiers that lack
        it, its slot pinned until each reports. True when a job started (the slot is pinned)."""
        entry = self._dirty.pop(key, None)
        if entry is None:
            return False
        tenant, tiers = entry
        started = False
        self._submitting = True
        try:
            for tier in tiers:
                if self._tiers.lookup(tier, [key], tenant=tenant)[0] is Lookup.HIT:
                    continue
                assert tier.admission is not None
                tier.admission.admitted += 1
                self._cache.pin(key)
                started = True
                self._writing_back.add(key)
                self._tiers.submit(tier, "store", [(key, slot)], tenant=tenant)
        finally:
            self._submitting = False
        return started and self._cache.is_pinned(slot)

    def _cascade(self, items: list[tuple[bytes, int]], tenant: str | None) -> None:
        """Send freshly stored chunks (``tenant``'s) to every tier that does not have them yet."""
        for tier in self._tiers.tiers:
            admitted = set(self._admit(tier, [k for k, _ in items], tenant)) if tier.admission else None
            down = items if admitted is None else [(k, s) for k, s in items if k in admitted]
            if not down:
                continue
            answers = self._tiers.lookup(tier, [k for k, _ in down], tenant=tenant)
            todo = [(k, s) for (k, s), a in zip(down, answers, strict=True) if a is not Lookup.HIT]
            if not todo:
                continue
            for key, _ in todo:
                self._cache.pin(key)
            self._tiers.submit(tier, "store", todo, tenant=tenant)


def chunk_limit(request: Request | None, *, max_offload_tokens: int | None, offload_prompt_only: bool,
                tokens_per_chunk: int | None) -> int | None:
    """The chunk index a store stops at: the smallest of the configured and the request's
    token limits (the prompt, with ``offload_prompt_only``), in chunks; ``None`` for none."""
    limits = []
    if max_offload_tokens is not None:
        limits.append(max_offload_tokens)
    if request is not None:
        if request.max_offload_tokens is not None:
            limits.append(request.max_offload_tokens)
        if offload_prompt_only and request.num_prompt_tokens is not None:
            limits.append(request.num_prompt_tokens)
    if not limits:
        return None
    if not tokens_per_chunk:
        raise ValueError("token limits need tokens_per_chunk (give tokens_per_block to from_config)")
    return min(limits) // tokens_per_chunk
