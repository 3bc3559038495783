"""A primary-tier (host arena) policy for vLLM that keeps hitting under cyclic reuse.

vLLM's CPU primary tier takes a ``CachePolicy`` (``eviction_policy``: ``"lru"``, ``"arc"``, or
a class from ``cache_policy_module_path``). Under LRU, a cycle of reuse larger than the cache
(conversations taken in turn, each turn reading its whole history again) evicts every chunk
just before it is used again: no hit at all. ``kvtiers_bip`` is bimodal insertion (BIP,
Qureshi et al., ISCA 2007): a new chunk enters at the *old* end, so it is the first to go
unless it is used again first; a chunk that a request reuses moves to the new end; one insert
in ``BIP_EVERY`` enters at the new end instead, so the resident set still turns over when the
workload moves on. Under a cycle larger than the cache the chunks that got in stay and hit on
every round; where LRU already hits, reused chunks are ordered as LRU orders them. A chunk
promoted from a kvtiers secondary tier is a use: it goes to the new end (``promoted``).

Registered as ``"kvtiers_bip"`` by kvtiers' vLLM plugin; elsewhere name the class:
``"eviction_policy": "BipCachePolicy", "cache_policy_module_path":
"kvtiers.integrations.vllm.policy"``. Written against vLLM's abstract ``CachePolicy`` only
(vLLM 0.32-0.34), not a subclass of its LRU, whose internals change between releases.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

#: one insert in this many enters at the new end (BIP's epsilon, 1/32)
BIP_EVERY = 32
NAME = "kvtiers_bip"


class BipCachePolicy(CachePolicy):
    """Bimodal insertion over one recency order (see the module). Ranks only grow at the new
    end and only shrink at the old end; evictable chunks sit in a min-heap of rank with lazy
    invalidation, so insert, reuse and eviction are O(log n)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._rank: dict[OffloadKey, int] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[int, OffloadKey]] = []
        self._new_end = 0  # the next rank at the new end is above this
        self._old_end = 0  # ... and at the old end below this
        self._inserts = 0

    def _place(self, key: OffloadKey, rank: int) -> None:
        self._rank[key] = rank
        if key in self._evictable:
            heapq.heappush(self._heap, (rank, key))
            if len(self._heap) > max(64, 4 * len(self._evictable)):  # drop stale entries now and then
                self._heap = [(self._rank[k], k) for k in self._evictable]
                heapq.heapify(self._heap)

    def _to_new_end(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self.chunks:
                self._new_end += 1
                self._place(key, self._new_end)

    def promoted(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` are being promoted from a secondary tier for a request: to the new end.
        Their insert put them at the old end, where the next stores would take them before
        the request reads them (it reads them a step later) and they would be promoted again.
        Called by kvtiers' secondary tiers (``KvtiersOffloadingSpec`` wires it)."""
        self._to_new_end(keys)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None) -> None:
        """A new chunk: at the old end, or (one in ``BIP_EVERY``) at the new end."""
        self.chunks[key] = chunk
        self._inserts += 1
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
        if self._inserts % BIP_EVERY == 0:
            self._new_end += 1
            self._place(key, self._new_end)
        else:
            self._old_end -= 1
            self._place(key, self._old_end)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._rank.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A use of ``keys`` (head first): to the new end, the head newest."""
        self._to_new_end(reversed(list(keys)))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A miss is not a use: the chunk it brings in enters by :meth:`insert`'s rule."""

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        """The chunks the request reused go to the new end (head newest); those it only
        inserted stay where :meth:`insert` put them."""
        order = order_request_keys(key_groups, req_context)
        self._to_new_end(reversed([k for k in order if k in reused_keys]))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """The ``n`` evictable chunks nearest the old end, not in ``protected``; None (and
        nothing changed) if there are fewer."""
        if n == 0:
            return []
        picked: list[tuple[int, OffloadKey]] = []
        skipped: list[tuple[int, OffloadKey]] = []
        seen: set[OffloadKey] = set()
        while self._heap and len(picked) < n:
            rank, key = entry = heapq.heappop(self._heap)
            if key not in self._evictable or self._rank.get(key) != rank or key in seen:
                continue  # stale
            seen.add(key)
            (skipped if key in protected else picked).append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(picked) < n:
            for entry in picked:
                heapq.heappush(self._heap, entry)
            return None
        out = []
        for _, key in picked:
            self._evictable.discard(key)
            del self._rank[key]
            out.append((key, self.chunks.pop(key)))
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._rank.clear()
        self._evictable.clear()
        self._heap.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._rank[key], key))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


def register() -> None:
    """Make ``"eviction_policy": "kvtiers_bip"`` name :class:`BipCachePolicy` (once per process)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    if NAME not in CachePolicyFactory._registry:
        CachePolicyFactory.register_cache_policy(NAME, __name__, "BipCachePolicy")
