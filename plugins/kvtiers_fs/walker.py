"""Listing a namespace directory into an :class:`~kvtiers_fs.index.Index`, visiting only
the chunk directories that changed.

A :class:`Walker` remembers the mtime of every ``<h1>`` and ``<h1>/<h2>`` directory at its
last listing. A pass ``stat``s the directories and lists only those whose mtime changed
(creating, renaming or deleting a file changes its directory's mtime; reading or touching a
file does not), so after the first pass its cost grows with the churn, not with the number
of files. A directory whose mtime is too close to the listing, or that held temporary
files, is listed again at the next pass (a change in the same clock tick would not show):
"too close" is read on the file system's own clock (the mtime it gives the clock file
when the walker touches it, :meth:`Walker.fs_now`), never on this host's wall clock, so a
wall clock stepped or skewed either way changes nothing; and it is :data:`RACY_SECONDS`
plus the mtime granularity the directory's mtime shows (:func:`granularity`: a whole even
second is read as a FAT-like 2 s tick, a whole second as a 1 s tick; a file system with
finer mtimes shows finer ones). ``full`` lists everything (the first pass without a
snapshot).

Mtimes restored from a snapshot (:meth:`Walker.restore`) are a hint, not a listing of this
instance's: anyone who can write the root can record there the current mtime of a directory
together with a table that lacks its files, which would keep that directory from ever being
listed (its files never counted against the bound, never evicted). So they are marked
unverified, and a pass with ``verify`` lists every unverified directory once, whatever its
mtime; from then on only its own listings' mtimes decide. The cleaner runs such a pass
right after the reconciling one (:class:`~kvtiers_fs.tier.FsTier`), and every pass it makes
later verifies too, so a snapshot hides nothing from the bound for longer than one pass.

It counts what it does (``listed``: directory entries read; ``stats``: directories
``stat``ed), for ``kvtiers bench fs --scale``.
"""

from __future__ import annotations

import logging
import os
import stat as _stat
import time
from collections.abc import Callable

import numpy as np

from . import layout
from .index import Index
from .keytable import fingerprint

log = logging.getLogger("kvtiers.fs")

RACY_SECONDS = 1.0
UNKNOWN = 0  # never listed (or absent)
AGAIN = 1  # list again at the next pass (no real mtime is 1 ns)
_BATCH = 8192  # directories merged into the index at once
_HEX = set("0123456789abcdef")


def _is_hex(name: str) -> bool:
    return name[0] in _HEX and name[1] in _HEX


def granularity(mtime_ns: int) -> float:
    """The mtime tick an mtime may come from, in seconds: 2 for a whole even second
    (FAT-like), 1 for a whole second, 0 otherwise (finer; one in a billion fine mtimes is
    read as coarse, which costs one more listing of its directory)."""
    if mtime_ns % 1_000_000_000:
        return 0.0
    return 1.0 if mtime_ns % 2_000_000_000 else 2.0


def racy(now: float, mtime_ns: int) -> bool:
    """Whether a directory with mtime ``mtime_ns`` listed at file-system time ``now`` may
    still change within the same mtime tick (then its next pass lists it again)."""
    return now - mtime_ns / 1e9 < RACY_SECONDS + granularity(mtime_ns)


