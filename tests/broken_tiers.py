"""Tiers for testing the conformance suite itself.

Two good ones the suite must pass (:class:`DictAsyncTier`, a checksummed ``AsyncTier``
over a process-wide dict with ``conformance_corrupt``; :class:`DirTier`, a checksummed file-per-chunk tier
with atomic publish, claiming ``durable`` and ``shared``), and deliberately broken ones, each
breaking one rule (``BROKEN`` maps them to it), several of them intermittently. The broken
ones are built on the memory tier where that is the shortest way to the bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Sequence

from tier_helpers import InlineMemoryTier

from kvtiers import AsyncTier, Job, JobResult, Lookup, TierContext, hookimpl
from kvtiers.types import check_keys

# -- good tiers ------------------------------------------------------------------------------

_BUCKETS: dict[str, dict[bytes, bytes]] = {}
_BUCKETS_LOCK = threading.Lock()


class DictAsyncTier(AsyncTier):
    """Chunks and their blake2b tags in a process-wide dict per ``bucket``: instances on one
    bucket in one process share data (so it claims only ``core``: ``shared`` is certified
    across processes). ``conformance_corrupt`` flips a byte of a stored chunk."""

    levels = frozenset({"core"})
    checksum = True  # UncheckedDictTier: no tag check on load

    def __init__(self, ctx: TierContext, *, bucket: str = "default") -> None:
        super().__init__(ctx)
        with _BUCKETS_LOCK:
            self.data = _BUCKETS.setdefault(bucket, {})

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        return {"bucket": str(scratch)}

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace, key: bytes) -> None:
        data = _BUCKETS[config.get("bucket", "default")]
        blob, tag = data[key]
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0xFF
        data[key] = (bytes(bad), tag)

    async def exists(self, key: bytes) -> bool:
        return key in self.data

    async def put(self, key: bytes, data: memoryview) -> None:
        blob = bytes(data)
        self.data.setdefault(key, (blob, hashlib.blake2b(blob, digest_size=16).digest()))

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        entry = self.data.get(key)
        if entry is None:
            return False
        blob, tag = entry
        if self.checksum and hashlib.blake2b(blob, digest_size=16).digest() != tag:
            raise ValueError(f"chunk {key.hex()} is corrupt")
        out[:] = blob
        return True

    async def delete(self, key: bytes) -> None:
        self.data.pop(key, None)


def _intact(entry: tuple[bytes, bytes]) -> bool:
    blob, tag = entry
    return hashlib.blake2b(blob, digest_size=16).digest() == tag


class BatchDictTier(DictAsyncTier):
    """:class:`DictAsyncTier` with ``put_many``/``get_many_into``: a whole job per call,
    copies on the loop (so a cancelled batch never touches a slot afterwards)."""

    async def put_many(self, items):
        for key, data in items:
            await self.put(key, data)

    async def get_many_into(self, items):
        failed = {}
        for key, out in items:
            try:
                if not await self.get_into(key, out):
                    failed[key] = False
            except ValueError as e:
                failed[key] = e
        return failed


class DirTier(AsyncTier):
    """One file per chunk under ``root_dir``: hex name, blake2b trailer, tmp + rename."""

    levels = frozenset({"core", "durable", "shared"})
    torn = False  # BrokenTornDirTier: write in place, no checksum

    def __init__(self, ctx: TierContext, *, root_dir: str) -> None:
        super().__init__(ctx)
        self.root = os.path.join(root_dir, ctx.namespace.digest)
        os.makedirs(self.root, exist_ok=True)

    def path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex() + ".bin")

    async def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    async def put(self, key: bytes, data: memoryview) -> None:
        payload = bytes(data)
        if self.torn:
            with open(self.path(key), "wb") as f:
                f.write(payload[: len(payload) // 2])
                f.flush()
                time.sleep(0.005)  # a slow disk: the crash test kills us here
                f.write(payload[len(payload) // 2:])
            return
        tmp = f"{self.path(key)}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(payload + hashlib.blake2b(payload, digest_size=16).digest())
        os.replace(tmp, self.path(key))

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        try:
            with open(self.path(key), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return False
        if self.torn:
            out[: len(raw)] = raw
            return True
        body, tag = raw[:-16], raw[-16:]
        if len(body) != len(out) or hashlib.blake2b(body, digest_size=16).digest() != tag:
            raise ValueError(f"chunk {key.hex()} is corrupt")
        out[:] = body
        return True


class BoundedDirTier(DirTier):
    """:class:`DirTier` with ``max_bytes``: each instance deletes the oldest chunks it stored
    and reports them (the evicting instance reports); another instance may answer HIT for
    them until a load finds the file gone (``False``: missing), then MISS."""

    levels = frozenset({"core", "shared", "bounded"})
    sticky = False  # StickyHitDirTier: a vanished file raises instead of answering missing

    def __init__(self, ctx: TierContext, *, root_dir: str, max_bytes: int | None = None) -> None:
        super().__init__(ctx, root_dir=root_dir)
        self.max_bytes = max_bytes
        self.mine: dict[bytes, None] = {}  # keys this instance stored, oldest first
        self.mine_lock = threading.Lock()

    async def put(self, key: bytes, data: memoryview) -> None:
        await super().put(key, data)
        if self.max_bytes is None:
            return
        gone = []
        with self.mine_lock:
            self.mine.pop(key, None)
            self.mine[key] = None
            while len(self.mine) * len(data) > self.max_bytes:
                old = next(iter(self.mine))
                del self.mine[old]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(old))
                gone.append(old)
        self.evicted(gone)

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        if self.sticky and not os.path.exists(self.path(key)):
            raise FileNotFoundError(f"{self.path(key)} is gone")
        return await super().get_into(key, out)


# -- broken tiers, by rule -----------------------------------------------------------------


class SleepyLookupTier(InlineMemoryTier):
    """Rule 1: lookup sleeps (as if it asked a server) on the caller's thread."""

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        time.sleep(0.08)
        return super().lookup(keys)


