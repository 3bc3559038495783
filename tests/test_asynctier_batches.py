"""``AsyncTier`` batch coroutines ``put_many``/``get_many_into``: one call per job (or per
``batch_size`` keys), per-key failures reported exactly, timeouts and close cancel a batch,
and a cancelled batch never writes a slot after its job is reported (issue 11, item 8)."""

from __future__ import annotations

import asyncio
import time

import pytest
from tier_helpers import wait_job as result

from kvtiers import Arena, AsyncTier, Job, TierContext

SLOT = 4096


class BatchTier(AsyncTier):
    """A dict with batch coroutines; ``calls`` records each batch's keys, ``hang`` makes a
    batch holding one of those keys sleep for an hour, ``bad`` answers per-key failures."""

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.data: dict[bytes, bytes] = {}
        self.calls: list[tuple[str, tuple[bytes, ...]]] = []
        self.hang: set[bytes] = set()
        self.bad: dict[bytes, object] = {}
        self.cancelled: list[tuple[bytes, ...]] = []
        self.raise_exc: Exception | None = None

    async def exists(self, key):
        return key in self.data

    async def put(self, key, data):  # used only when put is replaced on the instance
        self.data[key] = bytes(data)

    async def get_into(self, key, out):
        raise AssertionError("a tier with get_many_into gets no get_into call")

    async def _maybe_hang(self, keys) -> None:
        if self.hang & set(keys):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.append(tuple(keys))
                raise

    async def put_many(self, items):
        keys = tuple(k for k, _ in items)
        self.calls.append(("put_many", keys))
        if self.raise_exc is not None:
            raise self.raise_exc
        blobs = [(k, bytes(v)) for k, v in items]  # copy before the first await (rule 6)
        await self._maybe_hang(keys)
        for k, b in blobs:
            if k not in self.bad:
                self.data[k] = b
        return {k: why for k, why in self.bad.items()} | {b"not-in-this-batch": "ignored"}

    async def get_many_into(self, items):
        keys = tuple(k for k, _ in items)
        self.calls.append(("get_many_into", keys))
        await self._maybe_hang(keys)
        failed = {}
        for k, out in items:
            if k in self.bad:
                failed[k] = self.bad[k]
            elif k not in self.data:
                failed[k] = False
            else:
                out[:] = self.data[k]
        return failed


@pytest.fixture
def ctx() -> TierContext:
    return TierContext(Arena.allocate(64, SLOT))


@pytest.fixture
def tier(ctx):
    t = BatchTier(ctx)
    yield t
    t.close()


def fill(ctx, n: int) -> list[bytes]:
    out = []
    for s in range(n):
        data = bytes([s + 1]) * 16 + bytes(SLOT - 16)
        ctx.arena[s][:] = data
        out.append(data)
    return out


def keys_of(n: int, tag: bytes = b"k") -> tuple[bytes, ...]:
    return tuple(tag + b"%02d" % i for i in range(n))


def test_a_job_is_one_batch_call_and_round_trips(tier, ctx) -> None:
    want = fill(ctx, 32)
    keys = keys_of(32)
    tier.submit_store(Job(1, keys, tuple(range(32))))
    r = result(tier, 1)
    assert r.ok and r.nbytes == 32 * SLOT and r.error is None
    tier.submit_load(Job(2, keys, tuple(range(32, 64))))
    assert result(tier, 2).ok
    assert [bytes(ctx.arena[32 + i]) for i in range(32)] == want
    assert tier.calls == [("put_many", keys), ("get_many_into", keys)]


def test_batch_size_splits_a_job(tier, ctx) -> None:
    fill(ctx, 20)
    tier.batch_size = 8
    tier.submit_store(Job(1, keys_of(20), tuple(range(20))))
    assert result(tier, 1).ok
    assert [len(k) for _, k in tier.calls] == [8, 8, 4]


def test_per_key_failures_inside_a_batch_are_exact(tier, ctx) -> None:
    fill(ctx, 8)
    keys = keys_of(8)
    tier.bad = {keys[2]: OSError(28, "No space left on device")}
    tier.submit_store(Job(1, keys, tuple(range(8))))
    r = result(tier, 1)
    assert r.failed_keys == (keys[2],)  # the stray key outside the batch is ignored
    assert r.error == "OSError: [Errno 28] No space left on device"
    assert r.nbytes == 7 * SLOT
    tier.bad = {keys[5]: "checksum mismatch"}
    tier.submit_load(Job(2, keys, tuple(range(8, 16))))
    r = result(tier, 2)
    assert r.failed_keys == (keys[2], keys[5])
    assert r.error == "checksum mismatch; missing"


def test_a_raising_batch_fails_each_of_its_keys(tier, ctx) -> None:
    fill(ctx, 4)
    tier.raise_exc = ConnectionError("backend down")
    tier.submit_store(Job(1, keys_of(4), (0, 1, 2, 3)))
    r = result(tier, 1)
    assert r.failed_keys == keys_of(4) and r.error == "ConnectionError: backend down" and r.nbytes == 0


def test_a_hanging_batch_times_out_alone_and_never_writes_after(tier, ctx) -> None:
    fill(ctx, 16)
    keys = keys_of(16)
    tier.submit_store(Job(1, keys, tuple(range(16))))
    assert result(tier, 1).ok
    tier.op_timeout = 0.5
    tier.batch_size = 4
    tier.hang = {keys[5]}
    for s in range(16, 32):
        ctx.arena[s][:] = b"\xee" * SLOT
    t0 = time.monotonic()
    tier.submit_load(Job(2, keys, tuple(range(16, 32))))
    r = result(tier, 2)
    assert time.monotonic() - t0 < 8  # generous: the bound is 0.5 s
    assert r.failed_keys == keys[4:8] and r.error == "timed out after 0.5 s"
    assert tier.cancelled == [keys[4:8]]  # the batch was cancelled, not left running
    time.sleep(0.2)
    assert all(bytes(ctx.arena[s]) == b"\xee" * SLOT for s in range(20, 24))  # rule 6
    assert bytes(ctx.arena[16]) == bytes(ctx.arena[0])


def test_close_cancels_a_hanging_batch_and_reports_it(ctx) -> None:
    t = BatchTier(ctx)
    t.close_timeout = 0.3
    fill(ctx, 4)
    t.hang = {b"stuck"}
    t.submit_store(Job(1, (b"stuck", b"other"), (0, 1)))
    t0 = time.monotonic()
    t.close()
    assert time.monotonic() - t0 < 10
    (r,) = t.get_finished_jobs()
    assert r.failed_keys == (b"stuck", b"other") and r.error == "cancelled on close"
    assert t.cancelled == [(b"stuck", b"other")]


def test_a_replaced_per_key_coroutine_is_used_instead_of_the_batch(tier, ctx) -> None:
    """The conformance suite injects faults by replacing put/get_into on the instance."""
    fill(ctx, 2)

    async def failing_put(key, data):
        raise OSError("injected")

    tier.put = failing_put
    tier.submit_store(Job(1, (b"a", b"b"), (0, 1)))
    r = result(tier, 1)
    assert r.failed_keys == (b"a", b"b") and r.error == "OSError: injected"
    assert tier.calls == []
