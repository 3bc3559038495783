"""``kvtiers bench fs``: the fs tier against raw file I/O on the same directory, in one run.

The raw baseline does what any chunk store must at least do, with the same syscalls in the
same mode: per chunk ``open(O_CREAT|O_EXCL[|O_DIRECT])`` + one ``pwritev([slot, page])`` +
``close`` + ``rename`` into the same two-level directories for stores, and ``open`` + one
``preadv([slot, page])`` + ``close`` for loads, from a plain ``ThreadPoolExecutor`` with the
tier's thread counts. The tier adds checksums, the existence check, the index, job
tracking and its queues. Tier and raw runs alternate within each round (the first one
alternating between rounds); the median of the rounds is reported.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtiers import Arena, Job, Namespace, TierContext, open_tier

from . import direct as _direct
from . import layout

LOOKUP_BATCH = 1000
SUBMIT_KEYS = 64


def _wait(tier, n: int, timeout: float = 600.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        got = tier.get_finished_jobs()
        if got:
            out.extend(got)
        elif time.monotonic() > deadline:
            raise RuntimeError(f"bench: {n - len(out)} job(s) did not finish within {timeout:.0f} s")
        else:
            time.sleep(0.0002)
    return out


class _Raw:
    """The baseline: the same syscalls over a thread pool, no checksum, no bookkeeping."""

    def __init__(self, arena: Arena, root: str, direct: bool, n_read: int, n_write: int) -> None:
        self.arena = arena
        self.dir = root
        flag = _direct.O_DIRECT if direct else 0
        self.wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag
        self.rflags = os.O_RDONLY | os.O_CLOEXEC | flag
        self.rpool = ThreadPoolExecutor(n_read)
        self.wpool = ThreadPoolExecutor(n_write)
        self.pages = [_direct.aligned_buffer() for _ in range(max(n_read, n_write) * 2)]
        self.views = [memoryview(p) for p in self.pages]

    def _store(self, i: int, key: bytes) -> None:
        final = layout.chunk_path(self.dir, key)
        tmp = layout.temp_path(final)
        try:
            fd = os.open(tmp, self.wflags, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, self.wflags, 0o644)
        try:
            os.pwritev(fd, [self.arena[i], self.views[i % len(self.views)]], 0)
        finally:
            os.close(fd)
        os.rename(tmp, final)

    def _load(self, i: int, key: bytes) -> None:
        fd = os.open(layout.chunk_path(self.dir, key), self.rflags)
        try:
            os.preadv(fd, [self.arena[i], self.views[i % len(self.views)]], 0)
        finally:
            os.close(fd)

    def store(self, keys: list[bytes]) -> None:
        list(self.wpool.map(self._store, range(len(keys)), keys))

    def load(self, keys: list[bytes]) -> None:
        list(self.rpool.map(self._load, range(len(keys)), keys))

    def close(self) -> None:
        self.rpool.shutdown()
        self.wpool.shutdown()
        for v in self.views:
            v.release()
        for p in self.pages:
            p.close()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tier_io(tier, keys: list[bytes], load: bool, submit_us: list[float]) -> None:
    submit = tier.submit_load if load else tier.submit_store
    n = 0
    for j in range(0, len(keys), SUBMIT_KEYS):
        batch = tuple(keys[j : j + SUBMIT_KEYS])
        job = Job(j, batch, tuple(range(j, j + len(batch))))
        t0 = time.perf_counter()
        submit(job)
        submit_us.append((time.perf_counter() - t0) * 1e6)
        n += 1
    results = _wait(tier, n)
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"bench: {'load' if load else 'store'} failed: {bad[0].error}")


def _lookup_rates(tier, keys: list[bytes], batches: int = 300) -> tuple[float, float]:
    """Keys per second for ``lookup`` of batches of 1000 known keys, and for the plain dict
    membership test over the same batches (the floor any Python index pays)."""
    reps = -(-LOOKUP_BATCH // len(keys))
    pool = (keys * reps)[:LOOKUP_BATCH]
    batch = list(pool)
    from kvtiers import Lookup

    ans = tier.lookup(batch)
    if any(a is not Lookup.HIT for a in ans):
        raise RuntimeError("bench: stored keys did not all answer HIT")
    index = dict.fromkeys(keys)
    tier_s = _timed(lambda: [tier.lookup(batch) for _ in range(batches)])
    base_s = _timed(lambda: [[k in index for k in batch] for _ in range(batches)])
    n = LOOKUP_BATCH * batches
    return n / tier_s, n / base_s


def _checksum_gbps(arena: Arena) -> float:
    t = _timed(lambda: [layout.data_digest(arena[i]) for i in range(len(arena))])
    return len(arena) * arena.slot_bytes / t / 1e9


def run_bench(
    options: dict,
    chunk_sizes: list[int],
    *,
    total_bytes: int = 256 << 20,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the benchmark; return ``{"results": [...], ...}`` (see the module docstring)."""
    say = progress or (lambda s: None)
    results = []
    extra = {"lookup": [], "submit_latency_us": [], "checksum_gbps": []}
    root = os.path.abspath(options["root_dir"])
    os.makedirs(root, exist_ok=True)
    for chunk in chunk_sizes:
        if chunk <= 0 or chunk % 4096:
            raise ValueError(f"--chunk-bytes must be a positive multiple of 4096, got {chunk}")
        n = max(1, total_bytes // chunk)
        arena = Arena.allocate(n, chunk)
        arena.buffer[:] = np.random.default_rng(chunk).integers(0, 256, n * chunk, dtype=np.uint8).data
        ns = Namespace({"kvtiers_bench": "fs", "chunk_bytes": chunk, "run": secrets.token_hex(4)})
        ctx = TierContext(arena, ns)
        handle = open_tier("fs", options, ctx)
        tier = handle.tier
        raw_dir = os.path.join(root, f"bench-raw-{os.getpid()}-{secrets.token_hex(2)}")
        raw = _Raw(arena, raw_dir, tier.direct, tier._reads.n, tier._writes.n)
        times: dict[str, list[float]] = {"store": [], "load": [], "raw_store": [], "raw_load": []}
        submit_us: dict[str, list[float]] = {"store": [], "load": []}
        all_keys: list[bytes] = []
        try:
            for r in range(rounds):
                keys = [b"bench-%d-%d" % (r, i) for i in range(n)]
                raw_keys = [b"raw-%d-%d" % (r, i) for i in range(n)]
                all_keys.extend(keys)
                order = [("tier", "raw"), ("raw", "tier")][r % 2]
                for op, whos in (("store", order), ("load", order[::-1])):  # stores, then loads
                    for who in whos:
                        if who == "tier":
                            t0 = time.perf_counter()
                            _tier_io(handle, keys, op == "load", submit_us[op])
                            times[op].append(time.perf_counter() - t0)
                        else:
                            t0 = time.perf_counter()
                            (raw.load if op == "load" else raw.store)(raw_keys)
                            times["raw_" + op].append(time.perf_counter() - t0)
                say(
                    f"chunk {chunk} round {r + 1}/{rounds}: "
                    + ", ".join(f"{op} {n * chunk / times[op][-1] / 1e9:.2f} GB/s" for op in times)
                )
            tier_kps, dict_kps = _lookup_rates(handle, all_keys)
            csum = _checksum_gbps(arena)
        finally:
            handle.close()
            raw.close()
            shutil.rmtree(tier.nsdir, ignore_errors=True)
            shutil.rmtree(raw_dir, ignore_errors=True)
        nbytes = n * chunk
        mode = "O_DIRECT" if tier.direct else "buffered"
        for op in ("store", "load"):
            gbps = nbytes / statistics.median(times[op]) / 1e9
            base = nbytes / statistics.median(times["raw_" + op]) / 1e9
            results.append({
                "op": op, "chunk_bytes": chunk, "gbps": round(gbps, 4), "baseline_gbps": round(base, 4),
                "ratio": round(gbps / base, 4), "baseline": f"raw {'pwritev' if op == 'store' else 'preadv'} ({mode})",
                "rounds": rounds, "bytes_per_round": nbytes, "threads": raw.rpool._max_workers
                if op == "load" else raw.wpool._max_workers, "mode": mode,
                "round_gbps": [round(nbytes / t / 1e9, 4) for t in times[op]],
                "baseline_round_gbps": [round(nbytes / t / 1e9, 4) for t in times["raw_" + op]],
            })
        extra["lookup"].append({
            "chunk_bytes": chunk, "batch": LOOKUP_BATCH, "keys_per_s": round(tier_kps),
            "baseline_keys_per_s": round(dict_kps), "ratio": round(tier_kps / dict_kps, 4),
            "baseline": "dict membership over the same batches",
        })
        for op in ("store", "load"):
            us = sorted(submit_us[op])
            extra["submit_latency_us"].append({
                "op": op, "chunk_bytes": chunk, "keys_per_job": SUBMIT_KEYS, "median": round(statistics.median(us), 1),
                "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1), "max": round(us[-1], 1),
            })
        extra["checksum_gbps"].append({"chunk_bytes": chunk, "gbps": round(csum, 2), "algorithm": "xxh3-128"})
    return {"results": results, **extra}


def print_table(result: dict, echo: Callable[[str], None]) -> None:
    """The human-readable form of :func:`run_bench`'s result."""
    echo(f"{'op':<7} {'chunk':>9} {'tier GB/s':>10} {'raw GB/s':>9} {'ratio':>6}  baseline")
    for r in result["results"]:
        echo(f"{r['op']:<7} {r['chunk_bytes']:>9} {r['gbps']:>10.3f} {r['baseline_gbps']:>9.3f} "
             f"{r['ratio']:>5.2f}x  {r['baseline']}, {r['threads']} threads, median of {r['rounds']}")
    for lk in result["lookup"]:
        echo(f"lookup  {lk['chunk_bytes']:>9} {lk['keys_per_s'] / 1e6:>7.2f} M keys/s  "
             f"(dict membership {lk['baseline_keys_per_s'] / 1e6:.2f} M keys/s, {lk['ratio']:.2f}x), "
             f"batches of {lk['batch']}")
    for s in result["submit_latency_us"]:
        echo(f"submit_{s['op']:<5} {s['chunk_bytes']:>7} median {s['median']:.0f} us, p99 {s['p99']:.0f} us, "
             f"max {s['max']:.0f} us ({s['keys_per_job']}-key jobs)")
    for c in result["checksum_gbps"]:
        echo(f"checksum {c['chunk_bytes']:>8} {c['algorithm']} {c['gbps']:.1f} GB/s on one thread")