class StatLookupTier(InlineMemoryTier):
    """Rule 1: lookup opens a file per call (fast, but I/O on the caller's thread)."""

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        with open(os.devnull, "rb"):
            pass
        return super().lookup(keys)


class ForeverRetryTier(InlineMemoryTier):
    """Rule 1: unknown keys answer RETRY forever."""

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return [Lookup.RETRY if a is Lookup.MISS else a for a in super().lookup(keys)]


class DropEveryThirdTier(InlineMemoryTier):
    """Rule 2: every third key stored is dropped, and the store reported good."""

    n = 0

    @hookimpl
    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        with self._lock:
            for k in job.keys:
                self.n += 1
                if self.n % 3 == 0:
                    self._data.pop(k, None)


class BitFlipTier(InlineMemoryTier):
    """Rule 3: every seventh key loaded gets one byte flipped."""

    n = 0

    @hookimpl
    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        for k, s in zip(job.keys, job.slots, strict=True):
            if k in self._data:
                self.n += 1
                if self.n % 7 == 0:
                    view = self.ctx.arena[s]
                    view[100] ^= 0x01


class PhantomLoadTier(InlineMemoryTier):
    """Rule 4: a missing key is loaded "successfully" (zeros, reported good)."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._check(job)
        for k, s in zip(job.keys, job.slots, strict=True):
            blob = self._data.get(k)
            self.ctx.arena[s][:] = blob if blob is not None else bytes(self.ctx.arena.slot_bytes)
        self._finished.append(JobResult(job.job_id, (), 0, 0.0))


class RaisingLoadTier(InlineMemoryTier):
    """Rule 4: a missing key raises KeyError out of submit_load."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        for k in job.keys:
            if k not in self._data:
                raise KeyError(k)
        super().submit_load(job)


