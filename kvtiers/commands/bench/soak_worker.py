"""One process of ``kvtiers bench tier --soak``: ``python -m kvtiers.commands.bench.soak_worker``.

It reads its spec (one JSON line) on stdin, opens the tier, says ``{"ready": ...}`` on stdout,
waits for ``{"start": EPOCH}``, then until the end of the last interval repeats one step:
store a job of fresh keys (each chunk's first 8 bytes are its key's number, the rest the
slot's random bytes), look up the last ``lookup_batch`` keys it stored, load the previous
step's job into other slots and check every loaded byte. At each interval's end it writes
one JSON line of what happened in it; at the end it closes the tier and writes
``{"done": ...}``. Nothing else goes to stdout (logs go to stderr).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import threading
import time
from collections import Counter, deque
from typing import Any

from ...registry import TierHandle, open_tier
from ...types import Arena, Job, JobResult, Lookup, Namespace, TierContext
from .harness import _drive
from .soak_probes import fs_usage, process_stats

_HEAD = struct.Struct("<Q")
MAX_ERRORS = 5  # distinct error messages kept per process


class _Removed:
    """The ``ctx.removed`` listener: keys the tier dropped on its own, by reason."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_reason: Counter[str] = Counter()
        self.total = 0

    def __call__(self, keys: Any, reason: str) -> None:
        with self.lock:
            self.by_reason[reason] += len(keys)
            self.total += len(keys)


