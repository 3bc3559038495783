"""The fs tier's in-memory view of its namespace directory.

An :class:`Index` maps key -> on-disk bytes in least-recently-used order and counts the
total. It is filled by a background scan at open (in file mtime order, so the LRU order
survives a restart: loads touch their file's mtime), by the tier's own stores, evictions
and loads, and by batched ``stat`` probes of keys it does not know, which is how files
written by other instances are found. A probe that finds nothing is remembered for
``negative_ttl`` seconds. ``lookup`` only reads dictionaries: no I/O, no lock.

A rescan (:meth:`Index.merge_scan` after :meth:`Index.begin_scan`) replaces the view with
what is on disk: every instance's files, ordered by the later of their mtime and this
instance's last use, so ``max_bytes`` bounds the namespace directory as a whole. Only
regular files of the instance's chunk size count (:func:`scan` skips anything else).
Between rescans, files another instance wrote that this one finds by a probe or a load are
*foreign*: they answer HIT but are neither counted nor evicted until a rescan puts them in
the order, because their age among the files this instance does not know is unknown.
"""

from __future__ import annotations

import logging
import os
import stat as _stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from . import layout

log = logging.getLogger("kvtiers.fs")


class Index:
    """Key -> file bytes, LRU first; plus the negative cache and the pin counts of keys
    being read (never evicted while a load of this instance reads them)."""

    def __init__(self, negative_ttl: float) -> None:
        self.lock = threading.Lock()
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.foreign: dict[bytes, int] = {}  # others' files found since the last scan: HIT, never victims
        self.used = 0
        self.reserved = 0
        self.absent: dict[bytes, float] = {}  # key -> monotonic time the MISS expires
        self.unread: set[bytes] = set()  # probed absent, not yet answered (so MISS comes even with ttl 0)
        self.negative_ttl = negative_ttl
        self.reading: dict[bytes, int] = {}
        self.writing: dict[bytes, int] = {}  # keys this instance is storing: counted in `reserved`
        self.dropped_during_scan: set[bytes] | None = None  # removals the running scan may not see
        self.changed_during_scan: set[bytes] | None = None  # keys added or used while a scan runs
        self.found_during_scan: set[bytes] | None = None  # foreign keys found while a scan runs
        self.last_use: dict[bytes, float] = {}  # key -> wall time this instance last stored/read/touched it

    # -- updates (any thread) --------------------------------------------------------
    def add(self, key: bytes, nbytes: int) -> None:
        """``key`` is on disk with ``nbytes``, stored (or refreshed) by this instance: most
        recently used."""
        with self.lock:
            self._add(key, nbytes)

    def add_found(self, key: bytes, nbytes: int) -> None:
        """``key`` is on disk with ``nbytes``, found by a probe or a load: known keys are
        marked used, others are foreign until the next scan."""
        with self.lock:
            if key in self.entries:
                self._used(key)
            else:
                self.foreign[key] = nbytes
                if self.found_during_scan is not None:
                    self.found_during_scan.add(key)
            self.absent.pop(key, None)
            self.unread.discard(key)

    def _add(self, key: bytes, nbytes: int) -> None:
        self.foreign.pop(key, None)
        old = self.entries.pop(key, None)
        if old is not None:
            self.used -= old
        self.entries[key] = nbytes
        self.used += nbytes
        self.absent.pop(key, None)
        self.unread.discard(key)
        self.last_use[key] = time.time()
        if self.changed_during_scan is not None:
            self.changed_during_scan.add(key)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used; False if unknown."""
        with self.lock:
            if key in self.entries:
                self._used(key)
                return True
            return False

    def _used(self, key: bytes) -> None:
        """A known ``key`` was used: most recent in LRU order, and kept through a running scan."""
        self.entries.move_to_end(key)
        self.last_use[key] = time.time()
        if self.changed_during_scan is not None:
            self.changed_during_scan.add(key)

    def drop(self, key: bytes, *, absent: bool = True) -> bool:
        """Forget ``key`` (gone from disk); True if it was known."""
        with self.lock:
            n = self.entries.pop(key, None)
            if n is not None:
                self.used -= n
            elif self.foreign.pop(key, None) is not None:
                n = 0
            self.last_use.pop(key, None)
            if self.dropped_during_scan is not None:
                self.dropped_during_scan.add(key)
            if absent:
                self.absent[key] = time.monotonic() + self.negative_ttl
            return n is not None

    def mark_absent(self, keys: Iterable[bytes]) -> None:
        until = time.monotonic() + self.negative_ttl
        with self.lock:
            for k in keys:
                if k not in self.entries and k not in self.foreign:
                    self.absent[k] = until
                    self.unread.add(k)
            if len(self.absent) > 65536:
                now = time.monotonic()
                self.absent = {k: t for k, t in self.absent.items() if t > now or k in self.unread}

    def begin_scan(self) -> None:
        """Start remembering removals and uses, so a scan that listed a file before it was
        removed does not bring it back, and what changed meanwhile stays most recent."""
        with self.lock:
            self.dropped_during_scan = set()
            self.changed_during_scan = set()
            self.found_during_scan = set()

    def merge_scan(self, found: list[tuple[float, bytes, int]]) -> list[bytes]:
        """Make the view what a scan found: files (mtime, key, bytes), oldest first by the
        later of their mtime and this instance's last use, then what was added or used while
        the scan ran. Returns the keys known before that the scan did not find (removed
        under this instance, e.g. by another instance's eviction or by gc). The sort runs
        outside the lock: stores and probes are not held up by a large rescan."""
        last_use = dict(self.last_use)
        ordered = sorted((max(t, last_use.get(k, 0.0)), k, n) for t, k, n in found)
        merged: OrderedDict[bytes, int] = OrderedDict()
        used = 0
        for _, k, n in ordered:
            if k not in merged:
                merged[k] = n
                used += n
        del ordered, last_use
        with self.lock:
            dropped = self.dropped_during_scan or set()
            changed = self.changed_during_scan or set()
            found_meanwhile = self.found_during_scan or set()
            self.dropped_during_scan = self.changed_during_scan = self.found_during_scan = None
            # removed, used or stored while the scan ran: what this instance knows wins; a key
            # being stored is already counted in `reserved`, its store adds it
            for k in (*dropped, *changed, *self.writing):
                n = merged.pop(k, None)
                if n is not None:
                    used -= n
            for k in found_meanwhile:  # probed or read while the scan ran: recent, whatever mtime it saw
                if k in merged:
                    merged.move_to_end(k)
            for k in sorted(changed, key=lambda k: self.last_use.get(k, 0.0)):  # most recent, after every scanned file
                n = self.entries.get(k)
                if n is not None:
                    merged[k] = n
                    used += n
            gone = [k for k in self.entries if k not in merged]
            # foreign keys are now in the order, or gone; those found while it ran stay foreign
            foreign = {}
            for k, n in self.foreign.items():
                if k in merged:
                    continue
                if k in found_meanwhile:
                    foreign[k] = n
                else:
                    gone.append(k)
            self.foreign = foreign
            for k in gone:
                self.last_use.pop(k, None)
            self.entries = merged
            self.used = used
            for k in [k for k in self.absent if k in merged]:
                del self.absent[k]
                self.unread.discard(k)
            return gone

    # -- pins --------------------------------------------------------------------------
    def pin(self, key: bytes) -> None:
        with self.lock:
            self.reading[key] = self.reading.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        with self.lock:
            n = self.reading[key] - 1
            if n:
                self.reading[key] = n
            else:
                del self.reading[key]

    # -- capacity ----------------------------------------------------------------------
    def reserve(self, nbytes: int, max_bytes: int | None, key: bytes | None = None) -> list[bytes]:
        """Reserve room for a file of ``nbytes``; return the LRU keys to evict for it
        (already dropped from the index; the caller unlinks them). ``key``: the chunk being
        stored, until :meth:`commit` or :meth:`unreserve`; keys being stored or read are
        never chosen as victims."""
        victims: list[bytes] = []
        with self.lock:
            self.reserved += nbytes
            if key is not None:
                self.writing[key] = self.writing.get(key, 0) + 1
            if max_bytes is None:
                return victims
            excess = self.used + self.reserved - max_bytes
            if excess <= 0:
                return victims
            until = time.monotonic() + self.negative_ttl
            for k in list(self.entries):
                if excess <= 0:
                    break
                if k in self.reading or k in self.writing:
                    continue
                n = self.entries.pop(k)
                self.last_use.pop(k, None)
                self.used -= n
                excess -= n
                if self.dropped_during_scan is not None:
                    self.dropped_during_scan.add(k)
                self.absent[k] = until
                victims.append(k)
        return victims

    def unreserve(self, nbytes: int, key: bytes | None = None) -> None:
        with self.lock:
            self._unreserve(nbytes, key)

    def commit(self, key: bytes, nbytes: int) -> None:
        """The store of ``key`` reserved with :meth:`reserve` is on disk: index it and
        release the reservation in one step (no window in which it counts twice)."""
        with self.lock:
            self._unreserve(nbytes, key)
            self._add(key, nbytes)

    def _unreserve(self, nbytes: int, key: bytes | None) -> None:
        self.reserved -= nbytes
        if key is not None:
            n = self.writing.pop(key) - 1
            if n:
                self.writing[key] = n


class Prober:
    """One thread that ``stat``s unknown keys in batches and records what it finds."""

    def __init__(self, index: Index, path_of: Callable[[bytes], str], name: str, file_bytes: int) -> None:
        self.index = index
        self.path_of = path_of
        self.file_bytes = file_bytes  # only regular files of this size are chunks of ours
        self._cond = threading.Condition()
        self._pending: dict[bytes, None] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        """Start the thread (idempotent; done by the first request otherwise)."""
        with self._cond:
            if not self._started and not self._stop:
                self._started = True
                self._thread.start()

    def request(self, keys: list[bytes]) -> None:
        """Ask for ``keys`` to be checked (never blocks on I/O)."""
        with self._cond:
            if self._stop:
                return
            for k in keys:
                self._pending[k] = None
            if not self._started:
                self._started = True
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                batch = list(self._pending)[:512]
            missing = []
            for k in batch:
                try:
                    st = os.lstat(self.path_of(k))
                except OSError:
                    missing.append(k)
                else:
                    if _stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes:
                        self.index.add_found(k, st.st_size)
                    else:  # a FIFO, directory, link or another slot size: not a chunk of ours
                        missing.append(k)
            self.index.mark_absent(missing)
            with self._cond:
                for k in batch:
                    self._pending.pop(k, None)

    def pending(self, key: bytes) -> bool:
        return key in self._pending

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread; False if it is still stuck in a ``stat`` after ``timeout``."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


def scan(
    nsdir: str,
    *,
    stale_after: float,
    stopping: Callable[[], bool] = lambda: False,
    clean: bool = True,
    problems: list[str] | None = None,
) -> tuple[list[tuple[float, bytes, int]], list[str]]:
    """Walk a namespace directory: return its chunk files (regular files named
    ``<key hex>.bin``) as ``(mtime, key, bytes)`` and the stale temporary files it removed
    (none unless ``clean``). One bad entry never stops the walk: an entry or directory
    that cannot be read, or a stale temporary file that cannot be removed (EACCES, EROFS,
    an immutable file), is skipped, logged, and described in ``problems`` if given."""
    found: list[tuple[float, bytes, int]] = []
    removed: list[str] = []
    trouble: list[str] = [] if problems is None else problems
    now = time.time()

    def skip(what: str, e: OSError) -> None:
        if len(trouble) < 1000:
            trouble.append(f"{what}: {e.strerror or e}")
        if len(trouble) <= 3:
            log.warning("fs tier: scan skipped %s: %s", what, e.strerror or e)

    try:
        level1 = sorted(e.name for e in os.scandir(nsdir) if len(e.name) == 2 and e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return found, removed
    for h1 in level1:
        if stopping():
            break
        try:
            level2 = [e.path for e in os.scandir(f"{nsdir}/{h1}") if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            continue
        except OSError as e:
            skip(f"{nsdir}/{h1}", e)
            continue
        for d in level2:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            except OSError as e:
                skip(d, e)
                continue
            for e in entries:
                name = e.name
                try:
                    if name.endswith(layout.CHUNK_SUFFIX):
                        key = layout.key_of_name(name)
                        if key is not None:
                            st = e.stat(follow_symlinks=False)
                            if _stat.S_ISREG(st.st_mode):  # a FIFO, directory or link is no chunk
                                found.append((st.st_mtime, key, st.st_size))
                    elif clean and name.endswith(layout.TEMP_SUFFIX):
                        st = e.stat(follow_symlinks=False)
                        if layout.temp_is_stale(e.path, st.st_mtime, now, stale_after):
                            os.unlink(e.path)
                            removed.append(e.path)
                except FileNotFoundError:
                    continue  # another instance removed or published it meanwhile
                except OSError as err:
                    skip(e.path, err)
    if len(trouble) > 3:
        log.warning("fs tier: scan of %s skipped %d entries in all", nsdir, len(trouble))
    return found, removed
