"""The reuse ceiling: the share of chunk offers that repeat an earlier one, over a window.

An operator's first question is whether more capacity would help. A cache that kept every
chunk it was ever offered would hit on every offer that repeats a key offered before within
its memory; that share, ``1 - distinct / offers``, bounds the hit rate any cache can reach on
the same traffic. :class:`ReuseEstimator` keeps it for the last 15 minutes, hour and day in
bounded memory: the offers are counted exactly, the distinct keys by HyperLogLog sketches
(docs/observability.md#the-reuse-ceiling).

Error: a HyperLogLog of ``2**p`` one-byte registers counts distinct keys with a relative
standard error of ``1.04 / sqrt(2**p)`` (0.81 % at the default ``p = 14``, 16 KiB), so the
ceiling is within ``3 * 1.04 / sqrt(2**p) * distinct / offers`` (2.44 percentage points at
most, less the more keys repeat) of the exact share with probability about 99.7 %. Below
``2.5 * 2**p`` distinct keys the sketch uses linear counting, which is more exact still.

Windows slide in steps: each is kept as four sketches of a quarter of the window each, and
the oldest is dropped when a new quarter starts, so an estimate covers between three
quarters of the window and the whole of it. Memory: 4 sketches x 3 windows x 16 KiB.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

__all__ = ["WINDOWS", "HyperLogLog", "ReuseEstimator", "ReuseWindow"]

#: the windows every estimator keeps: label -> seconds
WINDOWS = {"15m": 15 * 60.0, "1h": 3600.0, "1d": 86400.0}
BUCKETS = 4  # sketches per window


def key_hashes(keys: Iterable[bytes]) -> list[int]:
    """A 64-bit hash of each key (keys of some engines are not uniform: hash them again)."""
    return [int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little") for k in keys]


class HyperLogLog:
    """Distinct 64-bit hashes in ``2**p`` registers (Flajolet et al. 2007, with linear
    counting for small cardinalities)."""

    def __init__(self, p: int = 14) -> None:
        if not 4 <= p <= 18:
            raise ValueError(f"p must be 4-18, got {p}")
        self.p = p
        self.m = 1 << p
        self.registers = np.zeros(self.m, dtype=np.uint8)

    @property
    def standard_error(self) -> float:
        """The relative standard error of :meth:`count`."""
        return 1.04 / math.sqrt(self.m)

    def add(self, hashes: list[int]) -> None:
        self.add_positions(*positions(hashes, self.p))

    def add_positions(self, idx: np.ndarray, rank: np.ndarray) -> None:
        np.maximum.at(self.registers, idx, rank)

    def count(self) -> float:
        """The estimated number of distinct hashes added."""
        return cardinality(self.registers)


def cardinality(registers: np.ndarray) -> float:
    """HyperLogLog's estimate from ``registers`` (linear counting while it is small)."""
    m = len(registers)
    alpha = 0.7213 / (1 + 1.079 / m)
    est = alpha * m * m / float(np.sum(np.ldexp(1.0, -registers.astype(np.int32))))
    zeros = int(np.count_nonzero(registers == 0))
    if est <= 2.5 * m and zeros:
        return m * math.log(m / zeros)
    return est


class ReuseWindow:
    """Offers and distinct keys over the last ``seconds`` (in :data:`BUCKETS` rotating sketches)."""

    def __init__(self, seconds: float, *, p: int = 14, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.p = p
        self._clock = clock
        self._buckets: deque[tuple[float, HyperLogLog, list[int]]] = deque()  # (start, sketch, [offers])

    def _current(self) -> tuple[HyperLogLog, list[int]]:
        now = self._clock()
        span = self.seconds / BUCKETS
        if not self._buckets or now - self._buckets[-1][0] >= span:
            self._buckets.append((now, HyperLogLog(self.p), [0]))
        self._drop_old(now)
        _, hll, n = self._buckets[-1]
        return hll, n

    def _drop_old(self, now: float) -> None:
        while self._buckets and (len(self._buckets) > BUCKETS or now - self._buckets[0][0] >= self.seconds):
            self._buckets.popleft()

    def add(self, idx: np.ndarray, rank: np.ndarray) -> None:
        hll, n = self._current()
        hll.add_positions(idx, rank)
        n[0] += len(idx)

    def offers(self) -> int:
        self._drop_old(self._clock())
        return sum(n[0] for _, _, n in self._buckets)

    def distinct(self) -> float:
        self._drop_old(self._clock())
        if not self._buckets:
            return 0.0
        return cardinality(np.maximum.reduce([h.registers for _, h, _ in self._buckets]))

    def ceiling(self) -> float | None:
        """``1 - distinct / offers`` over the window (0 to 1), or None with no offers."""
        n = self.offers()
        if not n:
            return None
        return min(1.0, max(0.0, 1.0 - self.distinct() / n))


class ReuseEstimator:
    """The reuse ceiling of the chunk keys an engine offers, over each of :data:`WINDOWS`."""

    def __init__(self, windows: dict[str, float] | None = None, *, p: int = 14,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.p = p
        self.windows = {label: ReuseWindow(s, p=p, clock=clock) for label, s in (windows or WINDOWS).items()}
        self.offers = 0  # every offer since start

    @property
    def error_bound(self) -> float:
        """Three standard errors of the distinct count, relative: the ceiling is within
        ``error_bound * distinct / offers`` of the exact share (about 99.7 % of the time)."""
        return 3 * 1.04 / math.sqrt(1 << self.p)

    def offer(self, keys: Iterable[bytes]) -> None:
        """Count one offer of each of ``keys`` (in order)."""
        hashes = key_hashes(keys)
        if not hashes:
            return
        self.offers += len(hashes)
        idx, rank = positions(hashes, self.p)
        for w in self.windows.values():
            w.add(idx, rank)

    def ceiling(self, window: str) -> float | None:
        """The share of offers in ``window`` (a label of :attr:`windows`) that repeat an earlier
        offer in it: the hit rate an unbounded cache would reach; None before any offer."""
        return self.windows[window].ceiling()

    def summary(self) -> dict[str, float | None]:
        """The ceiling per window label."""
        return {label: w.ceiling() for label, w in self.windows.items()}


def positions(hashes: list[int], p: int) -> tuple[np.ndarray, np.ndarray]:
    """Register index (the top ``p`` bits) and rank (leading zeros + 1 of the other bits) of
    each 64-bit hash."""
    q = 64 - p
    low = (1 << q) - 1
    idx = np.fromiter((h >> q for h in hashes), dtype=np.intp, count=len(hashes))
    rank = np.fromiter((q - (h & low).bit_length() + 1 for h in hashes), dtype=np.uint8, count=len(hashes))
    return idx, rank