class LoseEveryFourthTier(InlineMemoryTier):
    """Rule 5: every fourth result is never reported."""

    n = 0

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        for r in super().get_finished_jobs():
            self.n += 1
            if self.n % 4:
                out.append(r)
        return out


class DoubleReportTier(InlineMemoryTier):
    """Rule 5: the fifth result is reported twice (again on the next poll)."""

    n = 0
    again: list[JobResult] = []

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        out = self.again + super().get_finished_jobs()
        self.again = []
        for r in out:
            self.n += 1
            if self.n == 5:
                self.again = [r]
        return out


class LateWriteTier(InlineMemoryTier):
    """Rule 6: a load's slot is written again 50 ms after its job was reported."""

    @hookimpl
    def submit_load(self, job: Job) -> None:
        super().submit_load(job)
        arena, data = self.ctx.arena, dict(self._data)

        def again() -> None:
            for k, s in zip(job.keys, job.slots, strict=True):
                if k in data:
                    arena[s][:] = data[k]

        timer = threading.Timer(0.05, again)
        timer.daemon = True
        timer.start()


class NoCopyTier(InlineMemoryTier):
    """Rule 6: stores keep a view of the slot instead of copying it."""

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._check(job)
        for k, s in zip(job.keys, job.slots, strict=True):
            self._data[k] = self.ctx.arena[s]  # type: ignore[assignment]
        self._finished.append(JobResult(job.job_id, (), 0, 0.0))


class NonIdempotentTier(InlineMemoryTier):
    """Rule 7: storing a key that exists fails."""

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._check(job)
        dup = tuple(k for k in job.keys if k in self._data)
        if not dup:
            return super().submit_store(job)
        self._finished.append(JobResult(job.job_id, dup, 0, 0.0, "key exists"))


class BlockingSubmitTier(InlineMemoryTier):
    """Rule 8: submit waits for "the disk" (100 ms) before returning."""

    @hookimpl
    def submit_store(self, job: Job) -> None:
        time.sleep(0.1)
        super().submit_store(job)


class UncheckedSlotTier(InlineMemoryTier):
    """Rule 8: slots are never validated; views are cut from the flat buffer, so an
    out-of-range or negative slot is silently accepted."""

    def _view(self, s: int) -> memoryview:
        size = self.ctx.arena.slot_bytes
        return self.ctx.arena.buffer[s * size:(s + 1) * size]

    @hookimpl
    def submit_store(self, job: Job) -> None:
        for k, s in zip(job.keys, job.slots, strict=True):
            self._data[k] = bytes(self._view(s))
        self._finished.append(JobResult(job.job_id, (), 0, 0.0))

    @hookimpl
    def submit_load(self, job: Job) -> None:
        failed = []
        for k, s in zip(job.keys, job.slots, strict=True):
            blob = self._data.get(k)
            view = self._view(s)
            if blob is None or len(view) != len(blob):
                failed.append(k)
            else:
                view[:] = blob
        self._finished.append(JobResult(job.job_id, tuple(failed), 0, 0.0, "failed" if failed else None))


class WrongErrorTier(InlineMemoryTier):
    """Rule 8: an out-of-range slot raises RuntimeError, not a caller error."""

    def _check(self, job: Job) -> None:
        try:
            super()._check(job)
        except IndexError as e:
            raise RuntimeError(f"internal error: {e}") from None


class LeakyThreadTier(InlineMemoryTier):
    """Rule 9: a background thread that close never stops."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._stop = threading.Event()
        threading.Thread(target=self._stop.wait, name="leaky-flusher", daemon=True).start()


class LeakyFdTier(InlineMemoryTier):
    """Rule 9: a file descriptor opened at start and never closed."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._fd = os.open(os.devnull, os.O_RDONLY)


class DeferredResultTier(InlineMemoryTier):
    """Rule 9: results wait one poll in a side queue, and close throws that queue away."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._later: list[JobResult] = []

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        out, self._later = self._later, super().get_finished_jobs()
        return out

    @hookimpl
    def close(self) -> None:
        self._later = []
        super().close()


class UnboundedTier(InlineMemoryTier):
    """Rule 11: max_bytes is accepted and ignored."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=None)


