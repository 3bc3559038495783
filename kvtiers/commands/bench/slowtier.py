"""A deliberately slow tier, for tests and benches (fault injection).

:class:`SlowLoads` is a wrapper plugin (``handle.add_wrapper``) that holds back the results
of a tier's load jobs until ``delay_s + chunks * per_chunk_s`` after their submit, and reports
that time as the job's ``seconds``; stores, lookups and the bytes are untouched. It never
blocks: the held results come back from a later ``get_finished_jobs``. Use it to show what
the engine does with a tier slower than recompute (``recompute_when_faster``,
kvtiers/engine/costs.py)::

    slow_down(mgr.tiers[0].handle, delay_s=0.05, per_chunk_s=0.01)

Under vLLM, kvtiers' tier adapter takes it as the secondary tier entry's ``"slow_loads":
{"delay_ms": 50, "per_chunk_ms": 10}`` (so ``kvtiers bench serve --variant`` can make a slow
copy of a configuration, see ``make bench-serve-slow``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from ...hookspecs import hookimpl

__all__ = ["SlowLoads", "parse_slow_loads", "slow_down"]


class SlowLoads:
    """Holds each load job's result until ``delay_s + chunks * per_chunk_s`` after its submit."""

    def __init__(self, delay_s: float = 0.0, per_chunk_s: float = 0.0) -> None:
        if delay_s < 0 or per_chunk_s < 0:
            raise ValueError(f"delay_s and per_chunk_s must be >= 0, got {delay_s}, {per_chunk_s}")
        self.delay_s = delay_s
        self.per_chunk_s = per_chunk_s
        self._due: dict[int, tuple[float, float]] = {}  # load job id -> (submit time, release time)
        self._held: list[Any] = []
        self._lock = threading.Lock()

    @hookimpl(wrapper=True)
    def submit_load(self, job: Any) -> Any:
        t0 = time.perf_counter()
        result = yield
        with self._lock:
            self._due[job.job_id] = (t0, t0 + self.delay_s + len(job.keys) * self.per_chunk_s)
        return result

    @hookimpl(wrapper=True)
    def get_finished_jobs(self) -> Any:
        results = yield
        now = time.perf_counter()
        out = []
        with self._lock:
            self._held.extend(results or ())
            held, self._held = self._held, []
            for res in held:
                due = self._due.get(res.job_id)
                if due is None:
                    out.append(res)
                elif now >= due[1]:
                    del self._due[res.job_id]
                    out.append(dataclasses.replace(res, seconds=now - due[0]))
                else:
                    self._held.append(res)
        return out

    @hookimpl(wrapper=True)
    def backlog(self) -> Any:
        n = yield
        with self._lock:
            return (n or 0) + len(self._held)


def slow_down(handle: Any, *, delay_s: float = 0.0, per_chunk_s: float = 0.0,
              name: str = "kvtiers-slow-loads") -> SlowLoads:
    """Wrap ``handle`` (a :class:`kvtiers.registry.TierHandle`) in :class:`SlowLoads`; returns it."""
    slow = SlowLoads(delay_s, per_chunk_s)
    handle.add_wrapper(slow, name=name)
    return slow


def parse_slow_loads(obj: Any) -> SlowLoads | None:
    """A ``{"delay_ms": ..., "per_chunk_ms": ...}`` object (either key optional) as a
    :class:`SlowLoads`, None for None; ``ValueError`` (one line) for anything else."""
    if obj is None:
        return None
    if not isinstance(obj, dict) or not obj or set(obj) - {"delay_ms", "per_chunk_ms"}:
        raise ValueError(f"'slow_loads' must be an object of delay_ms and/or per_chunk_ms, got {obj!r}")
    for k, v in obj.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"'slow_loads': {k!r} must be a number of milliseconds >= 0, got {v!r}")
    return SlowLoads(obj.get("delay_ms", 0) / 1000.0, obj.get("per_chunk_ms", 0) / 1000.0)
