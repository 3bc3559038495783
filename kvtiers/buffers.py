"""Small facts about memory buffers and files the SDK's parts share (no numpy, no torch)."""

from __future__ import annotations

import ctypes
import fcntl
import os


def address(buf: memoryview) -> int:
    """The address of the first byte of a writable, contiguous buffer (the ctypes view is
    dropped at once, so no export of ``buf`` is left behind)."""
    view = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def flock_held(path: str) -> bool | None:
    """Whether some process holds a ``flock`` on ``path``: True (held), False (free), None
    (unknown: the file cannot be opened, or the file system has no locks). A missing file
    raises ``FileNotFoundError``. Never blocks: ``O_NONBLOCK`` open, non-blocking lock attempt;
    a lock taken here is released at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # and with it the lock just taken, if it was
    return False
