"""The tenant scope (``as_tenant``, docs/security.md#tenants) holds per asyncio task, per
thread and per callback (issue 51 item 2), on a real fs tier opened with ``"encrypt"``: two
tasks of one loop each inside its own ``with as_tenant(...)`` and awaiting inside it, two
threads likewise, and callbacks scheduled inside a block. Alice's chunk is never sealed for
bob (its file carries alice's key id), bob never loads alice's bytes, bob's own store
succeeds, and no scope outlives its block."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time

import pytest
from test_encryption import _key, _pattern
from tier_helpers import wait_job

from kvtiers import Arena, Job, JobResult, Namespace, TierContext, open_tier
from kvtiers.encryption import HEADER, read_header
from kvtiers.encryption.tenants import as_tenant

pytest.importorskip("cryptography")

SLOT = 64 << 10
ALICE, BOB = b"alice-0", b"bob-0"


@pytest.fixture
def tier(tmp_path):
    """An fs tier, alice and bob each with a key of their own, no default key (a store
    with no tenant is not offloaded), and 16 caller slots: 0-7 hold ``_pattern(i)``."""
    enc = {"tenants": {"alice": {"key_file": _key(tmp_path, "alice"), "key_id": "alice-1"},
                       "bob": {"key_file": _key(tmp_path, "bob"), "key_id": "bob-1"}}}
    ctx = TierContext(Arena.allocate(16, SLOT), Namespace({"model": "m"}))
    for i in range(8):
        ctx.arena[i][:] = _pattern(i, SLOT)
    h = open_tier("fs", {"root_dir": str(tmp_path / "kv"), "encrypt": enc}, ctx)
    h.root = tmp_path / "kv"
    try:
        yield h
    finally:
        h.close()


def _results(h, jids, timeout: float = 30.0) -> dict[int, JobResult]:
    """The results of jobs ``jids``, collected together (one ``wait_job`` each would drop the
    others reported in the same batch)."""
    done: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout
    while set(jids) - done.keys() and time.monotonic() < deadline:
        done.update((r.job_id, r) for r in h.get_finished_jobs())
        time.sleep(0.001)
    missing = set(jids) - done.keys()
    assert not missing, f"jobs {sorted(missing)} not reported within {timeout} s"
    return done


def _key_id(h, key: bytes) -> str | None:
    """The key id in the sealed header of ``key``'s file on the medium (None: no file)."""
    files = list(h.root.rglob(key.hex() + ".bin"))
    return read_header(files[0].read_bytes()[:HEADER.size])[0] if files else None


def _check_tenants_kept(h) -> None:
    """Alice's and bob's chunks (stored from slots 0 and 1) each sealed for its own tenant;
    alice loads hers; bob's load of alice's key fails and leaves none of her bytes."""
    assert (_key_id(h, ALICE), _key_id(h, BOB)) == ("alice-1", "bob-1")
    with as_tenant(h, "alice"):
        h.submit_load(Job(90, (ALICE,), (8,)))
    assert wait_job(h, 90, strict=False).ok and bytes(h.ctx.arena[8]) == _pattern(0, SLOT)
    h.ctx.arena[9][:] = b"\xa5" * SLOT
    with as_tenant(h, "bob"):
        h.submit_load(Job(91, (ALICE,), (9,)))
    assert wait_job(h, 91, strict=False).failed_keys == (ALICE,)
    assert bytes(h.ctx.arena[9]) == b"\xa5" * SLOT


def _check_no_scope_left(h, key: bytes, slot: int, jid: int) -> None:
    """Outside every block the calls are no tenant's: a key never noted is not offloaded
    (no default key), not sealed for whichever tenant entered last."""
    skipped = h.hooks.stats["tenant_skipped_store"]
    h.submit_store(Job(jid, (key,), (slot,)))
    assert wait_job(h, jid, strict=False).failed_keys == (key,)
    assert h.hooks.stats["tenant_skipped_store"] == skipped + 1 and _key_id(h, key) is None


