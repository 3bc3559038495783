"""Rules 5-8 on one instance: results exactly once, slot ownership, idempotent stores,
submits that never block and raise only for caller errors."""

from __future__ import annotations

import statistics
import time

from kvtiers import Job

from ..harness import ConformanceFailure, Harness, fail, poison, qkey
from ..rules import check


@check(5, "exactly_once_64_in_flight")
def exactly_once_64_in_flight(h: Harness) -> None:
    """64 jobs (stores, then loads) in flight at once: each reported exactly once, within 30 s."""
    lim = h.limits
    t = h.open()
    per = max(1, min(8, (len(t.arena) // 2) // lim.jobs_in_flight))
    keys = h.keys(lim.jobs_in_flight * per, b"E")
    ids = [t.submit("store", keys[i * per:(i + 1) * per]) for i in range(lim.jobs_in_flight)]
    for r in t.wait(ids).values():
        if not r.ok:
            fail(f"store failed: {r.error}")
    ids = [t.submit("load", keys[i * per:(i + 1) * per]) for i in range(lim.jobs_in_flight)]
    ids += [t.submit("store", [k]) for k in h.keys(8, b"e")]
    t.wait(ids)  # duplicates, unknown ids and late results fail inside the harness
    deadline = time.monotonic() + lim.ownership_wait_s  # a duplicate may come later
    while time.monotonic() < deadline:
        t.poll()
        time.sleep(0.01)


@check(5, "empty_job_reported")
def empty_job_reported(h: Harness) -> None:
    """An empty job is valid and is reported, good, exactly once."""
    t = h.open()
    ids = [t.submit("store", []), t.submit("load", [])]
    for jid, r in t.wait(ids).items():
        if not r.ok:
            fail(f"rule 5: empty job {jid} reported failed keys")


@check(6, "slot_poisoning")
def slot_poisoning(h: Harness) -> None:
    """Slots poisoned after their job is reported stay poisoned, and stored bytes stay intact."""
    lim = h.limits
    t = h.open()
    keys = h.keys(48, b"O")
    size = t.slot_bytes
    pat = poison(size)
    watched: list[tuple[int, str, int]] = []  # (slot, kind, job)
    # stores (all of them first): once reported, the tier must have copied the slot;
    # poisoning it must not change what a later load returns.
    # loads: once reported, the tier must never write the slot again
    for kind, failed in (("store", "store failed"), ("load", "rule 2: load of stored keys failed")):
        for i in range(0, len(keys), 4):
            slots = t.alloc(4)
            jid = t.submit(kind, keys[i:i + 4], slots)
            r = t.wait([jid])[jid]
            if not r.ok:
                fail(f"{failed}: {r.error}")
            t.poison(slots)
            watched += [(s, kind, jid) for s in slots]

    def recheck() -> None:
        for s, kind, jid in watched:
            if t.arena[s] != pat:
                fail(f"rule 6: slot {s} of {kind} job {jid} was written after the job was reported")

    deadline = time.monotonic() + lim.ownership_wait_s
    while time.monotonic() < deadline:
        recheck()
        t.poll()
        time.sleep(0.01)
    recheck()
    try:
        t.load_all(keys, why="rule 6")
    except ConformanceFailure as e:  # e.g. the tier kept a view of the slot and now returns poison
        fail(f"rule 6: after the slots of reported stores were poisoned, loading their keys went wrong "
             f"(did the tier keep reading the slot after reporting the store?): {e}")
    recheck()


@check(7, "idempotent_stores")
def idempotent_stores(h: Harness) -> None:
    """Storing existing keys succeeds, also with several stores of one key in flight at once."""
    t = h.open()
    keys = h.keys(8, b"I")
    t.store(keys)
    r = t.store(keys, must_succeed=False)
    if not r.ok:
        fail(f"rule 7: storing {len(r.failed_keys)} existing key(s) failed: {r.error}")
    fresh = h.keys(4, b"i")
    ids = [t.submit("store", fresh + keys[:2]) for _ in range(4)]  # same keys, four jobs in flight
    for jid, r in t.wait(ids).items():
        if not r.ok:
            fail(f"rule 7: concurrent store job {jid} of one key failed {qkey(r.failed_keys[0])}: {r.error}")
    t.resolve(keys + fresh)
    t.load_all(keys + fresh, why="rule 7")


@check(8, "submit_latency")
def submit_latency(h: Harness) -> None:
    """A 64-key store or load submit returns within 50 ms (median of 5)."""
    lim = h.limits
    t = h.open()
    stored = [h.keys(lim.submit_keys, b"S") for _ in range(lim.repeats)]
    for kind in ("store", "load"):
        times = []
        for keys in stored:
            t.submit(kind, keys)
            times.append(t.last_submit_s)
        t.drain()
        med = statistics.median(times) * 1000
        if med > lim.submit_ms:
            fail(f"rule 8: submit_{kind} of {lim.submit_keys} keys took {med:.1f} ms "
                 f"(median of {lim.repeats}; bound {lim.submit_ms:g} ms)")


def _expect_caller_error(t, kind: str, job: Job, what: str, must_mention: str | None = None) -> None:
    try:
        getattr(t.handle, f"submit_{kind}")(job)
    except (ValueError, IndexError, TypeError) as e:
        msg = str(e)
        if not msg:
            fail(f"rule 8: submit_{kind} with {what} raised {type(e).__name__} without a message")
        if must_mention and must_mention not in msg:
            fail(f"rule 8: submit_{kind} with {what} raised {type(e).__name__}({msg!r}), "
                 f"which does not name {must_mention}")
        return
    except Exception as e:
        fail(f"rule 8: submit_{kind} with {what} raised {type(e).__name__}: {e} "
             "(only ValueError, IndexError or TypeError are caller errors)")
    fail(f"rule 8: submit_{kind} accepted a job with {what}")


@check(8, "caller_errors")
def caller_errors(h: Harness) -> None:
    """Out-of-range slots and non-Job arguments raise ValueError/IndexError/TypeError with a
    message, and a rejected job is never reported (rule 5)."""
    t = h.open()
    n = len(t.arena)
    k = h.keys(2, b"X")
    t.store([k[1]])
    for kind in ("store", "load"):
        for bad in (n, n + 7, -1):
            t.fill([k[0]], [0]) if kind == "store" else None
            job = Job(900_000 + bad, (k[0], k[1]), (0, bad))
            _expect_caller_error(t, kind, job, f"slot {bad} of an arena of {n} slots", str(bad))
        # not a Job at all
        try:
            getattr(t.handle, f"submit_{kind}")((1, (k[0],), (0,)))
        except (ValueError, IndexError, TypeError):
            pass
        except AttributeError as e:
            fail(f"rule 8: submit_{kind} of a tuple raised AttributeError ({e}); check the argument is a kvtiers.Job")
        else:
            fail(f"rule 8: submit_{kind} accepted a tuple instead of a kvtiers.Job")
    # rejected jobs never show up: one good job to flush, then watch a little
    jid = t.submit("store", [h.key(b"x")])
    t.wait([jid])
    deadline = time.monotonic() + h.limits.ownership_wait_s
    while time.monotonic() < deadline:
        t.poll()  # a result for a rejected job id fails in the harness ("never submitted")
        time.sleep(0.01)
    if t.arena[n - 1] != poison(t.slot_bytes):
        fail("rule 8: a rejected job wrote the last slot (slot -1 taken as an index from the end?)")
    if t.resolve([k[0]])[0].name == "HIT":
        fail(f"rule 5: key {qkey(k[0])} of a rejected store answers HIT (a submit that raised must not accept its job)")
