"""What ``kvtiers bench serve --soak`` samples of a running ``vllm serve``: its processes (the
API server, vLLM's engine core and its workers: RSS, open fds, threads, from ``/proc``), the
time-to-first-token quantiles of an interval (from the server's TTFT histogram), and the
offload regions in ``/dev/shm``."""

from __future__ import annotations

import glob
import os
from typing import Any

__all__ = ["histogram_quantile", "process_tree", "shm_usage"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: process names (``/proc/PID/comm``, 15 characters) vLLM gives its engine core and workers
ENGINE_CORE, WORKER = "VLLM::EngineCor", "VLLM::Worker"


def _proc(pid: int) -> dict[str, Any] | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status", "rb") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith(b"Threads:"))
        with open(f"/proc/{pid}/comm", "rb") as f:
            comm = f.read().decode(errors="replace").strip()
        return {"pid": pid, "comm": comm, "rss": rss, "fds": fds, "threads": threads}
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(d))
    return out


def process_tree(api_pid: int) -> dict[str, Any]:
    """``{"api": stats, "engine_core": stats or None, "workers": [stats...]}`` of the server
    whose API process is ``api_pid`` (each ``{"pid", "comm", "rss", "fds", "threads"}``)."""
    kids = _children()
    out: dict[str, Any] = {"api": _proc(api_pid), "engine_core": None, "workers": []}
    stack = list(kids.get(api_pid, ()))
    while stack:
        pid = stack.pop()
        st = _proc(pid)
        stack.extend(kids.get(pid, ()))
        if st is None:
            continue
        if st["comm"].startswith(ENGINE_CORE):
            out["engine_core"] = st
        elif st["comm"].startswith(WORKER):
            out["workers"].append(st)
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The ``q`` quantile of what histogram ``name`` observed between two scrapes
    (:func:`kvtiers.commands.bench.serve_metrics.parse` dicts), linear within a bucket as
    Prometheus' ``histogram_quantile`` does; None if it observed nothing."""
    buckets: list[tuple[float, float]] = []
    for key, v in after.items():
        if not key.startswith(name + "_bucket{"):
            continue
        le = next((p.split("=", 1)[1] for p in key[len(name) + 8:-1].split(",") if p.startswith("le=")), None)
        if le is None:
            continue
        bound = float("inf") if le in ("+Inf", "inf") else float(le)
        buckets.append((bound, v - before.get(key, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def shm_usage(pattern: str = "/dev/shm/vllm_offload_*") -> dict[str, int]:
    """Offload regions in ``/dev/shm`` (files, bytes allocated) and the bytes ``/dev/shm`` uses
    in all (``used``; 0 where it is not a file system here)."""
    files = glob.glob(pattern)
    nbytes = 0
    for p in files:
        try:
            nbytes += os.stat(p).st_blocks * 512
        except OSError:
            pass
    try:
        st = os.statvfs(os.path.dirname(pattern))
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
    except OSError:
        used = 0
    return {"regions": len(files), "region_bytes": nbytes, "used": used}
