"""``kvtiers bench tier TYPE --soak DURATION``: a tier under sustained churn at a bound.

``processes`` worker processes (:mod:`kvtiers.commands.bench.soak_worker`) open the tier on
one backend, in one namespace, with ``max_bytes`` set to the bound, and repeat for the whole
duration: store a job of fresh keys (so every store past the bound evicts), look up the last
``lookup_batch`` keys stored, load the previous job back and check every byte. Every
``interval`` each process reports what it did; this module adds the rows up, one per
interval, and closes with the ratio of the last interval's rates to the first's and how RSS,
open fds and threads grew. Flat lines are the goal.

Bytes on the backend: for the fs tier, a walk of the namespace directory by process 0 at the
end of each interval, between its steps (so with one process nothing of it is in flight: an
exact at-rest figure; with several, the others keep writing during the walk); the walk's time
is charged to no interval. For any other tier: the keys the processes stored minus those the
tier reported through ``ctx.removed``, times the chunk size (exact for a tier that reports
every removal, as the memory tier does), with the tier's ``backlog``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import ConfigError, TierError
from ...options import tier_options
from ...registry import get_registry
from ...types import Namespace
from .harness import _size, default_options

__all__ = ["format_header", "format_row", "format_summary", "parse_duration", "run_soak"]

DEFAULT_INTERVAL_S = 10.0
BOUND_CHUNKS = 256  # the default bound, in chunks, when neither --max-bytes nor the config sets one
READY_TIMEOUT_S = 120.0
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float) -> float:
    """``90``, ``60s``, ``10m``, ``1.5h``, ``1h30m`` -> seconds (> 0)."""
    if isinstance(text, int | float):
        secs = float(text)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", str(text).strip().lower())
        rebuilt = "".join(f"{n}{u}" for n, u in parts)
        if not parts or rebuilt != re.sub(r"\s+", "", str(text).lower()) or \
                (len(parts) > 1 and not all(u for _, u in parts)):
            raise ValueError(f"{text!r} is not a duration (e.g. 90, 60s, 10m, 1h30m)")
        secs = sum(float(n) * _UNITS[u] for n, u in parts)
    if secs <= 0:
        raise ValueError(f"a duration must be > 0, got {text!r}")
    return secs


def _plan(tier_type: str, options: dict[str, Any], chunk_bytes: int, max_bytes: int | None, keys_per_job: int,
          processes: int) -> tuple[Any, dict[str, Any], int, int]:
    """The tier class, the options with ``max_bytes`` set, the bound and the keys per job."""
    info = get_registry().tier_info(tier_type)
    if chunk_bytes <= 0 or chunk_bytes % 4096:
        raise ValueError(f"--chunk-bytes must be a positive multiple of 4096, got {chunk_bytes}")
    if "max_bytes" not in tier_options(info.cls):
        raise ConfigError(f"tier {info.name!r} takes no max_bytes option: --soak stores and evicts at a bound")
    if processes > 1 and "shared" not in info.levels:
        raise ConfigError(f"tier {info.name!r} does not claim the 'shared' level: --processes {processes} needs a "
                          "backend that several processes share")
    if max_bytes is not None and options.get("max_bytes") not in (None, max_bytes):
        raise ConfigError(f"--max-bytes {max_bytes} and the config's max_bytes {options['max_bytes']} differ: "
                          "give one")
    bound = max_bytes or options.get("max_bytes") or BOUND_CHUNKS * chunk_bytes
    if bound < 4 * chunk_bytes:
        raise ConfigError(f"the bound ({bound} bytes) must hold at least 4 chunks of {chunk_bytes} bytes")
    kpj = max(1, min(keys_per_job, bound // chunk_bytes // 4))  # the previous job is still there to load
    return info, {**options, "max_bytes": bound}, bound, kpj


class _Worker:
    """A soak process: its Popen, its stderr file, and a thread that queues its JSON lines."""

    def __init__(self, index: int, spec: dict[str, Any], lines: queue.Queue) -> None:
        self.index = index
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtiers.commands.bench.soak_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.proc.stdin.write(json.dumps({**spec, "index": index}) + "\n")
        self.proc.stdin.flush()
        self.reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        self.reader.start()

    def _read(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:
            try:
                lines.put((self.index, json.loads(line)))
            except ValueError:
                lines.put((self.index, {"error": f"not JSON on stdout: {line.strip()[:200]}"}))
        lines.put((self.index, None))

    def send(self, obj: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        text = self.stderr.read().strip().splitlines()
        return " | ".join(text[-3:])

    def stop(self) -> None:
        """End the process if it still runs: SIGTERM (it closes its tier), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # one still waiting for its start reads the end of input
            except OSError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self.stderr.close()


