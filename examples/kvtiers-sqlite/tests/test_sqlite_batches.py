"""The sqlite example stores and loads a whole job in one transaction (put_many,
get_many_into), and reports per-key outcomes exactly inside it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from test_kvtiers_sqlite import wait

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier

SLOT = 4096


def test_a_job_is_one_transaction_with_exact_per_key_results(tmp_path: Path) -> None:
    removed = []
    ctx = TierContext(Arena.allocate(130, SLOT), Namespace({"model": "m"}),
                      removed=lambda keys, why: removed.append((tuple(keys), why)))
    h = open_tier("sqlite", {"path": str(tmp_path / "kv.sqlite3")}, ctx)
    statements: list[str] = []
    try:
        h.tier.db.set_trace_callback(statements.append)
        keys = tuple(b"key-%02d" % i for i in range(64))
        for s in range(64):
            ctx.arena[s][:] = bytes([s]) * SLOT
        h.submit_store(Job(1, keys, tuple(range(64))))
        assert wait(h, 1).ok
        assert statements.count("BEGIN IMMEDIATE") == 1 and statements.count("COMMIT") == 1
        assert sum(s.startswith("INSERT") for s in statements) == 64  # executemany, one per row

        with sqlite3.connect(tmp_path / "kv.sqlite3") as raw:  # damage one row behind its back
            raw.execute(f"UPDATE {h.tier.table} SET data = zeroblob({SLOT}) WHERE key = ?", (keys[7],))
        statements.clear()
        wanted = (*keys, b"never-stored")
        h.submit_load(Job(2, wanted, tuple(range(64, 129))))
        r = wait(h, 2)
        assert r.failed_keys == (keys[7], b"never-stored")
        assert "corrupt" in r.error and "missing" in r.error
        assert statements.count("BEGIN") == 1  # one read transaction for the whole job
        assert all(bytes(ctx.arena[64 + i]) == bytes([i]) * SLOT for i in range(64) if i != 7)
        assert removed == [((keys[7],), "corrupt")]
        assert h.lookup([keys[7]]) == [Lookup.MISS]  # evicted: a MISS at once, no probe
    finally:
        h.close()
