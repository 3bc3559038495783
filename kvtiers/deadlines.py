"""Keys that hold until a time, found in time order: the table behind every lifetime pin
(the engine's host cache, the fs, obj and p2p tiers; docs/pins.md).

A key's deadline is a time on the caller's clock, ``math.inf`` for one that holds until it is
removed. Deadlines due are found through a heap, so expiring costs the keys that expire, not
the table; a renewed or removed key leaves a stale heap entry behind that is skipped when it
comes up, and the heap is rebuilt when stale entries outnumber the live ones. Not
thread-safe: callers lock around it where they need to.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, ItemsView
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """``key -> deadline``, with the keys due at a time found in deadline order."""

    __slots__ = ("_until", "_heap")

    def __init__(self) -> None:
        self._until: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []  # (deadline, tie-breaker, key); stale entries skipped
        # the tie-breaker keeps keys out of the comparison: keys of one deadline need not be ordered

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

    def items(self) -> ItemsView[K, float]:
        """Every ``(key, deadline)``, in no order."""
        return self._until.items()

    def extend(self, key: K, until: float) -> bool:
        """Hold ``key`` until ``until``, or keep its deadline if that is later. Returns whether
        ``key`` had none before."""
        old = self._until.get(key)
        if old is not None and old >= until:
            return False
        self._until[key] = until
        if until != math.inf:
            heapq.heappush(self._heap, (until, id(key), key))
            if len(self._heap) > 2 * len(self._until) + 1024:  # renewals left stale entries: keep it in proportion
                self._heap = [(u, id(k), k) for k, u in self._until.items() if u != math.inf]
                heapq.heapify(self._heap)
        return old is None

    def pop(self, key: K) -> float | None:
        """Remove ``key``; its deadline, or ``None`` if it had none."""
        return self._until.pop(key, None)

    def due(self, now: float) -> list[K]:
        """Remove and return the keys whose deadline is ``now`` or earlier, soonest first."""
        heap, gone = self._heap, []
        while heap and heap[0][0] <= now:
            until, _, key = heapq.heappop(heap)
            if self._until.get(key) == until:
                del self._until[key]
                gone.append(key)
        return gone