class _Counts:
    """What one interval saw."""

    def __init__(self) -> None:
        self.stored = self.store_failed = self.loaded = self.load_failed = self.wrong = 0
        self.lookups = self.lookup_hits = 0
        self.lookup_s = self.walk_s = 0.0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Soaker:
    """The loop of one soak process on an open tier."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import numpy as np

        self.spec = spec
        self.index = int(spec["index"])
        self.kpj = int(spec["keys_per_job"])
        self.chunk = int(spec["chunk_bytes"])
        self.arena = Arena.allocate(2 * self.kpj, self.chunk)
        np.frombuffer(self.arena.buffer, dtype=np.uint8)[:] = np.random.default_rng(1000 + self.index).integers(
            0, 256, 2 * self.kpj * self.chunk, dtype=np.uint8)
        self.removed = _Removed()
        self.ctx = TierContext(self.arena, Namespace(spec["namespace"]), removed=self.removed)
        self.handle: TierHandle = open_tier(spec["tier"], spec["options"], self.ctx)
        self.ids = iter(range(1, 1 << 62))
        self.next_key = 0
        self.stored_total = 0
        self.recent: deque[bytes] = deque(maxlen=int(spec["lookup_batch"]))
        self.prev: list[tuple[bytes, int]] = []
        self.errors: list[str] = []
        self.counts = _Counts()

    def _error(self, what: str) -> None:
        if what not in self.errors and len(self.errors) < MAX_ERRORS:
            self.errors.append(what)

    def _job(self, keys: list[bytes], slots: range, load: bool) -> JobResult:
        """Run one job to its result (polled as the bench harness polls)."""
        job = Job(next(self.ids), tuple(keys), tuple(slots))
        got: list[JobResult] = []

        def submit(lo: int, hi: int) -> int:
            (self.handle.submit_load if load else self.handle.submit_store)(job)
            return job.job_id

        def finished() -> list[tuple[Any, str | None]]:
            res = self.handle.get_finished_jobs()
            got.extend(res)
            return [(r.job_id, None) for r in res]

        _drive(len(keys), max(1, len(keys)), None, submit, finished, "soak")
        return got[-1]

    def step(self) -> None:
        """Store a job of fresh keys, look up the recent ones, load the previous job."""
        c = self.counts
        n0 = self.next_key
        self.next_key += self.kpj
        nums = list(range(n0, n0 + self.kpj))
        keys = [b"soak-%d-%d" % (self.index, n) for n in nums]
        for i, n in enumerate(nums):
            _HEAD.pack_into(self.arena[i], 0, n)
        res = self._job(keys, range(self.kpj), load=False)
        failed = set(res.failed_keys)
        c.stored += len(keys) - len(failed)
        c.store_failed += len(failed)
        if failed:
            self._error(f"store: {res.error}")
        self.stored_total += len(keys) - len(failed)
        self.recent.extend(k for k in keys if k not in failed)
        batch = list(self.recent)
        t0 = time.perf_counter()
        ans = self.handle.lookup(batch)
        c.lookup_s += time.perf_counter() - t0
        c.lookups += len(batch)
        c.lookup_hits += sum(a is Lookup.HIT for a in ans)
        todo = self.prev or [(k, n) for k, n in zip(keys, nums, strict=True) if k not in failed]
        self.prev = [(k, n) for k, n in zip(keys, nums, strict=True) if k not in failed]
        if todo:
            self._load(todo)

    def _load(self, todo: list[tuple[bytes, int]]) -> None:
        c = self.counts
        k = self.kpj
        res = self._job([key for key, _ in todo], range(k, k + len(todo)), load=True)
        failed = set(res.failed_keys)
        c.load_failed += len(failed)
        if failed:
            self._error(f"load: {res.error}")
        for i, (key, n) in enumerate(todo):
            if key in failed:
                continue
            out = self.arena[k + i]
            src = self.arena[n % k]  # key n was stored from slot n % kpj; its bytes after the head are the slot's
            if _HEAD.unpack_from(out, 0)[0] != n or out[8:] != src[8:]:
                c.wrong += 1
                self._error(f"load: {key!r} loaded bytes that are not the ones stored")
            else:
                c.loaded += 1

    def row(self, i: int, t: float, seconds: float) -> dict[str, Any]:
        """The JSON line of interval ``i`` (``seconds`` long, ending ``t`` seconds after the
        start); starts the next interval."""
        c, self.counts = self.counts, _Counts()
        with self.removed.lock:
            removed = dict(self.removed.by_reason)
            removed_total = self.removed.total
        row: dict[str, Any] = {
            "i": i, "index": self.index, "t": round(t, 3), "seconds": round(seconds, 4), "stored": c.stored,
            "store_failed": c.store_failed, "loaded": c.loaded, "load_failed": c.load_failed, "wrong": c.wrong,
            "lookups": c.lookups, "lookup_hits": c.lookup_hits, "lookup_s": round(c.lookup_s, 6),
            "removed_total": removed_total, "removed_by_reason": removed, "backlog": int(self.handle.backlog() or 0),
            "live_bytes": max(0, self.stored_total - removed_total) * self.chunk, **process_stats(),
        }
        walk = self.spec.get("walk")
        if walk:
            usage = fs_usage(walk)
            row["fs"] = usage
            row["walk_s"] = usage["walk_s"]
        return row

    def run(self, start_epoch: float) -> None:
        interval = float(self.spec["interval"])
        n = int(self.spec["intervals"])
        start = time.monotonic() + max(0.0, start_epoch - time.time())
        time.sleep(max(0.0, start - time.monotonic()))
        i, last = 0, start
        parent = os.getppid()
        while i < n:
            if _STOP.is_set() or os.getppid() != parent:  # asked to stop, or the soak's parent is gone
                raise KeyboardInterrupt
            self.step()
            now = time.monotonic()
            if now >= start + (i + 1) * interval:
                row = self.row(i, now - start, now - last)
                _emit(row)
                last = time.monotonic()  # the walk's time is charged to no interval
                i += 1  # a step longer than an interval makes the next interval short, never missing

    def close(self) -> float:
        t0 = time.perf_counter()
        self.handle.close()
        self.handle.get_finished_jobs()
        return time.perf_counter() - t0


_STOP = threading.Event()  # set by SIGTERM or SIGINT: the soak ends after the step in progress


def _interrupted(signum: int, frame: Any) -> None:
    _STOP.set()


def main() -> int:
    """The worker's entry point: spec on stdin, JSON lines on stdout. SIGTERM or SIGINT (or
    the death of the parent) ends the soak after the step in progress, closing the tier
    (exit status 130)."""
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    spec = json.loads(sys.stdin.readline())
    try:
        soaker = Soaker(spec)
    except Exception as e:
        _emit({"error": f"{type(e).__name__}: {e}"})
        return 1
    try:
        _emit({"ready": True, "pid": os.getpid(), **process_stats()})
        line = sys.stdin.readline()
        if not line:
            return 1
        soaker.run(float(json.loads(line)["start"]))
    except KeyboardInterrupt:
        soaker.close()
        return 130
    except Exception as e:
        _emit({"error": f"{type(e).__name__}: {e}"})
        soaker.close()
        return 1
    close_s = soaker.close()
    _emit({"done": True, "close_s": round(close_s, 3), "errors": soaker.errors, **process_stats()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
