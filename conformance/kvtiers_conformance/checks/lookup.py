"""Rule 1: lookups never block, are fast, and RETRY resolves."""

from __future__ import annotations

import statistics
import time

from kvtiers import Lookup

from .. import audit
from ..harness import Harness, fail, qkey
from ..rules import check


@check(1, "lookup_latency")
def lookup_latency(h: Harness) -> None:
    """1000-key lookups (half stored, half unknown) answer within 50 ms, median of 5."""
    lim = h.limits
    t = h.open()
    stored = h.keys(lim.lookup_keys // 2, b"L")
    t.store_many(stored)
    batch = stored + h.keys(lim.lookup_keys - len(stored), b"U")
    t.lookup(batch)  # warm-up: first calls may start background probes
    times = []
    for _ in range(lim.repeats):
        t0 = time.perf_counter()
        t.lookup(batch)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1000
    if med > lim.lookup_ms:
        fail(f"rule 1: lookup of {len(batch)} keys took {med:.1f} ms "
             f"(median of {lim.repeats}; bound {lim.lookup_ms:g} ms)")


@check(1, "no_io_on_caller_thread")
def no_io_on_caller_thread(h: Harness) -> None:
    """lookup does no audited I/O (open, listdir, sockets, sqlite, sleep) on the caller's thread."""
    t = h.open()
    stored = h.keys(8, b"L")
    t.store(stored)
    batch = stored + h.keys(8, b"U")
    t.lookup(batch)  # warm-up (lazy imports open files once)
    with audit.watch() as seen:
        for _ in range(3):
            t.lookup(batch)
            t.lookup(h.keys(8, b"U"))
    if seen:
        more = f" (+{len(seen) - 1} more)" if len(seen) > 1 else ""
        fail(f"rule 1: lookup did I/O on the caller's thread: {seen[0]}{more}")


@check(1, "retry_resolves")
def retry_resolves(h: Harness) -> None:
    """RETRY resolves to HIT for stored keys and MISS for unknown ones within 5 s."""
    t = h.open()
    stored = h.keys(16, b"L")
    t.store(stored)
    unknown = h.keys(16, b"U")
    answers = t.resolve(stored + unknown)
    for k, a in zip(stored, answers[:16], strict=True):
        if a is not Lookup.HIT:
            fail(f"rule 2: stored key {qkey(k)} answers {a.name}")
    for k, a in zip(unknown, answers[16:], strict=True):
        if a is not Lookup.MISS:
            fail(f"rule 1: never-stored key {qkey(k)} resolves to {a.name}, not MISS")
