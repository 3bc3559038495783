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
A snapshot that is torn, of another format, namespace or chunk size is ignored. It is written
to a locked temporary file (``index-snapshot.<pid>@<host>.<rand>.tmp``) and renamed into place.
"""

from __future__ import annotations

import logging
import os
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
    try:
        try:
            layout.lock_temp(fd)
            for p in parts:
                view = memoryview(p)
                while view:
                    view = view[os.write(fd, view):]
            os.rename(tmp, final)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return sum(map(len, parts))


def load(nsdir: str, file_bytes: int, ns: bytes) -> tuple[KeyTable, np.ndarray, float] | None:
    """The table, directory mtimes and write time of the snapshot, or None if there is no
    usable one (missing, torn, another format, namespace or chunk size)."""
    p = path(nsdir)
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("fs tier: cannot read the index snapshot %s: %s", p, e)
        return None
    try:
        magic, version, _flags, fbytes, slots, tag, written = _HEAD.unpack_from(raw, 0)
        size = _HEAD.size + 16 * slots + 8 * NDIRS + 8
        if magic != MAGIC or version != VERSION or len(raw) != size:
            raise ValueError("not a snapshot of this format, or torn")
        if struct.unpack_from("<Q", raw, size - 8)[0] != xxhash.xxh3_64_intdigest(memoryview(raw)[: size - 8]):
            raise ValueError("checksum mismatch")
        if tag != ns or fbytes != file_bytes:
            return None  # another namespace's or chunk size's: not ours
        o = _HEAD.size
        fp = np.frombuffer(raw, "<u8", slots, o).astype(np.uint64)
        clock = np.frombuffer(raw, "<f8", slots, o + 8 * slots).astype(np.float64)
        dirs = np.frombuffer(raw, "<i8", NDIRS, o + 16 * slots).astype(np.int64)
    except (ValueError, struct.error) as e:
        log.warning("fs tier: ignoring the index snapshot %s: %s", p, e)
        return None
    if slots < 1:
        return None
    return KeyTable.from_arrays(fp, clock), dirs, written


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
