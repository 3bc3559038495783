"""Admission: whether a chunk goes down to a tier at all (the ``"admit"`` option of any tier).

The first of the wrappers every tier may have (admission, then compression, then sealing,
then the tier; docs/admission.md). It lives in the manager's cascade, on the engine side: a
chunk it declines is never submitted to the tier, so the tier's contract is untouched (the
tier only ever sees the stores admission let through) and a lookup never claims a chunk the
tier was not given.

- ``{"min_offers": N}``: a chunk goes down once its key was offered (a :meth:`TieringManager.store
  <kvtiers.engine.manager.TieringManager.store>` of it) ``N`` times. Offers are counted in a
  count-min sketch of fixed size (:class:`OfferCounter`): it never undercounts, so a key
  offered ``N`` times is always admitted; it may overcount, so a key offered fewer times is
  admitted early with a small, stated probability.
- ``{"when": "evicted"}``: write-back. A chunk goes down when the host cache evicts it (its
  slot stays pinned until the tier reported the store), not when it is stored
  (``"when": "stored"``, write-through, the default). Chunks still in the host arena when the
  manager closes are not written.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..options import parse_admit

__all__ = ["Admission", "OfferCounter"]


class OfferCounter:
    """How often each key was offered, in ``width * depth`` 16-bit counters (a count-min
    sketch with conservative update).

    The estimate of a key's count is never below its true count (since the last halving),
    and exceeds it by more than ``e / width * total`` (``total``: the offers counted since
    then) with probability at most ``exp(-depth)``. With the defaults (65536 x 4, 512 KiB)
    and the halving every ``8 * width`` offers, that is: over by at most 22 offers with
    probability >= 98 %; in practice, for ``min_offers`` 2, a once-offered key is admitted
    early only when all four of its counters were hit by other keys (about (total/width)^4).

    Counts age: every ``reset_after`` offers all counters are halved (TinyLFU's reset), so a
    key offered long ago must be offered again.
    """

    def __init__(self, width: int = 1 << 16, depth: int = 4, reset_after: int | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width}")
        if not 1 <= depth <= 8:
            raise ValueError(f"depth must be 1-8, got {depth}")
        self.width, self.depth = width, depth
        self.reset_after = reset_after if reset_after is not None else 8 * width
        self._rows = np.zeros((depth, width), dtype=np.uint16)
        self.total = 0  # offers counted since the last halving

    @property
    def epsilon(self) -> float:
        """The sketch's relative error: an estimate exceeds the true count by more than
        ``epsilon * total`` with probability at most :attr:`delta`."""
        return math.e / self.width

    @property
    def delta(self) -> float:
        return math.exp(-self.depth)

    def _cells(self, key: bytes) -> list[int]:
        h = hashlib.blake2b(key, digest_size=4 * self.depth).digest()
        mask = self.width - 1
        return [int.from_bytes(h[4 * i:4 * i + 4], "little") & mask for i in range(self.depth)]

    def estimate(self, key: bytes) -> int:
        """The estimated offers of ``key`` (never fewer than its true count)."""
        rows = self._rows
        return min(int(rows[i, c]) for i, c in enumerate(self._cells(key)))

    def add(self, key: bytes) -> int:
        """Count one offer of ``key``; return its new estimate."""
        rows, cells = self._rows, self._cells(key)
        new = min(min(int(rows[i, c]) for i, c in enumerate(cells)) + 1, 0xFFFF)
        for i, c in enumerate(cells):  # conservative update: raise only the counters below the new estimate
            if rows[i, c] < new:
                rows[i, c] = new
        self.total += 1
        if self.total >= self.reset_after:
            rows >>= 1
            self.total //= 2
        return new

    @property
    def nbytes(self) -> int:
        """The memory the counters take."""
        return 2 * self.width * self.depth


class Admission:
    """One tier's admission policy (its ``"admit"`` option), with its counts.

    ``admitted``: chunks sent to the tier by this policy (a threshold met, or written back on
    eviction); ``declined``: times a chunk was not sent because its key had been offered fewer
    than ``min_offers`` times; ``deferred``: chunks held back for write-back."""

    def __init__(self, min_offers: int = 1, when: str = "stored", *, counter: OfferCounter | None = None) -> None:
        self.min_offers = min_offers
        self.when = when
        self.counter = counter if counter is not None else (OfferCounter() if min_offers > 1 else None)
        self.admitted = 0
        self.declined = 0
        self.deferred = 0

    @classmethod
    def from_option(cls, tier: str, value: Mapping[str, Any] | None) -> Admission | None:
        """The policy of a tier's ``"admit"`` option (``None``: admit everything, write-through).
        A bad option is a one-line :class:`~kvtiers.errors.ConfigError`."""
        if value is None:
            return None
        min_offers, when = parse_admit(tier, value)
        return cls(min_offers, when)

    @property
    def write_back(self) -> bool:
        return self.when == "evicted"

    def offer(self, key: bytes) -> bool:
        """Count one offer of ``key``; True when this offer is the one that meets ``min_offers``
        (the chunk may be in the host arena already: then it goes down now)."""
        if self.counter is None:
            return False
        return self.counter.add(key) == self.min_offers

    def admits(self, key: bytes) -> bool:
        """Whether ``key`` has been offered ``min_offers`` times (estimated; never too few)."""
        return self.counter is None or self.counter.estimate(key) >= self.min_offers

    def describe(self) -> dict[str, Any]:
        return {"min_offers": self.min_offers, "when": self.when, "admitted": self.admitted,
                "declined": self.declined, "deferred": self.deferred}