def run_soak(tier_type: str, options: dict[str, Any] | None, *, duration: float, interval: float | None = None,
             processes: int = 1, chunk_bytes: int = 64 << 10, max_bytes: int | None = None,
             keys_per_job: int = 64, lookup_batch: int = 1000,
             on_row: Callable[[dict[str, Any]], None] | None = None,
             on_start: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Soak ``tier_type`` for ``duration`` seconds from ``processes`` processes on one
    backend (``options``; None or empty: the tier's ``conformance_config`` in a scratch
    directory) at the bound ``max_bytes`` (default: the config's, else 256 chunks).
    ``interval``: seconds per row (default 10, or a quarter of a shorter soak).
    ``on_start(report)`` is called with the report's head before the processes start,
    ``on_row(row)`` with each interval's row as it completes. Returns the report
    (``intervals``: the rows; ``summary``: last against first)."""
    if processes < 1:
        raise ValueError("--processes must be >= 1")
    interval = interval or min(DEFAULT_INTERVAL_S, duration / 4)
    if interval <= 0 or interval > duration:
        raise ValueError(f"--interval must be > 0 and at most the soak's duration ({duration:g} s)")
    n = max(1, round(duration / interval))
    scratch = None
    if not options:
        scratch = tempfile.TemporaryDirectory(prefix="kvtiers-soak-")
        options = default_options(tier_type, scratch.name)
    try:
        info, opts, bound, kpj = _plan(tier_type, dict(options), chunk_bytes, max_bytes, keys_per_job, processes)
        ns = Namespace({"kvtiers_bench": info.name, "soak": True, "chunk_bytes": chunk_bytes,
                        "run": secrets.token_hex(4)})
        is_fs = info.cls.__module__.split(".")[0] == "kvtiers_fs"
        walk = os.path.join(os.path.abspath(opts["root_dir"]), ns.digest) if is_fs else None
        backend = (f"fs walk of {walk} by process 0 between its steps (.bin chunk files + .tmp stores in flight)"
                   if is_fs else "keys stored minus keys reported through ctx.removed, x chunk bytes")
        spec = {"tier": tier_type, "options": opts, "namespace": ns.fields, "chunk_bytes": chunk_bytes,
                "keys_per_job": kpj, "lookup_batch": lookup_batch, "interval": interval, "intervals": n,
                "walk": walk}
        report: dict[str, Any] = {
            "tier": info.name, "mode": "soak", "processes": processes, "duration_s": round(n * interval, 3),
            "interval_s": interval, "chunk_bytes": chunk_bytes, "keys_per_job": kpj, "lookup_batch": lookup_batch,
            "bound_bytes": bound, "namespace": ns.digest, "backend": backend, "intervals": [], "processes_end": [],
            "errors": [],
        }
        if on_start is not None:
            on_start(report)
        _run_workers(spec, processes, n, interval, report, on_row)
    finally:
        if scratch is not None:
            scratch.cleanup()
    report["summary"] = summarize(report)
    return report


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminated_is_interrupt() -> Iterator[None]:
    """While inside: a SIGTERM of this process raises KeyboardInterrupt, as Ctrl-C does, so a
    soak ends early through its own cleanup (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_workers(spec: dict[str, Any], processes: int, n: int, interval: float, report: dict[str, Any],
                 on_row: Callable[[dict[str, Any]], None] | None) -> None:
    """Start the processes, add up their rows as they come, stop them whatever happens (a
    SIGTERM of this process too: they close their tiers)."""
    lines: queue.Queue = queue.Queue()
    workers: list[_Worker] = []
    with terminated_is_interrupt():
        try:
            for i in range(processes):
                workers.append(_Worker(i, spec, lines))
            ready: dict[int, dict[str, Any]] = {}
            while len(ready) < processes:
                idx, msg = _next(lines, READY_TIMEOUT_S, workers, "to open the tier")
                ready[idx] = msg or {}
            start = time.time() + 0.2
            for w in workers:
                w.send({"start": start})
            pending: dict[int, dict[int, dict[str, Any]]] = {}
            done: dict[int, dict[str, Any]] = {}
            emitted = 0
            while len(done) < processes:
                idx, msg = _next(lines, max(120.0, 6 * interval), workers, "for an interval's report", done)
                if msg is None:  # the end of the output of a process that said it was done
                    continue
                if msg.get("done"):
                    done[idx] = msg
                    continue
                pending.setdefault(msg["i"], {})[idx] = msg
                while len(pending.get(emitted, {})) == processes:
                    row = combine(emitted, pending.pop(emitted), report)
                    report["intervals"].append(row)
                    if on_row is not None:
                        on_row(row)
                    emitted += 1
            for w in workers:
                if w.proc.wait(60) != 0:
                    raise TierError(f"soak process {w.index} exited with {w.proc.returncode}: {w.stderr_tail()}")
            report["processes_end"] = [{k: done[i].get(k) for k in ("close_s", "errors", "rss", "fds", "threads")}
                                       for i in range(processes)]
            report["errors"] = [f"process {i}: {e}" for i in range(processes) for e in done[i].get("errors") or []]
        finally:
            for w in workers:
                w.stop()


def _next(lines: queue.Queue, timeout: float, workers: list[_Worker], what: str,
          done: dict[int, Any] | None = None) -> tuple[int, dict[str, Any] | None]:
    """The next message of any worker (None: the end of the output of one in ``done``); a
    worker's error, death or silence raises."""
    try:
        idx, msg = lines.get(timeout=timeout)
    except queue.Empty:
        raise TierError(f"soak: no word from the tier's processes for {timeout:.0f} s waiting {what}") from None
    if msg is None and done is not None and idx in done:
        return idx, None
    if msg is None or "error" in msg:
        w = workers[idx]
        try:
            w.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        why = msg["error"] if msg else f"exited with {w.proc.returncode}"
        tail = w.stderr_tail()
        raise TierError(f"soak process {idx}: {why}" + (f" ({tail})" if tail and msg is None else ""))
    return idx, msg


def combine(i: int, rows: dict[int, dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
    """One interval's row from each process's: counts added up, rates over each process's
    own interval (the longest), per-process RSS, fds and threads, bytes on the backend."""
    per = [rows[k] for k in sorted(rows)]
    secs = max(r["seconds"] for r in per) or 1e-9
    tot = {k: sum(r[k] for r in per) for k in ("stored", "store_failed", "loaded", "load_failed", "wrong",
                                               "lookups", "lookup_hits", "backlog", "live_bytes")}
    lookup_s = sum(r["lookup_s"] for r in per)
    removed = sum(r["removed_total"] for r in per)
    prev_removed = report["intervals"][-1]["removed_total"] if report["intervals"] else 0
    chunk = report["chunk_bytes"]
    t_end = max(r["t"] for r in per)
    row: dict[str, Any] = {
        "i": i, "t": round(t_end, 3), "seconds": round(secs, 4), **tot,
        "store_keys_per_s": round(tot["stored"] / secs, 1), "load_keys_per_s": round(tot["loaded"] / secs, 1),
        "store_gbps": round(tot["stored"] * chunk / secs / 1e9, 4),
        "load_gbps": round(tot["loaded"] * chunk / secs / 1e9, 4),
        "lookup_keys_per_s": round(tot["lookups"] / lookup_s) if lookup_s else None,
        "lookup_hit_fraction": round(tot["lookup_hits"] / tot["lookups"], 4) if tot["lookups"] else None,
        "removed_total": removed, "evictions_per_s": round((removed - prev_removed) / secs, 1),
        "removed_by_reason": _sum_dicts(r["removed_by_reason"] for r in per),
        "rss": [r["rss"] for r in per], "fds": [r["fds"] for r in per], "threads": [r["threads"] for r in per],
    }
    fs = per[0].get("fs")
    if fs is not None:
        row["backend_bytes"] = fs["chunk_bytes"] + fs["temp_bytes"]
        row["fs"] = fs
    else:
        row["backend_bytes"] = tot["live_bytes"]
    return row


def _sum_dicts(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Last interval against first: rate ratios; RSS, fds and threads at start and end per
    process; the most bytes seen on the backend; failures."""
    rows = report["intervals"]
    if not rows:
        return {}
    first, last = rows[0], rows[-1]
    out: dict[str, Any] = {
        "intervals": len(rows),
        "store_ratio": _ratio(last["store_keys_per_s"], first["store_keys_per_s"]),
        "load_ratio": _ratio(last["load_keys_per_s"], first["load_keys_per_s"]),
        "lookup_ratio": _ratio(last["lookup_keys_per_s"], first["lookup_keys_per_s"]),
        "evictions_ratio": _ratio(last["evictions_per_s"], first["evictions_per_s"]),
        "first": {k: first[k] for k in ("store_keys_per_s", "load_keys_per_s", "lookup_keys_per_s",
                                        "evictions_per_s")},
        "last": {k: last[k] for k in ("store_keys_per_s", "load_keys_per_s", "lookup_keys_per_s",
                                      "evictions_per_s")},
        "backend_max_bytes": max(r["backend_bytes"] for r in rows), "bound_bytes": report["bound_bytes"],
        "stored": sum(r["stored"] for r in rows), "loaded": sum(r["loaded"] for r in rows),
        "evicted": last["removed_total"],
        "store_failed": sum(r["store_failed"] for r in rows), "load_failed": sum(r["load_failed"] for r in rows),
        "wrong": sum(r["wrong"] for r in rows),
    }
    for k in ("rss", "fds", "threads"):
        out[f"{k}_start"], out[f"{k}_end"] = first[k], last[k]
    out["rss_growth"] = [_ratio(e, s) for s, e in zip(first["rss"], last["rss"], strict=True)]
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def _each(vals: list[Any], fmt: Callable[[Any], str]) -> str:
    return "/".join(fmt(v) for v in vals)


def format_header(report: dict[str, Any]) -> str:
    """The lines above the rows: what runs, and the columns."""
    pro = report["processes"]
    return (f"kvtiers bench tier {report['tier']} --soak {report['duration_s']:g}s: {pro} process(es), "
            f"{_size(report['chunk_bytes'])} chunks, jobs of {report['keys_per_job']} keys, bound "
            f"{_mib(report['bound_bytes'])} MiB, a row every {report['interval_s']:g} s\n"
            f"backend bytes: {report['backend']}\n"
            f"{'t s':>7} {'store k/s':>9} {'load k/s':>8} {'lookup Mk/s':>11} {'hit':>4} {'evict/s':>8} "
            f"{'RSS MiB':>9} {'fds':>5} {'thr':>5} {'backend MiB':>11}")


def format_row(row: dict[str, Any]) -> str:
    """One interval as a line of the table."""
    lk = row["lookup_keys_per_s"]
    hit = row["lookup_hit_fraction"]
    fail = row["store_failed"] + row["load_failed"] + row["wrong"]
    return (f"{row['t']:>7.1f} {row['store_keys_per_s'] / 1e3:>9.2f} {row['load_keys_per_s'] / 1e3:>8.2f} "
            f"{'-' if lk is None else f'{lk / 1e6:.2f}':>11} {'-' if hit is None else f'{hit:.0%}':>4} "
            f"{row['evictions_per_s']:>8.0f} {_each(row['rss'], _mib):>9} {_each(row['fds'], str):>5} "
            f"{_each(row['threads'], str):>5} {_mib(row['backend_bytes']):>11}"
            + (f"  failed {row['store_failed']} stores, {row['load_failed']} loads, {row['wrong']} wrong"
               if fail else ""))


def format_summary(report: dict[str, Any]) -> str:
    """The closing lines: last interval against first, growth, the bound."""
    s = report["summary"]
    if not s:
        return "no interval completed"

    def r(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = [
        f"last/first interval: store {r(s['store_ratio'])} ({s['first']['store_keys_per_s']:.0f} -> "
        f"{s['last']['store_keys_per_s']:.0f} keys/s), load {r(s['load_ratio'])} ({s['first']['load_keys_per_s']:.0f}"
        f" -> {s['last']['load_keys_per_s']:.0f} keys/s), lookup {r(s['lookup_ratio'])}, "
        f"evictions {r(s['evictions_ratio'])}",
        f"RSS MiB {_each(s['rss_start'], _mib)} -> {_each(s['rss_end'], _mib)} "
        f"({_each(s['rss_growth'], lambda g: '-' if g is None else f'{g:.2f}x')}), fds "
        f"{_each(s['fds_start'], str)} -> {_each(s['fds_end'], str)}, threads {_each(s['threads_start'], str)} -> "
        f"{_each(s['threads_end'], str)}",
        f"{s['stored']} keys stored, {s['loaded']} loaded, {s['evicted']} removed by the tier; backend at most "
        f"{_mib(s['backend_max_bytes'])} MiB against a bound of {_mib(s['bound_bytes'])} MiB; failed: "
        f"{s['store_failed']} stores, {s['load_failed']} loads, {s['wrong']} wrong bytes",
    ]
    return "\n".join(lines)
