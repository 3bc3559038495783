"""``AsyncTier``: write a tier as four coroutines, get the four hooks.

A subclass implements ``exists``, ``put``, ``get_into`` and optionally ``delete`` and
``aclose``; the base class does job tracking, a concurrency limit, per-operation timeouts,
errors as failed keys, a non-blocking ``lookup`` (a positive cache from the tier's own
stores and loads, probes for unknown keys on the I/O loop answering ``RETRY`` meanwhile, and
a short-lived negative cache), and cancellation on close. Everything runs on ``ctx.loop``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Sequence

from .hookspecs import hookimpl
from .types import Job, JobResult, Lookup, TierContext, accept_job, check_keys, drain


class AsyncTier:
    """Base class for tiers written as coroutines; see the module docstring.

    Subclasses call ``super().__init__(ctx)`` and may set ``max_concurrency`` (coroutines in
    flight per tier), ``op_timeout`` (seconds one ``put``/``get_into`` may take
    before its key fails) and ``negative_ttl`` (seconds a ``MISS`` is remembered) from their
    own options; ``probe_timeout`` bounds a lookup probe (an ``exists`` that errs or takes
    longer answers ``MISS``, so ``RETRY`` always resolves). ``put`` and ``get_into`` must
    stop touching their buffer once cancelled. docs/writing-a-tier.md says when each
    attribute is read.
    """

    levels = frozenset({"core"})
    max_concurrency: int = 16
    op_timeout: float = 30.0
    negative_ttl: float = 1.0
    probe_timeout: float = 3.0
    close_timeout: float = 60.0

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self._loop = ctx.loop
        self._lock = threading.Lock()
        self._present: set[bytes] = set()
        self._absent: dict[bytes, float] = {}  # key -> when the MISS expires
        self._probing: set[bytes] = set()
        self._unanswered: set[bytes] = set()  # probed MISSes not yet answered (negative_ttl 0)
        self._finished: deque[JobResult] = deque()
        self._tasks: set[asyncio.Task] = set()  # touched on the loop thread only
        self._cancelling = False
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._sem: asyncio.Semaphore | None = None

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

    async def delete(self, key: bytes) -> None:  # optional
        """Remove ``key`` (optional; used by eviction and tests)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release the tier's resources; runs on the I/O loop after all jobs are done."""

    # -- helpers for subclasses ------------------------------------------------------
    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from the lookup caches (after the tier removed them itself)."""
        with self._lock:
            for k in keys:
                self._present.discard(k)
                self._absent.pop(k, None)

    def run_sync(self, coro, timeout: float | None = None):
        """Run ``coro`` on the I/O loop and wait for it (for set-up and tear-down only)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the hooks ---------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        now = time.monotonic()
        out: list[Lookup] = []
        probe: list[bytes] = []
        with self._lock:
            for k in keys:
                if k in self._present:
                    out.append(Lookup.HIT)
                    continue
                expiry = self._absent.get(k)
                if expiry is not None and (expiry > now or k in self._unanswered):
                    self._unanswered.discard(k)  # a probe's MISS is answered at least once
                    out.append(Lookup.MISS)
                    continue
                if k not in self._probing:
                    self._probing.add(k)
                    probe.append(k)
                out.append(Lookup.RETRY)
        if probe and not self._closed:
            self._loop.call_soon_threadsafe(self._start_probe, probe)
        return out

    def _start_probe(self, keys: list[bytes]) -> None:
        asyncio.ensure_future(self._probe(keys))

    async def _probe(self, keys: list[bytes]) -> None:
        async def ask(k: bytes) -> bool:
            async with self._semaphore():
                return await self.exists(k)

        async def one(k: bytes) -> None:
            try:
                found = bool(await asyncio.wait_for(ask(k), self.probe_timeout))
            except Exception:
                # A backend that errs or hangs must not keep the key at RETRY (rule 1):
                # answer MISS (the engine recomputes) and ask again after negative_ttl.
                found = False
            with self._lock:
                self._probing.discard(k)
                if found:
                    self._present.add(k)
                    self._absent.pop(k, None)
                else:
                    self._absent[k] = time.monotonic() + self.negative_ttl
                    self._unanswered.add(k)

        await asyncio.gather(*(one(k) for k in keys))

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the loop's thread
            self._sem = asyncio.Semaphore(self.max_concurrency)
        return self._sem

    def _submit(self, job: Job, store: bool) -> None:
        accept_job(job, self.ctx.arena, closed=self._closed)
        t0 = time.perf_counter()
        with self._lock:
            self._inflight += 1
        asyncio.run_coroutine_threadsafe(self._run(job, store, t0), self._loop)

    async def _run(self, job: Job, store: bool, t0: float) -> None:
        failed: dict[bytes, str] = {}
        moved = 0
        arena = self.ctx.arena

        async def one(key: bytes, slot: int) -> None:
            nonlocal moved
            try:
                async with self._semaphore():
                    view = arena[slot]
                    if store:
                        await asyncio.wait_for(self.put(key, view), self.op_timeout)
                    elif not await asyncio.wait_for(self.get_into(key, view), self.op_timeout):
                        failed[key] = "missing"
                        return
                moved += arena.slot_bytes
            except asyncio.TimeoutError:
                failed[key] = f"timed out after {self.op_timeout:g} s"
            except asyncio.CancelledError:
                failed[key] = "cancelled on close"
            except Exception as e:
                failed[key] = f"{type(e).__name__}: {e}"

        me = asyncio.current_task()
        self._tasks.add(me)
        if self._cancelling:
            failed.update((k, "cancelled on close") for k in job.keys)
            tasks = []
        else:
            tasks = [asyncio.ensure_future(one(k, s)) for k, s in zip(job.keys, job.slots, strict=True)]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # close gave up waiting: fail what is left, report once
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._tasks.discard(me)
        for k in job.keys:  # keep the lookup caches in step with what we just learnt
            if k in failed:
                continue
            with self._lock:
                self._present.add(k)
                self._absent.pop(k, None)
        if not store:
            with self._lock:
                for k, why in failed.items():
                    if why == "missing":
                        self._present.discard(k)
        failed_keys = tuple(k for k in job.keys if k in failed)
        error = None
        if failed_keys:
            reasons = sorted(set(failed.values()))
            error = "; ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else "")
        self._finished.append(
            JobResult(job.job_id, failed_keys, moved, time.perf_counter() - t0, error)
        )
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._submit(job, store=True)

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._submit(job, store=False)

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return drain(self._finished)

    @hookimpl
    def backlog(self) -> int:
        with self._lock:
            return self._inflight

    @hookimpl
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if not self._idle.wait_for(lambda: self._inflight == 0, self.close_timeout):
                self._cancelling = True  # each job then reports its unfinished keys as failed
                self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(self._tasks)])
                self._idle.wait_for(lambda: self._inflight == 0, 10)
        try:
            self.run_sync(self.aclose(), timeout=30)
        except concurrent.futures.TimeoutError:
            pass
