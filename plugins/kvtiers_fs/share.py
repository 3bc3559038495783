"""A bounded fs instance's share of a shared bound while another instance is the cleaner.

The cleaner (:mod:`kvtiers_fs.lease`) keeps its view of the namespace within ``max_bytes``,
but it learns what the other instances stored only at its next pass. So each of the others
counts the bytes it added since then: its stores in flight and the chunks it published that
no completed pass of the cleaner can have counted yet (its *unacknowledged* bytes), minus
those of them that are gone again. The cleaner records pass numbers
(:func:`~kvtiers_fs.lease.write_passes`): chunks published before a read of the record that
said pass ``S`` had begun are in the cleaner's view once a pass numbered above ``S`` has
completed (that pass began after the read, so its listing saw them, and it evicted down to
``max_bytes`` counting them). When a store would take its unacknowledged bytes above
:attr:`Share.budget`, the instance reads the record again and, if that does not bring it
back under, removes its own oldest unacknowledged chunks (:meth:`Share.take`) until it is.
It never counts removing a chunk the cleaner already counts: the cleaner would find that
chunk gone at its next eviction and fill the room again. So however fast the others write
and however rarely the cleaner passes, each adds at most its budget plus its stores in
flight to the cleaner's ``max_bytes``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

FRACTION = 16  # an instance's budget: max_bytes / FRACTION (at least one chunk file)


def budget_for(max_bytes: int, file_bytes: int) -> int:
    """The unacknowledged bytes an instance that is not the cleaner may hold."""
    return max(file_bytes, max_bytes // FRACTION // file_bytes * file_bytes)


class _Bucket:
    __slots__ = ("tag", "nbytes", "keys")

    def __init__(self, nbytes: int, keys: dict[bytes, int]) -> None:
        self.tag: int | None = None  # the pass begun at the first read of the record after it
        self.nbytes = nbytes  # bytes of the chunks in keys
        self.keys = keys  # published key -> its file's bytes, oldest first


class Share:
    """The bytes this instance added that the cleaner's view may not count yet."""

    def __init__(self, budget: int, read: Callable[[], tuple[int, int] | None]) -> None:
        self.budget = budget
        self._read = read  # -> (begun, completed) pass numbers, or None
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one read of the record at a time (tags stay exact)
        self._inflight = 0  # stores reserved, not yet published (never acknowledged)
        self._open = _Bucket(0, {})  # published since the last read of the record
        self._closed: deque[_Bucket] = deque()  # oldest first
        self.reads = 0

    @property
    def net(self) -> int:
        """Bytes this instance added that the cleaner may not have counted yet."""
        with self._lock:
            return self._net()

    def _net(self) -> int:
        return self._inflight + self._open.nbytes + sum(b.nbytes for b in self._closed)

    def excess(self) -> int:
        """Bytes over the budget now (no I/O)."""
        with self._lock:
            return max(0, self._net() - self.budget)

    def reserve(self, nbytes: int) -> int:
        """Count a store of ``nbytes`` about to be written; return the bytes over the
        budget, after reading the cleaner's record again if it was over."""
        with self._lock:
            self._inflight += nbytes
            over = self._net() - self.budget
        if over <= 0:
            return 0
        self.refresh()
        return self.excess()

    def unreserve(self, nbytes: int) -> None:
        """A store counted by :meth:`reserve` failed: nothing was published."""
        with self._lock:
            self._inflight -= nbytes

    def published(self, key: bytes, nbytes: int) -> None:
        """The store of ``key`` counted by :meth:`reserve` is on disk (a key published
        again replaces its older entry: one file)."""
        with self._lock:
            self._inflight -= nbytes
            for bucket in self._closed:
                if key in bucket.keys:
                    bucket.nbytes -= bucket.keys.pop(key)
            old = self._open.keys.pop(key, 0)
            self._open.keys[key] = nbytes
            self._open.nbytes += nbytes - old

    def take(self, nbytes: int, skip: Callable[[bytes], bool] = lambda k: False) -> list[tuple[bytes, int]]:
        """Take this instance's oldest unacknowledged chunks, at least ``nbytes`` of them
        (fewer if there are not so many; none for which ``skip`` says so), out of the
        count: the caller removes their files (or gives one back with :meth:`give_back`)."""
        out: list[tuple[bytes, int]] = []
        with self._lock:
            got = 0
            for bucket in (*self._closed, self._open):
                for key in [k for k in bucket.keys if not skip(k)]:
                    if got >= nbytes:
                        return out
                    n = bucket.keys.pop(key)
                    bucket.nbytes -= n
                    out.append((key, n))
                    got += n
            self._compact()
        return out

    def give_back(self, key: bytes, nbytes: int) -> None:
        """``key`` from :meth:`take` is still on disk after all: count it again."""
        with self._lock:
            self._open.nbytes += nbytes
            self._open.keys[key] = nbytes

    def refresh(self) -> None:
        """Read the cleaner's pass record: what it acknowledges no longer counts."""
        with self._reading:
            with self._lock:
                if self._open.keys:  # published before the read below
                    self._closed.append(self._open)
                    self._open = _Bucket(0, {})
            got = self._read()
            with self._lock:
                self.reads += 1
                if got is not None:
                    begun, completed = got
                    for bucket in self._closed:
                        if bucket.tag is None or bucket.tag > begun:  # (a record started again: its numbers)
                            bucket.tag = begun
                    while self._closed and completed > self._closed[0].tag:
                        self._closed.popleft()
                self._compact()

    def _compact(self) -> None:
        """Merge neighbouring buckets of one tag and drop empty ones (lock held): at most
        one bucket per pass not yet completed, however often the record is read."""
        out: deque[_Bucket] = deque()
        for bucket in self._closed:
            if not bucket.keys:
                continue
            if out and out[-1].tag == bucket.tag:
                out[-1].keys.update(bucket.keys)
                out[-1].nbytes += bucket.nbytes
            else:
                out.append(bucket)
        self._closed = out
