"""The host-memory chunk store of a standalone peer server: LRU under a byte capacity,
chunks kept per namespace, each namespace optionally capped by its clients' ``max_bytes``.

Chunks live in buffers of a per-size pool, carved from pre-faulted anonymous mappings
(slabs) and reused after eviction, so a PUT is received straight into memory that is already
mapped (a fresh allocation per chunk costs page faults that halve the push rate). The slabs
of all pools together never map more than ``capacity`` bytes, each slab at most
:data:`SLAB_BYTES` and, without NIXL, at most ``capacity / SLAB_SHARE`` (or one chunk), so one
chunk size never maps the whole capacity at once and a second size finds room beside it. A chunk
size that needs a new slab when the capacity is mapped evicts least recently used chunks until
a whole slab of another size is free, then carves that slab anew if it is large enough (with
NIXL the only way: slabs stay mapped and registered), else, without NIXL, unmaps idle slabs of
other sizes and maps its own. Buffers are carved from a slab as they are needed, so a small
chunk size costs no bookkeeping for buffers nobody uses; a pool nobody uses any more is
unmapped.

GETs send a buffer zero-copy: pyzmq holds a reference to the buffer's memoryview until
libzmq has sent it, so a buffer whose chunk was evicted meanwhile is reused only once that
reference is gone (its reference count is back to ours). That costs nothing per send, where
a MessageTracker per message costs about 30 us.

Eviction is least recently used first across namespaces, or, given the namespaces clients
are using (``active``: a server with tenants passes those with a session), fair between
them: a chunk of namespace A that needs room evicts A's own least recently used chunk
while A holds its share of the capacity or more (``capacity`` divided by the active
namespaces holding chunks), and otherwise the least recently used chunk of a namespace
nobody is using or of one above its share, so one namespace's pushes cannot flush another
active namespace's chunks below that share.

Lifetime pins (PIN/UNPIN, docs/pins.md): a pinned chunk leaves its namespace's LRU for a
table of held chunks, so no eviction ever takes it, until the last of its pins ends (each
client instance, an *owner*, pins for its own time; unpin ends that owner's pin only). At most
:data:`PIN_SHARE` of a namespace's cap (its quota, or the capacity) and of the capacity is
pinned, so eviction can always make room; a pin past that is refused whole, with the reason.
"""

from __future__ import annotations

import itertools
import math
import mmap
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from kvtiers.misscache import Deadlines

SLAB_BYTES = 64 << 20  #: buffers are mapped this many bytes at a time (at most)
#: without NIXL, a slab is at most this fraction of the capacity (or one chunk): at 64 MiB or
#: less, a first chunk size mapping it all made a second size evict every chunk of the first
SLAB_SHARE = 16
MIN_CHUNK_BYTES = 4096  #: the smallest chunk a store keeps (an arena slot's granularity)
IDLE_REFS = 2  #: sys.getrefcount of a pooled buffer nobody else holds (a local name + the argument)
PIN_SHARE = 0.5  #: of a namespace's cap and of the capacity: the most that is pinned


