"""The keys an fs tier's index dropped lately, for the listings under way.

A listing of a directory can find a chunk file that the index drops (an eviction, a load
that found it gone) before the listing is merged: the merge must not bring that key back.
:class:`DropRing` remembers the last :data:`CAPACITY` drops, each with the index's own
strictly increasing clock at the drop (never the raw wall clock, so a clock stepped back
does not make old drops look recent), in two fixed numpy arrays: O(1) per drop, 1 MiB
whatever the churn. A listing asks for the drops at or after its start
(:meth:`DropRing.since`); when more drops than the ring holds happened since, the answer
says it is incomplete and the caller relists those directories instead of trusting it.
"""

from __future__ import annotations

import numpy as np

CAPACITY = 1 << 16  # drops remembered (16 bytes each)


class DropRing:
    """A ring of ``(fingerprint, stamp)`` of the last ``capacity`` drops, stamps non-decreasing."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.fp = np.zeros(capacity, np.uint64)
        self.at = np.zeros(capacity, np.float64)
        self.count = 0  # drops ever recorded
        self.lost_at = float("-inf")  # the stamp of the latest drop overwritten

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def add(self, fp: int, at: float) -> None:
        """Record that ``fp`` was dropped at stamp ``at`` (not less than any earlier stamp)."""
        i = self.count % self.capacity
        if self.count >= self.capacity:
            self.lost_at = float(self.at[i])
        self.fp[i] = fp
        self.at[i] = at
        self.count += 1

    def since(self, started: float) -> tuple[np.ndarray, bool]:
        """The fingerprints dropped at stamps ``>= started``, and whether that is all of them
        (False: drops after ``started`` were overwritten by later ones)."""
        n = len(self)
        if not n:
            return np.zeros(0, np.uint64), True
        at = self.at[:n]
        picked = self.fp[:n][at >= started]
        return picked, self.lost_at < started
