"""The host-memory chunk store of a standalone peer server: LRU under a byte capacity,
chunks kept per namespace, each namespace optionally capped by its clients' ``max_bytes``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class MemoryStore:
    """Chunks by ``(namespace digest, key)``: the received frame (kept zero-copy) and its xxh3.

    ``capacity`` bounds all namespaces together; :meth:`put` returns the keys it evicted
    (least recently used first) so the server can tell the storing client. ``removed`` counts
    evictions per namespace (what ``ctx.removed`` reports on the client side).
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.bytes = 0
        self._lru: OrderedDict[tuple[str, bytes], tuple[Any, int, int]] = OrderedDict()
        self._ns_bytes: dict[str, int] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def has(self, ns: str, key: bytes) -> bool:
        return (ns, key) in self._lru

    def get(self, ns: str, key: bytes) -> tuple[Any, int] | None:
        """``(buffer, xxh3)`` of a chunk, marked recently used; ``None`` when absent."""
        item = self._lru.get((ns, key))
        if item is None:
            return None
        self._lru.move_to_end((ns, key))
        return item[0], item[1]

    def put(self, ns: str, key: bytes, data: Any, digest: int, size: int, quota: int | None) -> list[bytes] | None:
        """Keep ``data`` under ``(ns, key)``; evict to fit ``capacity`` and ``quota`` (the
        namespace's cap). Returns the evicted keys of ``ns``, or ``None`` when the chunk can
        never fit. A key already stored is kept (idempotent) and marked recently used."""
        limit = min(self.capacity, quota) if quota is not None else self.capacity
        if size > limit:
            return None
        k = (ns, key)
        if k in self._lru:
            self._lru.move_to_end(k)
            return []
        self._lru[k] = (data, digest, size)
        self.bytes += size
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + size
        evicted: list[bytes] = []
        while self.bytes > self.capacity:
            (ens, ekey), _ = self._pop_oldest(None)
            if ens == ns:
                evicted.append(ekey)
        if quota is not None:
            while self._ns_bytes.get(ns, 0) > quota:
                (_, ekey), _ = self._pop_oldest(ns)
                evicted.append(ekey)
        return evicted

    def _pop_oldest(self, ns: str | None) -> tuple[tuple[str, bytes], Any]:
        if ns is None:
            k, item = self._lru.popitem(last=False)
        else:
            k = next(x for x in self._lru if x[0] == ns)
            item = self._lru.pop(k)
        self.bytes -= item[2]
        self._ns_bytes[k[0]] -= item[2]
        self.evictions += 1
        return k, item
