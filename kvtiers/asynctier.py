"""``AsyncTier``: write a tier as coroutines, get the four hooks.

A subclass implements ``exists``, ``put``, ``get_into`` and optionally ``delete``,
``aclose`` and the batch coroutines ``put_many``/``get_many_into``; the base class does
job tracking, a concurrency limit, a deadline per job, errors as failed keys, a
non-blocking ``lookup`` (a positive cache from the tier's own stores and loads, probes for
unknown keys on the I/O loop answering ``RETRY`` meanwhile, and a short-lived negative
cache), evictions reported by the tier (:meth:`AsyncTier.evicted`), and cancellation on
close. Everything runs on ``ctx.loop``.

How it runs: a submit queues the job for the I/O loop (one wake-up per burst of submits,
not per key). On the loop, up to ``max_concurrency`` worker tasks per instance take the
queued operations (one key, or one batch) in order and await the tier's coroutine
directly: no task, future or lock per key. One timer per job fires at its deadline and
fails what is left of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .hookspecs import hookimpl
from .misscache import MissCache
from .types import Job, JobResult, Lookup, TierContext, accept_job, check_keys, drain

STORE, LOAD, PROBE = 0, 1, 2
ACLOSE_TIMEOUT_S = 30.0  # close: bound on the tier's aclose
ABANDONED = "abandoned on close"  # error prefix of a job whose coroutines never stopped


class _Run:
    """One job (or one round of lookup probes) in flight: touched on the loop thread,
    except ``gone``/``reported``, which are guarded by the tier's lock."""

    __slots__ = (
        "job_id", "kind", "keys", "slots", "n", "bs", "items", "next", "running", "failed",
        "found", "t0", "deadline", "timer", "timeout_reason", "gone", "keyset", "reported",
    )

    def __init__(self, job_id: int, kind: int, keys: tuple[bytes, ...], slots: tuple[int, ...],
                 bs: int, t0: float, deadline: float, timeout_reason: str) -> None:
        self.job_id = job_id
        self.kind = kind
        self.keys = keys
        self.slots = slots
        self.n = len(keys)
        self.bs = bs  # keys per operation: 1 for the per-key coroutines
        self.items = -(-self.n // bs)
        self.next = 0  # the next item to hand to a worker
        self.running = 0  # items being awaited now
        self.failed: dict[bytes, str] = {}
        self.found: set[bytes] = set()  # probes: keys that exist
        self.t0 = t0
        self.deadline = deadline
        self.timer: asyncio.TimerHandle | None = None
        self.timeout_reason = timeout_reason
        self.gone: set[bytes] | None = None  # keys evicted while this ran
        self.keyset: frozenset[bytes] | None = None  # built on the first eviction
        self.reported = False


def _cancel_requested(task: asyncio.Task) -> bool:
    """Whether someone asked to cancel ``task`` (Python 3.10 cannot tell: assume so)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or cancelling() > 0


def _reason(value: object) -> str:
    """A failed key's reason: an exception as ``Type: message``, ``False`` as ``missing``."""
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if value is False:
        return "missing"
    return str(value)


class AsyncTier:
    """Base class for tiers written as coroutines; see the module docstring.

    Subclasses call ``super().__init__(ctx)`` and may set, from their own options:

    - ``max_concurrency``: operations (a ``put``, ``get_into``, ``exists`` or one batch
      call) in flight per instance;
    - ``op_timeout``: seconds from a job's submit within which each of its keys must be
      done; then its running coroutines are cancelled and every key not done fails with
      ``timed out after N s`` (waiting for a concurrency slot counts);
    - ``negative_ttl``: seconds a ``MISS`` is remembered; ``probe_timeout``: bound on a
      round of lookup probes (an ``exists`` that errs or takes longer answers ``MISS``, so
      ``RETRY`` always resolves);
    - ``close_timeout``: seconds ``close`` waits for jobs before cancelling them, and
      ``cancel_grace`` seconds it then gives cancelled coroutines to stop;
    - ``batch_size``: keys per ``put_many``/``get_many_into`` call (``None``: a whole job).

    A job ends by its deadline, so ``close`` returns within ``min(close_timeout, the
    latest job's deadline)``, plus ``cancel_grace`` only if a coroutine ignores its
    cancellation (that job is then reported failed, ``abandoned on close``), plus
    ``aclose`` (at most ``ACLOSE_TIMEOUT_S``).

    Batches: a tier may define ``put_many(items)`` and/or ``get_many_into(items)``, with
    ``items`` a list of ``(key, view)`` pairs; the base class then makes one call per job
    (or per ``batch_size`` keys) instead of one coroutine per key. Each returns ``None``
    (every key done) or a mapping of the keys that failed to a reason (an exception, a
    message, or ``False`` for a load of a key not stored); raising fails every key of the
    call. A batch cancelled (deadline, close) fails all its keys. If the instance's
    ``put``/``get_into`` is replaced (fault injection), the per-key coroutine is used.

    ``put``/``get_into`` and the batch calls must stop touching their buffers once
    cancelled. A bounded tier reports what it drops with :meth:`evicted`.
    docs/asynctier.md says when each attribute is read.
    """

    levels = frozenset({"core"})
    max_concurrency: int = 16
    op_timeout: float = 30.0
    negative_ttl: float = 1.0
    probe_timeout: float = 3.0
    close_timeout: float = 60.0
    cancel_grace: float = 10.0
    batch_size: int | None = None

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self._loop = ctx.loop
        self._lock = threading.Lock()
        self._present: set[bytes] = set()
        self._misses = MissCache()
        self._finished: deque[JobResult] = deque()
        self._inflight = 0  # jobs accepted, not reported
        self._active: set[_Run] = set()  # runs that an eviction must see (under _lock)
        self._idle = threading.Condition(self._lock)
        self._closed = False
        # the caller's thread hands runs to the loop through _inbox, one wake-up per burst
        self._inbox: deque[_Run] = deque()
        self._kicked = False
        # loop thread only:
        self._jobs: deque[_Run] = deque()  # runs with items not yet handed to a worker
        self._probes: deque[_Run] = deque()  # the same for probe rounds (served first)
        self._workers: dict[asyncio.Task, _Run | None] = {}  # worker -> the run it awaits for
        self._cancel_why: dict[asyncio.Task, list] = {}  # worker -> [why we cancelled it, how often]

    # -- what subclasses implement -------------------------------------------------
    async def exists(self, key: bytes) -> bool:
        """Whether ``key`` is stored."""
        raise NotImplementedError

    async def put(self, key: bytes, data: memoryview) -> None:
        """Store ``data`` (the whole slot) under ``key``; raise on failure."""
        raise NotImplementedError

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        """Write the bytes of ``key`` into ``out``; ``False`` if missing; raise if corrupt."""
        raise NotImplementedError

    async def put_many(self, items: Sequence[tuple[bytes, memoryview]]) -> Mapping[bytes, Any] | None:
        """Optional: store each ``(key, data)``; return ``None`` or ``{key: reason}`` of the
        keys that failed (raise: all failed). Defining it replaces ``put`` for jobs."""
        raise NotImplementedError

    async def get_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> Mapping[bytes, Any] | None:
        """Optional: load each ``(key, out)``; return ``None`` or ``{key: reason}`` of the
        keys that failed, ``False`` for a key not stored (raise: all failed). Defining it
        replaces ``get_into`` for jobs."""
        raise NotImplementedError

    async def delete(self, key: bytes) -> None:  # optional
        """Remove ``key`` (optional; used by eviction and tests)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release the tier's resources; runs on the I/O loop after all jobs are done."""

    # -- helpers for subclasses ------------------------------------------------------
    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from the lookup caches (the next lookup probes them again)."""
        keys = check_keys(keys)
        with self._lock:
            for k in keys:
                self._present.discard(k)
                self._misses.present(k)  # neither: the next lookup probes it

    def known_stored(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of ``keys`` this instance knows are stored (it stored or found them and
        has not seen them leave), from memory: no I/O. For hooks that must not block, such
        as ``pin``."""
        with self._lock:
            return [k for k in keys if k in self._present]

    def evicted(self, keys: Iterable[bytes], reason: str = "evicted") -> None:
        """Report ``keys`` as removed by the tier itself (eviction, corruption, gc).

        Safe from any thread or coroutine. From now on the keys answer ``MISS`` (until
        stored again; after ``negative_ttl`` a lookup asks ``exists`` again), they leave
        every cache of the base class, a job or probe in flight that holds them does not
        mark them present when it ends, and they go to ``ctx.removed(keys, reason)``.
        """
        keys = check_keys(list(keys))
        if not keys:
            return
        gone = set(keys)
        expiry = time.monotonic() + self.negative_ttl
        with self._lock:
            present, misses = self._present, self._misses
            for k in keys:
                present.discard(k)
                misses.missing(k, expiry)
            for run in self._active:
                if run.keyset is None:
                    run.keyset = frozenset(run.keys)
                hit = run.keyset & gone
                if hit:
                    run.gone = set(hit) if run.gone is None else run.gone | hit
        self.ctx.removed(keys, reason)

    def run_sync(self, coro, timeout: float | None = None):
        """Run ``coro`` on the I/O loop and wait for it (for set-up and tear-down only)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the hooks ---------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        now = time.monotonic()
        run = None
        with self._lock:
            out, probe = self._misses.answer(keys, self._present.__contains__, now)
            if probe and not self._closed:
                run = _Run(-1, PROBE, tuple(probe), (), 1, 0.0, now + self.probe_timeout, "probe timed out")
                self._active.add(run)
        if run is not None:
            self._hand_over(run)
        return out

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._submit(job, STORE)

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._submit(job, LOAD)

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return drain(self._finished)

    @hookimpl
    def backlog(self) -> int:
        with self._lock:
            return self._inflight

    @hookimpl
    def close(self) -> None:
        """Wait for the jobs in flight (each ends by its deadline), at most ``close_timeout``;
        then cancel what is left (keys fail ``cancelled on close``); a job whose coroutines
        do not stop within ``cancel_grace`` is reported failed (``abandoned on close``);
        then ``aclose`` (at most ``ACLOSE_TIMEOUT_S``)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._inflight == 0, self.close_timeout)
        if not idle:
            self._loop.call_soon_threadsafe(self._cancel_all, "cancelled on close")
            with self._lock:
                idle = self._idle.wait_for(lambda: self._inflight == 0, self.cancel_grace)
        if not idle:
            self._abandon()
        try:
            self.run_sync(self.aclose(), timeout=ACLOSE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            pass

    # -- submitting (caller's thread) ----------------------------------------------------
    def _uses_batch(self, kind: int) -> bool:
        one, many = ("put", "put_many") if kind == STORE else ("get_into", "get_many_into")
        mine = self.__dict__
        if many in mine:
            return True
        if one in mine:  # the per-key coroutine was replaced on the instance (fault injection)
            return False
        return getattr(type(self), many) is not getattr(AsyncTier, many)

    def _submit(self, job: Job, kind: int) -> None:
        accept_job(job, self.ctx.arena, closed=self._closed)
        t0 = time.perf_counter()
        timeout = self.op_timeout
        bs = 1
        if job.keys and self._uses_batch(kind):
            bs = self.batch_size or len(job.keys)
        # the deadline runs from now, in the loop's clock (time.monotonic)
        run = _Run(job.job_id, kind, job.keys, job.slots, bs, t0, time.monotonic() + timeout,
                   f"timed out after {timeout:g} s")
        with self._lock:
            if self._closed:
                raise ValueError(f"job {job.job_id}: tier is closed")
            self._inflight += 1
            self._active.add(run)
        self._hand_over(run)

    def _hand_over(self, run: _Run) -> None:
        self._inbox.append(run)
        if not self._kicked:
            self._kicked = True
            self._loop.call_soon_threadsafe(self._take_inbox)

    # -- on the loop ---------------------------------------------------------------------
    def _take_inbox(self) -> None:
        self._kicked = False  # before draining: a later hand-over schedules a new wake-up
        inbox, loop = self._inbox, self._loop
        new = 0
        while inbox:
            run = inbox.popleft()
            if run.n == 0:
                self._finish(run)
                continue
            run.timer = loop.call_at(run.deadline, self._expire, run, run.timeout_reason)
            (self._probes if run.kind == PROBE else self._jobs).append(run)
            new += run.items
        spare = min(new, max(1, self.max_concurrency) - len(self._workers))
        for _ in range(spare):
            task = loop.create_task(self._work())
            self._workers[task] = None

    def _expire(self, run: _Run, reason: str) -> None:
        """Fail what is left of ``run``: items not started now, running ones when their
        cancelled coroutine returns."""
        if run.next < run.items:
            lo = run.next * run.bs
            failed = run.failed
            for k in run.keys[lo:]:
                failed[k] = reason
            run.next = run.items
        for task, r in self._workers.items():
            if r is run:  # again if a first cancellation was ignored
                self._cancel_why.setdefault(task, [reason, 0])[1] += 1
                task.cancel()
        if run.running == 0:
            self._finish(run)

    def _cancel_all(self, reason: str) -> None:
        self._take_inbox()
        runs = {id(r): r for r in (*self._probes, *self._jobs, *self._workers.values()) if r is not None}
        for run in runs.values():
            if not run.reported:
                self._expire(run, reason)

    async def _work(self) -> None:
        me = asyncio.current_task()
        workers, jobs, probes = self._workers, self._jobs, self._probes
        buf = self.ctx.arena.buffer
        size = self.ctx.arena.slot_bytes
        try:
            while True:
                queue = probes or jobs
                if not queue:
                    return
                run = queue[0]
                i = run.next
                if i >= run.items:  # expired while queued
                    queue.popleft()
                    continue
                run.next = i + 1
                if run.next >= run.items:
                    queue.popleft()
                run.running += 1
                workers[me] = run
                kind, failed = run.kind, run.failed
                try:
                    if run.bs == 1:
                        key = run.keys[i]
                        if kind == STORE:
                            off = run.slots[i] * size
                            await self.put(key, buf[off:off + size])
                        elif kind == LOAD:
                            off = run.slots[i] * size
                            if not await self.get_into(key, buf[off:off + size]):
                                failed[key] = "missing"
                        elif await self.exists(key):
                            run.found.add(key)
                    else:
                        await self._batch(run, i, buf, size)
                except BaseException as e:  # noqa: BLE001 - every outcome is a result
                    why = self._cancel_why.get(me, (None,))[0]
                    if why is None and isinstance(e, asyncio.CancelledError) and _cancel_requested(me):
                        self._fail_item(run, i, "cancelled")  # not ours: the loop is stopping
                        run.running -= 1
                        workers[me] = None
                        if run.running == 0 and run.next >= run.items:
                            self._finish(run)
                        raise
                    if not isinstance(e, (Exception, asyncio.CancelledError)):
                        raise  # KeyboardInterrupt, SystemExit
                    self._fail_item(run, i, why or _reason(e))
                ours = self._cancel_why.pop(me, None)
                if ours and hasattr(me, "uncancel"):  # Python >= 3.11
                    for _ in range(ours[1]):
                        me.uncancel()  # one per cancel of ours, so asyncio.timeout in tiers stays right
                workers[me] = None
                run.running -= 1
                if run.running == 0 and run.next >= run.items:
                    self._finish(run)
        finally:
            workers.pop(me, None)

    async def _batch(self, run: _Run, i: int, buf: memoryview, size: int) -> None:
        lo = i * run.bs
        keys = run.keys[lo:lo + run.bs]
        slots = run.slots[lo:lo + run.bs]
        items = [(k, buf[s * size:(s + 1) * size]) for k, s in zip(keys, slots, strict=True)]
        call = self.put_many if run.kind == STORE else self.get_many_into
        bad = await call(items)
        if bad:
            failed = run.failed
            mine = set(keys)
            for k, why in bad.items():
                if k in mine:
                    failed[k] = _reason(why)

    def _fail_item(self, run: _Run, i: int, why: str) -> None:
        if run.kind == PROBE:
            return  # a probe that failed is a MISS
        lo = i * run.bs
        failed = run.failed
        for k in run.keys[lo:lo + run.bs]:
            failed[k] = why

    def _finish(self, run: _Run) -> None:
        """Report ``run`` once and bring the lookup caches in step with what it learnt."""
        if run.timer is not None:
            run.timer.cancel()
        keys, failed = run.keys, run.failed
        with self._lock:
            if run.reported:
                return
            run.reported = True
            self._active.discard(run)
            gone = run.gone
            if run.kind == PROBE:
                until = time.monotonic() + self.negative_ttl
                misses = self._misses
                for k in keys:
                    misses.probing.discard(k)
                    if gone and k in gone:
                        continue
                    if k in run.found:
                        self._present.add(k)
                        misses.present(k)
                    else:
                        misses.missing(k, until)
                return
            ok = [k for k in keys if k not in failed] if failed else keys
            if gone:  # an eviction during the job wins over what the job learnt
                ok = [k for k in ok if k not in gone]
            self._present.update(ok)
            absent = self._misses.absent
            if absent:
                for k in ok:
                    absent.pop(k, None)
            if run.kind == LOAD and failed:
                for k, why in failed.items():
                    if why == "missing":
                        self._present.discard(k)
            self._inflight -= 1
            nbytes = (run.n - len(failed)) * self.ctx.arena.slot_bytes
            error = None
            if failed:
                reasons = sorted(set(failed.values()))
                error = "; ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else "")
            self._finished.append(JobResult(run.job_id, tuple(k for k in keys if k in failed) if failed else (),
                                            nbytes, time.perf_counter() - run.t0, error))
            self._idle.notify_all()

    def _abandon(self) -> None:
        """From ``close``'s thread: report jobs whose coroutines did not stop when cancelled.
        Their slots may still be written by those coroutines: an engine must not reuse them."""
        with self._lock:
            for run in list(self._active):
                if run.reported or run.kind == PROBE:
                    continue
                run.reported = True
                self._active.discard(run)
                self._inflight -= 1
                self._finished.append(JobResult(
                    run.job_id, run.keys, 0, time.perf_counter() - run.t0,
                    f"{ABANDONED}: still running {self.cancel_grace:g} s after it was cancelled "
                    "(its slots may still be written)"))
            self._idle.notify_all()
