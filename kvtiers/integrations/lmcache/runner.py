"""The adapter's worker: one thread that makes every call into the kvtiers tiers.

LMCache calls an L2 adapter from its store and prefetch controller threads and expects
every call to return at once; a kvtiers tier wants one caller at a time and reports jobs
when polled. :class:`TierRunner` sits between: ``submit`` queues a :class:`Task` (never
blocking, never raising), and its thread opens each namespace's tier on first use, asks
lookups (again while the tier answers RETRY, up to ``lookup_wait_ms``), cuts stores and
loads into kvtiers jobs on the namespace's slots (LMCache's own memory where it lies on the
grid, else staging slots, as many at a time as there are), polls the tiers, and hands each
finished task to ``on_done`` with one bool per item. Every failure (a namespace that does
not open, a refused job, a failed key, an object off the grid) is a False, never an
exception out of the thread. No LMCache, no torch here.

A tier whose ``get_finished_jobs`` raises (rule 4 says it never does) on every poll for
:data:`POLL_GIVE_UP_S` would leave LMCache's tasks waiting forever: its namespace is then
given up as one that did not open: its instances closed (rule 9: every accepted job finished
or failed, no thread left that could touch a slot), their unreported jobs failed, its chunks
misses until it is opened again after :data:`REOPEN_S`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...encryption.tenants import note_tenant
from ...registry import TierHandle, open_tier
from ...types import Job, JobResult, Lookup, Namespace, TierContext
from .mapping import Space
from .params import WHAT, AdapterParams
from .slots import L1Grid, grid_slot_bytes, staging_arena

log = logging.getLogger("kvtiers.integrations.lmcache")

#: how long a namespace whose tier did not open is left failed before it is tried again
REOPEN_S = 30.0
#: seconds of polls of one tier instance that all raised before its namespace is given up (see the module)
POLL_GIVE_UP_S = 10.0
_POLL_MIN_S = 0.0001
_POLL_MAX_S = 0.0005  # a finished load waits at most this long to be noticed
#: the counters ``report_status`` (LMCache's /status) shows, each from 0
STATS = ("stored", "loaded", "lookup_hits", "touched", "deleted", "evicted", "failed_keys", "off_grid",
         "open_failed")


@dataclass
class Item:
    """One object of a task: its namespace, tier key and tenant; for stores and loads its
    bytes (``buf``, the object's logical size) and address in L1."""

    space: Space
    key: bytes
    tenant: str | None = None
    buf: memoryview | None = None
    address: int = 0


@dataclass
class Task:
    """A store, load or lookup of LMCache's, with one result per item (``ok``)."""

    kind: str  # "store" | "load" | "lookup"
    task_id: int
    items: list[Item]
    user: Any = None  # the adapter's own (LMCache's keys), handed back with the task
    ok: list[bool] = field(default_factory=list)
    waiting: dict[Space, list[int]] = field(default_factory=dict)  # items not yet in a job, by namespace
    inflight: collections.Counter[Space] = field(default_factory=collections.Counter)  # jobs out, by namespace
    deadline: float = 0.0
    off_grid: set[int] = field(default_factory=set)  # items counted off the grid (once each)

    def finished(self) -> bool:
        return not self.inflight and not any(self.waiting.values())


@dataclass
class _Sub:
    """One kvtiers job of a task: its items, their slots, staged or in place."""

    task: Task
    idxs: list[int]
    slots: list[int]
    staged: bool


class _Ns:
    """An open namespace: its tier, its arena (grid or staging) and its jobs."""

    def __init__(self, space: Space) -> None:
        self.space = space
        self.handle: TierHandle | None = None
        self.grid: L1Grid | None = None
        self.free: list[int] = []  # free staging slots (staging arenas only)
        self.arena: Any = None
        self.jobs: dict[int, _Sub] = {}
        self.error: str | None = None
        self.failed_at = 0.0
        self.poll_failing_since: float | None = None  # monotonic time of the first poll of a run that raised
        #: zero_copy null, a grid namespace: the staged instance of the same namespace (the same
        #: medium) that objects off the grid go through, opened on the first such object
        self.twin: _Ns | None = None


class TierRunner:
    """The worker thread over every namespace's tier (see the module)."""

    def __init__(self, params: AdapterParams, l1: tuple[int, int, int] | None,
                 on_done: Callable[[Task], None]) -> None:
        self.params = params
        self.l1 = l1  # (ptr, size, align_bytes) of LMCache's L1 region, or None
        self.on_done = on_done
        self._cv = threading.Condition()
        self._new: list[Task] = []
        self._closing = False
        self._spaces: dict[Space, _Ns] = {}
        self._lookups: list[Task] = []
        self._transfers: list[Task] = []
        self._ids = itertools.count(1)
        self.stats = collections.Counter({k: 0 for k in STATS})  # every counter from the start (/status)
        self._touches: list[Item] = []
        self._thread = threading.Thread(target=self._run, name="kvtiers-lmcache", daemon=True)
        self._thread.start()

    # --- the callers' side ------------------------------------------------------------
    def submit(self, task: Task) -> None:
        """Queue ``task``; a closed runner finishes it at once, every item failed."""
        task.ok = [False] * len(task.items)
        with self._cv:
            if not self._closing:
                self._new.append(task)
                self._cv.notify()
                return
        self._finish(task)

    def touch(self, items: list[Item]) -> None:
        """Queue a recency refresh of ``items`` (LMCache 0.5.7's ``submit_touch``); never blocks."""
        with self._cv:
            if not self._closing:
                self._touches.extend(items)
                self._cv.notify()

    def _touch(self) -> bool:
        with self._cv:
            items, self._touches = self._touches, []
        by_space: dict[Space, list[bytes]] = {}
        for it in items:
            by_space.setdefault(it.space, []).append(it.key)
        for space, keys in by_space.items():
            ns = self._spaces.get(space)
            if ns is None or ns.handle is None:  # nothing of it was stored or asked here yet
                continue
            try:
                ns.handle.touch(keys)
                self.stats["touched"] += len(keys)
            except Exception as e:
                log.debug("%s: touch failed: %s", WHAT, e)
        return bool(items)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 60.0) -> None:
        """Stop taking tasks, let the tiers finish or fail what they accepted, close them,
        finish every task, and end the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: the worker did not end within %.0f s", WHAT, timeout)

    def spaces(self) -> dict[Space, str]:
        """Each namespace opened so far, with its mode (``zero-copy``, ``staged``, or why it failed)."""
        return {s: n.error or ("staged" if n.grid is None else
                               "zero-copy, off-grid objects staged" if n.twin is not None else "zero-copy")
                for s, n in list(self._spaces.items())}

    # --- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        pause = _POLL_MIN_S
        while True:
            with self._cv:
                if not self._new and not self._touches and not self._busy() and not self._closing:
                    self._cv.wait()
                elif not self._new and self._busy():
                    self._cv.wait(pause)
                new, self._new = self._new, []
                closing = self._closing
            progressed = bool(new)
            for task in new:
                self._guard(self._start, task)
            progressed |= self._guard(self._touch) or False
            progressed |= self._guard(self._advance_lookups) or False
            progressed |= self._guard(self._advance_transfers) or False
            progressed |= self._guard(self._poll) or False
            pause = _POLL_MIN_S if progressed else min(_POLL_MAX_S, pause * 2)
            if closing:
                self._shutdown()
                return

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # a bug here must not end the thread: LMCache would wait forever
            log.exception("%s: worker step %s failed", WHAT, getattr(fn, "__name__", fn))
            return None

    def _busy(self) -> bool:
        return bool(self._lookups or self._transfers)

    def _finish(self, task: Task) -> None:
        try:
            self.on_done(task)
        except Exception:
            log.exception("%s: finishing %s task %d failed", WHAT, task.kind, task.task_id)

    def _start(self, task: Task) -> None:
        by_space: dict[Space, list[int]] = {}
        for i, item in enumerate(task.items):
            by_space.setdefault(item.space, []).append(i)
        for space, idxs in by_space.items():
            if space.layout.nbytes <= 0:  # a group no layout is known for: misses
                continue
            ns = self._open(space)
            if ns is not None:
                task.waiting[space] = idxs
        if task.kind == "lookup":
            task.deadline = time.monotonic() + self.params.lookup_wait_ms / 1000.0
            self._lookups.append(task)
            self._ask(task)
        else:
            self._transfers.append(task)
        self._reap()

    # --- namespaces ---------------------------------------------------------------------
    def _open(self, space: Space) -> _Ns | None:
        ns = self._spaces.get(space)
        if ns is not None and ns.handle is not None:
            return ns
        if ns is not None and time.monotonic() - ns.failed_at < REOPEN_S:
            return None
        ns = _Ns(space)
        self._spaces[space] = ns
        try:
            self._open_tier(ns)
        except Exception as e:
            ns.error = f"{type(e).__name__}: {e}".splitlines()[0]
            ns.failed_at = time.monotonic()
            self.stats["open_failed"] += 1
            log.error("%s: the tier of namespace %s did not open (its chunks are misses): %s", WHAT,
                      _label(space), ns.error)
            return None
        return ns

    def _twin(self, ns: _Ns) -> _Ns | None:
        """The staged instance beside grid namespace ``ns`` (see ``_Ns.twin``), opened once."""
        if ns.twin is None:
            twin = _Ns(ns.space)
            try:
                self._open_tier(twin, staged=True)
            except Exception as e:
                log.warning("%s: the staged instance of namespace %s did not open: objects off the grid fail: %s",
                            WHAT, _label(ns.space), e)
                return None
            ns.twin = twin
        return ns.twin

    def _open_tier(self, ns: _Ns, *, staged: bool = False) -> None:
        p, n = self.params, ns.space.layout.nbytes
        slot = grid_slot_bytes(n, self.l1[2]) if self.l1 is not None and not staged else None
        if p.zero_copy and slot is None and not staged:
            why = "LMCache gave no L1 region" if self.l1 is None else f"objects of {n} bytes fit no page grid"
            raise ValueError(f"zero_copy is required, but {why}")
        if slot is not None and p.zero_copy is not False:
            ns.grid = L1Grid(self.l1[0], self.l1[1], slot)
            ns.arena = ns.grid.arena
        else:
            ns.arena = staging_arena(n, p.staging_slots)
            ns.free = list(range(len(ns.arena) - 1, -1, -1))
        namespace = Namespace(ns.space.fields(p.namespace))
        ns.handle = open_tier(p.tier_type, p.tier_options, TierContext(ns.arena, namespace, removed=self._removed))
        log.info("%s: namespace %s (%s) on tier %r, %s, %d-byte objects", WHAT, _label(ns.space), namespace.digest,
                 p.tier_type, "zero-copy in LMCache's L1" if ns.grid else f"staged through {len(ns.arena)} slots", n)

    def _instances(self) -> list[_Ns]:
        """Every open tier instance: each namespace's, and the staged twins beside grid ones."""
        out = []
        for ns in list(self._spaces.values()):
            out.append(ns)
            if ns.twin is not None:
                out.append(ns.twin)
        return out

    def _removed(self, keys: Sequence[bytes], reason: str) -> None:
        """A tier dropped chunks on its own (its ``max_bytes``, a corrupt file): counted."""
        self.stats["evicted"] += len(keys)

    # --- lookups ------------------------------------------------------------------------
    def _ask(self, task: Task) -> bool:
        """Ask the tiers about the task's unanswered items; True if any was answered."""
        answered = False
        expired = time.monotonic() >= task.deadline
        for space, idxs in list(task.waiting.items()):
            if not idxs:
                continue
            ns = self._spaces[space]
            if ns.handle is None:  # given up (_give_up) since the task started: misses
                task.waiting[space] = []
                answered = True
                continue
            keys = [task.items[i].key for i in idxs]
            try:
                for tenant, tkeys in _by_tenant(task.items, idxs).items():
                    note_tenant(ns.handle, tkeys, tenant)
                answers = list(ns.handle.lookup(keys))
                if len(answers) != len(keys):
                    raise RuntimeError(f"{len(answers)} answers for {len(keys)} keys")
            except Exception as e:
                log.warning("%s: lookup on namespace %s failed (misses): %s", WHAT, _label(space), e)
                answers = [Lookup.MISS] * len(keys)
            if ns.twin is not None and Lookup.MISS in answers:  # chunks stored through the staged twin
                miss = [j for j, a in enumerate(answers) if a is Lookup.MISS]
                try:
                    for tenant, tkeys in _by_tenant(task.items, [idxs[j] for j in miss]).items():
                        note_tenant(ns.twin.handle, tkeys, tenant)
                    again = ns.twin.handle.lookup([keys[j] for j in miss])
                    for j, a in zip(miss, again, strict=True):
                        answers[j] = a
                except Exception as e:
                    log.debug("%s: lookup on the staged instance failed: %s", WHAT, e)
            hits, left = [], []
            for i, a in zip(idxs, answers, strict=True):
                if a is Lookup.HIT:
                    task.ok[i] = True
                    self.stats["lookup_hits"] += 1
                    hits.append(task.items[i].key)
                elif a is Lookup.RETRY and not expired:
                    left.append(i)
            if hits:
                try:
                    ns.handle.touch(hits)  # what LMCache locks is the most recently used
                except Exception as e:
                    log.debug("%s: touch failed: %s", WHAT, e)
            answered |= len(left) < len(idxs)
            task.waiting[space] = left
        return answered

    def _advance_lookups(self) -> bool:
        progressed = False
        for task in self._lookups:
            progressed |= self._ask(task)
        self._reap()
        return progressed

    # --- stores and loads ----------------------------------------------------------------
    def _advance_transfers(self) -> bool:
        progressed = False
        for task in self._transfers:
            for space, idxs in task.waiting.items():
                if idxs and space not in task.inflight:
                    progressed |= self._submit(task, self._spaces[space], idxs)
        self._reap()
        return progressed

    def _submit(self, task: Task, ns: _Ns, idxs: list[int]) -> bool:
        """Put the next of ``idxs`` that fit (distinct keys and slots, free staging slots)
        into one job; True if a job went out or items failed."""
        if ns.handle is None:  # given up (_give_up) since the task started: failed
            task.waiting[ns.space] = []
            return True
        take, slots, later, off_grid = [], [], [], []
        keys_seen: set[bytes] = set()
        slots_seen: set[int] = set()
        failed = False
        for i in idxs:
            item = task.items[i]
            if ns.grid is not None:
                slot = ns.grid.slot_of(item.address)
                if slot is None or len(item.buf) > ns.grid.slot_bytes:
                    staged = self.params.zero_copy is None
                    if not self.stats["off_grid"]:
                        log.warning("%s: an object of namespace %s is not on L1's %d-byte grid: %s", WHAT,
                                    _label(ns.space), ns.grid.slot_bytes,
                                    "such objects are copied through a staging arena" if staged else
                                    "it fails (zero_copy is true; null copies such objects through staging)")
                    if i not in task.off_grid:
                        task.off_grid.add(i)
                        self.stats["off_grid"] += 1
                    if staged:
                        off_grid.append(i)
                    else:
                        failed = True
                    continue
            elif ns.free:
                slot = None
            else:
                later.append(i)
                continue
            if item.key in keys_seen or (slot is not None and slot in slots_seen):
                later.append(i)
                continue
            if slot is None:
                slot = ns.free.pop()
            keys_seen.add(item.key)
            slots_seen.add(slot)
            take.append(i)
            slots.append(slot)
        if off_grid and (twin := self._twin(ns)) is not None:  # a job of them on the staged instance
            failed |= self._submit(task, twin, off_grid)
            later.extend(task.waiting.get(ns.space, []))  # what the staging slots did not take yet
        elif off_grid:
            failed = True
        task.waiting[ns.space] = later
        if not take:
            return failed
        staged = ns.grid is None
        job = Job(next(self._ids), tuple(task.items[i].key for i in take), tuple(slots))
        try:
            if staged and task.kind == "store":
                for i, s in zip(take, slots, strict=True):
                    buf = task.items[i].buf
                    ns.arena[s][: len(buf)] = buf
            for tenant, tkeys in _by_tenant(task.items, take).items():
                note_tenant(ns.handle, tkeys, tenant)
            (ns.handle.submit_store if task.kind == "store" else ns.handle.submit_load)(job)
        except Exception as e:
            log.warning("%s: %s of %d chunks refused by the tier (failed): %s", WHAT, task.kind, len(take), e)
            if staged:
                ns.free.extend(slots)
            return True
        ns.jobs[job.job_id] = _Sub(task, take, slots, staged)
        task.inflight[ns.space] += 1
        return True

    def _poll(self) -> bool:
        progressed = False
        for ns in self._instances():
            if ns.jobs:
                progressed |= self._collect(ns)
        self._reap()
        return progressed

    def _collect(self, ns: _Ns) -> bool:
        try:
            results = ns.handle.get_finished_jobs()
        except Exception as e:
            now = time.monotonic()
            if ns.poll_failing_since is None:
                ns.poll_failing_since = now
                log.warning("%s: polling the tier of %s failed: %s: %s", WHAT, _label(ns.space), type(e).__name__, e)
            elif now - ns.poll_failing_since >= POLL_GIVE_UP_S:
                self._give_up(ns, f"get_finished_jobs raised on every poll for {POLL_GIVE_UP_S:g} s, "
                                  f"last {type(e).__name__}: {e}")
                return True
            return False
        ns.poll_failing_since = None
        return self._settle(ns, results)

    def _give_up(self, ns: _Ns, why: str) -> None:
        """Treat the namespace of instance ``ns`` as one that did not open (see the module):
        close its instances, fail every job they did not report."""
        main = next((m for m in self._spaces.values() if m is ns or m.twin is ns), ns)
        log.error("%s: the tier of namespace %s given up (its chunks are misses for %.0f s): %s", WHAT,
                  _label(main.space), REOPEN_S, why)
        for inst in (main, main.twin):
            if inst is None or inst.handle is None:
                continue
            try:
                inst.handle.close()  # rule 9: its accepted jobs finished or failed, its threads gone
            except Exception as e:
                log.error("%s: closing the tier of %s raised %s: %s", WHAT, _label(inst.space), type(e).__name__, e)
            try:
                self._settle(inst, inst.handle.get_finished_jobs())
            except Exception:  # as before: what it did not report fails below
                pass
            self._settle(inst, [JobResult(job_id, tuple(sub.task.items[i].key for i in sub.idxs), error=why)
                                for job_id, sub in list(inst.jobs.items())])
            inst.handle = None
        main.twin = None
        main.error = f"given up: {why}"
        main.failed_at = time.monotonic()

    def _settle(self, ns: _Ns, results: Sequence[JobResult]) -> bool:
        """Hand the results of ``ns``'s jobs to their tasks; True if there were any."""
        for res in results:
            sub = ns.jobs.pop(res.job_id, None)
            if sub is None:
                continue
            task, failed = sub.task, set(res.failed_keys)
            if failed:
                self.stats["failed_keys"] += len(failed)
                log.info("%s: %s: %d of %d chunks failed: %s", WHAT, task.kind, len(failed), len(sub.idxs), res.error)
            for i, s in zip(sub.idxs, sub.slots, strict=True):
                item = task.items[i]
                ok = item.key not in failed
                if ok and sub.staged and task.kind == "load":
                    item.buf[:] = ns.arena[s][: len(item.buf)]
                task.ok[i] = ok
                self.stats["stored" if task.kind == "store" else "loaded"] += ok
            if sub.staged:
                ns.free.extend(sub.slots)
            task.inflight[ns.space] -= 1
            if task.inflight[ns.space] <= 0:
                del task.inflight[ns.space]
        return bool(results)

    def _reap(self) -> None:
        for tasks in (self._lookups, self._transfers):
            done = [t for t in tasks if t.finished()]
            for t in done:
                tasks.remove(t)
                self._finish(t)

    def _shutdown(self) -> None:
        """Close every tier (each finishes or fails what it accepted), collect what it
        reports, and finish every task, unfinished items failed."""
        with self._cv:
            new, self._new = self._new, []
        for ns in self._instances():
            if ns.handle is None:
                continue
            try:
                ns.handle.close()
                self._collect(ns)
            except Exception as e:
                log.warning("%s: closing the tier of %s: %s", WHAT, _label(ns.space), e)
        for task in [*new, *self._lookups, *self._transfers]:
            task.waiting.clear()  # never submitted, or not answered: failed (ok starts False)
            task.inflight.clear()
            self._finish(task)
        self._lookups.clear()
        self._transfers.clear()


def _by_tenant(items: Sequence[Item], idxs: Sequence[int]) -> dict[str | None, list[bytes]]:
    out: dict[str | None, list[bytes]] = {}
    for i in idxs:
        out.setdefault(items[i].tenant, []).append(items[i].key)
    return out


def _label(space: Space) -> str:
    return f"{space.model}/rank {space.kv_rank:#x}/group {space.group}"
