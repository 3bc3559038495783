"""``kvtiers fs churn``: the fs tier's store rate under sustained eviction.

One bounded fs tier (``--bound-chunks`` chunks of ``--chunk-bytes``) stores distinct keys in
jobs of ``--job-keys`` keys, so once it is full every stored key evicts one. The store rate
(keys/s) is measured over ``--window`` keys right after the first mark (10 000 evictions by
default) and right after the last (``--evictions``), in the same process and tier, and the
ratio printed: a tier that keeps its speed under churn reads about 1. Along the way it
prints the rate of every window, the process's RSS and the index's memory for recent drops.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable

import click


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _ring_bytes(dropped) -> int:
    """Memory of the index's record of recent drops (a :class:`DropRing`)."""
    return int(sum(getattr(dropped, a).nbytes for a in ("fp", "at") if hasattr(dropped, a)))


def run_churn(root: str, *, evictions: int, first: int = 10_000, window: int = 20_000, bound_chunks: int = 64,
              chunk_bytes: int = 4096, job_keys: int = 64, echo: Callable[[str], None] = print) -> dict:
    """Store distinct keys into a bounded fs tier under ``root`` until ``evictions`` keys
    were evicted plus one more ``window``; return the store rates after ``first`` and
    after ``evictions`` evictions (keys/s over ``window`` keys each) and their ratio."""
    from kvtiers import Arena, Job, Namespace, TierContext

    from . import layout
    from .tier import FsTier

    if not 0 < first < evictions:
        raise ValueError(f"need 0 < first ({first}) < evictions ({evictions})")
    if window < job_keys or bound_chunks < job_keys:
        raise ValueError(f"window ({window}) and bound_chunks ({bound_chunks}) must be >= job_keys ({job_keys})")
    arena = Arena.allocate(job_keys, chunk_bytes)
    evicted = [0]

    def removed(keys, why):
        if why == "evicted":
            evicted[0] += len(keys)

    ctx = TierContext(arena, Namespace({"model": "kvtiers-fs-churn", "chunk_bytes": chunk_bytes}), removed=removed)
    tier = FsTier(ctx, root_dir=root, max_bytes=bound_chunks * layout.file_bytes(chunk_bytes), rescan_seconds=None,
                  snapshot_seconds=None)
    out: dict = {"bound_chunks": bound_chunks, "chunk_bytes": chunk_bytes, "job_keys": job_keys, "window": window}
    marks = {"after_first": first, "after_last": evictions}
    rates: dict[str, float] = {}
    windows = []
    try:
        if not tier.scanned.wait(60):
            raise RuntimeError(f"the tier under {root} did not finish its first listing in 60 s")
        slots = tuple(range(job_keys))
        for s in slots:
            arena[s][:8] = s.to_bytes(8, "little")
        stored, job_id = 0, 0
        measuring: tuple[str, int, float] | None = None  # (mark, keys stored at its start, its start time)
        w_start, w_keys = time.perf_counter(), 0
        while True:
            if measuring is None:
                for name, at in marks.items():
                    if name not in rates and evicted[0] >= at:
                        measuring = (name, stored, time.perf_counter())
                        break
            job_id += 1
            keys = tuple(b"churn-%d" % (stored + j) for j in range(job_keys))
            tier.submit_store(Job(job_id, keys, slots))
            while True:
                done = tier.get_finished_jobs()
                if done:
                    break
                time.sleep(0.0002)
            if not done[0].ok:
                raise RuntimeError(f"store failed: {done[0].error}")
            stored += job_keys
            now = time.perf_counter()
            if measuring is not None and stored - measuring[1] >= window:
                name, at, t0 = measuring
                rates[name] = (stored - at) / (now - t0)
                echo(f"{name.replace('_', ' ')} ({marks[name]} evictions): {rates[name]:.0f} keys/s")
                measuring = None
                if len(rates) == len(marks):
                    break
            if stored - w_keys >= window:
                rate = (stored - w_keys) / (now - w_start)
                windows.append({"stored": stored, "evictions": evicted[0], "keys_per_s": round(rate, 1),
                                "rss_bytes": _rss_bytes()})
                echo(f"stored {stored:>9}  evictions {evicted[0]:>9}  {rate:8.0f} keys/s  "
                     f"RSS {_rss_bytes() / 2**20:6.1f} MiB")
                w_start, w_keys = now, stored
        out.update(stored=stored, evictions=evicted[0], windows=windows,
                   rate_after_first=round(rates["after_first"], 1), rate_after_last=round(rates["after_last"], 1),
                   first=first, last=evictions, ratio=round(rates["after_last"] / rates["after_first"], 3),
                   dropped_ring_bytes=_ring_bytes(tier.index.dropped))
    finally:
        tier.close()
        tier.get_finished_jobs()
    return out


@click.command(name="churn")
@click.option("--dir", "where", type=click.Path(file_okay=False), default=None,
              help="Where the tier's root goes (default: a temporary directory, removed after).")
@click.option("--evictions", type=click.IntRange(2), default=1_000_000, show_default=True,
              help="Evictions before the second measured window.")
@click.option("--first", type=click.IntRange(1), default=10_000, show_default=True,
              help="Evictions before the first measured window.")
@click.option("--window", type=click.IntRange(1), default=20_000, show_default=True,
              help="Keys stored per measured window.")
@click.option("--bound-chunks", type=click.IntRange(1), default=64, show_default=True,
              help="max_bytes, in chunks.")
@click.option("--chunk-bytes", type=click.IntRange(4096), default=4096, show_default=True,
              help="Slot size (a multiple of 4096).")
@click.option("--job-keys", type=click.IntRange(1), default=64, show_default=True, help="Keys per store job.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (progress to stderr).")
def churn(where: str | None, evictions: int, first: int, window: int, bound_chunks: int, chunk_bytes: int,
          job_keys: int, as_json: bool) -> None:
    """Store rate of a bounded fs tier after FIRST and after EVICTIONS evictions, one run."""
    if chunk_bytes % 4096:
        raise click.BadParameter(f"{chunk_bytes} is not a multiple of 4096", param_hint="--chunk-bytes")
    echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    opts = dict(evictions=evictions, first=first, window=window, bound_chunks=bound_chunks,
                chunk_bytes=chunk_bytes, job_keys=job_keys, echo=echo)
    try:
        if where is not None:
            os.makedirs(where, exist_ok=True)
            res = run_churn(where, **opts)
        else:
            with tempfile.TemporaryDirectory(prefix="kvtiers-fs-churn-") as tmp:
                res = run_churn(tmp, **opts)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(res, indent=1))
    else:
        click.echo(f"store rate after {res['last']} evictions / after {res['first']}: {res['ratio']:.2f}x "
                   f"({res['rate_after_last']:.0f} / {res['rate_after_first']:.0f} keys/s); "
                   f"recent drops held in {res['dropped_ring_bytes'] // 1024} KiB")

