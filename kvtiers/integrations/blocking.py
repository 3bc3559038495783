"""A kvtiers tier for engines that call from several threads and wait for each batch.

SGLang's HiCache calls its storage backend from a prefetch thread and a backup thread, and
each call returns only when its pages are read or written. The tier contract wants one
caller at a time and non-blocking hooks, so :class:`BlockingTier` serialises the hook calls
under a lock, and each caller polls ``get_finished_jobs`` until its own job is back,
keeping other callers' results for them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

from ..registry import TierHandle
from ..types import Job, JobResult, Lookup

log = logging.getLogger("kvtiers.integrations")

_POLL_S = 0.0005
_WARN_S = 10.0


class BlockingTier:
    """Thread-safe, blocking calls over one :class:`~kvtiers.TierHandle`."""

    def __init__(self, handle: TierHandle) -> None:
        self.handle = handle
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._done: dict[int, JobResult] = {}
        self._closed = False

    def lookup(self, keys: Sequence[bytes], wait_s: float = 0.5) -> list[Lookup]:
        """The tier's answers, asking again while some are RETRY for up to ``wait_s``
        seconds; a RETRY left after that is answered MISS."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self._closed:
                    return [Lookup.MISS] * len(keys)
                answers = list(self.handle.lookup(list(keys)))
            if Lookup.RETRY not in answers:
                return answers
            if time.monotonic() >= deadline:
                return [Lookup.MISS if a is Lookup.RETRY else a for a in answers]
            time.sleep(0.002)

    def run(self, kind: str, keys: Sequence[bytes], slots: Sequence[int]) -> JobResult:
        """Store (``kind="store"``) or load the keys from/into the slots and wait for the result.

        Waits as long as the tier takes (rule 5 bounds it at 30 s): the tier may touch the
        slots until it reports the job, so returning earlier could let it write into memory
        the engine has reused. A job the tier refuses (or a closed tier) fails every key.
        """
        job = Job(next(self._ids), tuple(keys), tuple(slots))
        with self._lock:
            try:
                if self._closed:
                    raise RuntimeError("tier is closed")
                (self.handle.submit_store if kind == "store" else self.handle.submit_load)(job)
            except Exception as e:
                return JobResult(job.job_id, job.keys, error=f"{type(e).__name__}: {e}")
        start = warned = time.monotonic()
        while True:
            with self._lock:
                if job.job_id not in self._done:
                    for res in self.handle.get_finished_jobs():
                        self._done[res.job_id] = res
                res = self._done.pop(job.job_id, None)
            if res is not None:
                return res
            time.sleep(_POLL_S)
            if time.monotonic() - warned > _WARN_S:
                warned = time.monotonic()
                log.warning("kvtiers tier %r: %s job %d still running after %.0f s", self.handle.name, kind,
                            job.job_id, warned - start)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            if not self._closed:
                self.handle.touch(list(keys))

    def close(self) -> None:
        """Close the tier; it finishes or fails every accepted job first (rule 9)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.handle.close()
            for res in self.handle.get_finished_jobs():
                self._done[res.job_id] = res
