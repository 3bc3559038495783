"""The harness the checks drive a tier with.

A :class:`Harness` builds tier instances from ``(type, config)`` — each on its own arena,
with a namespace of its own — and an :class:`Instance` submits jobs, polls results and
verifies them. The harness enforces the rules that hold in every check, so any check can
catch them: each result is for a submitted job and comes exactly once (rule 5), loads
reported good hold exactly the stored bytes (rule 3), hooks do not raise (rule 4), and
after ``close`` one more ``get_finished_jobs`` returns every outstanding result (rule 9).

Chunk contents are a function of the key (:func:`content`), as in a content-addressed
cache: every store of a key, from any instance or process, carries the same bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvtiers import Arena, AsyncTier, Job, JobResult, Lookup, Namespace, TierContext
from kvtiers.registry import TierHandle, TierInfo, get_registry, open_tier, validate_tier_class

from .limits import DEFAULT_LIMITS, Limits

POISON_WORD = b"\xde\xad\xbe\xef"


class ConformanceFailure(AssertionError):
    """A rule was broken; the message says which and how."""


class CheckSkipped(Exception):
    """The check does not apply to this tier (the message says why)."""


class NotCertified(CheckSkipped):
    """The check could not run for want of something the tier could provide (a hook such
    as ``conformance_corrupt``, an option) or the suite needs (``hypothesis``). Reported as
    a skip that names what is missing; the summary says ``NOT CERTIFIED``, and
    ``--strict`` fails it."""


def fail(message: str) -> None:
    """Raise :class:`ConformanceFailure`."""
    raise ConformanceFailure(message)


def content(key: bytes, size: int) -> bytes:
    """The bytes every store of ``key`` carries in a slot of ``size`` bytes."""
    digest = hashlib.blake2b(key + size.to_bytes(8, "little"), digest_size=16).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).bytes(size)


def poison(size: int) -> bytes:
    """The pattern free and poisoned slots hold."""
    return POISON_WORD * (size // len(POISON_WORD))


def first_difference(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """Index of the first differing byte (``-1`` if equal)."""
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    if len(x) != len(y):
        return min(len(x), len(y))
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else -1


def resolve_tier(tier_type: str | type) -> TierInfo:
    """The :class:`TierInfo` of a registered name, import path or class."""
    if isinstance(tier_type, type):
        name = type_path(tier_type)
        validate_tier_class(name, tier_type)
        return TierInfo(name, tier_type, "?", "?", "class")
    return get_registry().tier_info(tier_type)


def type_path(tier_type: str | type) -> str:
    """A string another process can open the tier type by (name or ``pkg.mod:Class``)."""
    if isinstance(tier_type, str):
        return tier_type
    return f"{tier_type.__module__}:{tier_type.__qualname__}"


def child_env() -> dict[str, str]:
    """The environment of a subprocess of a check: this process's ``sys.path`` on its
    ``PYTHONPATH``, so it imports the tier the way this process did."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def qkey(key: bytes) -> str:
    """A short printable form of a key for messages."""
    return key.hex() if len(key) <= 12 else key[:12].hex() + "..."


