"""What a tier remembers between lookups besides its HITs: recent MISSes (and, for a tier
with a remote or slow backend, the keys being probed), and the keys it holds until a time
(:class:`Deadlines`, the table of every lifetime pin).

:class:`MissTable` is the MISS memory itself: a fixed-size, 4-way set-associative table of
64-bit key fingerprints, each with when its MISS expires and whether a probe's MISS is still
unanswered, in three numpy arrays allocated once (17 bytes a slot, 1.1 MiB at the default
65,536 slots). Remembering a key costs O(1) whatever the churn and never allocates: a new key
takes a free slot of its set, else the slot whose MISS expires first (so a key is forgotten
only after about ``capacity`` newer ones, and a forgotten key is simply probed again: RETRY,
then its answer). It holds no Python object per key, so a stream of evictions that never ends
leaves neither a growing dict nor memory pinned by long-lived keys behind (the fs tier's
10-minute soak lost 1.5x RSS to a dict of evicted keys that was halved and refilled; see
docs/measured-tiers.md#soak-the-fs-tier-for-10-minutes). The fs tier's index and :class:`MissCache` both use it.

:class:`MissCache` adds the probes in flight, for :class:`kvtiers.AsyncTier` and the p2p tier;
the caller holds its own lock around every call.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np
import xxhash

from .types import Lookup

__all__ = ["MISS_SLOTS", "Deadlines", "MissCache", "MissTable", "miss_fingerprint"]

MISS_SLOTS = 1 << 16  # the default MissTable size: MISSes remembered at most
WAYS = 4  # slots per set (answer_fps reads a set's 4 match flags as one uint32)
_EMPTY = 0
_STEPS = np.arange(WAYS, dtype=np.int64)
_h64 = xxhash.xxh3_64_intdigest


def miss_fingerprint(key: bytes) -> int:
    """The fingerprint a :class:`MissTable` keeps of ``key``: its xxh3-64, with 0 and 1 moved
    to 2 and 3 (the fs tier's key fingerprint, ``kvtiers_fs.keytable.fingerprint``)."""
    h = _h64(key)
    return h + 2 if h < 2 else h


def _fingerprints(keys: Sequence[bytes]) -> np.ndarray:
    a = np.fromiter(map(_h64, keys), np.uint64, len(keys))
    small = a < 2
    if small.any():
        a[small] += np.uint64(2)
    return a


class MissTable:
    """Remembered MISSes: ``key -> (expiry, unanswered)`` in fixed memory (module docstring).

    Two keys with one fingerprint are one entry (one pair in about 1e14 at 65,536 entries):
    the worst it does is answer ``MISS`` for a key that is there (a lost hit, never wrong
    bytes). Reads (:meth:`answer`, ``in``, :meth:`get`) may run without the writers' lock:
    the arrays are never replaced, so a read that races with a write only sees the entry
    before or after it.
    """

    __slots__ = ("capacity", "count", "fp", "unread", "until", "_mask")

    def __init__(self, capacity: int = MISS_SLOTS) -> None:
        if capacity < WAYS:
            raise ValueError(f"a MissTable needs at least {WAYS} slots, got {capacity}")
        sets = 1 << (capacity // WAYS - 1).bit_length()  # a power of two: the set is fp & mask
        self.capacity = sets * WAYS
        self._mask = sets - 1
        self.fp = np.zeros(self.capacity, np.uint64)  # 0: a free slot
        self.until = np.zeros(self.capacity, np.float64)  # when the MISS expires (monotonic seconds)
        self.unread = np.zeros(self.capacity, bool)  # a probe's MISS not yet answered
        self.count = 0  # slots in use

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (fixed at creation)."""
        return self.fp.nbytes + self.until.nbytes + self.unread.nbytes

    def __len__(self) -> int:
        return self.count

    def _find(self, fp: int) -> tuple[int, int]:
        """``(first slot of fp's set, fp's slot or -1)``."""
        base = (fp & self._mask) * WAYS
        row = self.fp[base:base + WAYS].tolist()
        try:
            return base, base + row.index(fp)
        except ValueError:
            return base, -1

    def __contains__(self, key: bytes) -> bool:
        return self._find(miss_fingerprint(key))[1] >= 0

    def get(self, key: bytes) -> float | None:
        """When ``key``'s remembered MISS expires, or None if none is remembered."""
        i = self._find(miss_fingerprint(key))[1]
        return None if i < 0 else float(self.until[i])

    def is_unread(self, key: bytes) -> bool:
        """Whether ``key`` holds a probe's MISS not yet answered."""
        i = self._find(miss_fingerprint(key))[1]
        return i >= 0 and bool(self.unread[i])

    def unread_count(self) -> int:
        """How many entries hold a probe's MISS not yet answered (a scan of the table)."""
        return int(np.count_nonzero(self.unread))

    # -- writes (one writer at a time: the caller's lock) ---------------------------------
    def add(self, key: bytes, until: float, unread: bool = False) -> None:
        """Remember ``key`` as a MISS until ``until``; ``unread``: a probe found it absent,
        so the next lookup answers MISS even when ``until`` passed (an entry unread already
        stays so). A new key takes a free slot of its set, else the one expiring first."""
        self.add_fp(miss_fingerprint(key), until, unread)

    def add_fp(self, fp: int, until: float, unread: bool = False) -> None:
        """:meth:`add` of the key whose :func:`miss_fingerprint` is ``fp``."""
        base = (fp & self._mask) * WAYS
        row = self.fp[base:base + WAYS].tolist()
        if fp in row:
            i = base + row.index(fp)
            if unread:
                self.unread[i] = True
        else:
            if _EMPTY in row:
                i = base + row.index(_EMPTY)
                self.count += 1
            else:
                ends = self.until[base:base + WAYS].tolist()
                i = base + ends.index(min(ends))
            self.fp[i] = fp
            self.unread[i] = unread
        self.until[i] = until

    def pop(self, key: bytes, default: float | None = None) -> float | None:
        """Forget ``key``'s MISS (it is there, or unknown again); return its expiry, else ``default``."""
        return self.pop_fp(miss_fingerprint(key), default)

    def pop_fp(self, fp: int, default: float | None = None) -> float | None:
        """:meth:`pop` of the key whose :func:`miss_fingerprint` is ``fp``."""
        i = self._find(fp)[1]
        if i < 0:
            return default
        until = float(self.until[i])
        self.fp[i] = _EMPTY
        self.unread[i] = False
        self.count -= 1
        return until

    # -- the lookup ----------------------------------------------------------------------
    def answer(self, keys: Sequence[bytes], now: float) -> np.ndarray:
        """Whether each key's MISS is to be answered now: remembered and not expired at
        ``now``, or a probe's MISS not answered yet (which is then answered: one vectorised
        pass). Other keys are the caller's to probe."""
        return self.answer_fps(_fingerprints(keys), now)

    def answer_fps(self, fps: np.ndarray, now: float) -> np.ndarray:
        """:meth:`answer` for keys given by their :func:`miss_fingerprint` (a ``uint64`` array)."""
        if not len(fps):
            return np.zeros(0, bool)
        base = (fps & np.uint64(self._mask)).astype(np.int64) * WAYS
        match = self.fp[base[:, None] + _STEPS] == fps[:, None]  # at most one True a row
        slot = base + match.argmax(axis=1)
        unread = self.unread[slot]
        miss = (match.view(np.uint32).ravel() != 0) & ((self.until[slot] > now) | unread)  # (4 bools = a uint32)
        first = miss & unread
        if first.any():  # answered now: no longer unread (unless a writer gave the slot to another key meanwhile)
            answered = slot[first]
            self.unread[answered[self.fp[answered] == fps[first]]] = False
        return miss


class MissCache:
    """MISSes that expire (a :class:`MissTable`), probes asked once per key, and a probe's
    MISS answered at least once.

    ``absent`` remembers a key's MISS and when it expires. A MISS a probe found is answered
    to the next lookup even when it expired already (``negative_ttl`` 0): otherwise a caller
    could ask forever and only ever see ``RETRY``. ``probing`` holds the keys whose probe is
    in flight (each leaves it when its answer comes).
    """

    __slots__ = ("absent", "probing")

    def __init__(self, capacity: int = MISS_SLOTS) -> None:
        self.absent = MissTable(capacity)
        self.probing: set[bytes] = set()

    def answer(self, keys: Sequence[bytes], hit: Callable[[bytes], bool], now: float,
               ) -> tuple[list[Lookup], list[bytes]]:  # fmt: skip
        """The answer per key (``HIT`` where ``hit(key)``, a remembered ``MISS``, else
        ``RETRY``) and the keys the caller must now probe (each once while in flight)."""
        out: list[Lookup | None] = [Lookup.HIT if hit(k) else None for k in keys]
        rest = [i for i, a in enumerate(out) if a is None]
        probe: list[bytes] = []
        if not rest:
            return out, probe  # type: ignore[return-value]
        probing = self.probing
        remembered = self.absent.answer([keys[i] for i in rest], now).tolist()
        for i, m in zip(rest, remembered, strict=True):
            if m:
                out[i] = Lookup.MISS
                continue
            k = keys[i]
            if k not in probing:
                probing.add(k)
                probe.append(k)
            out[i] = Lookup.RETRY
        return out, probe  # type: ignore[return-value]

    def missing(self, key: bytes, until: float) -> None:
        """``key`` is known absent until ``until`` (a probe or an eviction said so)."""
        self.absent.add(key, until, unread=True)

    def present(self, key: bytes) -> None:
        """``key`` is known present: forget its MISS."""
        self.absent.pop(key)


K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """``key -> deadline``, with the keys due at a time found in deadline order (keys of one
    deadline in key order: keys must be orderable, as bytes, ints and tuples of them are).

    A deadline is a time on the caller's clock, ``math.inf`` for a key that holds until it is
    removed. Due keys are found through a heap, so expiring costs the keys that expire, not the
    table; a renewed or removed key leaves a stale heap entry that is skipped when it comes up,
    and the heap is rebuilt when stale entries outnumber live ones. Not thread-safe: callers
    lock around it where they need to. The table behind every lifetime pin (the engine's host
    cache, the fs, obj and p2p tiers; docs/pins.md)."""

    __slots__ = ("_until", "_heap")

    def __init__(self) -> None:
        self._until: dict[K, float] = {}
        self._heap: list[tuple[float, K]] = []  # (deadline, key); stale entries skipped

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a deadline (passed or not: see :meth:`held`)."""
        return key in self._until

    def get(self, key: K) -> float | None:
        """``key``'s deadline, or ``None``."""
        return self._until.get(key)

    def held(self, key: K, now: float) -> bool:
        """Whether ``key``'s deadline is after ``now``."""
        until = self._until.get(key)
        return until is not None and until > now

    def extend(self, key: K, until: float) -> bool:
        """Hold ``key`` until ``until``, or keep its deadline if that is later. Returns whether
        ``key`` had none before."""
        old = self._until.get(key)
        if old is not None and old >= until:
            return False
        self._until[key] = until
        if until != math.inf:
            heapq.heappush(self._heap, (until, key))
            if len(self._heap) > 2 * len(self._until) + 1024:  # renewals left stale entries: keep it in proportion
                self._heap = [(u, k) for k, u in self._until.items() if u != math.inf]
                heapq.heapify(self._heap)
        return old is None

    def pop(self, key: K) -> float | None:
        """Remove ``key``; its deadline, or ``None`` if it had none."""
        return self._until.pop(key, None)

    def due(self, now: float) -> list[K]:
        """Remove and return the keys whose deadline is ``now`` or earlier, soonest first."""
        heap, gone = self._heap, []
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._until.get(key) == until:
                del self._until[key]
                gone.append(key)
        return gone