class _Slab:
    """One mapping, carved into buffers of its pool's size as they are needed."""

    __slots__ = ("mm", "view", "n", "carved", "out")

    def __init__(self, nbytes: int, size: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(-1, nbytes, flags=flags)
        self.view = memoryview(self.mm)
        self.n = nbytes // size
        self.carved = 0
        self.out = 0  # buffers handed out (reserved, stored, or evicted and maybe still being sent)


class _Pool:
    """Buffers of one size: free ones, evicted ones maybe still being sent, their slabs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[memoryview] = []
        self.busy: deque[memoryview] = deque()  # evicted, maybe still being sent
        self.slabs: list[_Slab] = []
        self._slab_of: dict[int, _Slab] = {}  # id(buffer) -> its slab

    @property
    def mapped(self) -> int:
        return sum(len(s.view) for s in self.slabs)

    def _reclaim(self) -> None:
        keep: deque = deque()
        while self.busy:
            buf = self.busy.popleft()
            # references: `buf` here and getrefcount's argument; more means ZMQ still sends it
            if sys.getrefcount(buf) <= IDLE_REFS:
                self._slab_of[id(buf)].out -= 1
                self.free.append(buf)
            else:
                keep.append(buf)
        self.busy = keep

    def take(self) -> memoryview | None:
        """A free buffer, or None when every mapped one is in use (map a slab with :meth:`grow`)."""
        if not self.free and self.busy:
            self._reclaim()
        if self.free:
            buf = self.free.pop()
            self._slab_of[id(buf)].out += 1
            return buf
        for slab in self.slabs:
            if slab.carved < slab.n:
                i, size = slab.carved, self.size
                buf = slab.view[i * size : (i + 1) * size]
                slab.carved += 1
                slab.out += 1
                self._slab_of[id(buf)] = slab
                return buf
        return None

    def grow(self, nbytes: int) -> memoryview:
        """Map a slab of ``nbytes`` (a multiple of the size); returns its view."""
        slab = _Slab(nbytes, self.size)
        self.slabs.append(slab)
        return slab.view

    def give(self, buf: memoryview, sent: bool) -> None:
        """Take back ``buf``; ``sent``: it may still be referenced by a zero-copy send."""
        if sent:
            self.busy.append(buf)
        else:
            self._slab_of[id(buf)].out -= 1
            self.free.append(buf)

    def detach(self, size: int) -> _Slab | None:
        """Take out a slab of at least ``size`` bytes none of whose buffers is out (for
        another pool to carve anew: it stays mapped, and registered with NIXL)."""
        if self.busy:
            self._reclaim()
        slab = next((s for s in self.slabs if s.out == 0 and len(s.view) >= size), None)
        if slab is not None:
            self._drop([slab])
            self.slabs.remove(slab)
        return slab

    def adopt(self, slab: _Slab) -> None:
        """Carve ``slab`` (detached from another pool) into buffers of this pool's size."""
        slab.n, slab.carved, slab.out = len(slab.view) // self.size, 0, 0
        self.slabs.append(slab)

    def _drop(self, slabs: list[_Slab]) -> None:
        """Forget the free buffers of ``slabs`` (released: the slab may be unmapped or recarved)."""
        gone = {id(s) for s in slabs}
        keep = []
        for buf in self.free:
            if id(self._slab_of[id(buf)]) in gone:
                del self._slab_of[id(buf)]
                buf.release()
            else:
                keep.append(buf)
        self.free = keep

    def trim(self) -> int:
        """Unmap every slab none of whose buffers is out; returns the bytes unmapped."""
        if self.busy:
            self._reclaim()
        idle = [s for s in self.slabs if s.out == 0]
        if not idle:
            return 0
        self._drop(idle)
        freed = 0
        for s in idle:
            self.slabs.remove(s)
            freed += len(s.view)
            s.view.release()
            s.mm.close()
        return freed


class MemoryStore:
    """Chunks by ``(namespace digest, key)``: a pooled buffer, its xxh3, its size and
    whether it was ever sent (zero-copy).

    A PUT takes a buffer with :meth:`reserve` (evicting to fit ``capacity`` and the
    namespace's ``quota``), receives into it, then :meth:`commit`s it or gives it back with
    :meth:`release`. ``evictions`` counts what was dropped. ``mapped`` is what the pools
    have mapped, never more than ``capacity``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.bytes = 0  # committed and reserved
        self.mapped = 0
        self._lru: dict[str, OrderedDict[bytes, list[Any]]] = {}  # ns -> key -> [buf, digest, size, sent, used]
        self._count = 0
        self._ns_bytes: dict[str, int] = {}
        self._pools: dict[int, _Pool] = {}
        self._tick = itertools.count()
        self._active: set[str] | None = None
        self.evictions = 0
        self.on_slab: Any = None  #: called with each newly mapped slab (NIXL registers it; slabs then stay)
        # lifetime pins: pinned items leave _lru for _held (never a victim) until their last pin ends
        self._held: dict[str, dict[bytes, list[Any]]] = {}
        self._pins: dict[tuple[str, bytes], set[str]] = {}  # (ns, key) -> its pins' owners
        self._pin_until: Deadlines[tuple[str, bytes, str]] = Deadlines()  # (ns, key, owner) -> until
        self._npinned = 0  # chunks in _held
        self._ns_pinned: dict[str, int] = {}  # bytes held per namespace
        self.pinned_bytes = 0
        self.clock = time.monotonic  #: the pins' clock (tests replace it)

    def __len__(self) -> int:
        return self._count

    def namespaces(self) -> set[str]:
        """The namespaces holding chunks (or reserved buffers)."""
        return {ns for ns, b in self._ns_bytes.items() if b > 0}

    def chunk_sizes(self) -> set[int]:
        """The buffer sizes of the pools that have memory mapped."""
        return {size for size, p in self._pools.items() if p.slabs}

    def has(self, ns: str, key: bytes) -> bool:
        d = self._lru.get(ns)
        return (d is not None and key in d) or key in self._held.get(ns, ())

    def get(self, ns: str, key: bytes) -> list[Any] | None:
        """``[buffer, xxh3, size, sent, ...]`` of a chunk, marked recently used; ``None``
        when absent. Set ``sent`` when the buffer is handed to a zero-copy send."""
        d = self._lru.get(ns)
        item = None if d is None else d.get(key)
        if item is None:
            item = self._held.get(ns, {}).get(key)
            if item is not None:
                item[4] = next(self._tick)
            return item
        d.move_to_end(key)
        item[4] = next(self._tick)
        return item

    def reserve(self, ns: str, size: int, quota: int | None,
                active: set[str] | None = None) -> tuple[memoryview, list[bytes]] | None:  # fmt: skip
        """A buffer of ``size`` bytes for a chunk of ``ns`` and the keys of ``ns`` evicted to
        make room; ``None`` when such a chunk can never fit, or when every buffer that could
        hold it is still being sent (try again later). ``active``: the namespaces in use,
        whose share eviction keeps (``None``: least recently used first, whatever the namespace)."""
        self._active = active
        limit = min(self.capacity, quota) if quota is not None else self.capacity
        if size > limit or size < MIN_CHUNK_BYTES:
            return None
        if self._pins:
            self.expire_pins()
        if self._npinned and (self.pinned_bytes + size > self.capacity
                              or (quota is not None and self._ns_pinned.get(ns, 0) + size > quota)):
            return None  # pinned chunks leave no room (a quota shrunk below what its namespace pinned)
        evicted: list[bytes] = []
        while self._count > self._npinned and self.bytes + size > self.capacity:
            ens, ekey = self._evict(self._victim(ns, size))
            if ens == ns:
                evicted.append(ekey)
        while quota is not None and self._ns_bytes.get(ns, 0) + size > quota and self._lru.get(ns):
            evicted.append(self._evict(ns)[1])
        pool = self._pools.get(size)
        if pool is None:
            pool = self._pools[size] = _Pool(size)
        buf = pool.take()
        while buf is None:
            if not self._map(pool):
                if self._count <= self._npinned:
                    return None
                ens, ekey = self._evict(self._victim(ns, size))
                if ens == ns:
                    evicted.append(ekey)
            buf = pool.take()
        self.bytes += size
        self._ns_bytes[ns] = self._ns_bytes.get(ns, 0) + size
        return buf, evicted

    def _map(self, pool: _Pool) -> bool:
        """Map one more slab for ``pool`` within the capacity (unmapping other pools' idle
        slabs to make room); False when there is no room."""
        size = pool.size
        room = self.capacity - self.mapped
        if room < size:  # carve an idle slab of another size anew (it stays mapped and registered)
            for other in self._pools.values():
                slab = other.detach(size) if other is not pool and other.slabs else None
                if slab is not None:
                    pool.adopt(slab)
                    return True
            if self.on_slab is not None:
                return False  # NIXL: slabs stay registered, none is unmapped
            for other in self._pools.values():  # idle slabs too small to carve: unmapped for room
                if other is not pool and other.slabs and room < size:
                    freed = other.trim()
                    self.mapped -= freed
                    room += freed
            if room < size:
                return False
        most = SLAB_BYTES if self.on_slab is not None else min(SLAB_BYTES, max(size, self.capacity // SLAB_SHARE))
        nbytes = min(most, room) // size * size
        view = pool.grow(nbytes)
        self.mapped += nbytes
        if self.on_slab is not None:
            self.on_slab(view)
        return True

    def _victim(self, ns: str, size: int) -> str:
        """The namespace whose least recently used chunk goes next (see the module docstring)."""
        held = [n for n, d in self._lru.items() if d]
        active = self._active
        if active is None:
            return min(held, key=lambda n: next(iter(self._lru[n].values()))[4])
        using = [n for n in held if n in active or n == ns]
        share = self.capacity // max(1, len(using) + (ns not in using))
        if self._lru.get(ns) and self._ns_bytes.get(ns, 0) + size > share:
            return ns
        fair = [n for n in held if (n not in active and n != ns) or self._ns_bytes.get(n, 0) > share] or held
        return min(fair, key=lambda n: next(iter(self._lru[n].values()))[4])

    def release(self, ns: str, buf: memoryview) -> None:
        """Give back a reserved buffer that was not committed."""
        size = len(buf)
        self.bytes -= size
        self._ns_bytes[ns] -= size
        self._pools[size].give(buf, False)
        self._forget(ns)

    def commit(self, ns: str, key: bytes, buf: memoryview, digest: int) -> None:
        """Keep the reserved ``buf`` under ``(ns, key)``; a key already stored keeps its
        copy (idempotent) and ``buf`` goes back to the pool."""
        d = self._lru.setdefault(ns, OrderedDict())
        if key in d or key in self._held.get(ns, ()):
            d.move_to_end(key)
            self.release(ns, buf)
            return
        d[key] = [buf, digest, len(buf), False, next(self._tick)]
        self._count += 1

    def drop(self, ns: str) -> int:
        """Evict every chunk of ``ns`` (a server reclaims the namespace), pinned ones too;
        returns how many."""
        for pk in [pk for pk in self._pins if pk[0] == ns]:
            for owner in self._pins.pop(pk):
                self._pin_until.pop((ns, pk[1], owner))
            self._release(ns, pk[1])
        n = 0
        while self._lru.get(ns):
            self._evict(ns)
            n += 1
        return n

    def _evict(self, ns: str) -> tuple[str, bytes]:
        key, item = self._lru[ns].popitem(last=False)
        buf, _, size, sent, _ = item
        del item[:]  # no reference to buf left but the pool's
        self._count -= 1
        self.bytes -= size
        self._ns_bytes[ns] -= size
        self._pools[size].give(buf, sent)
        self.evictions += 1
        self._forget(ns)
        return ns, key

    # -- lifetime pins ----------------------------------------------------------------------
    def pin(self, ns: str, keys: Sequence[bytes], seconds: float | None, owner: str,
            quota: int | None) -> tuple[str | None, list[bytes]]:  # fmt: skip
        """Pin ``keys`` of ``ns`` for ``owner`` for ``seconds`` (``None``: until unpinned), all
        or none; an owner's pin of a key it pinned already keeps the later end. Returns
        ``(None, keys this owner had not pinned)``, or ``(why not, [])``."""
        keys = list(dict.fromkeys(keys))
        self.expire_pins()
        absent = [k for k in keys if not self.has(ns, k)]
        if absent:
            return f"p2p server: {len(absent)} of {len(keys)} key(s) not stored here (first {absent[0].hex()[:16]})", []
        lru = self._lru.get(ns) or {}
        add = sum(lru[k][2] for k in keys if k in lru)
        limit = self.capacity if quota is None else min(self.capacity, quota)
        ns_cap, all_cap = int(PIN_SHARE * limit), int(PIN_SHARE * self.capacity)
        held = self._ns_pinned.get(ns, 0)
        if held + add > ns_cap or self.pinned_bytes + add > all_cap:
            over, cap, of = ((held + add, ns_cap, "the namespace's max_bytes" if quota is not None else "the capacity")
                             if held + add > ns_cap else (self.pinned_bytes + add, all_cap, "the capacity"))
            return (f"p2p server: pinning {add} more bytes would pin {over} of at most {cap} bytes ({PIN_SHARE:g} of "
                    f"{of}): eviction could no longer keep the bound"), []
        until = math.inf if seconds is None else self.clock() + seconds
        new = []
        for k in keys:
            self._pins.setdefault((ns, k), set()).add(owner)
            if self._pin_until.extend((ns, k, owner), until):
                new.append(k)
            item = lru.pop(k, None)
            if item is not None:  # out of the LRU: no eviction sees it now
                item[4] = next(self._tick)
                self._held.setdefault(ns, {})[k] = item
                self._npinned += 1
                self._ns_pinned[ns] = self._ns_pinned.get(ns, 0) + item[2]
                self.pinned_bytes += item[2]
        return None, new

    def unpin(self, ns: str, keys: Sequence[bytes] | None, owner: str) -> int:
        """End ``owner``'s pins of ``keys`` of ``ns`` (``None``: all its pins there); a chunk no
        pin holds any more goes back to its LRU as just used. Returns how many pins ended."""
        pks = [pk for pk, o in self._pins.items() if pk[0] == ns and owner in o] if keys is None \
            else [(ns, k) for k in keys]
        n = 0
        for pk in pks:
            owners = self._pins.get(pk)
            if owners is not None and owner in owners:
                owners.discard(owner)
                self._pin_until.pop((*pk, owner))
                n += 1
                if not owners:
                    del self._pins[pk]
                    self._release(*pk)
        return n

    def expire_pins(self) -> int:
        """End the pins whose time has come; how many."""
        n = 0
        for ns, key, owner in self._pin_until.due(self.clock()):
            owners = self._pins.get((ns, key))
            if owners is not None and owner in owners:
                owners.discard(owner)
                n += 1
                if not owners:
                    del self._pins[(ns, key)]
                    self._release(ns, key)
        return n

    def pinned(self, ns: str | None = None) -> int:
        """Chunks held by pins (of ``ns``, or of all namespaces)."""
        return self._npinned if ns is None else len(self._held.get(ns, ()))

    def _release(self, ns: str, key: bytes) -> None:
        """``key`` of ``ns`` is pinned no more: back to its LRU, as just used."""
        held = self._held.get(ns)
        item = None if held is None else held.pop(key, None)
        if item is None:
            return
        if not held:
            del self._held[ns]
        self._npinned -= 1
        self._ns_pinned[ns] -= item[2]
        self.pinned_bytes -= item[2]
        item[4] = next(self._tick)
        self._lru.setdefault(ns, OrderedDict())[key] = item

    def _forget(self, ns: str) -> None:
        """``ns`` holds nothing any more: forget it, and unmap the pools nobody uses."""
        if self._ns_bytes.get(ns) or self._lru.get(ns):
            return
        self._ns_bytes.pop(ns, None)
        self._lru.pop(ns, None)
        if self.on_slab is None:
            for pool in self._pools.values():
                if pool.slabs and not pool.busy and all(s.out == 0 for s in pool.slabs):
                    self.mapped -= pool.trim()
