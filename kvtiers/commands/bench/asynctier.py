"""``kvtiers bench asynctier``: what :class:`kvtiers.AsyncTier` itself costs per key.

A tier whose coroutines do no I/O (``put`` keeps nothing, ``get_into`` writes nothing,
both return at once) runs jobs of ``--keys`` keys, stores and loads alternating, one job
in flight at a time, through the hooks as an engine calls them: ``submit_store`` /
``submit_load``, then ``get_finished_jobs`` polled until the job is reported. The time from
submit to report, divided by the job's keys, is the base class's cost per key (job
tracking, the concurrency limit, timeouts, the I/O-loop round trip). ``per-key`` runs the
per-key coroutines; ``batch`` the same tier with ``put_many``/``get_many_into`` instead.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence

import click

from ...asynctier import AsyncTier
from ...types import Arena, Job, TierContext

SLOT_BYTES = 4096
POLL_S = 20e-6  # between two get_finished_jobs calls, as an engine's step loop would


class NullTier(AsyncTier):
    """Coroutines that do no I/O: what is left to measure is the base class."""

    async def exists(self, key: bytes) -> bool:
        return True

    async def put(self, key: bytes, data: memoryview) -> None:
        return None

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        return True


class NullBatchTier(NullTier):
    """The same, with one batch call per job instead of one coroutine per key."""

    async def put_many(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        return None

    async def get_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        return None


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(mode: str = "per-key", keys: int = 512, jobs: int = 200, warmup: int = 20) -> dict:
    """Run ``jobs`` timed jobs of ``keys`` keys on a no-I/O tier; return µs per key figures."""
    cls = NullBatchTier if mode == "batch" else NullTier
    tier = cls(TierContext(Arena.allocate(keys, SLOT_BYTES)))
    slots = tuple(range(keys))
    samples: dict[str, list[float]] = {"store": [], "load": []}
    try:
        for n in range(warmup + jobs):
            op = "store" if n % 2 == 0 else "load"
            job = Job(n, tuple(b"k%07d-%d" % (i, n // 2) for i in range(keys)), slots)
            submit = tier.submit_store if op == "store" else tier.submit_load
            t0 = time.perf_counter()
            submit(job)
            while not (done := tier.get_finished_jobs()):
                time.sleep(POLL_S)
            took = time.perf_counter() - t0
            (r,) = done
            if not r.ok:
                raise RuntimeError(f"bench job {n} failed: {r.error}")
            if n >= warmup:
                samples[op].append(took / keys * 1e6)
    finally:
        tier.close()
    both = samples["store"] + samples["load"]
    out = {"mode": mode, "keys_per_job": keys, "jobs": jobs}
    for name, vals in (("store", samples["store"]), ("load", samples["load"]), ("all", both)):
        out[name] = {
            "median_us_per_key": round(statistics.median(vals), 3),
            "p99_us_per_key": round(_percentile(vals, 0.99), 3),
        }
    return out


@click.command("asynctier")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--keys", type=click.IntRange(1, 4096), default=512, show_default=True, help="Keys per job.")
@click.option("--jobs", type=click.IntRange(2, None), default=200, show_default=True,
              help="Timed jobs per mode (stores and loads alternating).")
@click.option("--mode", type=click.Choice(["per-key", "batch", "both"]), default="both", show_default=True,
              help="Per-key coroutines, the batch coroutines, or both.")
def asynctier(as_json: bool, keys: int, jobs: int, mode: str) -> None:
    """Cost per key of the AsyncTier base class, on a tier that does no I/O."""
    modes = ("per-key", "batch") if mode == "both" else (mode,)
    results = [measure(m, keys=keys, jobs=jobs) for m in modes]
    if as_json:
        click.echo(json.dumps({"results": results}, indent=1))
        return
    click.echo(f"kvtiers bench asynctier: no-I/O tier, {keys}-key jobs, {jobs} jobs per mode, "
               "submit to report")
    click.echo(f"{'mode':<8} {'op':<6} {'median us/key':>14} {'p99 us/key':>11}")
    for r in results:
        for op in ("store", "load", "all"):
            f = r[op]
            click.echo(f"{r['mode']:<8} {op:<6} {f['median_us_per_key']:>14.2f} {f['p99_us_per_key']:>11.2f}")
