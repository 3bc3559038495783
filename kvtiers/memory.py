"""The ``memory`` tier: the reference tier, kept in this process's memory.

Bounded by ``max_bytes`` with LRU eviction reported through ``ctx.removed``. It copies in
the submitting call (a memcpy, no I/O) and claims the ``core`` and ``bounded`` levels. It is
registered through the ``kvtiers`` entry point like any third-party tier.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

from .hookspecs import hookimpl
from .types import Job, JobResult, Lookup, TierContext, accept_job, check_keys, drain


class MemoryTier:
    """Chunks in a dict, least recently used first out when over ``max_bytes``."""

    levels = frozenset({"core", "bounded"})

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.ctx = ctx
        self.max_bytes = max_bytes
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._finished: deque[JobResult] = deque()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        return {}

    def _check(self, job: Job) -> None:
        accept_job(job, self.ctx.arena, closed=self._closed)

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        data = self._data
        return [Lookup.HIT if k in data else Lookup.MISS for k in keys]

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._check(job)
        t0 = time.perf_counter()
        arena = self.ctx.arena
        size = arena.slot_bytes
        failed: list[bytes] = []
        evicted: list[bytes] = []
        with self._lock:
            for key, slot in zip(job.keys, job.slots, strict=True):
                if self.max_bytes is not None and size > self.max_bytes:
                    failed.append(key)
                    continue
                if key in self._data:
                    self._data.move_to_end(key)
                    continue
                self._data[key] = bytes(arena[slot])
                self._bytes += size
                while self.max_bytes is not None and self._bytes > self.max_bytes:
                    old, blob = self._data.popitem(last=False)
                    self._bytes -= len(blob)
                    evicted.append(old)
        moved = size * (len(job.keys) - len(failed))
        error = f"chunk of {size} bytes exceeds max_bytes={self.max_bytes}" if failed else None
        if evicted:
            self.ctx.removed(evicted, "evicted")
        self._finished.append(JobResult(job.job_id, tuple(failed), moved, time.perf_counter() - t0, error))

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._check(job)
        t0 = time.perf_counter()
        arena = self.ctx.arena
        failed: list[bytes] = []
        with self._lock:
            for key, slot in zip(job.keys, job.slots, strict=True):
                blob = self._data.get(key)
                if blob is None:
                    failed.append(key)
                    continue
                self._data.move_to_end(key)
                arena[slot][:] = blob
        moved = arena.slot_bytes * (len(job.keys) - len(failed))
        error = f"{len(failed)} key(s) not stored" if failed else None
        self._finished.append(JobResult(job.job_id, tuple(failed), moved, time.perf_counter() - t0, error))

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return drain(self._finished)

    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        with self._lock:
            for k in keys:
                if k in self._data:
                    self._data.move_to_end(k)

    @hookimpl
    def backlog(self) -> int:
        return 0

    @hookimpl
    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._data.clear()
            self._bytes = 0


@hookimpl
def register_tiers(register) -> None:
    register("memory", MemoryTier)
