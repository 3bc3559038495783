"""The fs tier's index snapshot: ``<namespace dir>/index.snapshot``.

Written at close (and every ``snapshot_seconds`` by the instance holding the cleaner's
lease), read at open, so that a restarted instance has its full view at once instead of
listing every directory. The file is the index's two arrays as they are in memory (the
fingerprints and clocks of :class:`~kvtiers_fs.keytable.KeyTable`, 16 bytes a slot, at most
32 bytes per key) and the mtime of each of the 65536 chunk directories at its last listing,
(and of the 256 first-level ones), behind a header and followed by an xxh3-64 of everything before it::

    magic "KVTFSIX1" | version u32 | flags u32 | file_bytes u64 | slots u64 |
    namespace tag (8 bytes) | written at (f64) | fingerprints (u64 x slots) |
    clocks (f64 x slots) | directory mtimes (i64 ns x 65536, then 256 for <h1>) | xxh3-64 (u64)

It is a hint, never the truth: at open the tier starts from it and lists again (in the
background) every directory whose mtime differs from the recorded one, so what changed after
the snapshot was written is found; a key it lists that is gone is a failed load that drops it.
A snapshot of another namespace or chunk size is ignored. Anyone who can write the root can
put anything at its name, and compute a valid checksum, so the reader trusts nothing it has
not checked: it opens only a regular file (``lstat`` first, then ``O_NONBLOCK | O_NOFOLLOW``
and ``fstat``: a FIFO, a link to ``/dev/zero``, a directory or a device is never read), reads
exactly the size its header gives and at most :data:`MAX_SLOTS` slots, checks the checksum,
and takes only a table its own writer could have made (a free slot kept, finite clocks, every
key where a probe finds it). Anything else (torn, another format, hostile) is refused with one
warning naming the file, and the tier lists the directory instead. It is written to a locked
temporary file (``index-snapshot.<pid>@<host>.<rand>.tmp``) and renamed into place.
"""

from __future__ import annotations

import logging
import math
import os
import stat as _stat
import struct

import numpy as np
import xxhash

from . import layout
from .keytable import KeyTable

log = logging.getLogger("kvtiers.fs")

NAME = "index.snapshot"
MAGIC = b"KVTFSIX1"
VERSION = 1
NDIRS = 65536 + 256  # the chunk directories' mtimes, then the 256 first-level ones'
MAX_SLOTS = 1 << 30  # the biggest table read (a 16 GiB file, about 800M keys): a sane absolute cap
_HEAD = struct.Struct("<8sIIQQ8sd")


def path(nsdir: str) -> str:
    return os.path.join(nsdir, NAME)


def save(nsdir: str, fp: np.ndarray, clock: np.ndarray, dir_mtime: np.ndarray, file_bytes: int,
         ns: bytes, written_at: float) -> int:
    """Write a snapshot of the arrays (copies the caller took); returns its size in bytes."""
    head = _HEAD.pack(MAGIC, VERSION, 0, file_bytes, len(fp), ns, written_at)
    parts = [head, fp.astype("<u8", copy=False).tobytes(), clock.astype("<f8", copy=False).tobytes(),
             dir_mtime.astype("<i8", copy=False).tobytes()]
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    parts.append(struct.pack("<Q", h.intdigest()))
    final = path(nsdir)
    tmp = os.path.join(nsdir, f"index-snapshot{layout.temp_path('x.bin')[1:]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with layout.Publishing(tmp, fd):
        layout.lock_temp(fd)
        for p in parts:
            view = memoryview(p)
            while view:
                view = view[os.write(fd, view):]
        os.rename(tmp, final)
    return sum(map(len, parts))


def size_of(slots: int) -> int:
    """The size in bytes of a snapshot of a table of ``slots`` slots."""
    return _HEAD.size + 16 * slots + 8 * NDIRS + 8


def load(nsdir: str, file_bytes: int, ns: bytes) -> tuple[KeyTable, np.ndarray, float] | None:
    """The table, directory mtimes and write time of the snapshot, or None if there is no
    usable one: missing, or of another namespace or chunk size (both silently), or refused
    with one warning naming the file: not a regular file (a FIFO, a link, a directory, a
    device: never opened, or never read), torn, of another format, bigger than its header
    says or than :data:`MAX_SLOTS`, with a wrong checksum, or holding a table no writer makes
    (no free slot, clocks that are not finite, keys out of place; see
    :meth:`KeyTable.from_arrays`). Reads at most the size its header gives."""
    p = path(nsdir)
    try:
        got = _read(p, file_bytes, ns)
        if got is None:
            return None
        buf, slots, written = got
        o = _HEAD.size
        fp = buf[o : o + 8 * slots].view("<u8").astype(np.uint64, copy=False)
        clock = buf[o + 8 * slots : o + 16 * slots].view("<f8").astype(np.float64, copy=False)
        dirs = buf[o + 16 * slots : o + 16 * slots + 8 * NDIRS].view("<i8").astype(np.int64, copy=False)
        if not math.isfinite(written):
            raise ValueError(f"written at {written}")
        return KeyTable.from_arrays(fp, clock), dirs, written
    except FileNotFoundError:
        return None
    except (OSError, ValueError, struct.error, MemoryError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        log.warning("fs tier: ignoring the index snapshot %s (listing the directory instead): %s", p, why)
        return None


def _read(p: str, file_bytes: int, ns: bytes) -> tuple[np.ndarray, int, float] | None:
    """The bytes of the snapshot at ``p`` (checksum checked), its slots and write time; None
    if it is another namespace's or chunk size's; ``ValueError`` if it is not one to read."""

    mode = os.lstat(p).st_mode
    if not _stat.S_ISREG(mode):  # refused before any open: a FIFO would block, a device never end
        raise ValueError(f"not a regular file ({layout.file_kind(mode)})")
    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):  # replaced since the lstat
            raise ValueError(f"not a regular file ({layout.file_kind(st.st_mode)})")
        head = os.pread(fd, _HEAD.size, 0)
        if len(head) != _HEAD.size:
            raise ValueError(f"{st.st_size} bytes: shorter than a header, torn")
        magic, version, _flags, fbytes, slots, tag, written = _HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise ValueError("not a snapshot of this format")
        if tag != ns or fbytes != file_bytes:
            return None  # another namespace's or chunk size's: not ours
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a table of {slots} slots (1 to {MAX_SLOTS})")
        size = size_of(slots)
        if st.st_size != size:
            raise ValueError(f"{st.st_size} bytes, its header says {size}: torn")
        buf = np.empty(size, np.uint8)
        view = memoryview(buf)
        done = 0
        while done < size:  # bounded: never more than the header's size
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise ValueError(f"{done} bytes, its header says {size}: torn")
            done += n
    finally:
        os.close(fd)
    if int(buf[size - 8 :].view("<u8")[0]) != xxhash.xxh3_64_intdigest(view[: size - 8]):
        raise ValueError("checksum mismatch")
    return buf, slots, written


def remove_stale_temps(nsdir: str) -> None:
    """Remove temporary snapshot files whose writer is gone (a crash while writing one)."""
    import time

    try:
        entries = [e for e in os.scandir(nsdir) if e.name.startswith("index-snapshot.")]
    except OSError:
        return
    now = time.time()
    for e in entries:
        try:
            if layout.temp_is_stale(e.path, e.stat(follow_symlinks=False).st_mtime, now, 3600.0):
                os.unlink(e.path)
        except OSError:
            pass
