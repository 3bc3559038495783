"""``max_bytes`` bookkeeping for the obj tier: which chunks this instance knows, oldest first.

The tier records every chunk it stores, finds or loads, with its object size; when the
total passes ``max_bytes`` the least recently used chunks not in use are the victims.
Known limits: the view is per instance (seeded by one listing of the namespace at open);
several instances sharing a prefix each bound what they see, not the bucket's total.

Lifetime pins (the optional ``pin``/``unpin`` hooks, docs/pins.md) are :class:`Pins`: a
pinned key is never one of :meth:`LruBytes.victims` before its time, and at most
:data:`PIN_SHARE` of ``max_bytes`` is pinned, so eviction can always get back under it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtiers.misscache import Deadlines

PIN_SHARE = 0.5  #: of max_bytes: the most a bounded obj tier keeps pinned


class Pins:
    """Keys pinned until a time on ``clock`` (``math.inf``: until unpinned), each with its
    object size; at most ``cap`` bytes pinned at once (``None``: no cap, an unbounded tier).
    Not thread-safe: the tier calls it under its capacity lock."""

    def __init__(self, cap: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.clock = clock
        self._until: Deadlines[bytes] = Deadlines()
        self._size: dict[bytes, int] = {}
        self.bytes = 0  # pinned now (expired pins included until expire() finds them)
        self.pinned = self.unpinned = self.expired = self.refused = 0

    def __len__(self) -> int:
        return len(self._until)

    def held(self, key: bytes) -> bool:
        """Whether a pin holds ``key`` now."""
        return self._until.held(key, self.clock())

    def add(self, keys: Sequence[bytes], size: int, seconds: float | None) -> str | None:
        """Pin ``keys`` (objects of ``size`` bytes) for ``seconds`` (``None``: until unpinned),
        all or none; a key pinned already keeps the later end. ``None``, or why not."""
        keys = list(dict.fromkeys(keys))
        self.expire()
        new = [k for k in keys if k not in self._until]
        if self.cap is not None and self.bytes + len(new) * size > self.cap:
            self.refused += len(keys)
            return (f"obj tier: pinning {len(new)} more chunk(s) would pin {self.bytes + len(new) * size} of at most "
                    f"{self.cap} bytes ({PIN_SHARE:g} of max_bytes): eviction could no longer keep the bound")
        until = math.inf if seconds is None else self.clock() + seconds
        for k in keys:
            if self._until.extend(k, until):
                self._size[k] = size
                self.bytes += size
        self.pinned += len(keys)
        return None

    def remove(self, keys: Iterable[bytes]) -> int:
        """End the pins of ``keys`` (unknown keys are ignored); how many there were."""
        n = 0
        for k in keys:
            if self._until.pop(k) is not None:
                self.bytes -= self._size.pop(k)
                n += 1
        self.unpinned += n
        return n

    def expire(self) -> int:
        """Forget the pins whose time has come; how many."""
        gone = self._until.due(self.clock())
        for k in gone:
            self.bytes -= self._size.pop(k)
        self.expired += len(gone)
        return len(gone)


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

    def victims(self, busy: Iterable[bytes] = (), held: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Remove and return least recently used keys, skipping ``busy`` ones and those
        ``held`` (pinned: each passed over counts as used, so the next search does not walk
        past it again), until the total is at most ``max_bytes`` (or only those are left)."""
        busy = set(busy)
        out: list[bytes] = []
        if self.total <= self.max_bytes:
            return out
        for k in list(self._sizes):
            if self.total <= self.max_bytes:
                break
            if k in busy:
                continue
            if held is not None and held(k):
                self._sizes.move_to_end(k)
                continue
            self.total -= self._sizes.pop(k)
            out.append(k)
        return out