def test_two_tasks_awaiting_inside_their_scopes_keep_their_own_tenant(tier):
    """Both tasks are inside their blocks when either submits: a scope kept per thread
    (``threading.local``) gives alice's store bob's tenant, and leaves a tenant set after
    both blocks end."""
    h = tier

    async def main() -> None:
        inside = {"alice": asyncio.Event(), "bob": asyncio.Event()}

        async def task(me: str, other: str, key: bytes, slot: int, jid: int) -> None:
            with as_tenant(h, me):
                inside[me].set()
                await inside[other].wait()
                await asyncio.sleep(0)
                h.submit_store(Job(jid, (key,), (slot,)))
                await asyncio.sleep(0)

        await asyncio.gather(task("alice", "bob", ALICE, 0, 1), task("bob", "alice", BOB, 1, 2))

    asyncio.run(main())
    res = _results(h, (1, 2))
    assert res[1].ok and res[2].ok, res  # bob's own store succeeds
    _check_tenants_kept(h)
    _check_no_scope_left(h, b"nobody-0", 2, 3)


def test_two_threads_inside_their_scopes_keep_their_own_tenant(tier):
    """Two threads each inside its own block at once (their calls on the tier one at a
    time, as the contract says)."""
    h = tier
    both_inside = threading.Barrier(2, timeout=30)
    one_at_a_time = threading.Lock()
    errors: list[BaseException] = []

    def run(me: str, key: bytes, slot: int, jid: int) -> None:
        try:
            with as_tenant(h, me):
                both_inside.wait()
                with one_at_a_time:
                    h.submit_store(Job(jid, (key,), (slot,)))
                both_inside.wait()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=("alice", ALICE, 0, 1)),
               threading.Thread(target=run, args=("bob", BOB, 1, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    res = _results(h, (1, 2))
    assert res[1].ok and res[2].ok, res
    _check_tenants_kept(h)
    _check_no_scope_left(h, b"nobody-0", 2, 3)


def test_a_callback_is_the_tenant_of_the_block_that_scheduled_it(tier):
    """``loop.call_soon`` inside alice's block copies the context then: the callback stores
    for alice although it runs after her block ended, while bob's task sits inside his."""
    h = tier

    async def main() -> None:
        loop = asyncio.get_running_loop()
        bob_inside, stored = asyncio.Event(), asyncio.Event()

        def store_alice() -> None:
            h.submit_store(Job(1, (ALICE,), (0,)))
            stored.set()

        async def bob() -> None:
            with as_tenant(h, "bob"):
                bob_inside.set()
                await stored.wait()
                h.submit_store(Job(2, (BOB,), (1,)))

        async def alice() -> None:
            await bob_inside.wait()
            with as_tenant(h, "alice"):
                loop.call_soon(store_alice)
            # the block has ended; the callback has not run yet

        await asyncio.gather(bob(), alice())

    asyncio.run(main())
    res = _results(h, (1, 2))
    assert res[1].ok and res[2].ok, res
    _check_tenants_kept(h)
    _check_no_scope_left(h, b"nobody-0", 2, 3)


def test_executor_threads_carry_the_tenant_only_when_given_the_context(tier):
    """Inside alice's block: ``asyncio.to_thread`` and ``run_in_executor`` over
    ``contextvars.copy_context().run`` store for alice; a bare ``run_in_executor`` (its
    thread has a context of its own) stores for no tenant: not offloaded, never sealed for
    anyone."""
    h = tier
    keys = [b"alice-to-thread", b"alice-copied", b"bare-executor"]

    def store(jid: int) -> JobResult:
        h.submit_store(Job(jid, (keys[jid - 1],), (jid - 1,)))
        return wait_job(h, jid, strict=False)

    async def main() -> list[JobResult]:
        loop = asyncio.get_running_loop()
        with as_tenant(h, "alice"):
            return [await asyncio.to_thread(store, 1),
                    await loop.run_in_executor(None, contextvars.copy_context().run, store, 2),
                    await loop.run_in_executor(None, store, 3)]

    res = asyncio.run(main())
    assert res[0].ok and res[1].ok, res
    assert [_key_id(h, k) for k in keys] == ["alice-1", "alice-1", None]
    assert res[2].failed_keys == (keys[2],) and h.hooks.stats["tenant_skipped_store"] == 1


@pytest.mark.skipif(bool(getattr(sys.flags, "thread_inherit_context", 0)),
                    reason="this Python copies the context into new threads (sys.flags.thread_inherit_context)")
def test_a_thread_started_inside_a_block_has_no_tenant(tier):
    h = tier
    out: list[JobResult] = []
    with as_tenant(h, "alice"):
        t = threading.Thread(
            target=lambda: (h.submit_store(Job(1, (ALICE,), (0,))), out.append(wait_job(h, 1, strict=False))))
        t.start()
        t.join(60)
    assert out and out[0].failed_keys == (ALICE,) and _key_id(h, ALICE) is None
