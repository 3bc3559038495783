"""Catch I/O and sleeping on the caller's thread with a ``sys.addaudithook`` (rule 1).

Audit hooks cannot be removed, so one hook is installed on first use and does nothing
unless :func:`watch` is active on the calling thread. It sees what CPython audits:
``open``, directory listings, renames and removals, sockets, subprocesses, SQLite
connections and (from Python 3.12) ``time.sleep``; it does not see ``os.stat``. Sleeps and
I/O it cannot see still show in the timed lookup check.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

WATCHED = frozenset({
    "open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.rmdir",
    "os.truncate", "os.link", "os.symlink", "os.utime", "os.chmod", "shutil.copyfile",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "subprocess.Popen", "os.system", "os.posix_spawn", "os.fork",
    "sqlite3.connect", "time.sleep", "glob.glob",
})

_installed = False
_install_lock = threading.Lock()
_watching: dict[int, list[str]] = {}


def _hook(event: str, args: tuple) -> None:
    if _watching and event in WATCHED:
        seen = _watching.get(threading.get_ident())
        if seen is not None:
            seen.append(f"{event}{_short(args)}")


def _short(args: tuple) -> str:
    text = repr(args)
    return text if len(text) <= 80 else text[:77] + "...)"


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True


@contextmanager
def watch() -> Iterator[list[str]]:
    """Collect the audited I/O events the current thread raises inside the block."""
    _install()
    ident = threading.get_ident()
    seen: list[str] = []
    _watching[ident] = seen
    try:
        yield seen
    finally:
        _watching.pop(ident, None)