class SilentEvictTier(InlineMemoryTier):
    """Rule 11: evicts, but never reports it through ctx.removed."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(TierContext(ctx.arena, ctx.namespace), max_bytes=max_bytes)


class GhostHitTier(InlineMemoryTier):
    """Rule 11: evicts and reports it, but lookup still answers HIT for every key ever
    stored (a stale index, or a base class that marks a whole job present after it)."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._ever: set[bytes] = set()

    @hookimpl
    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        self._ever.update(job.keys)

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return [Lookup.HIT if k in self._ever else a for k, a in zip(keys, super().lookup(keys), strict=True)]


class WholeJobPresentTier(InlineMemoryTier):
    """Rule 11, only with one job larger than the bound: lookup answers from a present-set
    that drops evicted keys, then marks every key of the finished job present, so keys
    evicted by later keys of the same job answer HIT (AsyncTier's bug before ``evicted``)."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._present: set[bytes] = set()

    @hookimpl
    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        with self._lock:
            self._present &= set(self._data)
            self._present.update(job.keys)

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return [Lookup.HIT if k in self._present else Lookup.MISS for k in check_keys(keys)]


class ZombieLoadTier(InlineMemoryTier):
    """Rule 11 (and 4): evicted keys answer MISS and are reported, but a load of one still
    succeeds from a copy kept aside."""

    def __init__(self, ctx: TierContext, *, max_bytes: int | None = None) -> None:
        super().__init__(ctx, max_bytes=max_bytes)
        self._aside: dict[bytes, bytes] = {}

    @hookimpl
    def submit_store(self, job: Job) -> None:
        super().submit_store(job)
        for k, s in zip(job.keys, job.slots, strict=True):
            self._aside[k] = bytes(self.ctx.arena[s])

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._check(job)
        for k, s in zip(job.keys, job.slots, strict=True):
            self.ctx.arena[s][:] = self._aside[k] if k in self._aside else poison_like(self.ctx.arena.slot_bytes)
        failed = tuple(k for k in job.keys if k not in self._aside)
        self._finished.append(JobResult(job.job_id, failed, 0, 0.0, "not stored" if failed else None))


def poison_like(size: int) -> bytes:
    return b"\xde\xad\xbe\xef" * (size // 4)


class NormalisingTier(InlineMemoryTier):
    """Rule 12: keys are "normalised" by dropping '/', so a/b and ab alias."""

    @staticmethod
    def norm(keys: Sequence[bytes]) -> tuple[bytes, ...]:
        return tuple(k.replace(b"/", b"") or b"_" for k in keys)

    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        return super().lookup(self.norm(check_keys(keys)))

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._alias(job, super().submit_store)

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._alias(job, super().submit_load)

    def _alias(self, job: Job, submit) -> None:
        normed = self.norm(job.keys)
        seen: dict[bytes, int] = {}
        keys, slots = [], []
        for k, s in zip(normed, job.slots, strict=True):
            if k not in seen:
                seen[k] = s
                keys.append(k)
                slots.append(s)
        submit(Job(job.job_id, tuple(keys), tuple(slots)))
        back = dict(zip(normed, job.keys, strict=True))
        r = self._finished.pop()
        for k, s in zip(normed, job.slots, strict=True):  # duplicates get the first one's bytes
            if seen[k] != s:
                self.ctx.arena[s][:] = self.ctx.arena[seen[k]]
        self._finished.append(JobResult(r.job_id, tuple(back[k] for k in r.failed_keys), r.nbytes, r.seconds, r.error))


class NulTruncatingTier(NormalisingTier):
    """Rule 12: keys are cut at the first NUL, C-string style."""

    @staticmethod
    def norm(keys: Sequence[bytes]) -> tuple[bytes, ...]:
        return tuple(k.split(b"\x00")[0] or b"_" for k in keys)


class UncheckedDictTier(DictAsyncTier):
    """Rule 4: no checksum, so a chunk damaged in place (``conformance_corrupt``) loads as
    success with wrong bytes. It keeps no files: only the hook can show it."""

    checksum = False


class ProcessLocalTier(DictAsyncTier):
    """Rule 2 (shared): claims ``shared`` but its instances share a dict of their process,
    as a tier sharing one handle per process might; two instances in one process would pass,
    an instance in another process never sees the keys."""

    levels = frozenset({"core", "shared"})


class TornDirTier(DirTier):
    """Rule 10: writes chunk files in place, with no checksum; a kill mid-write leaves a
    short file that answers HIT and loads wrong bytes."""

    torn = True


class LateBatchLoadTier(BatchDictTier):
    """Rule 6: get_many_into copies into the slots on a thread that outlives the job's
    deadline: the job is reported timed out, then the thread writes its slots. With the
    default op_timeout every job waits for the thread, so only a deadline shows it."""

    async def get_many_into(self, items):
        def copy() -> dict:
            time.sleep(0.05)
            failed: dict = {}
            for key, out in items:
                if key not in self.data:
                    failed[key] = False
                elif _intact(self.data[key]):
                    out[:] = self.data[key][0]
                else:
                    failed[key] = "corrupt"
            return failed

        return await asyncio.get_running_loop().run_in_executor(None, copy)


class LateKeyLoadTier(DictAsyncTier):
    """Rule 6: the per-key get_into copies into the slot on a thread that outlives the
    job's deadline (or the close that cancelled it)."""

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        def copy() -> bool:
            time.sleep(0.05)
            if key not in self.data:
                return False
            if not _intact(self.data[key]):
                raise ValueError(f"chunk {key.hex()} is corrupt")
            out[:] = self.data[key][0]
            return True

        return await asyncio.get_running_loop().run_in_executor(None, copy)


