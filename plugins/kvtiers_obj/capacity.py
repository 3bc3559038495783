"""``max_bytes`` bookkeeping for the obj tier: which chunks this instance knows, oldest first.

The tier records every chunk it stores, finds or loads, with its object size; when the
total passes ``max_bytes`` the least recently used chunks not in use are the victims.
Known limits: the view is per instance (seeded by one listing of the namespace at open);
several instances sharing a prefix each bound what they see, not the bucket's total.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LruBytes:
    """Keys with sizes in least-recently-used order, and the victims that bring the total
    back under ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self.total = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def add(self, key: bytes, size: int) -> None:
        """Record ``key`` as most recently used."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self.total -= old
        self._sizes[key] = size
        self.total += size

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` (those known) as most recently used."""
        for k in keys:
            if k in self._sizes:
                self._sizes.move_to_end(k)

    def discard(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.total -= size

    def victims(self, busy: Iterable[bytes] = ()) -> list[bytes]:
        """Remove and return least recently used keys, skipping ``busy`` ones, until the
        total is at most ``max_bytes`` (or only busy keys are left)."""
        busy = set(busy)
        out: list[bytes] = []
        if self.total <= self.max_bytes:
            return out
        for k in list(self._sizes):
            if self.total <= self.max_bytes:
                break
            if k in busy:
                continue
            self.total -= self._sizes.pop(k)
            out.append(k)
        return out
