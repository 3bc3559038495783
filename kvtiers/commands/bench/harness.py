"""``kvtiers bench tier``: one benchmark harness for any tier, third-party ones included.

What it measures, per chunk size (``chunk_sizes``): store and load GB/s of the tier through
its hooks (fresh keys each round, jobs of ``keys_per_job`` keys, all submitted at once);
then, at the first chunk size, the same by concurrency (``jobs`` in flight x ``keys`` per
job); the lookup rate of batches of stored keys (after they resolved, against plain dict
membership over the same batches); and submit latency (median, p99, max).

A raw baseline where the tier offers one: a tier class may define the optional classmethod
``bench_baseline(cls, tier, chunk_bytes) -> Baseline | None`` (documented in
:mod:`kvtiers.hookspecs`) that hands the bench plain ``put(key, data)`` / ``get(key, out)``
callables on the same medium (functions or coroutine functions). The baseline runs
interleaved with the tier in the same run (which goes first alternates between rounds), on
the same bytes, with as many calls in flight as the tier's own parallelism (``concurrency``);
medians over the rounds are compared and printed as a ratio. Before the first round of each
chunk size, the tier (each variant) and the baseline store and load ``WARM_CHUNKS`` chunks
unmeasured, so what a first transfer sets up (connections, endpoints, lazily made state) is
not charged to one round of either.

No torch: the arena is :class:`kvtiers.Arena`.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...registry import TierHandle, get_registry, open_tier
from ...types import Arena, Baseline, Job, Lookup, Namespace, TierContext

__all__ = ["DEFAULT_CONCURRENCY", "Baseline", "format_table", "run_tier_bench"]

DEFAULT_CONCURRENCY = ((1, 1), (4, 1), (1, 16), (4, 16))
KEYS_PER_JOB = 64
LOOKUP_BATCH = 1000
LOOKUP_SECONDS = 0.3  # the warm lookup rate is timed over at least this long (or 300 batches)
POLL_MIN_S, POLL_MAX_S = 0.0001, 0.002  # pause between get_finished_jobs calls when nothing finished
JOB_TIMEOUT = 600.0
WARM_CHUNKS = 8  # stored and loaded unmeasured by the tier and the baseline before a chunk size's first round


class _Runner:
    """Runs a baseline's calls with a given number in flight, on threads or the I/O loop."""

    def __init__(self, base: Baseline) -> None:
        self.base = base
        self.pools: dict[int, ThreadPoolExecutor] = {}
        self.stored: dict[bytes, None] = {}  #: every key the baseline's put was given, in order

    def limit(self, op: str) -> int:
        b = self.base
        return max(1, (b.load_concurrency or b.concurrency) if op == "load" else b.concurrency)

    def run(self, op: str, keys: Sequence[bytes], views: Sequence[memoryview], parallel: int) -> None:
        try:
            self._run(op, keys, views, parallel)
        except Exception as e:  # the baseline's own fault, said in one line like the tier's
            raise RuntimeError(f"bench: baseline {self.base.name!r} {op} failed: {type(e).__name__}: {e}") from e

    def _fn(self, op: str, keys: Sequence[bytes]) -> Callable[..., Any]:
        """The baseline's call for ``op`` on ``keys``; a store's keys are remembered for ``close``."""
        if op == "load":
            return self.base.get
        self.stored.update(dict.fromkeys(keys))
        return self.base.put

    def _pool(self, n: int) -> ThreadPoolExecutor:
        pool = self.pools.get(n)
        if pool is None:
            pool = self.pools[n] = ThreadPoolExecutor(n, thread_name_prefix="kvtiers-bench")
        return pool

    def _run(self, op: str, keys: Sequence[bytes], views: Sequence[memoryview], parallel: int) -> None:
        fn = self._fn(op, keys)
        if inspect.iscoroutinefunction(fn):
            from ...ioloop import get_loop

            done = asyncio.run_coroutine_threadsafe(_calls(fn, keys, views, asyncio.Semaphore(parallel)), get_loop())
            done.result(JOB_TIMEOUT)
            return
        list(self._pool(parallel).map(fn, keys, views))

    def run_jobs(self, op: str, keys: Sequence[bytes], views: Sequence[memoryview], *, keys_per_job: int,
                 jobs: int) -> None:
        """The baseline driven as the tier is in the concurrency sweep: its calls grouped in
        jobs of ``keys_per_job`` (run at once, within its own concurrency), at most ``jobs``
        in flight, each job's end seen by the same polling loop as the tier's results, so
        both pay the same notice of a finished job, which one job of one key at a time
        otherwise charges to the tier alone."""
        fn = self._fn(op, keys)
        cap = min(keys_per_job * jobs, self.limit(op))  # calls in flight, as in the rest of the sweep
        running: dict[int, list[Any]] = {}
        if inspect.iscoroutinefunction(fn):
            from ...ioloop import get_loop

            loop = get_loop()
            sem = asyncio.Semaphore(cap)  # shared by the jobs (it binds to the loop on first use)

            def start(lo: int, hi: int) -> list[Any]:
                return [asyncio.run_coroutine_threadsafe(_calls(fn, keys[lo:hi], views[lo:hi], sem), loop)]
        else:
            pool = self._pool(cap)

            def start(lo: int, hi: int) -> list[Any]:
                return [pool.submit(fn, keys[i], views[i]) for i in range(lo, hi)]

        def submit(lo: int, hi: int) -> int:
            running[lo] = start(lo, hi)
            return lo

        def finished() -> list[tuple[Any, str | None]]:
            out = []
            for lo in [lo for lo, fs in running.items() if all(f.done() for f in fs)]:
                errors = [e for e in (f.exception() for f in running.pop(lo)) if e is not None]
                out.append((lo, f"in a job of {len(errors)} failed call(s): {type(errors[0]).__name__}: {errors[0]}"
                                if errors else None))
            return out

        _drive(len(keys), keys_per_job, jobs, submit, finished, f"baseline {self.base.name!r} {op}")

    def close_baseline(self) -> None:
        """``Baseline.close`` with the keys the baseline's own ``put`` was given: a plain
        function on this thread, a coroutine function on the SDK's I/O loop."""
        close = self.base.close
        if close is None:
            return
        keys = list(self.stored)
        if inspect.iscoroutinefunction(close):
            from ...ioloop import get_loop

            asyncio.run_coroutine_threadsafe(close(keys), get_loop()).result(JOB_TIMEOUT)
        else:
            close(keys)

    def close(self) -> None:
        for p in self.pools.values():
            p.shutdown()


