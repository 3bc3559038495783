"""Rule 11 (bounded): with ``max_bytes`` set the tier evicts, stores keep succeeding, and
evicted keys answer MISS and are reported through ``ctx.removed``."""

from __future__ import annotations

import time

from kvtiers import Lookup

from ..catalog import check
from ..harness import Harness, fail, qkey


@check(11, "bounded_capacity", "bounded")
def bounded_capacity(h: Harness) -> None:
    """Store 4x max_bytes: every store succeeds, at most max_bytes stay, every MISS was
    reported removed, every removed key answers MISS, survivors load exactly."""
    lim = h.limits
    cap = lim.bounded_slots
    t = h.open(max_bytes=cap * lim.slot_bytes)
    keys = h.keys(4 * cap, b"V")
    for i in range(0, len(keys), 4):
        r = t.store(keys[i:i + 4], must_succeed=False)
        if not r.ok:
            fail(f"rule 11: a store into a full bounded tier failed {len(r.failed_keys)} key(s): {r.error}")
    deadline = time.monotonic() + lim.retry_s  # eviction may run in the background
    while True:
        answers = dict(zip(keys, t.resolve(keys), strict=True))
        hits = [k for k in keys if answers[k] is Lookup.HIT]
        removed = t.removed_keys()
        unreported = [k for k in keys if answers[k] is Lookup.MISS and k not in removed]
        if len(hits) <= cap and not unreported:
            break
        if time.monotonic() > deadline:
            if len(hits) > cap:
                fail(f"rule 11: {len(hits)} chunks of {lim.slot_bytes} bytes answer HIT with max_bytes="
                     f"{cap * lim.slot_bytes} (room for {cap}): the tier does not evict")
            fail(f"rule 11: {len(unreported)} key(s) answer MISS but were never reported through ctx.removed "
                 f"(e.g. {qkey(unreported[0])})")
        time.sleep(0.05)
    back = [k for k in removed if k in answers and answers[k] is not Lookup.MISS]
    if back:
        fail(f"rule 11: key {qkey(back[0])} was reported removed but answers {answers[back[0]].name}")
    if not hits:
        fail("rule 11: nothing survives in a bounded tier: it should evict down to max_bytes, not empty itself")
    t.load_all(hits, why="rule 11")
    t.expect_missing([k for k in keys if answers[k] is Lookup.MISS][:8], "rule 11")
    more = h.keys(cap, b"v")  # still taking stores after evicting
    t.store_many(more, per_job=4)
