"""The ``memory`` tier: the reference tier, kept in this process's memory.

Bounded by ``max_bytes`` with LRU eviction reported through ``ctx.removed``. A job of up to
``INLINE_BYTES`` (1 MiB, a memcpy of well under a millisecond) is copied in the submitting
call; a larger one (rule 8: a 64-key job of 4 MiB chunks is a 256 MiB copy) goes to one
worker thread, as does every job submitted while that thread has work, so jobs run in submit
order; ``close`` waits for them (rule 9). It claims the ``core`` and ``bounded`` levels and is registered through the
``kvtiers`` entry point like any third-party tier.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from .hookspecs import hookimpl
from .types import Job, JobResult, Lookup, TierContext, accept_job, check_keys, drain

#: the largest job (keys x slot bytes) copied in the submitting call; larger ones go to the worker
INLINE_BYTES = 1 << 20


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
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None  # started by the first submit, joined by close
        self._inflight = 0  # accepted jobs not reported yet

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        return {}

    def _check(self, job: Job) -> None:
        accept_job(job, self.ctx.arena, closed=self._closed)

    def _dispatch(self, job: Job, work: Callable[[Job, float], None]) -> None:
        """Run ``work(job, t0)`` (the job's copies, which append its result): in this call for a
        small job when nothing is queued, else on the worker thread, in submit order. An
        exception fails every key of the job."""
        t0 = time.perf_counter()
        with self._lock:
            inline = self._inflight == 0 and len(job.keys) * self.ctx.arena.slot_bytes <= INLINE_BYTES
            self._inflight += 1

        def run() -> None:
            try:
                work(job, t0)
            except Exception as e:  # rule 4: a failed job, never an exception lost on a thread
                why = f"memory tier: {type(e).__name__}: {e}"
                self._finished.append(JobResult(job.job_id, job.keys, 0, time.perf_counter() - t0, why))
            finally:
                with self._lock:
                    self._inflight -= 1

        if inline:
            run()
            return
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="kvtiers-memory-tier", daemon=True)
                self._worker.start()
        self._work.put(run)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            item()

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        data = self._data
        return [Lookup.HIT if k in data else Lookup.MISS for k in keys]

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._check(job)
        self._dispatch(job, self._store)

    def _store(self, job: Job, t0: float) -> None:
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
        self._dispatch(job, self._load)

    def _load(self, job: Job, t0: float) -> None:
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
        return self._inflight

    @hookimpl
    def close(self) -> None:
        self._closed = True  # no new jobs; the accepted ones finish first (rule 9)
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._work.put(None)
            worker.join()
        with self._lock:
            self._data.clear()
            self._bytes = 0


@hookimpl
def register_tiers(register) -> None:
    register("memory", MemoryTier)
