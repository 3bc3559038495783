"""The cleaner's lease of a shared namespace directory: ``<namespace dir>/cleaner.lock``.

Among the bounded instances sharing a root, the one that holds an exclusive ``flock`` on
this file is the cleaner: it lists the directories that changed every ``rescan_seconds`` and
evicts for everyone; the others store and read, and try to take the lease at each of their
``rescan_seconds``, so when the holder dies (the kernel, or the NFS lock manager, drops its
lock) another one takes over within one period. The holder writes ``<pid>@<host>
max_bytes=<N>`` into the file, for operators and for the others: its bound is the one that
governs the directory, and an instance whose own differs says so (:meth:`Lease.holder`);
and it writes its pass numbers into ``cleaner.passes`` (:func:`write_passes`) at
the start and at the end of each pass, which is how the others know what its view counts
(:mod:`kvtiers_fs.share`). Where the file system has no locks, every bounded instance is a
cleaner (each lists what changed and evicts from its own view, as before the lease existed).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import struct

import xxhash

log = logging.getLogger("kvtiers.fs")

NAME = "cleaner.lock"
PASSES = "cleaner.passes"  # the cleaner's pass counters (see write_passes)
_RECORD = struct.Struct("<8sQQ")
_MAGIC = b"KVTPASS1"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class Lease:
    """Try-only, never blocking: :meth:`try_take` either gets the lease or returns False."""

    def __init__(self, nsdir: str, max_bytes: int | None = None) -> None:
        self.path = os.path.join(nsdir, NAME)
        self.max_bytes = max_bytes  # recorded in the file while this instance holds the lease
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
            bound = "" if self.max_bytes is None else f" max_bytes={self.max_bytes}"
            os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}{bound}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return True

    def holder(self) -> tuple[str, int | None] | None:
        """``(who, max_bytes)`` as the lease's holder recorded them (``<pid>@<host>``, its bound
        or None), or None when the file holds no such record. Never blocks: ``O_NONBLOCK |
        O_NOFOLLOW``, regular files only, at most 256 bytes read."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = os.pread(fd, 256, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        fields = raw.decode("ascii", "replace").split()
        if not fields or "@" not in fields[0]:
            return None
        bound = None
        for f in fields[1:]:
            if f.startswith("max_bytes=") and f[10:].isdigit():
                bound = int(f[10:])
        return fields[0], bound

    def release(self) -> None:
        """Give the lease up (at close)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def write_passes(nsdir: str, started: int, completed: int) -> bool:
    """Record in ``<nsdir>/cleaner.passes`` that the cleaner's pass number ``started`` has
    begun and every pass up to ``completed`` has ended (the lease holder, at the start and
    at the end of each pass). One 32-byte record with its own checksum, written in place
    and closed (so NFS clients see it at their next open). False if it cannot be written."""
    head = _RECORD.pack(_MAGIC, started, completed)
    path = os.path.join(nsdir, PASSES)
    try:  # (O_NONBLOCK: a FIFO put there fails at once instead of waiting for a reader)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        _warn_once(path, e)
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.pwrite(fd, head + xxhash.xxh3_64_digest(head), 0)
        return True
    except OSError as e:
        _warn_once(path, e)
        return False
    finally:
        os.close(fd)


_warned: set[str] = set()


def _warn_once(path: str, e: OSError) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("fs tier: cannot write the cleaner's pass record %s: %s (the others keep to their share "
                    "of the bound, evicting their own chunks)", path, e.strerror or e)


def read_passes(nsdir: str) -> tuple[int, int] | None:
    """``(started, completed)`` from ``<nsdir>/cleaner.passes``, or None (no cleaner wrote
    one yet, or it is not a valid record: a torn read, a file put there by someone else).
    Never blocks: ``O_NONBLOCK | O_NOFOLLOW``, regular files only."""
    try:
        fd = os.open(os.path.join(nsdir, PASSES), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.pread(fd, _RECORD.size + 8, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != _RECORD.size + 8 or xxhash.xxh3_64_digest(raw[: _RECORD.size]) != raw[_RECORD.size :]:
        return None
    magic, started, completed = _RECORD.unpack(raw[: _RECORD.size])
    return (started, completed) if magic == _MAGIC and completed <= started else None
