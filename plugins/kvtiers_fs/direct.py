"""O_DIRECT: whether a directory's file system takes it, and page-aligned buffers for it.

O_DIRECT moves bytes between the disk and the arena without the page cache (no second
copy, no cache pollution); it needs offsets, lengths and buffer addresses aligned, which the
chunk layout (data at 0, one 4096-byte trailer page) and the page-aligned arena provide.
tmpfs and some network file systems refuse it: the tier then falls back to buffered I/O
with one warning per root. On a read-only directory the probe reads an existing file
instead of writing one (:func:`probe_read`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets

from kvtiers.types import buffer_address as address

log = logging.getLogger("kvtiers.fs")

ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned: set[str] = set()
_probed: dict[tuple[str, int], str | None] = {}


def aligned_buffer(nbytes: int = ALIGN) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer (an ``mmap``, not a file descriptor)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def is_aligned(view: memoryview, align: int = ALIGN) -> bool:
    """Whether ``view`` starts on an ``align`` boundary."""
    return address(view) % align == 0


def probe(directory: str) -> str | None:
    """Try an O_DIRECT write and read of one page in ``directory``.

    Returns ``None`` if it works, else a short reason (the errno name).
    """
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform"
    path = os.path.join(directory, f".direct-probe.{os.getpid()}.{secrets.token_hex(4)}.probe")
    buf = aligned_buffer()
    view = memoryview(buf)
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | os.O_CLOEXEC, 0o644)
        view[:4] = b"kvtf"
        if os.pwritev(fd, [view], 0) != ALIGN:
            return "short write"
        view[:4] = b"\0\0\0\0"
        if os.preadv(fd, [view], 0) != ALIGN or bytes(view[:4]) != b"kvtf":
            return "read back differs"
        return None
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return errno.errorcode.get(e.errno, str(e.errno))
        if fd < 0 and e.errno in _READ_ONLY:  # cannot create a file here: probe by reading
            return probe_read(directory)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        view.release()
        buf.close()


_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def probe_read(directory: str, name: str = "config.json") -> str | None:
    """Try an O_DIRECT read of the first page of ``directory/name`` (for directories this
    process may not write). Returns ``None`` if it works, else a short reason."""
    if not O_DIRECT:
        return "O_DIRECT is not available on this platform"
    buf = aligned_buffer()
    view = memoryview(buf)
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | O_DIRECT | os.O_CLOEXEC)
        try:
            os.preadv(fd, [view], 0)
        finally:
            os.close(fd)
        return None
    except OSError as e:
        return f"read-only, read probe: {errno.errorcode.get(e.errno or 0, str(e))}"
    finally:
        view.release()
        buf.close()


def choose(directory: str, want: bool | None, arena_aligned: bool, *, read_only: bool = False) -> bool:
    """Decide whether to use O_DIRECT under ``directory``.

    ``want`` is the ``direct`` option: ``None`` probes and falls back with one warning per
    directory, ``False`` never uses it, ``True`` requires it (``ValueError`` if impossible).
    ``read_only``: probe by reading an existing file, never by writing one.
    """
    if want is False:
        return False
    why = None if arena_aligned else "the arena is not page-aligned"
    if why is None:
        try:
            where = (directory, os.stat(directory).st_dev)
        except FileNotFoundError:  # a read-only root without this namespace: nothing to read
            return False
        if where not in _probed:  # once per directory and device
            _probed[where] = probe_read(directory) if read_only else probe(directory)
        why = _probed[where]
    if why is None:
        return True
    if want:
        raise ValueError(f"direct=true but O_DIRECT cannot be used under {directory}: {why}")
    if directory not in _warned:
        _warned.add(directory)
        log.warning("fs tier: O_DIRECT unavailable under %s (%s); using buffered I/O", directory, why)
    return False
