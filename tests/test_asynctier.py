"""``AsyncTier``: coroutines in, the four hooks out; errors, timeouts and close as results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

import kvtiers
from kvtiers import Arena, AsyncTier, Job, JobResult, Lookup, TierContext, open_tier

SLOT = 4096


class DictTier(AsyncTier):
    """An AsyncTier over a dict, with hooks for injecting faults into its coroutines.

    ``faults[key]`` is a coroutine function run before the operation on ``key`` (it may
    raise, sleep or hang). Everything but the test's reads runs on the I/O loop.
    """

    def __init__(self, ctx: TierContext, *, backend: dict | None = None) -> None:
        super().__init__(ctx)
        self.backend: dict[bytes, bytes] = {} if backend is None else backend
        self.faults: dict[bytes, Callable] = {}
        self.exists_fault: Callable | None = None
        self.active = 0
        self.peak = 0
        self.cancelled: list[bytes] = []
        self.aclosed = 0
        self.exists_calls = 0

    async def _fault(self, key: bytes) -> None:
        fault = self.faults.get(key)
        if fault is not None:
            await fault()

    async def exists(self, key: bytes) -> bool:
        self.exists_calls += 1
        if self.exists_fault is not None:
            await self.exists_fault()
        return key in self.backend

    async def put(self, key: bytes, data: memoryview) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0)
            await self._fault(key)
            self.backend[key] = bytes(data)
        except asyncio.CancelledError:
            self.cancelled.append(key)
            raise
        finally:
            self.active -= 1

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        await self._fault(key)
        blob = self.backend.get(key)
        if blob is None:
            return False
        out[:] = blob
        return True

    async def aclose(self) -> None:
        self.aclosed += 1


async def hang() -> None:
    await asyncio.sleep(3600)


def raising(exc: BaseException) -> Callable:
    async def fault() -> None:
        raise exc

    return fault


def sleeping(seconds: float) -> Callable:
    async def fault() -> None:
        await asyncio.sleep(seconds)

    return fault


@pytest.fixture
def ctx() -> TierContext:
    return TierContext(Arena.allocate(64, SLOT))


@pytest.fixture
def tier(ctx: TierContext):
    t = DictTier(ctx)
    yield t
    t.close()


def results(tier, n: int, timeout: float = 20.0) -> list[JobResult]:
    """Poll ``get_finished_jobs`` until ``n`` results came (or fail at the deadline)."""
    out: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        out += tier.get_finished_jobs()
        if len(out) >= n:
            break
        assert time.monotonic() < deadline, f"only {len(out)} of {n} results within {timeout} s"
        time.sleep(0.002)
    return out


def result(tier, job_id: int) -> JobResult:
    (r,) = results(tier, 1)
    assert r.job_id == job_id
    return r


def settle(tier, keys: list[bytes], timeout: float = 10.0) -> list[Lookup]:
    """Ask until no answer is RETRY (rule 1: RETRY resolves within a bound)."""
    deadline = time.monotonic() + timeout
    while True:
        answers = tier.lookup(keys)
        if Lookup.RETRY not in answers:
            return answers
        assert time.monotonic() < deadline, f"still RETRY after {timeout} s: {answers}"
        time.sleep(0.002)


def fill(ctx: TierContext, slot: int, tag: int) -> bytes:
    data = bytes([tag % 256]) * 7 + bytes(range(256)) * 16
    data = data[:SLOT]
    ctx.arena[slot][:] = data
    return data


# -- the happy path ------------------------------------------------------------------


def test_store_lookup_load_round_trip(tier: DictTier, ctx: TierContext) -> None:
    a, b = fill(ctx, 0, 1), fill(ctx, 1, 2)
    tier.submit_store(Job(1, (b"a", b"b"), (0, 1)))
    r = result(tier, 1)
    assert r.ok and r.nbytes == 2 * SLOT and r.seconds > 0 and r.error is None
    assert tier.lookup([b"a", b"b"]) == [Lookup.HIT, Lookup.HIT]  # positive cache: no probe
    assert tier.exists_calls == 0
    tier.submit_load(Job(2, (b"b", b"a"), (10, 11)))
    assert result(tier, 2).ok
    assert bytes(ctx.arena[10]) == b and bytes(ctx.arena[11]) == a


def test_works_through_open_tier(ctx: TierContext) -> None:
    h = open_tier(DictTier, {}, ctx)
    try:
        assert h.levels == {"core"}
        fill(ctx, 0, 3)
        h.submit_store(Job(1, (b"k",), (0,)))
        assert result(h, 1).ok
        assert h.lookup([b"k"]) == [Lookup.HIT]
    finally:
        h.close()
    assert h.tier.aclosed == 1


def test_every_job_reported_exactly_once(tier: DictTier, ctx: TierContext) -> None:
    for j in range(64):
        for s in range(4):
            fill(ctx, s, j)
        tier.submit_store(Job(j, tuple(b"k%d-%d" % (j, s) for s in range(4)), (0, 1, 2, 3)))
    got = results(tier, 64)
    assert sorted(r.job_id for r in got) == list(range(64))
    assert all(r.ok for r in got)
    time.sleep(0.05)
    assert tier.get_finished_jobs() == []
    assert tier.backlog() == 0


def test_concurrency_limit(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.max_concurrency = 3
    try:
        for k in range(12):
            tier.faults[b"k%d" % k] = sleeping(0.01)
        tier.submit_store(Job(1, tuple(b"k%d" % k for k in range(12)), tuple(range(12))))
        assert result(tier, 1).ok
        assert 1 <= tier.peak <= 3
    finally:
        tier.close()


# -- lookup: probes, RETRY, negative cache -------------------------------------------------


def test_unknown_keys_answer_retry_then_hit_or_miss(ctx: TierContext) -> None:
    backend = {b"there": b"x" * SLOT}
    tier = DictTier(ctx, backend=backend)  # e.g. stored by another instance
    try:
        first = tier.lookup([b"there", b"absent"])
        assert first == [Lookup.RETRY, Lookup.RETRY]
        assert settle(tier, [b"there", b"absent"]) == [Lookup.HIT, Lookup.MISS]
        tier.submit_load(Job(1, (b"there",), (0,)))
        assert result(tier, 1).ok and bytes(ctx.arena[0]) == b"x" * SLOT
    finally:
        tier.close()


def test_one_probe_per_key_while_it_is_in_flight(tier: DictTier) -> None:
    gate = asyncio.Event()

    async def wait_gate() -> None:
        await gate.wait()

    tier.exists_fault = wait_gate
    for _ in range(20):
        assert tier.lookup([b"p"]) == [Lookup.RETRY]
    tier.ctx.loop.call_soon_threadsafe(gate.set)
    assert settle(tier, [b"p"]) == [Lookup.MISS]
    assert tier.exists_calls == 1


def test_negative_cache_expires(ctx: TierContext) -> None:
    backend: dict[bytes, bytes] = {}
    tier = DictTier(ctx, backend=backend)
    tier.negative_ttl = 2.0
    try:
        assert settle(tier, [b"late"]) == [Lookup.MISS]
        backend[b"late"] = b"y" * SLOT  # appears behind the tier's back
        assert tier.lookup([b"late"]) == [Lookup.MISS]  # remembered for negative_ttl
        deadline = time.monotonic() + 15
        while tier.lookup([b"late"]) != [Lookup.HIT]:  # then probed again
            assert time.monotonic() < deadline, "negative cache never expired"
            time.sleep(0.01)
    finally:
        tier.close()


def test_forget_drops_cached_answers(tier: DictTier, ctx: TierContext) -> None:
    fill(ctx, 0, 1)
    tier.submit_store(Job(1, (b"k",), (0,)))
    assert result(tier, 1).ok
    del tier.backend[b"k"]  # the tier's own gc, say
    assert tier.lookup([b"k"]) == [Lookup.HIT]
    tier.forget([b"k"])
    assert settle(tier, [b"k"]) == [Lookup.MISS]


def test_failing_exists_answers_miss_then_hit_after_recovery(ctx: TierContext) -> None:
    # Rule 1: RETRY resolves within 5 s even when the backend errs; a failing probe is a
    # MISS (the engine recomputes), never a HIT, and is asked again after negative_ttl.
    tier = DictTier(ctx, backend={b"k": b"z" * SLOT})
    tier.negative_ttl = 0.05
    tier.exists_fault = raising(ConnectionError("server down"))
    try:
        assert settle(tier, [b"k"], timeout=5.0) == [Lookup.MISS]
        tier.exists_fault = None
        deadline = time.monotonic() + 5.0
        while tier.lookup([b"k"]) != [Lookup.HIT]:  # MISS until negative_ttl passes, then a probe
            assert time.monotonic() < deadline, "never HIT after the backend recovered"
            time.sleep(0.005)
    finally:
        tier.close()


def test_hanging_exists_answers_miss_within_probe_timeout(ctx: TierContext) -> None:
    tier = DictTier(ctx, backend={b"k": b"z" * SLOT})
    tier.probe_timeout = 0.2
    tier.exists_fault = sleeping(60)
    try:
        assert settle(tier, [b"k"], timeout=5.0) == [Lookup.MISS]
    finally:
        tier.exists_fault = None
        tier.close()


def test_zero_negative_ttl_still_answers_miss(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.negative_ttl = 0.0
    try:
        assert settle(tier, [b"absent"], timeout=5.0) == [Lookup.MISS]
    finally:
        tier.close()


def test_lookup_validates_keys(tier: DictTier) -> None:
    with pytest.raises(ValueError):
        tier.lookup([b"ok", b""])
    with pytest.raises(TypeError):
        tier.lookup(b"abc")


# -- coroutine errors and timeouts become failed keys -------------------------------------------


def test_put_exception_fails_only_its_key(tier: DictTier, ctx: TierContext) -> None:
    tier.faults[b"bad"] = raising(OSError(28, "No space left on device"))
    fill(ctx, 0, 1), fill(ctx, 1, 2)
    tier.submit_store(Job(1, (b"good", b"bad"), (0, 1)))
    r = result(tier, 1)
    assert r.failed_keys == (b"bad",)
    assert r.nbytes == SLOT
    assert r.error == "OSError: [Errno 28] No space left on device"
    assert tier.lookup([b"good"]) == [Lookup.HIT]
    assert settle(tier, [b"bad"]) == [Lookup.MISS]  # a failed store is not a hit


def test_get_into_false_is_a_failed_key_and_drops_the_cached_hit(tier: DictTier, ctx: TierContext) -> None:
    fill(ctx, 0, 1)
    tier.submit_store(Job(1, (b"k",), (0,)))
    assert result(tier, 1).ok
    del tier.backend[b"k"]  # evicted elsewhere
    tier.submit_load(Job(2, (b"k", b"never"), (5, 6)))
    r = result(tier, 2)
    assert r.failed_keys == (b"k", b"never")
    assert r.error == "missing"
    assert r.nbytes == 0
    assert settle(tier, [b"k"]) == [Lookup.MISS]


def test_get_into_exception_is_a_failed_key(tier: DictTier, ctx: TierContext) -> None:
    tier.backend[b"c"] = b"c" * SLOT
    tier.faults[b"c"] = raising(ValueError("checksum mismatch"))
    tier.submit_load(Job(1, (b"c",), (0,)))
    r = result(tier, 1)
    assert r.failed_keys == (b"c",)
    assert r.error == "ValueError: checksum mismatch"


def test_timeout_is_a_failed_key_within_the_bound(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.op_timeout = 0.2
    tier.faults[b"slow"] = hang
    try:
        fill(ctx, 0, 1), fill(ctx, 1, 2)
        t0 = time.monotonic()
        tier.submit_store(Job(1, (b"slow", b"fast"), (0, 1)))
        r = result(tier, 1)
        assert time.monotonic() - t0 < 10  # generous: the bound is 0.2 s
        assert r.failed_keys == (b"slow",)
        assert r.error == "timed out after 0.2 s"
        assert tier.cancelled == [b"slow"]  # the coroutine was cancelled, not left running
        tier.backend[b"x"] = b"x" * SLOT
        tier.faults[b"x"] = hang
        tier.submit_load(Job(2, (b"x",), (2,)))
        assert result(tier, 2).error == "timed out after 0.2 s"
    finally:
        tier.close()


def test_mixed_reasons_are_all_named(tier: DictTier, ctx: TierContext) -> None:
    tier.faults[b"e1"] = raising(RuntimeError("one"))
    tier.faults[b"e2"] = raising(KeyError("two"))
    tier.submit_load(Job(1, (b"e1", b"e2", b"gone"), (0, 1, 2)))
    r = result(tier, 1)
    assert set(r.failed_keys) == {b"e1", b"e2", b"gone"}
    assert "RuntimeError: one" in r.error and "KeyError: 'two'" in r.error and "missing" in r.error


# -- submits -----------------------------------------------------------------------


def test_caller_errors_raise_and_accept_nothing(tier: DictTier) -> None:
    with pytest.raises(IndexError, match="slot 64 out of range"):
        tier.submit_store(Job(1, (b"a",), (64,)))
    with pytest.raises(TypeError, match="expected a kvtiers.Job"):
        tier.submit_load([b"a"])  # type: ignore[arg-type]
    assert tier.backlog() == 0
    time.sleep(0.02)
    assert tier.get_finished_jobs() == []


def test_empty_job_is_reported(tier: DictTier) -> None:
    tier.submit_store(Job(9, (), ()))
    r = result(tier, 9)
    assert r.ok and r.nbytes == 0


# -- close ---------------------------------------------------------------------------


def test_close_waits_for_slow_jobs_and_reports_them_once(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.faults[b"slow"] = sleeping(0.3)
    fill(ctx, 0, 1)
    tier.submit_store(Job(1, (b"slow",), (0,)))
    assert tier.backlog() == 1
    tier.close()
    assert tier.backlog() == 0
    assert tier.backend[b"slow"] == bytes(ctx.arena[0])  # finished, not cancelled
    assert [(r.job_id, r.ok) for r in tier.get_finished_jobs()] == [(1, True)]
    assert tier.get_finished_jobs() == []
    assert tier.aclosed == 1


def test_close_cancels_jobs_past_close_timeout(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.close_timeout = 0.3
    tier.faults[b"stuck"] = tier.faults[b"stuck2"] = hang
    fill(ctx, 0, 1), fill(ctx, 1, 2)
    tier.submit_store(Job(1, (b"quick", b"stuck"), (0, 1)))
    tier.submit_store(Job(2, (b"stuck2",), (2,)))
    t0 = time.monotonic()
    tier.close()
    assert time.monotonic() - t0 < 15
    got = {r.job_id: r for r in tier.get_finished_jobs()}
    assert set(got) == {1, 2}
    assert got[1].failed_keys == (b"stuck",)
    assert got[1].error == "cancelled on close"
    assert got[2].failed_keys == (b"stuck2",)
    assert sorted(tier.cancelled) == [b"stuck", b"stuck2"]
    assert tier.get_finished_jobs() == []
    assert tier.backlog() == 0
    assert tier.aclosed == 1


def test_submit_after_close_raises(ctx: TierContext) -> None:
    tier = DictTier(ctx)
    tier.close()
    with pytest.raises(ValueError, match="job 1: tier is closed"):
        tier.submit_store(Job(1, (b"a",), (0,)))
    with pytest.raises(ValueError, match="tier is closed"):
        tier.submit_load(Job(2, (b"a",), (0,)))
    assert tier.get_finished_jobs() == []
    tier.close()  # idempotent
    assert tier.aclosed == 1


def test_base_class_coroutines_are_abstract(ctx: TierContext) -> None:
    tier = AsyncTier(ctx)
    tier.submit_store(Job(1, (b"a",), (0,)))
    r = result(tier, 1)
    assert r.failed_keys == (b"a",) and r.error.startswith("NotImplementedError")
    tier.close()


def test_hooks_are_pluggy_hookimpls() -> None:
    from kvtiers.registry import validate_tier_class

    validate_tier_class("dict", DictTier)
    for hook in ("lookup", "submit_store", "submit_load", "get_finished_jobs", "close", "backlog"):
        assert hasattr(getattr(AsyncTier, hook), "kvtiers_impl"), hook
    assert kvtiers.AsyncTier is AsyncTier