async def _calls(fn: Callable[..., Any], keys: Sequence[bytes], views: Sequence[memoryview],
                 sem: asyncio.Semaphore) -> None:
    """``await fn(key, view)`` for each pair, at most as many at once as ``sem`` lets in."""

    async def one(k: bytes, v: memoryview) -> None:
        async with sem:
            await fn(k, v)

    await asyncio.gather(*(one(k, v) for k, v in zip(keys, views, strict=True)))


def _drive(n: int, keys_per_job: int, jobs: int | None, submit: Callable[[int, int], Any],
           finished: Callable[[], list[tuple[Any, str | None]]], what: str) -> None:
    """Run keys ``0..n-1`` in jobs of ``keys_per_job``, at most ``jobs`` in flight (None: all
    at once), as an engine does: ``submit(lo, hi)`` starts a job and returns its id;
    ``finished()`` says which jobs ended since the last call (id, error or None), polled
    with a pause that backs off from 0.1 to 2 ms while nothing finishes."""
    batches = [(j, min(n, j + keys_per_job)) for j in range(0, n, keys_per_job)]
    limit = jobs or len(batches)
    inflight: set[Any] = set()
    deadline = time.monotonic() + JOB_TIMEOUT
    nxt = 0
    pause = POLL_MIN_S
    while nxt < len(batches) or inflight:
        while nxt < len(batches) and len(inflight) < limit:
            inflight.add(submit(*batches[nxt]))
            nxt += 1
        got = finished()
        for job_id, error in got:
            inflight.discard(job_id)
            if error is not None:
                raise RuntimeError(f"bench: {what} failed {error}")
        if got:
            pause = POLL_MIN_S
        else:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench: {len(inflight)} job(s) did not finish within {JOB_TIMEOUT:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)  # an engine polls once per step; a tight loop only steals the GIL