class Harness:
    """Builds and tracks the tier instances of one check.

    ``tier_type`` is a registered name, an import path or a class; ``config`` the tier's
    options; ``levels`` the levels being checked (checks adapt, e.g. the stateful test
    reopens only for ``durable``); ``seed`` makes the random choices of the check
    reproducible. Keys carry a random per-check salt, so a backend reused between runs
    does not confuse checks that expect a key to be absent.
    """

    def __init__(
        self,
        tier_type: str | type,
        config: Mapping[str, Any] | None = None,
        *,
        levels: Iterable[str] = ("core",),
        limits: Limits = DEFAULT_LIMITS,
        seed: int = 0,
    ) -> None:
        self.tier_type = tier_type
        self.info = resolve_tier(tier_type)
        self.config = dict(config or {})
        self.levels = frozenset(levels)
        self.limits = limits
        self.seed = seed
        self.rng = random.Random(seed)
        self.salt = os.urandom(4)
        self.instances: list[Instance] = []
        self._serial = itertools.count()
        #: slot_bytes -> keys stored in that namespace by this check (for cleanup)
        self.stored: dict[int, set[bytes]] = {}

    # -- keys --------------------------------------------------------------------------
    def key(self, tag: bytes = b"k") -> bytes:
        """A fresh key unique to this check run."""
        k = self.salt + tag + next(self._serial).to_bytes(4, "big")
        return k[:64]

    def keys(self, n: int, tag: bytes = b"k") -> list[bytes]:
        """``n`` fresh keys."""
        return [self.key(tag) for _ in range(n)]

    # -- instances -----------------------------------------------------------------------
    def namespace(self, slot_bytes: int) -> Namespace:
        return Namespace({"kvtiers_conformance": 1, "slot_bytes": slot_bytes})

    def options(self, max_bytes: int | None = None) -> dict[str, Any]:
        """The tier options of an instance (``max_bytes`` added for ``bounded``)."""
        options = dict(self.config)
        if max_bytes is not None:
            options["max_bytes"] = max_bytes
        return options

    def open(self, *, max_bytes: int | None = None, num_slots: int | None = None,
             slot_bytes: int | None = None) -> Instance:
        """A new instance of the tier on its own arena."""
        slot_bytes = slot_bytes or self.limits.slot_bytes
        arena = Arena.allocate(num_slots or self.limits.num_slots, slot_bytes)
        arena.buffer[:] = poison(len(arena.buffer))
        removed: list[tuple[tuple[bytes, ...], str]] = []

        def on_removed(keys: Sequence[bytes], reason: str) -> None:
            removed.append((tuple(keys), reason))

        ctx = TierContext(arena, self.namespace(slot_bytes), removed=on_removed)
        # registered names resolve by a dict lookup; import paths were resolved once above
        # (resolving one scans every installed distribution's metadata)
        by_name = isinstance(self.tier_type, str) and ":" not in self.tier_type
        handle = open_tier(self.tier_type if by_name else self.info.cls, self.options(max_bytes), ctx)
        inst = Instance(self, handle, arena, removed)
        self.instances.append(inst)
        return inst

    def close_all(self) -> None:
        """Close every instance still open (checking rule 9's result hand-over)."""
        errors = []
        for inst in self.instances:
            if not inst.closed:
                try:
                    inst.close()
                except ConformanceFailure as e:
                    errors.append(str(e))
        if errors:
            fail(errors[0])

    def path_roots(self) -> list[pathlib.Path]:
        """Directories named by the tier's options (where its files and temp files live)."""
        roots = []
        for value in self.config.values():
            if isinstance(value, (str, os.PathLike)) and os.path.isabs(os.fspath(value)):
                p = pathlib.Path(value)
                if p.is_dir():
                    roots.append(p)
        return roots


