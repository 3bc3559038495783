"""The fs tier's lifetime pins (the optional ``pin``/``unpin`` hooks, docs/pins.md).

Pinned keys, by the index's 64-bit fingerprint, with the time each pin ends on ``clock``
(``math.inf``: until unpinned). The index never offers a pinned key as an eviction victim
before its time (:meth:`kvtiers_fs.index.Index.victims`), nor does a non-cleaner's share
eviction take one. So that eviction can always get back under ``max_bytes``, the pinned
chunks are capped at :data:`PIN_SHARE` of ``max_bytes``; a pin past the cap is refused whole.
Pins live in this instance's memory: another instance on the same root does not see them,
which is why a bounded instance that is not the cleaner refuses pins (the cleaner evicts).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

from kvtiers.misscache import Deadlines

from .keytable import fingerprint

PIN_SHARE = 0.5  # of max_bytes: the most a bounded fs tier keeps pinned


class PinTable:
    """Fingerprints pinned until a time; at most ``cap`` (``None``: no cap, unbounded tier)."""

    def __init__(self, cap: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.clock = clock
        self._until: Deadlines[int] = Deadlines()
        self._lock = threading.Lock()  # pins come from the engine thread, victims from the store threads
        self.pinned = self.unpinned = self.expired = self.refused = 0

    def __len__(self) -> int:
        return len(self._until)

    def held(self, fp: int) -> bool:
        """Whether a pin holds the key of fingerprint ``fp`` now."""
        return self._until.held(fp, self.clock())

    def add(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Pin ``keys`` (all or none); ``None`` or why not."""
        fps = list(dict.fromkeys(fingerprint(k) for k in keys))
        with self._lock:
            self._expire()
            new = sum(fp not in self._until for fp in fps)
            if self.cap is not None and len(self._until) + new > self.cap:
                self.refused += len(fps)
                return (f"fs tier: pinning {new} more chunk(s) would hold {len(self._until) + new} of at most "
                        f"{self.cap} ({PIN_SHARE:g} of max_bytes): eviction could no longer keep the bound")
            until = math.inf if seconds is None else self.clock() + seconds
            for fp in fps:
                self._until.extend(fp, until)
            self.pinned += len(fps)
            return None

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                if self._until.pop(fingerprint(k)) is not None:
                    self.unpinned += 1

    def expire(self) -> int:
        """Forget the pins whose time has come; how many."""
        with self._lock:
            return self._expire()

    def _expire(self) -> int:
        n = len(self._until.due(self.clock()))
        self.expired += n
        return n
