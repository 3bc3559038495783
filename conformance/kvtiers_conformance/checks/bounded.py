"""Rule 11 (bounded): with ``max_bytes`` set the tier evicts, stores keep succeeding, and
evicted keys answer MISS and are reported through ``ctx.removed``.

Two shapes of load: many small jobs, and one job four times larger than the bound (a tier
that marks every key of a finished job present, as a naive base class does, resurrects the
keys it evicted during that job). After either, every key answering HIT loads its exact
bytes, the HIT keys fit in ``max_bytes``, and every stored key that left was reported.

With ``shared`` checked as well, two instances on one bounded backend (the second in another
process): the instance that evicts reports the eviction; the other may go on answering HIT
for a key it did not evict until a load of it fails, then answers MISS, and never loads
wrong bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtiers import Lookup

from ..harness import CheckSkipped, Harness, Instance, fail, qkey
from ..peer import RemoteInstance
from ..rules import check


def _store_over_bound(t: Instance, keys: Sequence[bytes], per_job: int) -> None:
    for i in range(0, len(keys), per_job):
        r = t.store(keys[i:i + per_job], must_succeed=False)
        if not r.ok:
            fail(f"rule 11: a store of {len(keys[i:i + per_job])} key(s) into a full bounded tier failed "
                 f"{len(r.failed_keys)} of them: {r.error}")


def _settled(h: Harness, t: Instance, keys: Sequence[bytes], cap: int) -> tuple[dict, list[bytes]]:
    """Poll (eviction may run in the background) until the HIT keys fit, every key that left
    was reported and no reported key answers HIT; fail with the most specific reason."""
    lim = h.limits
    deadline = time.monotonic() + lim.retry_s
    while True:
        answers = dict(zip(keys, t.resolve(keys), strict=True))
        hits = [k for k in keys if answers[k] is Lookup.HIT]
        removed = t.removed_keys()
        ghosts = [k for k in hits if k in removed]
        unreported = [k for k in keys if answers[k] is Lookup.MISS and k not in removed]
        if len(hits) <= cap and not unreported and not ghosts:
            return answers, hits
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if ghosts:
        fail(f"rule 11: {len(ghosts)} key(s) reported evicted through ctx.removed still answer HIT "
             f"(e.g. {qkey(ghosts[0])}); an evicted key answers MISS until stored again")
    if len(hits) > cap:
        fail(f"rule 11: {len(hits)} chunks of {lim.slot_bytes} bytes answer HIT with max_bytes="
             f"{cap * lim.slot_bytes} (room for {cap}): the tier does not evict, or keeps evicted keys as HIT")
    fail(f"rule 11: {len(unreported)} stored key(s) answer MISS but were never reported through ctx.removed "
         f"(e.g. {qkey(unreported[0])})")
    raise AssertionError("unreachable")


def _bounded(h: Harness, per_job: int) -> None:
    lim = h.limits
    cap = lim.bounded_slots
    n = 4 * cap
    t = h.open(max_bytes=cap * lim.slot_bytes, num_slots=max(lim.num_slots, n + 1))
    keys = h.keys(n, b"V")
    _store_over_bound(t, keys, per_job)
    answers, hits = _settled(h, t, keys, cap)
    if not hits:
        fail("rule 11: nothing survives in a bounded tier: it should evict down to max_bytes, not empty itself")
    t.load_all(hits, why="rule 11")  # byte-exact, checked by the harness
    gone = [k for k in keys if answers[k] is Lookup.MISS]
    t.expect_missing(gone[:16], "rule 11", what="evicted")
    more = h.keys(cap, b"v")  # still taking stores after evicting
    _store_over_bound(t, more, per_job)
    everything = keys + more
    _, hits = _settled(h, t, everything, cap)
    t.load_all(hits, why="rule 11")


@check(11, "bounded_capacity", "bounded")
def bounded_capacity(h: Harness) -> None:
    """Store 4x max_bytes in jobs of 4 keys: every store succeeds, the HIT keys fit and load
    exactly, every key that left was reported removed and answers MISS."""
    _bounded(h, per_job=4)


@check(11, "one_job_over_the_bound", "bounded")
def one_job_over_the_bound(h: Harness) -> None:
    """Store 4x max_bytes in one job: the keys evicted during that job do not answer HIT
    afterwards; the HIT keys fit and load exactly; every key that left was reported."""
    _bounded(h, per_job=4 * h.limits.bounded_slots)


def _then_miss(t, keys: Sequence[bytes], who: str, timeout: float) -> None:
    """Keys whose load failed must answer MISS (polled: a probe may be in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        hits = [k for k, a in zip(keys, t.resolve(keys), strict=True) if a in (Lookup.HIT, "HIT")]
        if not hits:
            return
        if time.monotonic() > deadline:
            fail(f"rule 11 (shared): key {qkey(hits[0])} still answers HIT on {who} after a load of it failed "
                 "(after a failed load, a key evicted by another instance answers MISS)")
        time.sleep(0.05)


def _load_hits(t, keys: Sequence[bytes], who: str, per_job: int) -> None:
    """Load the keys answering HIT on ``t`` (good bytes are verified where ``t`` runs); the
    ones that fail must answer MISS afterwards."""
    hits = [k for k, a in zip(keys, t.resolve(keys), strict=True) if a in (Lookup.HIT, "HIT")]
    failed: list[bytes] = []
    for i in range(0, len(hits), per_job):
        part = hits[i:i + per_job]
        failed += t.load(part) if not isinstance(t, Instance) else list(t.load(part).failed_keys)
    if failed:
        _then_miss(t, failed, who, t.h.limits.retry_s)


@check(11, "bounded_shared", "bounded")
def bounded_shared(h: Harness) -> None:
    """Two instances on one bounded backend (with level shared): every stored key that left
    was reported by the instance that evicted it; either instance may answer HIT for a key
    the other evicted until its load fails, then MISS, never wrong bytes."""
    if "shared" not in h.levels:
        raise CheckSkipped("needs level shared as well (two instances on one bounded backend)")
    lim = h.limits
    cap = lim.bounded_slots
    a = h.open(max_bytes=cap * lim.slot_bytes, num_slots=max(lim.num_slots, 4 * cap + 1))
    b = RemoteInstance(h, max_bytes=cap * lim.slot_bytes)
    early = h.keys(cap // 2, b"U")
    a.store(early)
    b.wait_hit(early)  # b has seen them: it may keep answering HIT once a evicts them
    keys = early + h.keys(4 * cap, b"u")
    _store_over_bound(a, keys[len(early):], 4)
    deadline = time.monotonic() + lim.retry_s
    while True:  # every key that left was reported, by a or by b (whichever evicted it)
        answers = dict(zip(keys, a.resolve(keys), strict=True))
        removed = a.removed_keys() | b.removed_keys()
        unreported = [k for k in keys if answers[k] is Lookup.MISS and k not in removed]
        ghosts = [k for k in a.removed_keys() if answers.get(k) is Lookup.HIT]
        if not unreported and not ghosts:
            break
        if time.monotonic() > deadline:
            if ghosts:
                fail(f"rule 11 (shared): key {qkey(ghosts[0])} that this instance reported evicted still "
                     "answers HIT here")
            fail(f"rule 11 (shared): {len(unreported)} stored key(s) answer MISS but neither instance reported "
                 f"them through ctx.removed (e.g. {qkey(unreported[0])}): the instance that evicts reports")
        time.sleep(0.05)
    if Lookup.HIT not in answers.values():
        fail("rule 11 (shared): nothing survives in a bounded tier: it should evict down to max_bytes")
    _load_hits(b, keys, "the other instance", 32)
    _load_hits(a, keys, "the storing instance", 64)
