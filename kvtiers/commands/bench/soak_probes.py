"""What ``kvtiers bench tier --soak`` samples besides its own counters: a process's RSS, open
file descriptors and threads (``/proc/self``, else psutil, else nothing), and the bytes an fs
tier's namespace directory holds on disk (a walk)."""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["fs_usage", "process_stats"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_stats() -> dict[str, int | None]:
    """``{"rss": bytes, "fds": open fds, "threads": n}`` of this process; ``None`` for what
    neither ``/proc`` nor psutil can say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE
        fds = len(os.listdir("/proc/self/fd")) - 1  # the listing's own descriptor
        with open("/proc/self/status", "rb") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith(b"Threads:"))
        return {"rss": rss, "fds": fds, "threads": threads}
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return {"rss": None, "fds": None, "threads": None}
    p = psutil.Process()
    num_fds = getattr(p, "num_fds", None)
    return {"rss": p.memory_info().rss, "fds": num_fds() if num_fds else None, "threads": p.num_threads()}


def fs_usage(nsdir: str) -> dict[str, Any]:
    """Walk an fs tier's namespace directory: ``chunk_bytes`` (the apparent size of its
    ``.bin`` chunk files, what ``max_bytes`` bounds), ``temp_bytes`` (``.tmp`` files: stores
    in flight), ``disk_bytes`` (blocks allocated to everything under it, directories, the
    index snapshot and lock files included), ``files`` and ``walk_s``. Files that vanish
    while it walks are skipped."""
    t0 = time.perf_counter()
    chunk = temp = disk = files = 0
    stack = [nsdir]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                disk += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                    continue
                files += 1
                if e.name.endswith(".bin"):
                    chunk += st.st_size
                elif e.name.endswith(".tmp"):
                    temp += st.st_size
    return {"chunk_bytes": chunk, "temp_bytes": temp, "disk_bytes": disk, "files": files,
            "walk_s": round(time.perf_counter() - t0, 4)}
