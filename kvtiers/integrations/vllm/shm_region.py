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
  no live process holds (their owners were killed before the first measure ran) are removed.

What decides "no live process holds it", for any user, root or not: the processes that can
hold a region are the engine's own, which run as the region's owner (vLLM creates the file
mode 0600, so no other user's process can open it, and only the owner's regions are swept).
Those are the processes a user can inspect: their open files and mappings in ``/proc``.
Processes of other users (root's included) are not counted, unless the file's mode lets
them open it; a process of this user that cannot be inspected (made non-dumpable) stops the
sweep. And a region someone holds a ``flock`` on is kept: kvtiers' CPU worker takes a shared
one on its region for its life (:func:`watch_region`), and so does the scheduler where it
leaves the file for vLLM's clean-up, so a kvtiers engine's region is kept even where its
processes cannot be seen (another PID namespace sharing ``/dev/shm``). A plain vLLM engine in
another PID namespace takes no lock: its region looks unheld from here.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import re
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtiers.launcher import flock_held  # absolute: this file is also loaded on its own (tests/test_shm_cleanup.py)

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
    """Remember a region this process opened, for :func:`unlink_when_mapped`, and hold a shared
    ``flock`` on its file for as long as the region keeps it open: the sign for any sweep that
    it is in use."""
    _regions.add(region)
    _lock_shared(region)


def _lock_shared(region: Any) -> None:
    fd = getattr(region, "fd", None)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:  # a sweep then goes by the processes it can see
        log.info("kvtiers: could not lock %s as in use: %s", getattr(region, "mmap_path", fd), e)


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
        _lock_shared(region)
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


def _uids(pid: str) -> set[int] | None:
    """The real, effective, saved and file-system user ids of process ``pid`` (its ``status``
    is readable by every user), or None if it exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return {int(x) for x in line.split()[1:]}
    except FileNotFoundError:
        return None
    except OSError:
        pass
    return {-1}  # unreadable: anyone's


def _zombie(pid: str) -> bool:
    """Whether process ``pid`` has ended (a zombie its parent has not reaped yet, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _held() -> tuple[set[tuple[int, int]], bool, bool]:
    """``(device, inode)`` of every ``/dev/shm`` file the processes this user can inspect hold
    open or mapped; whether every process running as this user could be inspected; whether
    every process could (vLLM keeps a region's file open as long as it maps it; segments are
    held by mappings only)."""
    held: set[tuple[int, int]] = set()
    mine_seen = everyone_seen = True
    me = os.getuid()
    for pid in _pids():
        base = f"/proc/{pid}"
        try:
            fds = os.listdir(f"{base}/fd")
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:  # another user's process, one of ours made non-dumpable, or a zombie
            if _zombie(pid):
                continue  # ended: holds no file, no mapping (its /proc entries are root's)
            everyone_seen = False
            uids = _uids(pid)
            if uids is not None and (me in uids or -1 in uids):
                mine_seen = False
            continue
        for fd in fds:  # a link that cannot be read (a sandbox's agent, even to root) is passed over
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
    return held, mine_seen, everyone_seen


def _locked(path: str) -> bool:
    """Whether some process holds a ``flock`` on ``path`` (True where that cannot be told)."""
    try:
        return flock_held(path) is not False
    except FileNotFoundError:
        return False


def sweep_stale_regions(pattern: str = PATTERN, grace_s: float = GRACE_S) -> list[str]:
    """Remove this user's vLLM offload regions that no live process holds; the paths removed.

    A region is kept while it is younger than ``grace_s`` seconds, while a process of this
    user has it open or mapped, while anyone holds a ``flock`` on it, while another user's
    process that its mode lets open it cannot be inspected, and whenever a process of this
    user cannot be inspected (see the module).
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
    held, mine_seen, everyone_seen = _held()
    if not mine_seen:
        log.info("kvtiers: not sweeping %d offload region(s) in /dev/shm: a process of this user cannot be "
                 "inspected", len(candidates))
        return []
    in_use = {p for p, st in candidates
              if (st.st_dev, st.st_ino) in held or (st.st_mode & 0o077 and not everyone_seen) or _locked(p)}
    removed = []
    for p, _ in candidates:
        if p in in_use or re.sub(r"\.\d+$", "", p) in in_use:  # a segment of a region in use
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
