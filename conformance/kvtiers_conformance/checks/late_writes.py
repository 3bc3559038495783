"""Rule 6 on the tier's own code cut short: jobs that end by a deadline or by ``close``
while the tier's coroutines or threads are still at work. Injected faults cannot show this
(a cancelled wrapper never runs the tier's code), so these checks run the tier's real
per-key and batch paths: with an ``op_timeout`` far below the latency the medium just
showed, and with ``close`` while jobs are in flight. Every slot of every reported job is
poisoned the moment its result arrives and must stay poisoned; keys whose stores were cut
short must later load their exact bytes or fail, never the poison a store read late.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvtiers import AsyncTier

from ..harness import CheckSkipped, ConformanceFailure, Harness, Instance, fail
from ..rules import check
from ..slotwatch import SlotWatch

#: op_timeout as fractions of the medium's latency: cut before, early in and late in a job
FRACTIONS = (0.02, 0.3, 0.7)
KEYS_PER_JOB = 16
MAX_WATCH_S = 5.0


def defines(tier: object, name: str) -> bool:
    """Whether the tier class overrides ``AsyncTier.<name>`` (a batch coroutine)."""
    return getattr(type(tier), name) is not getattr(AsyncTier, name)


def _force_per_key(tier: AsyncTier) -> None:
    """Make jobs use the tier's own ``put``/``get_into`` even if it has batch coroutines
    (the base class uses the per-key coroutine when it is set on the instance)."""
    tier.put = tier.put  # type: ignore[method-assign]
    tier.get_into = tier.get_into  # type: ignore[method-assign]


def _unforce(tier: AsyncTier) -> None:
    for name in ("put", "get_into"):
        tier.__dict__.pop(name, None)


def _latency(t: Instance, keys: Sequence[bytes]) -> float:
    """Seconds a job of ``keys`` takes on this medium: the slower of a store and a load."""
    times = []
    for kind in ("store", "load"):
        for i in range(0, len(keys), KEYS_PER_JOB):
            jid = t.submit(kind, keys[i:i + KEYS_PER_JOB])
            r = t.wait([jid])[jid]
            if not r.ok:
                fail(f"{'store' if kind == 'store' else 'rule 2: load'} of {len(r.failed_keys)} key(s) failed "
                     f"with the default op_timeout: {r.error}")
            times.append(r.seconds)
    return max(statistics.median(times), 1e-4)


@check(6, "late_writes_after_deadline")
def late_writes_after_deadline(h: Harness) -> None:
    """The tier's real per-key and batch paths cut by an op_timeout far below the medium's
    latency: no slot of a reported job is written afterwards, and keys of stores cut short
    load their exact bytes or fail."""
    t = h.open()
    if not t.is_async:
        raise CheckSkipped("not an AsyncTier")
    tier = t.tier
    stored = h.keys(2 * KEYS_PER_JOB, b"T")
    lat = _latency(t, stored)
    paths = []
    if defines(tier, "put_many") or defines(tier, "get_many_into"):
        paths.append("batch")
    if defines(tier, "put") and defines(tier, "get_into") or not paths:
        paths.append("per-key")
    default = tier.op_timeout
    watch = SlotWatch(t)
    cut: list[bytes] = []  # keys of stores that ran under a short deadline
    try:
        for path in paths:
            if path == "per-key":
                _force_per_key(tier)
            for frac in FRACTIONS:
                tier.op_timeout = lat * frac
                fresh = h.keys(KEYS_PER_JOB, b"t")
                cut += fresh
                note = f"op_timeout {tier.op_timeout:.2g} s, {path} path"
                ids = [watch.submit("load", stored[:KEYS_PER_JOB], note=note),
                       watch.submit("store", fresh, note=note),
                       watch.submit("load", stored[KEYS_PER_JOB:], note=note)]
                t.wait(ids)
                watch.check()
        tier.op_timeout = default
        _unforce(tier)
        watch.watch(min(MAX_WATCH_S, max(h.limits.ownership_wait_s, 3 * lat)))
    finally:
        tier.op_timeout = default
        _unforce(tier)
    watch.release()
    try:
        t.load(cut)  # a good key must hold its bytes, not the poison of its store's slot
        t.load_all(stored, why="rule 2")
    except ConformanceFailure as e:
        fail(f"rule 6: after stores cut short by op_timeout had their slots poisoned, loads went wrong "
             f"(did the tier read the slot after the job was reported?): {e}")
    watch.check()


@check(6, "late_writes_after_close")
def late_writes_after_close(h: Harness) -> None:
    """close with loads and stores in flight (for an AsyncTier, a close_timeout far below
    the medium's latency, so close cancels them): every result is handed over, and no slot
    of those jobs is written after close returned."""
    t = h.open()
    stored = h.keys(2 * KEYS_PER_JOB, b"Q")
    lat = _latency(t, stored)
    if t.is_async:
        t.tier.close_timeout = lat * FRACTIONS[1]
    watch = SlotWatch(t)
    for i in range(0, len(stored), KEYS_PER_JOB):
        watch.submit("load", stored[i:i + KEYS_PER_JOB], note="in flight at close")
        watch.submit("store", h.keys(KEYS_PER_JOB, b"q"), note="in flight at close")
    t.close()  # the harness fails unless every job is among the results
    watch.watch(min(MAX_WATCH_S, max(h.limits.ownership_wait_s, 3 * lat)))
