"""Rules 2 and 7 across instances: ``durable`` (a new instance after close) and ``shared``
(two live instances on one backend, the second in another process, as engines run them:
see :mod:`..peer_child`).

Across live instances a key stored by one may answer MISS on the other for a short while:
an ``AsyncTier`` remembers a MISS for ``negative_ttl`` seconds, and a tier with an index
learns of other writers by polling. The shared checks therefore poll ``lookup`` until
``HIT`` within the RETRY bound (5 s) instead of requiring an immediate ``HIT``.
"""

from __future__ import annotations

from kvtiers import Lookup

from ..harness import Harness, fail, qkey
from ..peer import RemoteInstance
from ..rules import check


@check(2, "read_your_writes_durable", "durable")
def read_your_writes_durable(h: Harness) -> None:
    """Keys stored and closed are HIT and load exactly from a new instance on the same backend."""
    a = h.open()
    keys = h.keys(24, b"D")
    a.store_many(keys, per_job=8)
    a.close()
    b = h.open()
    answers = b.resolve(keys)
    bad = [k for k, x in zip(keys, answers, strict=True) if x is not Lookup.HIT]
    if bad:
        fail(f"rule 2 (durable): {len(bad)} key(s) stored before close answer MISS after reopening "
             f"(e.g. {qkey(bad[0])})")
    b.load_all(keys, why="rule 2 (durable)")
    b.close()
    c = h.open()  # and once more, after the second instance only read
    c.load_all(keys[:4], why="rule 2 (durable)")


@check(2, "read_your_writes_shared", "shared")
def read_your_writes_shared(h: Harness) -> None:
    """A key stored by one live instance becomes HIT on another in another process (polling,
    see the module docstring) and loads exactly there; also after the other first answered
    MISS; and the other way round."""
    a, b = h.open(), RemoteInstance(h)
    early = h.keys(8, b"H")
    b.resolve(early)  # b now believes these are absent (a negative cache may hold that)
    a.store(early)
    b.wait_hit(early)
    b.load_all(early, why="rule 2 (shared)")
    keys = h.keys(16, b"h")
    b.store(keys[8:])
    a.store(keys[:8])
    a.wait_hit(keys[8:])
    b.wait_hit(keys[:8])
    a.load_all(keys, why="rule 2 (shared)")
    b.load_all(keys, why="rule 2 (shared)")


@check(7, "concurrent_stores_shared", "shared")
def concurrent_stores_shared(h: Harness) -> None:
    """Two live instances in two processes store the same keys (same bytes) at once: both
    succeed, one valid copy."""
    a, b = h.open(), RemoteInstance(h)
    keys = h.keys(32, b"W")
    ids_b = b.submit_stores([keys[i:i + 8][::-1] for i in range(0, 32, 8)])
    ids_a = [a.submit("store", keys[i:i + 8]) for i in range(0, 32, 8)]
    for jid, r in a.wait(ids_a).items():
        if not r.ok:
            fail(f"rule 7 (shared): store job {jid} of a key another instance stored at the same time "
                 f"failed {qkey(r.failed_keys[0])}: {r.error}")
    for jid, (failed, error) in b.wait(ids_b).items():
        if failed:
            fail(f"rule 7 (shared): store job {jid} in the second process, of a key this one stored at the "
                 f"same time, failed {qkey(failed[0])}: {error}")
    for inst in (a, b):
        inst.wait_hit(keys)
        inst.load_all(keys, why="rule 7 (shared)")
    a.close()
    b.close()
    c = h.open()
    if "durable" in h.levels or c.resolve(keys[:1])[0] is Lookup.HIT:
        c.load_all(keys, why="rule 7 (shared)")