class NoCorruptionCheckTier(DictAsyncTier):
    """Not certified: no checksum and no ``conformance_corrupt``, on a store other instances
    share, so the suite cannot test its corruption path; it passes rule 4 with that check
    skipped, and fails it under ``--strict``."""

    checksum = False
    conformance_corrupt = None


class StickyHitDirTier(BoundedDirTier):
    """Rule 11 (shared and bounded): a load of a key another instance evicted raises instead
    of answering missing, so the base class keeps it present: this instance answers HIT for
    it forever after its load failed."""

    sticky = True


# tier class -> the (rule, level) it breaks
BROKEN: dict[type, tuple[int, str]] = {
    SleepyLookupTier: (1, "core"),
    StatLookupTier: (1, "core"),
    ForeverRetryTier: (1, "core"),
    DropEveryThirdTier: (2, "core"),
    ProcessLocalTier: (2, "shared"),
    BitFlipTier: (3, "core"),
    PhantomLoadTier: (4, "core"),
    RaisingLoadTier: (4, "core"),
    UncheckedDictTier: (4, "core"),
    LoseEveryFourthTier: (5, "core"),
    DoubleReportTier: (5, "core"),
    LateWriteTier: (6, "core"),
    LateBatchLoadTier: (6, "core"),
    LateKeyLoadTier: (6, "core"),
    NoCopyTier: (6, "core"),
    NonIdempotentTier: (7, "core"),
    BlockingSubmitTier: (8, "core"),
    UncheckedSlotTier: (8, "core"),
    WrongErrorTier: (8, "core"),
    LeakyThreadTier: (9, "core"),
    LeakyFdTier: (9, "core"),
    DeferredResultTier: (9, "core"),
    TornDirTier: (10, "durable"),
    UnboundedTier: (11, "bounded"),
    SilentEvictTier: (11, "bounded"),
    GhostHitTier: (11, "bounded"),
    WholeJobPresentTier: (11, "bounded"),
    ZombieLoadTier: (11, "bounded"),
    NormalisingTier: (12, "core"),
    NulTruncatingTier: (12, "core"),
}