class Instance:
    """One tier instance, its arena and the bookkeeping of its jobs."""

    def __init__(self, harness: Harness, handle: TierHandle, arena: Arena,
                 removed: list[tuple[tuple[bytes, ...], str]]) -> None:
        self.h = harness
        self.handle = handle
        self.arena = arena
        self.removed = removed
        self.closed = False
        self._free = list(range(len(arena)))[::-1]
        self._ids = itertools.count(1)
        self.pending: dict[int, tuple[str, tuple[bytes, ...], tuple[int, ...], bool]] = {}
        self.results: dict[int, JobResult] = {}
        self.last_submit_s = 0.0  #: seconds the last submit hook call took
        #: job -> (keys it must fail, what they are: "never-stored", "evicted", ...)
        self.absent: dict[int, tuple[frozenset[bytes], str]] = {}
        #: jobs whose slots are poisoned the moment their result is accepted (rule 6 watches)
        self.poison_on_report: set[int] = set()

    @property
    def tier(self) -> Any:
        return self.handle.tier

    @property
    def is_async(self) -> bool:
        return isinstance(self.handle.tier, AsyncTier)

    @property
    def slot_bytes(self) -> int:
        return self.arena.slot_bytes

    def removed_keys(self) -> set[bytes]:
        return {k for keys, _ in self.removed for k in keys}

    # -- slots ---------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Reserve ``n`` free slots (the caller releases them with :meth:`release`)."""
        if n > len(self._free):
            raise RuntimeError(f"conformance harness: arena too small ({n} slots wanted, {len(self._free)} free)")
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)

    def fill(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        for k, s in zip(keys, slots, strict=True):
            self.arena[s][:] = content(k, self.slot_bytes)

    def poison(self, slots: Iterable[int]) -> None:
        pat = poison(self.slot_bytes)
        for s in slots:
            self.arena[s][:] = pat

    # -- hooks, checked ------------------------------------------------------------------
    def _call(self, hook: str, *args: Any) -> Any:
        try:
            return getattr(self.handle, hook)(*args)
        except ConformanceFailure:
            raise
        except Exception as e:
            fail(f"rule 4: {hook} raised {type(e).__name__}: {e} "
                 "(failure is a result, never an exception out of a hook)")

    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        """One ``lookup`` call, its answer checked for shape."""
        out = self._call("lookup", list(keys))
        if not isinstance(out, list) or len(out) != len(keys) or not all(isinstance(x, Lookup) for x in out):
            fail(f"rule 1: lookup of {len(keys)} keys must answer a list of {len(keys)} Lookup values, "
                 f"got {out!r:.100}")
        return out

    def resolve(self, keys: Sequence[bytes], timeout: float | None = None) -> list[Lookup]:
        """Ask until no key answers ``RETRY``; fail if one still does after ``retry_s``."""
        timeout = self.h.limits.retry_s if timeout is None else timeout
        keys = list(keys)
        answers = self.lookup(keys)
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            todo = [i for i, a in enumerate(answers) if a is Lookup.RETRY]
            if not todo:
                return answers
            if time.monotonic() > deadline:
                fail(f"rule 1: {len(todo)} key(s) still answer RETRY after {timeout:g} s (e.g. {qkey(keys[todo[0]])})")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
            again = self.lookup([keys[i] for i in todo])
            for i, a in zip(todo, again, strict=True):
                answers[i] = a

    def wait_hit(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        """Poll until every key answers ``HIT``; MISS is tolerated until the deadline
        (another instance's negative cache may answer MISS for a short while)."""
        timeout = self.h.limits.retry_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        todo = list(keys)
        pause = 0.001
        while True:
            answers = self.lookup(todo)
            todo = [k for k, a in zip(todo, answers, strict=True) if a is not Lookup.HIT]
            if not todo:
                return
            if time.monotonic() > deadline:
                last = dict(zip(todo, self.lookup(todo), strict=True))
                k = todo[0]
                why = [reason for keys, reason in self.removed if k in keys]
                said = f"; the tier reported it removed ({', '.join(why)})" if why else \
                    "; the tier did not report it removed"
                fail(f"rule 2: {len(todo)} stored key(s) do not answer HIT within {timeout:g} s "
                     f"(e.g. {qkey(k)}: {last[k].name}{said})")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def submit(self, kind: str, keys: Sequence[bytes], slots: Sequence[int] | None = None,
               *, prepare: bool = True, absent: Iterable[bytes] = (), absent_what: str = "never-stored") -> int:
        """Submit a store (slots filled with each key's content) or a load (slots
        poisoned first); return the job id. Slots are allocated unless given. A load of
        keys in ``absent`` must report them failed (rule 4); ``absent_what`` says what they
        are in a failure message (``never-stored``, ``evicted``...)."""
        keys = tuple(keys)
        own = slots is None
        slots = tuple(self.alloc(len(keys)) if own else slots)
        if prepare:
            (self.fill(keys, slots) if kind == "store" else self.poison(slots))
        job = Job(next(self._ids), keys, slots)
        if kind == "store":
            self.h.stored.setdefault(self.slot_bytes, set()).update(keys)
        hook = getattr(self.handle, f"submit_{kind}")
        try:
            t0 = time.perf_counter()
            hook(job)
            self.last_submit_s = time.perf_counter() - t0
        except Exception as e:
            if own:
                self.release(slots)
            fail(f"rule 4: submit_{kind} of a valid {len(keys)}-key job raised {type(e).__name__}: {e} "
                 "(failure is a result; submits raise only for caller errors, rule 8)")
        self.pending[job.job_id] = (kind, keys, slots, own)
        if absent:
            self.absent[job.job_id] = (frozenset(absent), absent_what)
        return job.job_id

    def poll(self) -> list[JobResult]:
        """One ``get_finished_jobs`` call; every result checked (rules 3, 4, 5)."""
        t0 = time.monotonic()
        out = self._call("get_finished_jobs")
        took = time.monotonic() - t0
        if took > self.h.limits.poll_block_s:
            fail(f"rule 5: get_finished_jobs blocked for {took:.2f} s")
        if not isinstance(out, list):
            fail(f"rule 5: get_finished_jobs must return a list, got {type(out).__name__}")
        for r in out:
            self._accept(r)
        return out

    def _accept(self, r: Any) -> None:
        if not isinstance(r, JobResult):
            fail(f"rule 5: get_finished_jobs returned {type(r).__name__}, not a JobResult")
        if r.job_id in self.results:
            fail(f"rule 5: job {r.job_id} reported twice")
        if r.job_id not in self.pending:
            fail(f"rule 5: job {r.job_id} reported but never submitted (or its submit raised)")
        kind, keys, slots, own = self.pending.pop(r.job_id)
        extra = set(r.failed_keys) - set(keys)
        if extra:
            fail(f"rule 5: job {r.job_id} reports failed key(s) it does not hold, e.g. {qkey(next(iter(extra)))}")
        self.results[r.job_id] = r
        if kind == "load":
            failed = set(r.failed_keys)
            absent, what = self.absent.pop(r.job_id, (frozenset(), ""))
            size = self.slot_bytes
            for k, s in zip(keys, slots, strict=True):
                if k in failed:
                    continue
                want = content(k, size)
                got = self.arena[s]
                if k in absent:
                    how = " with wrong bytes (no checksum on load?)" if got != want else ""
                    fail(f"rule 4: load job {r.job_id} reported the {what} key {qkey(k)} loaded successfully{how}")
                if got != want:
                    where = first_difference(got, want)
                    what = "was never written" if bytes(got) == poison(size) else "holds wrong bytes"
                    fail(f"rule 3: load job {r.job_id} reported key {qkey(k)} loaded but slot {s} {what} "
                         f"(first difference at byte {where})")
        if r.job_id in self.poison_on_report:
            self.poison_on_report.discard(r.job_id)
            self.poison(slots)
        if own:
            self.release(slots)

    def wait(self, ids: Iterable[int], timeout: float | None = None) -> dict[int, JobResult]:
        """Poll until every job in ``ids`` is reported; fail after ``finish_s``."""
        ids = list(ids)
        timeout = self.h.limits.finish_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pause = 0.0002
        while any(i not in self.results for i in ids):
            if any(i not in self.results and i not in self.pending for i in ids):
                raise RuntimeError("conformance harness: waiting for a job never submitted")
            if time.monotonic() > deadline:
                missing = [i for i in ids if i not in self.results]
                fail(f"rule 5: {len(missing)} job(s) not reported within {timeout:g} s (e.g. job {missing[0]})")
            if not self.poll():
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        return {i: self.results[i] for i in ids}

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every pending job."""
        self.wait(list(self.pending), timeout)

    # -- conveniences ----------------------------------------------------------------------
    def store(self, keys: Sequence[bytes], *, must_succeed: bool = True) -> JobResult:
        """Store ``keys`` in one job and wait for it."""
        jid = self.submit("store", keys)
        r = self.wait([jid])[jid]
        if must_succeed and not r.ok:
            fail(f"store of {len(keys)} key(s) failed {len(r.failed_keys)} of them: {r.error}")
        return r

    def store_many(self, keys: Sequence[bytes], per_job: int = 64) -> None:
        """Store ``keys`` in jobs of ``per_job`` submitted together; all must succeed."""
        ids = [self.submit("store", keys[i:i + per_job]) for i in range(0, len(keys), per_job)]
        for r in self.wait(ids).values():
            if not r.ok:
                fail(f"store failed {len(r.failed_keys)} key(s): {r.error}")

    def load(self, keys: Sequence[bytes]) -> JobResult:
        """Load ``keys`` in one job and wait (good keys are verified by the harness)."""
        jid = self.submit("load", keys)
        return self.wait([jid])[jid]

    def load_all(self, keys: Sequence[bytes], per_job: int = 64, why: str = "rule 2") -> None:
        """Load ``keys``; every one must succeed (bytes are verified)."""
        ids = [self.submit("load", keys[i:i + per_job]) for i in range(0, len(keys), per_job)]
        for r in self.wait(ids).values():
            if not r.ok:
                fail(f"{why}: load of stored key {qkey(r.failed_keys[0])} failed: {r.error}")

    def expect_missing(self, keys: Sequence[bytes], why: str, what: str = "never-stored") -> None:
        """Loads of ``keys`` must all report them failed; ``what`` names them in messages."""
        jid = self.submit("load", keys, absent=keys, absent_what=what)
        r = self.wait([jid])[jid]
        ok = [k for k in keys if k not in set(r.failed_keys)]
        if ok:
            fail(f"{why}: load of {what} key {qkey(ok[0])} reported success")

    def close(self) -> list[JobResult]:
        """Close the tier, then collect what one more ``get_finished_jobs`` returns; every
        accepted job must be among those results (rule 9)."""
        if self.closed:
            return []
        self.closed = True
        self._call("close")
        out = self.poll()
        if self.pending:
            ids = sorted(self.pending)
            fail(f"rule 9: after close, one get_finished_jobs call did not report {len(ids)} accepted job(s) "
                 f"(e.g. job {ids[0]})")
        return out
