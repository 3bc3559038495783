"""The secondary tiers behind the host arena, and the jobs in flight on each.

Every call the manager makes into a tier goes through :class:`TierSet`: a tier that raises
or answers nonsense is counted in ``ManagerStats.tier_errors``, logged (a warning the first
time, then at debug level) and treated as a miss; nothing a tier does is raised into the
engine's loop. What a finished job means for the host cache is not decided here: the
store and load paths register a handler per job kind (:meth:`TierSet.on_job_end`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..encryption.tenants import as_tenant
from ..registry import TierHandle
from ..types import Job, JobResult, Lookup
from .admission import Admission
from .events import HOST, log
from .types import ManagerStats

__all__ = ["Tier", "TierJob", "TierSet"]


@dataclass(eq=False)
class TierJob:
    """A store (arena -> tier) or load (tier -> arena) job submitted to ``tier``; its slots
    carry one host-cache pin each until the job ends."""

    tier: Tier
    kind: str  # "store" | "load"
    job: Job
    t0: float
    lost: bool = False  # not reported within the timeout: its keys were failed already
    abandoned: bool = False  # still unreported when the manager closed: its slots stay pinned


@dataclass(eq=False)
class Tier:
    """One open tier: its name (the ``medium`` of its events, the ``source`` in lookups),
    its handle and its jobs in flight by job id."""

    name: str
    handle: TierHandle
    jobs: dict[int, TierJob] = field(default_factory=dict)
    warned: bool = False
    admission: Admission | None = None  # its "admit" option (kvtiers.engine.admission): None admits everything


class TierSet:
    """The tiers in lookup order, their jobs, and the fault accounting of every tier call."""

    def __init__(self, stats: ManagerStats) -> None:
        self.tiers: list[Tier] = []
        self._stats = stats
        self._job_ids = itertools.count(1)
        self._on_end: dict[str, Callable[[TierJob, set[bytes]], None]] = {}
        self._on_lost: Callable[[TierJob, str], None] | None = None
        #: told ``(tier name, chunks, seconds)`` of each load job with loaded chunks (kvtiers.engine.costs)
        self.on_load_timed: Callable[[str, int, float], None] | None = None

    def on_job_end(self, kind: str, fn: Callable[[TierJob, set[bytes]], None]) -> None:
        """Call ``fn(job, failed_keys)`` when a job of ``kind`` ends (reported, or failed to
        submit); ``fn`` releases the job's pins."""
        self._on_end[kind] = fn

    def on_job_lost(self, fn: Callable[[TierJob, str], None]) -> None:
        """Call ``fn(job, error)`` when a load job is declared lost (by :meth:`check_lost`, or
        abandoned by :meth:`abandon`); ``error`` says why, for the engine's result."""
        self._on_lost = fn

    # -- the set -----------------------------------------------------------------------
    def unique_name(self, base: str, explicit: bool) -> str:
        """``base``, or ``base#2`` etc. when taken; a taken ``explicit`` name is an error."""
        taken = {t.name for t in self.tiers} | {HOST}
        final, n = base, 1
        while final in taken:
            if explicit:
                raise ValueError(f"tier name {base!r} is already used")
            n += 1
            final = f"{base}#{n}"
        return final

    def append(self, name: str, handle: TierHandle) -> None:
        """Add a tier after the others (tiers are asked in order)."""
        self.tiers.append(Tier(name, handle, admission=Admission.from_option(name, getattr(handle, "admit", None))))

    def pending(self) -> int:
        """Jobs in flight that are not lost."""
        return sum(1 for t in self.tiers for j in t.jobs.values() if not j.lost)

    def loading(self) -> dict[str, int]:
        """Per tier name, its load jobs in flight that are not lost (kvtiers.engine.costs)."""
        return {t.name: sum(1 for j in t.jobs.values() if j.kind == "load" and not j.lost) for t in self.tiers}

    # -- guarded tier calls ----------------------------------------------------------------
    def failed(self, tier: Tier, what: str, e: BaseException) -> None:
        """Count and log a fault of ``tier`` in call ``what``."""
        self._stats.tier_errors[tier.name] += 1
        if not tier.warned:
            tier.warned = True
            log.warning("kvtiers: tier %s: %s failed (%s: %s); treated as a miss (further errors at debug level)",
                        tier.name, what, type(e).__name__, e)
        else:
            log.debug("kvtiers: tier %s: %s failed: %s: %s", tier.name, what, type(e).__name__, e)

    def lookup(self, tier: Tier, keys: list[bytes], *, tenant: str | None) -> list[Lookup]:
        """``tier``'s answer per key, asked as ``tenant``'s (None: no tenant;
        docs/security.md#tenants); anything but a well-formed answer is all misses."""
        try:
            with as_tenant(tier.handle, tenant):
                answers = tier.handle.lookup(keys)
            if answers is None or len(answers) != len(keys):
                raise TypeError(f"lookup answered {0 if answers is None else len(answers)} for {len(keys)} keys")
            return [a if isinstance(a, Lookup) else Lookup.MISS for a in answers]
        except Exception as e:
            self.failed(tier, "lookup", e)
            return [Lookup.MISS] * len(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used in every tier."""
        for tier in self.tiers:
            try:
                tier.handle.touch(keys)
            except Exception as e:
                self.failed(tier, "touch", e)

    def close(self, bound: float) -> list[Tier]:
        """Close every tier, each in a daemon thread of its own, all at once, and wait for
        them up to ``bound`` seconds in all (their last results are collected by the next
        :meth:`poll`). Returns the tiers whose ``close`` had not returned by then: they are
        abandoned, their threads left running (a hung mount must not hang the engine)."""
        closing = []
        for tier in self.tiers:
            th = threading.Thread(target=self._close_one, args=(tier,), name=f"kvtiers-close-{tier.name}",
                                  daemon=True)
            th.start()
            closing.append((tier, th))
        end = time.monotonic() + bound
        stuck = []
        for tier, th in closing:
            th.join(max(0.0, end - time.monotonic()))
            if th.is_alive():
                stuck.append(tier)
                log.warning("kvtiers: tier %s: close() had not returned after %.3g s; abandoned", tier.name, bound)
        return stuck

    def _close_one(self, tier: Tier) -> None:
        try:
            tier.handle.close()
        except Exception as e:
            self.failed(tier, "close", e)

    # -- jobs ----------------------------------------------------------------------------
    def submit(self, tier: Tier, kind: str, items: list[tuple[bytes, int]], *, tenant: str | None) -> None:
        """Submit a tier job over ``items``; their slots carry one pin each for the job. The
        job is ``tenant``'s (None: no tenant): an encrypted tier seals or opens its keys for
        that tenant, passed with the job, never looked up later (docs/security.md#tenants)."""
        job = Job(next(self._job_ids), tuple(k for k, _ in items), tuple(s for _, s in items))
        try:
            with as_tenant(tier.handle, tenant):
                (tier.handle.submit_store if kind == "store" else tier.handle.submit_load)(job)
        except Exception as e:
            self.failed(tier, f"submit_{kind}", e)
            self._end(TierJob(tier, kind, job, time.perf_counter()),
                      JobResult(job.job_id, job.keys, error=f"{type(e).__name__}: {e}"))
            return
        tier.jobs[job.job_id] = TierJob(tier, kind, job, time.perf_counter())

    def poll(self) -> None:
        """Collect every tier's finished jobs and end them."""
        for tier in self.tiers:
            if not tier.jobs and not tier.handle.closed:
                continue
            try:
                results = tier.handle.get_finished_jobs()
            except Exception as e:
                self.failed(tier, "get_finished_jobs", e)
                continue
            for res in results:
                tj = tier.jobs.pop(getattr(res, "job_id", None), None)
                if tj is None:
                    self.failed(tier, "get_finished_jobs", ValueError(f"unknown or repeated job {res!r}"))
                    continue
                self._end(tj, res)

    def check_lost(self, timeout: float) -> None:
        """Promotions a tier has not reported within ``timeout`` seconds: mark them lost and
        hand them to the lost-job handler (the loads go on without their keys); they stay in
        the job table, slots pinned, until the tier reports."""
        now = time.perf_counter()
        for tier in self.tiers:
            # a copy: the handler may end a load wave and submit the next one to this tier
            for tj in list(tier.jobs.values()):
                if tj.kind != "load" or tj.lost or now - tj.t0 < timeout:
                    continue
                tj.lost = True
                error = TimeoutError(f"tier {tier.name}: job {tj.job.job_id} not reported within {timeout:g} s")
                self.failed(tier, "submit_load", error)
                if self._on_lost is not None:
                    self._on_lost(tj, str(error))

    def abandon(self, why: str) -> list[TierJob]:
        """Give up on every job still unreported (the manager is closing): mark it lost and
        abandoned, fail the keys of loads not failed yet through the lost-job handler (the
        engine's result says ``why``), and keep it in the job table with its slots pinned,
        so they are never reused while the tier might still write or read them (rule 6).
        Returns the abandoned jobs."""
        out = []
        for tier in self.tiers:
            for tj in list(tier.jobs.values()):
                out.append(tj)
                tj.abandoned = True
                if tj.lost:
                    continue
                tj.lost = True
                error = TimeoutError(f"tier {tier.name}: {tj.kind} job {tj.job.job_id} {why}")
                self.failed(tier, f"submit_{tj.kind}", error)
                if tj.kind == "load" and self._on_lost is not None:
                    self._on_lost(tj, str(error))
        return out

    def _end(self, tj: TierJob, res: JobResult) -> None:
        """Account a job's transfer on its path and hand it to the handler of its kind."""
        job = tj.job
        failed = set(res.failed_keys) & set(job.keys)
        now = time.perf_counter()
        path = f"{HOST}->{tj.tier.name}" if tj.kind == "store" else f"{tj.tier.name}->{HOST}"
        ok = [k for k in job.keys if k not in failed]
        if ok:
            seconds = res.seconds if 0 < res.seconds <= now - tj.t0 + 1e-3 else now - tj.t0
            self._stats.paths[path].add(res.nbytes, len(ok), tj.t0, tj.t0 + seconds)
            if tj.kind == "load" and self.on_load_timed is not None:
                self.on_load_timed(tj.tier.name, len(ok), seconds)
        self._on_end[tj.kind](tj, failed)
