"""The life of vLLM's offload region in ``/dev/shm``: no file left behind, however vLLM stops.

vLLM's tiering spec keeps its CPU primary tier in ``/dev/shm/vllm_offload_<engine id>.mmap``,
mapped by each worker (the rows they fill) and by the scheduler (the rows the tiers read).
vLLM removes the file in the creator's clean-up; ``vllm serve`` stopped by SIGTERM force-kills
its engine process after a short timeout, and SIGKILL runs no clean-up at all, so the file,
as large as ``cpu_bytes_to_use``, stays in RAM until someone deletes it.

Two measures, both in :class:`~.spec.KvtiersOffloadingSpec`:

- :func:`unlink_when_mapped`: once the scheduler has mapped the region, and every worker of
  this node has too (vLLM sets its workers' KV caches up before it builds the scheduler), the
  path is unlinked. The mappings stay valid, and the kernel frees the memory when the last
  process holding one exits, however it exits. Where the mappings cannot all be seen (workers
  on other nodes), the file is left alone.
- :func:`sweep_stale_regions`: at start-up, regions of this user, a minute old or more, that
  no live process holds open or mapped (their owners were killed before the first measure
  ran) are removed. Only processes visible here count: a container sharing ``/dev/shm`` with
  another PID namespace would see another namespace's regions as unheld.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("kvtiers.integrations.vllm")

__all__ = ["PATTERN", "region_paths", "sweep_stale_regions", "unlink_when_mapped",
           "watch_region"]

#: the files vLLM's ``SharedOffloadRegion`` makes (``.mmap`` and, in vLLM 0.33, ``.mmap.<i>`` segments)
PATTERN = "/dev/shm/vllm_offload_*.mmap*"
#: a file younger than this is never swept (its creator may be between ``open`` and ``mmap``)
GRACE_S = 60.0

# regions opened in this process by kvtiers' worker: told when their path is gone, so their
# clean-up does not try to remove it again
_regions: weakref.WeakSet[Any] = weakref.WeakSet()


def region_paths(region: Any) -> list[str]:
    """Every file behind a vLLM ``SharedOffloadRegion`` (one, or vLLM 0.33's segments)."""
    segments = getattr(region, "_segments", None)
    if segments:
        return [s[0] for s in segments]
    return [region.mmap_path]


def watch_region(region: Any) -> None:
    """Remember a region this process opened, for :func:`unlink_when_mapped`."""
    _regions.add(region)


def _pids() -> Iterator[str]:
    return (p for p in os.listdir("/proc") if p.isdigit())


def _mappings(path: str, ino: int) -> int:
    """How many mappings of file ``path`` (inode ``ino``) from its start live processes hold."""
    n = 0
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if path not in line:
                        continue
                    parts = line.split(None, 5)
                    if len(parts) == 6 and int(parts[4]) == ino and int(parts[2], 16) == 0:
                        n += 1
        except (OSError, ValueError):
            continue
    return n


def unlink_when_mapped(region: Any, mappers: int) -> bool:
    """Unlink the region's files if ``mappers`` mappings of it (the scheduler's and each local
    worker's) are live; True if it did. The memory lives on until the last mapping goes."""
    path = region.mmap_path
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    seen = _mappings(path, ino)
    if seen < mappers:
        log.info("kvtiers: %s has %d of %d mappings here (workers on other nodes?): left for vLLM's clean-up",
                 path, seen, mappers)
        return False
    for p in region_paths(region):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    for r in [region, *_regions]:
        if getattr(r, "mmap_path", None) == path:
            r._creator = False  # nothing left for its clean-up to remove
    log.info("kvtiers: unlinked %s: mapped by the scheduler and %d worker(s), freed when the last exits",
             path, mappers - 1)
    return True


def _held() -> tuple[set[tuple[int, int]], bool]:
    """``(device, inode)`` of every ``/dev/shm`` file a live process holds open or mapped, and
    whether the open files of every process that could hold this user's files were readable
    (vLLM keeps a region's file open as long as it maps it, so open files decide; mappings,
    where readable, are counted too)."""
    held: set[tuple[int, int]] = set()
    complete = True
    me = os.getuid()
    for pid in _pids():
        base = f"/proc/{pid}"
        try:
            fds = os.listdir(f"{base}/fd")
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            try:
                if os.stat(base).st_uid in (0, me):
                    complete = False
            except OSError:
                pass
            continue
        for fd in fds:
            try:
                if os.readlink(f"{base}/fd/{fd}").startswith("/dev/shm/"):
                    st = os.stat(f"{base}/fd/{fd}")
                    held.add((st.st_dev, st.st_ino))
            except OSError:
                continue
        try:
            with open(f"{base}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        parts = line.split(None, 5)
                        if len(parts) == 6:
                            major, minor = (int(x, 16) for x in parts[3].split(":"))
                            held.add((os.makedev(major, minor), int(parts[4])))
        except OSError:
            continue
    return held, complete


def sweep_stale_regions(pattern: str = PATTERN, grace_s: float = GRACE_S) -> list[str]:
    """Remove this user's vLLM offload regions that no live process holds; the paths removed.

    A region is kept while any process has it open or mapped, while it is younger than
    ``grace_s`` seconds, and whenever a process that could hold it cannot be inspected.
    """
    me, now = os.getuid(), time.time()
    candidates = []
    for p in glob.glob(pattern):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if st.st_uid == me and now - st.st_mtime > grace_s:
            candidates.append((p, st))
    if not candidates:
        return []
    held, complete = _held()
    if not complete:
        log.info("kvtiers: not sweeping %d offload region(s) in /dev/shm: some processes cannot be inspected",
                 len(candidates))
        return []
    held_paths = {p for p, st in candidates if (st.st_dev, st.st_ino) in held}
    removed = []
    for p, _ in candidates:
        if p in held_paths or re.sub(r"\.\d+$", "", p) in held_paths:  # a segment of a region in use
            continue
        try:
            os.unlink(p)
        except OSError:
            continue
        removed.append(p)
    if removed:
        freed = sum(st.st_size for p, st in candidates if p in removed)
        log.warning("kvtiers: removed %d stale vLLM offload region(s) (%.1f MiB) no process held: %s", len(removed),
                    freed / 2**20, ", ".join(Path(p).name for p in removed))
    return removed
