"""Shared helpers for the fs tier tests (imported by the other ``test_fs_*`` files)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtiers_fs import FsTier
from tier_helpers import resolve_lookup, wait_job  # the test_fs_* files import wait_job from here

from kvtiers import Arena, Job, JobResult, Lookup, Namespace, TierContext
from kvtiers.ioloop import is_io_thread

SLOT = 64 << 10
NS = Namespace({"model": "test", "dtype": "fp16"})


def pattern(key: bytes, size: int = SLOT) -> bytes:
    """Deterministic bytes for ``key`` (so any process can check a chunk)."""
    seed = key * (64 // len(key) + 1)
    block = bytes((b + i) & 0xFF for i, b in enumerate(seed[:64]))
    return (block * (size // 64 + 1))[:size]


class Env:
    """An arena, a context recording ``ctx.removed``, and helpers to run jobs."""

    def __init__(self, root: str, slots: int = 32, slot_bytes: int = SLOT, ns: Namespace = NS) -> None:
        self.root = root
        self.arena = Arena.allocate(slots, slot_bytes)
        self.removed: list[tuple[bytes, str]] = []
        self.ctx = TierContext(self.arena, ns, removed=lambda keys, why: self.removed.extend((k, why) for k in keys))
        self._job = 0
        self.tiers: list[FsTier] = []

    def open(self, **options) -> FsTier:
        t = FsTier(self.ctx, root_dir=self.root, **options)
        self.tiers.append(t)
        return t

    def next_id(self) -> int:
        self._job += 1
        return self._job

    def fill(self, keys, slots) -> None:
        for k, s in zip(keys, slots, strict=False):
            self.arena[s][:] = pattern(k, self.arena.slot_bytes)

    def poison(self, slots) -> None:
        for s in slots:
            self.arena[s][:] = b"\xee" * self.arena.slot_bytes

    def run(self, tier: FsTier, op: str, keys, slots=None, timeout: float = 30.0) -> JobResult:
        keys = tuple(keys)
        slots = tuple(range(len(keys))) if slots is None else tuple(slots)
        job = Job(self.next_id(), keys, slots)
        if op == "store":
            self.fill(keys, slots)
            tier.submit_store(job)
        else:
            self.poison(slots)
            tier.submit_load(job)
        return wait_job(tier, job.job_id, timeout)

    def store(self, tier, keys, slots=None) -> JobResult:
        return self.run(tier, "store", keys, slots)

    def load(self, tier, keys, slots=None) -> JobResult:
        return self.run(tier, "load", keys, slots)

    def check(self, keys, slots=None, failed=()) -> None:
        """Every key not in ``failed`` holds its pattern."""
        slots = range(len(keys)) if slots is None else slots
        for k, s in zip(keys, slots, strict=False):
            if k not in failed:
                assert bytes(self.arena[s]) == pattern(k, self.arena.slot_bytes), f"wrong bytes for {k!r}"

    def close(self) -> None:
        for t in self.tiers:
            if not t._closed:
                t.close()


@contextmanager
def two_envs(root) -> Iterator[tuple[Env, Env]]:
    """Two instances of the tier on one root directory, each with its own arena; both closed after."""
    a, b = Env(str(root)), Env(str(root))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def resolve(tier, keys, timeout: float = 5.0) -> list[Lookup]:
    """Ask until no key answers RETRY (rule 1's bound)."""
    return resolve_lookup(tier, keys, timeout)


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def chunk_files(root: str, suffix: str = ".bin") -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out.extend(os.path.join(d, f) for f in files if f.endswith(suffix))
    return sorted(out)


def chunk_bytes(root: str) -> int:
    """The bytes of the chunk files under ``root`` now (a file removed meanwhile counts 0)."""
    n = 0
    for p in chunk_files(root):
        try:
            n += os.path.getsize(p)
        except FileNotFoundError:
            pass
    return n


def tier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtiers-fs") and not is_io_thread(t)]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
