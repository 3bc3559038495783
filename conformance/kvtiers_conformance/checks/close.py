"""Rule 9: close finishes every accepted job, hands over the results, leaves nothing behind."""

from __future__ import annotations

import os
import pathlib
import re
import threading
import time

from kvtiers.ioloop import get_loop, is_io_thread

from ..harness import Harness, fail
from ..rules import check

TEMP_NAME = re.compile(r"(?i)(tmp|temp|\.part(ial)?$|~$|-journal$|-wal$|-shm$|\.lock$)")


def _fds() -> set[str]:
    """Open fds (the one listing the directory is gone by the time we readlink)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: no fd check
        return set()
    return {fd for fd in names if _fd_target(fd) != "?"}


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _threads() -> set[threading.Thread]:
    """Threads, less the SDK's I/O thread and its loop's default executor ("asyncio_N",
    process-wide, used by e.g. getaddrinfo)."""
    return {t for t in threading.enumerate() if not is_io_thread(t) and not t.name.startswith("asyncio_")}


def _files(roots: list[pathlib.Path]) -> set[pathlib.Path]:
    return {pathlib.Path(d, n) for r in roots for d, _, names in os.walk(r) for n in names}


@check(9, "clean_close")
def clean_close(h: Harness) -> None:
    """close with jobs in flight: all reported by one more poll; no thread, fd or temp file left."""
    get_loop()  # the SDK's own I/O loop and its fds exist before we count
    h.open().close()  # a first instance may start process-wide things (pools, caches)
    threads0, fds0 = _threads(), _fds()
    roots0 = h.path_roots()
    files0 = _files(roots0)
    t = h.open()
    keys = h.keys(64, b"Z")
    t.store_many(keys[:16])
    for i in range(16, 64, 8):
        t.submit("store", keys[i:i + 8])
    for i in range(0, 16, 4):
        t.submit("load", keys[i:i + 4])
    t.close()  # the harness fails unless one get_finished_jobs after close reports them all
    t.poll()  # nothing more may come after the hand-over (a duplicate fails in the harness)
    deadline = time.monotonic() + h.limits.close_grace_s
    while True:
        left = [x for x in _threads() - threads0 if x.is_alive()]
        fds = _fds() - fds0
        if not left and not fds:
            break
        if time.monotonic() > deadline:
            if left:
                fail(f"rule 9: close left thread {left[0].name!r} running"
                     + (" (daemon)" if left[0].daemon else "") + (f" (+{len(left) - 1} more)" if len(left) > 1 else ""))
            fd = sorted(fds, key=int)[0]
            fail(f"rule 9: close left {len(fds)} file descriptor(s) open, e.g. fd {fd} -> {_fd_target(fd)}")
        time.sleep(0.02)
    roots = h.path_roots() or roots0
    temps = [p for p in _files(roots) - files0 if TEMP_NAME.search(p.name)]
    if temps:
        fail(f"rule 9: close left temporary file(s), e.g. {temps[0]}")