def _tier_io(handle: TierHandle, keys: Sequence[bytes], load: bool, *, keys_per_job: int, jobs: int | None,
             submit_us: list[float] | None, ids: Any) -> None:
    """Store or load ``keys`` (key i in slot i) in jobs of ``keys_per_job``, at most ``jobs``
    in flight (None: all at once); wait for every result; raise if a key failed."""
    hook = handle.submit_load if load else handle.submit_store

    def submit(lo: int, hi: int) -> int:
        job = Job(next(ids), tuple(keys[lo:hi]), tuple(range(lo, hi)))
        t0 = time.perf_counter()
        hook(job)
        if submit_us is not None:
            submit_us.append((time.perf_counter() - t0) * 1e6)
        return job.job_id

    def finished() -> list[tuple[Any, str | None]]:
        return [(r.job_id, None if r.ok else f"for {len(r.failed_keys)} key(s): {r.error or 'no error given'}")
                for r in handle.get_finished_jobs()]

    _drive(len(keys), keys_per_job, jobs, submit, finished, f"tier {handle.name!r} {'load' if load else 'store'}")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _lookup(handle: TierHandle, keys: Sequence[bytes], batch: int) -> dict[str, Any]:
    """Resolve a batch of stored keys (RETRY asked again), then time repeated batches."""
    pool = list(keys) * (-(-batch // len(keys)))
    keys_b = pool[:batch]
    t0 = time.perf_counter()
    deadline = time.monotonic() + 10.0
    while True:
        ans = handle.lookup(keys_b)
        if not any(a is Lookup.RETRY for a in ans) or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    resolve_s = time.perf_counter() - t0
    hits = sum(a is Lookup.HIT for a in ans)
    reps, t0 = 0, time.perf_counter()
    while reps < 300 and (reps < 3 or time.perf_counter() - t0 < LOOKUP_SECONDS):
        handle.lookup(keys_b)
        reps += 1
    tier_s = time.perf_counter() - t0
    index = dict.fromkeys(keys)
    base_s = _timed(lambda: [[k in index for k in keys_b] for _ in range(reps)])
    n = batch * reps
    return {"batch": batch, "keys_per_s": round(n / tier_s), "baseline_keys_per_s": round(n / base_s),
            "ratio": round(base_s / tier_s, 4), "hits": hits, "resolve_ms": round(resolve_s * 1e3, 2),
            "baseline": "dict membership over the same batches"}


def _gbps(nbytes: int, times: list[float]) -> tuple[float, list[float]]:
    per = [nbytes / t / 1e9 for t in times]
    return nbytes / statistics.median(times) / 1e9, per


def _row(op: str, chunk: int, nbytes: int, times: list[float], base_times: list[float], base: Baseline | None,
         **extra: Any) -> dict[str, Any]:
    g, per = _gbps(nbytes, times)
    row: dict[str, Any] = {"op": op, "chunk_bytes": chunk, "gbps": round(g, 4)}
    if base_times:
        b, bper = _gbps(nbytes, base_times)
        row.update(baseline_gbps=round(b, 4), ratio=round(g / b, 4))
    else:
        bper = []
        row.update(baseline_gbps=None, ratio=None)
    row.update(baseline=base.name if base else None, bytes_per_round=nbytes, rounds=len(times),
               round_gbps=[round(x, 4) for x in per], baseline_round_gbps=[round(x, 4) for x in bper], **extra)
    return row


def _latency(op: str, chunk: int, us: list[float], keys_per_job: int) -> dict[str, Any]:
    us = sorted(us)
    return {"op": op, "chunk_bytes": chunk, "keys_per_job": keys_per_job, "jobs": len(us),
            "median": round(statistics.median(us), 1), "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
            "max": round(us[-1], 1)}


def default_options(tier_type: str | type, scratch: str) -> dict[str, Any]:
    """Options for a tier given none: its ``conformance_config(scratch)`` when it has one."""
    cls = tier_type if isinstance(tier_type, type) else get_registry().tier_info(tier_type).cls
    make = getattr(cls, "conformance_config", None)
    if make is None:
        return {}
    import pathlib

    return dict(make(pathlib.Path(scratch)))


def run_tier_bench(
    tier_type: str | type,
    options: dict[str, Any] | None,
    *,
    chunk_sizes: Sequence[int] = (1 << 20, 4 << 20),
    total_bytes: int = 256 << 20,
    chunks: int | None = None,
    rounds: int = 3,
    concurrency: Sequence[tuple[int, int]] = DEFAULT_CONCURRENCY,
    keys_per_job: int = KEYS_PER_JOB,
    lookup_batch: int = LOOKUP_BATCH,
    baseline: bool = True,
    variants: dict[str, dict[str, Any]] | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Benchmark ``tier_type`` (a registered name, an import path or a tier class) with
    ``options`` (None or empty: the tier's ``conformance_config`` in a temporary directory,
    if it has one). ``chunks`` per round
    (default ``total_bytes // chunk``). ``variants``: name -> option overrides, each opened
    as its own tier and measured in the same rounds against the same baseline (rows carry
    ``"variant"``). ``progress``: a :class:`kvtiers.commands.progress.Progress` (or None).
    Returns the JSON-able report (see the module docstring)."""
    import numpy as np

    for c in chunk_sizes:
        if c <= 0 or c % 4096:
            raise ValueError(f"--chunk-bytes must be a positive multiple of 4096, got {c}")
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if chunks is not None and chunks < 1:
        raise ValueError("--chunks must be >= 1")
    name = tier_type if isinstance(tier_type, str) else tier_type.__name__
    scratch = None
    if not options:
        scratch = tempfile.TemporaryDirectory(prefix="kvtiers-bench-")
        options = default_options(tier_type, scratch.name)
    variants = variants or {"": {}}
    report: dict[str, Any] = {"tier": name, "baseline": None, "rounds": rounds, "keys_per_job": keys_per_job,
                              "results": [], "concurrency": [], "lookup": [], "submit_latency_us": []}
    ids = iter(range(1, 1 << 62))
    try:
        for ci, chunk in enumerate(chunk_sizes):
            n = chunks or max(1, total_bytes // chunk)
            arena = Arena.allocate(n, chunk)
            np.frombuffer(arena.buffer, dtype=np.uint8)[:] = np.random.default_rng(chunk).integers(
                0, 256, n * chunk, dtype=np.uint8)
            views = [arena[i] for i in range(n)]
            ns = Namespace({"kvtiers_bench": name, "chunk_bytes": chunk, "run": secrets.token_hex(4)})
            ctx = TierContext(arena, ns)
            handles: dict[str, TierHandle] = {}
            base = runner = None
            stored: list[bytes] = []
            try:
                for vname, over in variants.items():
                    handles[vname] = open_tier(tier_type, {**options, **over}, ctx)
                first = next(iter(handles.values()))
                make = getattr(type(first.tier), "bench_baseline", None)
                if baseline and make is not None:
                    base = make(first.tier, chunk)
                    runner = _Runner(base) if base is not None else None
                if base is not None:
                    report["baseline"] = base.name
                stored += _warm_up(handles, runner, views, keys_per_job, ids)
                nbytes = n * chunk
                times: dict[tuple[str, str], list[float]] = {}
                submit_us: dict[str, list[float]] = {"store": [], "load": []}
                last_keys: list[bytes] = []
                for r in range(rounds):
                    order = [*handles, None] if runner else list(handles)
                    if r % 2:
                        order.reverse()
                    round_keys = {v: [b"bench-%s-%d-%d" % (v.encode(), r, i) for i in range(n)] for v in handles}
                    base_keys = [b"raw-%d-%d" % (r, i) for i in range(n)]
                    for v in handles:
                        stored.extend(round_keys[v])
                    for op in ("store", "load"):
                        for who in order:
                            t0 = time.perf_counter()
                            if who is None:
                                runner.run(op, base_keys, views, runner.limit(op))
                            else:
                                lat = submit_us[op] if who == next(iter(handles)) else None
                                _tier_io(handles[who], round_keys[who], op == "load", keys_per_job=keys_per_job,
                                         jobs=None, submit_us=lat, ids=ids)
                            times.setdefault((op, "base" if who is None else who), []).append(
                                time.perf_counter() - t0)
                    last_keys = round_keys[next(iter(handles))]
                    if progress is not None:
                        v0 = next(iter(handles))
                        notes = []
                        for op in ("store", "load"):
                            t = f"{op} {nbytes / times[(op, v0)][-1] / 1e9:.2f} GB/s"
                            if runner:
                                t += f" (raw {nbytes / times[(op, 'base')][-1] / 1e9:.2f})"
                            notes.append(t)
                        progress.advance(note=f"chunk {chunk} round {r + 1}/{rounds}: " + ", ".join(notes))
                for op in ("store", "load"):
                    for v in handles:
                        extra = {"chunks": n, "keys_per_job": keys_per_job}
                        if v:
                            extra["variant"] = v
                        if runner:
                            extra["baseline_parallel"] = runner.limit(op)
                        report["results"].append(_row(op, chunk, nbytes, times[(op, v)], times.get((op, "base"), []),
                                                      base, **extra))
                    if submit_us[op]:
                        report["submit_latency_us"].append(_latency(op, chunk, submit_us[op], keys_per_job))
                if ci == 0 and concurrency:
                    stored += _concurrency(report, first, runner, base, views, chunk, n, rounds, concurrency, ids,
                                           progress)
                lk = _lookup(first, last_keys, lookup_batch)
                report["lookup"].append({"chunk_bytes": chunk, **lk})
                if progress is not None:
                    progress.advance(note=f"chunk {chunk} lookup: {lk['keys_per_s'] / 1e6:.2f} M keys/s")
            finally:
                try:
                    if runner is not None:
                        runner.close_baseline()
                    if stored:
                        _forget(handles.values(), stored)
                finally:
                    if runner is not None:
                        runner.close()
                    for h in handles.values():
                        h.close()
    finally:
        if scratch is not None:
            scratch.cleanup()
    return report


def _warm_up(handles: dict[str, TierHandle], runner: _Runner | None, views: Sequence[memoryview],
             keys_per_job: int, ids: Any) -> list[bytes]:
    """Store and load ``WARM_CHUNKS`` chunks (fewer if the round has fewer) through each
    handle and the baseline, unmeasured. Returns the keys stored through the tier."""
    warm = views[:WARM_CHUNKS]
    stored: list[bytes] = []
    for v, h in handles.items():
        keys = [b"warm-%s-%d" % (v.encode(), i) for i in range(len(warm))]
        stored += keys
        for load in (False, True):
            _tier_io(h, keys, load, keys_per_job=keys_per_job, jobs=None, submit_us=None, ids=ids)
    if runner is not None:
        keys = [b"raw-warm-%d" % i for i in range(len(warm))]
        for op in ("store", "load"):
            runner.run(op, keys, warm, runner.limit(op))
    return stored


def _concurrency(report: dict[str, Any], handle: TierHandle, runner: _Runner | None, base: Baseline | None,
                 views: list[memoryview], chunk: int, n: int, rounds: int, concurrency: Sequence[tuple[int, int]],
                 ids: Any, progress: Any) -> list[bytes]:
    """GB/s by (jobs in flight, keys per job); the baseline with as many calls in flight,
    capped at its own concurrency. Returns the keys stored through the tier."""
    stored: list[bytes] = []
    nbytes = n * chunk
    for jobs, kpj in concurrency:
        times: dict[tuple[str, str], list[float]] = {}
        par = {op: min(jobs * kpj, runner.limit(op)) for op in ("store", "load")} if runner else {}
        for r in range(rounds):
            keys = [b"conc-%dx%d-%d-%d" % (jobs, kpj, r, i) for i in range(n)]
            bkeys = [b"rawc-%dx%d-%d-%d" % (jobs, kpj, r, i) for i in range(n)]
            stored += keys
            for op in ("store", "load"):
                order = ["tier", "base"] if runner else ["tier"]
                if r % 2:
                    order.reverse()
                for who in order:
                    t0 = time.perf_counter()
                    if who == "base":
                        runner.run_jobs(op, bkeys, views, keys_per_job=kpj, jobs=jobs)
                    else:
                        _tier_io(handle, keys, op == "load", keys_per_job=kpj, jobs=jobs, submit_us=None, ids=ids)
                    times.setdefault((op, who), []).append(time.perf_counter() - t0)
        for op in ("store", "load"):
            extra: dict[str, Any] = {"jobs": jobs, "keys_per_job": kpj, "in_flight": jobs * kpj, "chunks": n}
            if runner:
                extra["baseline_parallel"] = par[op]
            report["concurrency"].append(_row(op, chunk, nbytes, times[(op, "tier")], times.get((op, "base"), []),
                                              base, **extra))
        if progress is not None:
            st = report["concurrency"][-2]["gbps"]
            ld = report["concurrency"][-1]["gbps"]
            progress.advance(note=f"{jobs} jobs x {kpj} keys: store {st:.2f} GB/s, load {ld:.2f} GB/s")
    return stored


def _forget(handles: Any, keys: Sequence[bytes]) -> None:
    """Delete the bench's keys through ``AsyncTier.delete`` where the tier has it."""
    for h in handles:
        delete = getattr(h.tier, "delete", None)
        run_sync = getattr(h.tier, "run_sync", None)
        if delete is None or run_sync is None or not inspect.iscoroutinefunction(delete):
            continue

        async def go(delete: Any = delete) -> None:
            sem = asyncio.Semaphore(16)

            async def one(k: bytes) -> None:
                async with sem:
                    try:
                        await delete(k)
                    except Exception:
                        pass

            await asyncio.gather(*(one(k) for k in keys))

        try:
            run_sync(go(), timeout=120)
        except Exception:
            pass


def steps(chunk_sizes: Sequence[int], rounds: int, concurrency: Sequence[tuple[int, int]]) -> int:
    """The number of progress steps :func:`run_tier_bench` reports."""
    return len(chunk_sizes) * (rounds + 1) + (len(concurrency) if chunk_sizes else 0)


def _size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`run_tier_bench`'s report."""
    base = report.get("baseline")
    lines = [f"kvtiers bench tier {report['tier']}: median of {report['rounds']} interleaved rounds, "
             f"baseline: {base or 'none (the tier offers none)'}"]
    variants = any(r.get("variant") for r in report["results"])
    lines.append(f"{'op':<6} {'chunk':>8} " + (f"{'variant':<12} " if variants else "")
                 + f"{'tier GB/s':>10} {'raw GB/s':>9} {'ratio':>7}")
    for r in report["results"]:
        raw = f"{r['baseline_gbps']:>9.3f}" if r["baseline_gbps"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:>6.2f}x" if r["ratio"] is not None else f"{'-':>7}"
        var = f"{r.get('variant', ''):<12} " if variants else ""
        lines.append(f"{r['op']:<6} {_size(r['chunk_bytes']):>8} {var}{r['gbps']:>10.3f} {raw} {ratio}")
    if report["concurrency"]:
        cvar = any(r.get("variant") for r in report["concurrency"])
        lines.append("")
        lines.append(f"{'op':<6} {'chunk':>8} " + (f"{'variant':<12} " if cvar else "")
                     + f"{'jobs x keys':>12} {'tier GB/s':>10} {'raw GB/s':>9} {'ratio':>7}")
        for r in report["concurrency"]:
            raw = f"{r['baseline_gbps']:>9.3f}" if r["baseline_gbps"] is not None else f"{'-':>9}"
            ratio = f"{r['ratio']:>6.2f}x" if r["ratio"] is not None else f"{'-':>7}"
            jk = f"{r['jobs']} x {r['keys_per_job']}"
            var = f"{r.get('variant', ''):<12} " if cvar else ""
            lines.append(f"{r['op']:<6} {_size(r['chunk_bytes']):>8} {var}{jk:>12} {r['gbps']:>10.3f} {raw} {ratio}")
    lines.append("")
    for lk in report["lookup"]:
        var = f" ({lk['variant']})" if lk.get("variant") else ""
        lines.append(f"lookup {_size(lk['chunk_bytes']):>8}{var}: {lk['keys_per_s'] / 1e6:.2f} M keys/s in batches "
                     f"of {lk['batch']} (dict membership {lk['baseline_keys_per_s'] / 1e6:.2f} M keys/s), "
                     f"first batch resolved in {lk['resolve_ms']:.1f} ms")
    for s in report["submit_latency_us"]:
        var = f" ({s['variant']})" if s.get("variant") else ""
        lines.append(f"submit_{s['op']:<5} {_size(s['chunk_bytes']):>8}{var}: median {s['median']:.0f} us, "
                     f"p99 {s['p99']:.0f} us, max {s['max']:.0f} us ({s['keys_per_job']}-key jobs)")
    return "\n".join(lines)
