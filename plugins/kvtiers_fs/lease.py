"""The cleaner's lease of a shared namespace directory: ``<namespace dir>/cleaner.lock``.

Among the bounded instances sharing a root, the one that holds an exclusive ``flock`` on
this file is the cleaner: it lists the directories that changed every ``rescan_seconds`` and
evicts for everyone; the others store and read, and try to take the lease at each of their
``rescan_seconds``, so when the holder dies (the kernel, or the NFS lock manager, drops its
lock) another one takes over within one period. The holder writes ``<pid>@<host>`` into the
file for operators. Where the file system has no locks, every bounded instance is a cleaner
(each lists what changed and evicts from its own view, as before the lease existed).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket

log = logging.getLogger("kvtiers.fs")

NAME = "cleaner.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class Lease:
    """Try-only, never blocking: :meth:`try_take` either gets the lease or returns False."""

    def __init__(self, nsdir: str) -> None:
        self.path = os.path.join(nsdir, NAME)
        self._fd: int | None = None
        self.unsupported = False

    @property
    def held(self) -> bool:
        """Whether this instance is the cleaner (always, where locks are unsupported)."""
        return self._fd is not None or self.unsupported

    def try_take(self) -> bool:
        """Take the lease if nobody holds it; True if this instance holds it now."""
        if self.held:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            log.warning("fs tier: cannot open the cleaner's lease %s: %s", self.path, e)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                log.info("fs tier: no locks on %s: every bounded instance cleans", self.path)
                self.unsupported = True
                return True
            log.warning("fs tier: cannot lock the cleaner's lease %s: %s", self.path, e)
            return False
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return True

    def release(self) -> None:
        """Give the lease up (at close)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