class Walker:
    """The directory mtimes of one namespace directory and the passes over it."""

    def __init__(self, nsdir: str, index: Index, file_bytes: int, clock_path: str | None = None) -> None:
        self.nsdir = nsdir
        self.clock_path = clock_path  # a file whose mtime the walker sets to read the file system's clock
        self.index = index
        self.file_bytes = file_bytes
        self.dir_mtime = np.zeros(65536, np.int64)  # ns at the last listing; UNKNOWN / AGAIN as above
        self.h1_mtime: dict[int, int] = {}
        # mtimes a snapshot gave, not yet confirmed by a listing of this instance (see above)
        self.unverified = np.zeros(65536, bool)
        self.unverified_h1: set[int] = set()
        self.subdirs: dict[int, bytes] = {}  # h1 -> its h2 directories (as bytes 0-255: small)
        self.listed = 0
        self.stats = 0
        self.deferred = 0  # directories merges could not trust (listed again next pass): the caller resets it
        self.problems: list[str] = []
        self.removed: list[str] = []

    def state(self) -> np.ndarray:
        """The directory mtimes, then the 256 ``<h1>`` mtimes (for a snapshot)."""
        h1 = np.zeros(256, np.int64)
        for n1, m in self.h1_mtime.items():
            h1[n1] = m
        return np.concatenate([self.dir_mtime, h1])

    def restore(self, state: np.ndarray) -> None:
        """Start from :meth:`state` as a snapshot saved it: the next pass lists only what
        changed, and the next pass with ``verify`` every directory it vouched for."""
        self.dir_mtime = state[:65536].copy()
        known = self.dir_mtime.reshape(256, 256) != UNKNOWN
        self.h1_mtime, self.subdirs = {}, {}
        for n1 in range(256):
            if state[65536 + n1] != UNKNOWN:
                self.h1_mtime[n1] = int(state[65536 + n1])
                self.subdirs[n1] = bytes(np.flatnonzero(known[n1]).tolist())
        self.unverified = self.dir_mtime != UNKNOWN
        self.unverified_h1 = set(self.h1_mtime)

    @property
    def pending_verification(self) -> int:
        """Directories a snapshot vouched for that no listing of this instance confirmed yet."""
        return int(self.unverified.sum()) + len(self.unverified_h1)

    def _skip(self, what: str, e: OSError) -> None:
        if len(self.problems) < 1000:
            self.problems.append(f"{what}: {e.strerror or e}")
        if len(self.problems) <= 3:
            log.warning("fs tier: scan skipped %s: %s", what, e.strerror or e)

    def _scandir(self, path: str) -> list[os.DirEntry]:
        entries = list(os.scandir(path))
        self.listed += len(entries)
        return entries

    def run(self, *, full: bool, clean: bool = False, stale_after: float = 3600.0,
            stopping: Callable[[], bool] = lambda: False, verify: bool = False) -> int:
        """One pass (see the module docstring); returns how many known keys it found gone.
        ``clean`` removes stale temporary files on the way; ``verify`` also lists the
        directories whose mtimes only a snapshot gave. One bad entry never stops it."""
        self.problems = []
        forgotten = 0
        try:
            level1 = sorted(e.name for e in self._scandir(self.nsdir)
                            if len(e.name) == 2 and e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return 0
        except OSError as e:
            self._skip(self.nsdir, e)
            return 0
        batch_dirs: list[int] = []
        fps: list[int] = []
        mtimes: list[float] = []
        started, now = self.index.stamp(), self.fs_now()
        for h1 in level1:
            if stopping():
                break
            try:
                n1 = int(h1, 16)
                st1 = os.stat(f"{self.nsdir}/{h1}")
                self.stats += 1
                level2 = self.subdirs.get(n1)
                if (full or level2 is None or self.h1_mtime.get(n1) != st1.st_mtime_ns
                        or (verify and n1 in self.unverified_h1)):
                    # its subdirectories were created or removed since (or never listed by us)
                    level2 = bytes(sorted(int(e.name, 16) for e in self._scandir(f"{self.nsdir}/{h1}")
                                          if len(e.name) == 2 and _is_hex(e.name) and e.is_dir(follow_symlinks=False)))
                    self.subdirs[n1] = level2
                    self.h1_mtime[n1] = AGAIN if racy(now, st1.st_mtime_ns) else st1.st_mtime_ns
                    self.unverified_h1.discard(n1)
            except ValueError:
                continue
            except FileNotFoundError:
                continue
            except OSError as e:
                self._skip(f"{self.nsdir}/{h1}", e)
                continue
            for n2 in level2:
                d = n1 * 256 + n2
                path = f"{self.nsdir}/{h1}/{n2:02x}"
                try:
                    st = os.stat(path)
                    self.stats += 1
                except FileNotFoundError:  # removed (e.g. by gc): forget what it held
                    if self.dir_mtime[d] != UNKNOWN:
                        self.dir_mtime[d] = UNKNOWN
                        batch_dirs.append(d)
                    continue
                except OSError as e:
                    self._skip(path, e)
                    continue
                if not full and st.st_mtime_ns == self.dir_mtime[d] and not (verify and self.unverified[d]):
                    continue
                try:
                    entries = self._scandir(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    self._skip(path, e)
                    continue
                again = racy(now, st.st_mtime_ns)
                again |= self._collect(entries, fps, mtimes, clean, stale_after, now)
                self.dir_mtime[d] = AGAIN if again else st.st_mtime_ns
                self.unverified[d] = False
                batch_dirs.append(d)
                if len(batch_dirs) >= _BATCH:
                    forgotten += self._merge(batch_dirs, fps, mtimes, started)
                    batch_dirs, fps, mtimes, started, now = [], [], [], self.index.stamp(), self.fs_now()
        if batch_dirs and not stopping():
            forgotten += self._merge(batch_dirs, fps, mtimes, started)
        if len(self.problems) > 3:
            log.warning("fs tier: scan of %s skipped %d entries in all", self.nsdir, len(self.problems))
        return forgotten

    def _merge(self, dirs: list[int], fps: list[int], mtimes: list[float], started: float) -> int:
        """Merge one batch into the index; the directories it could not trust (a key dropped
        while they were listed, see :meth:`Index.merge_listing`) are listed again next pass."""
        forgotten = self.index.merge_listing(dirs, np.array(fps, np.uint64), np.array(mtimes), started)
        with self.index.lock:
            relist, self.index.relist = self.index.relist, set()
        for d in relist:
            if self.dir_mtime[d] != UNKNOWN:
                self.dir_mtime[d] = AGAIN
        self.deferred += len(relist)
        return forgotten

    def fs_now(self) -> float:
        """The file system's clock: the mtime it gives :attr:`clock_path` when touched now
        (its own clock, at its own granularity); this host's wall clock where that file
        cannot be touched (no clock file, a read-only root)."""
        if self.clock_path is not None:
            try:
                fd = os.open(self.clock_path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
                try:
                    os.utime(fd)
                    return os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
            except OSError:
                pass
        return time.time()

    def _collect(self, entries: list[os.DirEntry], fps: list[int], mtimes: list[float], clean: bool,
                 stale_after: float, now: float) -> bool:
        """Add the chunk files of one directory; True if it holds temporary files."""
        temps = False
        fb = self.file_bytes
        for e in entries:
            name = e.name
            try:
                if name.endswith(layout.CHUNK_SUFFIX):
                    key = layout.key_of_name(name)
                    if key is not None:
                        st = e.stat(follow_symlinks=False)
                        # a FIFO, directory or link is no chunk; another slot size is not ours
                        if _stat.S_ISREG(st.st_mode) and st.st_size == fb:
                            fps.append(fingerprint(key))
                            mtimes.append(st.st_mtime)
                elif name.endswith(layout.TEMP_SUFFIX):
                    temps = True
                    if clean and layout.remove_if_abandoned(e.path, now, stale_after):
                        self.removed.append(e.path)
            except FileNotFoundError:
                continue  # another instance removed or published it meanwhile
            except OSError as err:
                self._skip(e.path, err)
        return temps

    def find_in_dir(self, d: int, wanted: dict[int, float]) -> list[tuple[int, bytes, str, float]]:
        """The files of directory ``d`` whose fingerprints are in ``wanted``:
        ``(fingerprint, key, path, mtime)`` each (an eviction's lookup of its victims' names)."""
        path = f"{self.nsdir}/{d >> 8:02x}/{d & 0xFF:02x}"
        out = []
        try:
            entries = self._scandir(path)
        except OSError:
            return out
        fb = self.file_bytes
        for e in entries:
            key = layout.key_of_name(e.name)
            if key is None:
                continue
            fp = fingerprint(key)
            if fp in wanted:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if _stat.S_ISREG(st.st_mode) and st.st_size == fb:
                    out.append((fp, key, e.path, st.st_mtime))
        return out
