"""Helpers shared by tests of any tier or manager (fs, p2p, KV events, metrics)."""

from __future__ import annotations

import time
from typing import Any

from kvtiers import JobResult


def wait_job(tier: Any, job_id: int, timeout: float = 30.0) -> JobResult:
    """Poll ``get_finished_jobs`` until ``job_id`` is reported; any other result is an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in tier.get_finished_jobs():
            if r.job_id == job_id:
                return r
            raise AssertionError(f"unexpected result {r}")
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish within {timeout} s")


class CopyDma:
    """A DMA engine for a manager without devices: copies complete at once."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def submit_store(self, tid: int, chunks: Any) -> None:
        self.done.append(tid)

    def submit_load(self, tid: int, chunks: Any) -> None:
        self.done.append(tid)

    def poll(self) -> list[int]:
        out, self.done = self.done, []
        return out
