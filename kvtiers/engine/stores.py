"""The way out of the device: stores into the host arena, then the cascade to every tier.

A store admits the chunks the host cache does not hold yet (within the request's token
limit and the cache's ``store_threshold``) into new slots and copies them device -> arena.
Once the copy completes, the chunks are ready in the host cache and each tier that does not
have them yet gets a store job reading their slots.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..types import Lookup
from .events import HOST, EventBus
from .hostcache import STORING, HostCache
from .loads import LoadPath
from .tiers import TierJob, TierSet
from .transfers import Transfer, TransferBook
from .types import ManagerStats, Request

__all__ = ["StorePath", "chunk_limit"]


class StorePath:
    """Stores and their cascade to the tiers. Holds no state of its own: a store's slots are
    pinned by its :class:`~kvtiers.engine.transfers.Transfer` and then by its tier jobs."""

    def __init__(self, cache: HostCache, tiers: TierSet, book: TransferBook, loads: LoadPath, events: EventBus,
                 stats: ManagerStats, chunk_bytes: int) -> None:
        self._cache = cache
        self._tiers = tiers
        self._book = book
        self._loads = loads  # told when a slot is filled: loads may wait on a chunk being stored
        self._events = events
        self._stats = stats
        self._chunk_bytes = chunk_bytes

    def store(self, keys: tuple[bytes, ...], blocks: list[Sequence[int]], request: Request | None,
              limit: int | None, first_chunk: int) -> int:
        """Start the device -> arena copy of the chunks of ``keys`` worth storing; returns
        the transfer id. ``limit``: the chunk index (in the request) storing stops at."""
        tr = self._book.start("store", keys, request)
        todo: list[tuple[bytes, Sequence[int], int]] = []
        for j, key in enumerate(keys):
            if (limit is not None and first_chunk + j >= limit) or key in self._cache:
                self._cache.touch(key)
                tr.skipped.append(key)
                continue
            if not self._cache.offer(key):
                tr.skipped.append(key)
                continue
            slot = self._cache.allocate(key, STORING)
            if slot is None:
                self._stats.host_full += 1
                tr.skipped.append(key)
                continue
            todo.append((key, blocks[j], slot))
        self._stats.skipped_stores += len(tr.skipped)
        if todo:
            try:
                self._book.copy(tr, [(b, s) for _, b, s in todo])
            except BaseException:
                for key, _, slot in todo:
                    self._cache.unpin(slot)
                    self._cache.drop(key)
                raise
            tr.pins = {key: slot for key, _, slot in todo}
            self._book.poll_dma()  # a synchronous engine is done already
        else:
            self._book.finish(tr)
        return tr.tid

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
        self._cascade(items)  # pins the slots again for the tier jobs
        self._book.finish(tr)  # drops the copy's pins

    def tier_stored(self, tj: TierJob, failed: set[bytes]) -> None:
        """A tier store job ended: release its pins, report what the tier now holds."""
        for s in tj.job.slots:
            self._cache.unpin(s)
        self._events.emit("stored", [k for k in tj.job.keys if k not in failed], tj.tier.name, None)

    def _cascade(self, items: list[tuple[bytes, int]]) -> None:
        """Send freshly stored chunks to every tier that does not have them yet."""
        for tier in self._tiers.tiers:
            answers = self._tiers.lookup(tier, [k for k, _ in items])
            todo = [(k, s) for (k, s), a in zip(items, answers, strict=True) if a is not Lookup.HIT]
            if not todo:
                continue
            for key, _ in todo:
                self._cache.pin(key)
            self._tiers.submit(tier, "store", todo)


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
