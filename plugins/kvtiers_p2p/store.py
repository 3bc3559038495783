"""The host-memory chunk store of a standalone peer server: LRU under a byte capacity,
chunks kept per namespace, each namespace optionally capped by its clients' ``max_bytes``.

Chunks live in buffers of a per-size pool, carved from pre-faulted anonymous mappings and
reused after eviction, so a PUT is received straight into memory that is already mapped (a
fresh allocation per chunk costs page faults that halve the push rate). GETs send a buffer
zero-copy: pyzmq holds a reference to the buffer's memoryview until libzmq has sent it, so a
buffer whose chunk was evicted meanwhile is reused only once that reference is gone (its
reference count is back to ours). That costs nothing per send, where a MessageTracker per
message costs about 30 us.
"""

from __future__ import annotations

import mmap
import sys
from collections import OrderedDict, deque
from typing import Any

SLAB_BYTES = 64 << 20  #: buffers are mapped this many bytes at a time
IDLE_REFS = 2  #: sys.getrefcount of a pooled buffer nobody else holds (a local name + the argument)


class _Pool:
    """Free buffers of one size."""

    def __init__(self, size: int, on_slab: Any = None) -> None:
        self.size = size
        self.on_slab = on_slab
        self.free: list[memoryview] = []
        self.busy: deque[memoryview] = deque()  # evicted, maybe still being sent
        self.maps: list[mmap.mmap] = []

    def take(self, budget: int) -> memoryview:
        if not self.free and self.busy:
            keep: deque = deque()
            while self.busy:
                buf = self.busy.popleft()
                # references: `buf` here and getrefcount's argument; more means ZMQ still sends it
                (self.free if sys.getrefcount(buf) <= IDLE_REFS else keep).append(buf)
            self.busy = keep
        if not self.free:
            n = max(1, min(SLAB_BYTES, budget) // self.size)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(-1, n * self.size, flags=flags)
            self.maps.append(m)
            mv = memoryview(m)
            if self.on_slab is not None:
                self.on_slab(mv)
            self.free.extend(mv[i * self.size : (i + 1) * self.size] for i in range(n))
        return self.free.pop()

    def give(self, buf: memoryview, sent: bool) -> None:
        """Take back ``buf``; ``sent``: it may still be referenced by a zero-copy send."""
        (self.busy if sent else self.free).append(buf)


class MemoryStore:
    """Chunks by ``(namespace digest, key)``: a pooled buffer, its xxh3, its size and
    whether it was ever sent (zero-copy).

    A PUT takes a buffer with :meth:`reserve` (evicting to fit ``capacity`` and the
    namespace's ``quota``), receives into it, then :meth:`commit`s it or gives it back with
    :meth:`release`. ``evictions`` counts what was dropped.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.bytes = 0  # committed and reserved
        self._lru: OrderedDict[tuple[str, bytes], list[Any]] = OrderedDict()  # [buf, digest, size, sent]
        self._ns_bytes: dict[str, int] = {}
        self._pools: dict[int, _Pool] = {}
        self.evictions = 0
        self.on_slab: Any = None  #: called with each newly mapped slab (NIXL registers it)

    def __len__(self) -> int:
        return len(self._lru)

    def has(self, ns: str, key: bytes) -> bool:
        return (ns, key) in self._lru

    def get(self, ns: str, key: bytes) -> list[Any] | None:
        """``[buffer, xxh3, size, sent]`` of a chunk, marked recently used; ``None`` when
        absent. Set ``sent`` when the buffer is handed to a zero-copy send."""
        k = (ns, key)
        item = self._lru.get(k)
        if item is None:
            return None
        self._lru.move_to_end(k)
        return item

    def reserve(self, ns: str, size: int, quota: int | None) -> tuple[memoryview, list[bytes]] | None:
        """A buffer of ``size`` bytes for a chunk of ``ns`` and the keys of ``ns`` evicted to
        make room; ``None`` when such a chunk can never fit."""
        limit = min(self.capacity, quota) if quota is not None else self.capacity
        if size > limit:
            return None
        evicted: list[bytes] = []
        while self._lru and self.bytes + size > self.capacity:
            (ens, ekey) = self._evict(None)
            if ens == ns:
                evicted.append(ekey)
        while quota is not None and self._ns_bytes.get(ns, 0) + size > quota:
            if not any(k[0] == ns for k in self._lru):
                break
            evicted.append(self._evict(ns)[1])
        pool = self._pools.get(size)
        if pool is None:
            pool = self._pools[size] = _Pool(size, self.on_slab)
        self.bytes += size
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + size
        return pool.take(max(size, self.capacity - self.bytes + size)), evicted

    def release(self, ns: str, buf: memoryview) -> None:
        """Give back a reserved buffer that was not committed."""
        size = len(buf)
        self.bytes -= size
        self._ns_bytes[ns] -= size
        self._pools[size].give(buf, False)

    def commit(self, ns: str, key: bytes, buf: memoryview, digest: int) -> None:
        """Keep the reserved ``buf`` under ``(ns, key)``; a key already stored keeps its
        copy (idempotent) and ``buf`` goes back to the pool."""
        k = (ns, key)
        if k in self._lru:
            self._lru.move_to_end(k)
            self.release(ns, buf)
            return
        self._lru[k] = [buf, digest, len(buf), False]

    def _evict(self, ns: str | None) -> tuple[str, bytes]:
        if ns is None:
            k, item = self._lru.popitem(last=False)
        else:
            k = next(x for x in self._lru if x[0] == ns)
            item = self._lru.pop(k)
        buf, _, size, sent = item
        del item[:]  # no reference to buf left but the pool's
        self.bytes -= size
        self._ns_bytes[k[0]] -= size
        self._pools[size].give(buf, sent)
        self.evictions += 1
        return k
