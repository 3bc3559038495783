"""The fs tier's in-memory view of its namespace directory.

An :class:`Index` is a compact set of the chunk keys on disk (:class:`~kvtiers_fs.keytable.
KeyTable`: a 64-bit fingerprint and an LRU clock per key, 21-32 bytes each, numpy arrays),
a fixed-size table of remembered MISSes (:class:`kvtiers.misscache.MissTable`: probed
misses and dropped keys, by the same fingerprint), and small dictionaries for what is in
motion: the pins of keys being read, the keys being stored. Only regular files of the instance's chunk size
are chunks, so a key's size is the tier's file size and ``used`` is a count times that.

It is filled by listings of the namespace's directories (:meth:`Index.merge_listing`, at
open and, for the instance that holds the cleaner's lease, every ``rescan_seconds`` for the
directories that changed), by an index snapshot (:mod:`kvtiers_fs.snapshot`), by the tier's
own stores, loads and evictions, and by batched ``stat`` probes of keys it does not know,
which is how files written by other instances are found. A probe that finds nothing is
remembered for ``negative_ttl`` seconds. ``lookup`` only reads arrays and dictionaries: no
I/O, no lock.

A key found by a probe or a load that no listing has placed yet is *foreign* (a negative
clock): it answers HIT but is neither counted nor evicted until a listing of its directory
puts it in the LRU order by its mtime, because its age among the files this instance does
not know is unknown.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat as _stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import compress

import numpy as np

from kvtiers.misscache import MissTable

from . import layout
from .drops import DropRing
from .keytable import KeyTable, dir_of, fingerprint, fingerprints

log = logging.getLogger("kvtiers.fs")

HOT_KEYS = 16384  # at most this many keys in Index.hot (about 2 MiB)
HOT_BATCH = 256  # keys found by lookups of at most this many keys join Index.hot
ABSENT_KEYS = 65536  # at most this many remembered MISSes (Index.absent, a MissTable of 1.1 MiB)


class Index:
    """The known keys (a :class:`KeyTable`), the LRU clock, the negative cache, the pins
    of keys being read (never evicted while a load of this instance reads them) and the
    reservations of stores in flight."""

    def __init__(self, negative_ttl: float, file_bytes: int = 0) -> None:
        self.lock = threading.Lock()
        self.table = KeyTable()
        self.file_bytes = file_bytes
        self.placed = 0  # keys with a place in the LRU order (counted against max_bytes)
        self.reserved = 0
        # remembered MISSes (dropped, or probed absent: those answered once even with ttl 0),
        # by fingerprint, in fixed memory: O(1) per drop, nothing kept per key as an object
        self.absent = MissTable(ABSENT_KEYS)
        self.negative_ttl = negative_ttl
        self.reading: dict[int, int] = {}  # fingerprint -> loads of this instance reading it
        self.writing: dict[bytes, int] = {}  # keys this instance is storing: counted in `reserved`
        self._writing_fp: dict[int, int] = {}
        self.dropped = DropRing()  # recent drops, stamped by _now (for listings under way)
        self.relist: set[int] = set()  # directories a merge could not trust (see merge_listing)
        self._clock = 0.0
        self._cand: list[tuple[int, float]] = []  # eviction candidates, oldest last
        # keys lookups found lately: answered by one dict membership test, like a plain dict
        # index; bounded (cleared when full), emptied of a key (or cleared) by any removal
        self.hot: dict[bytes, None] = {}
        self.removals = 0  # counts removals, so a lookup never caches a key removed meanwhile
        #: ``pinned(fp)``: a lifetime pin holds the key (kvtiers_fs.pins): never a victim before its time
        self.pinned: Callable[[int], bool] = lambda fp: False

    @property
    def used(self) -> int:
        """Bytes of the keys placed in the LRU order."""
        return self.placed * self.file_bytes

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, key: bytes) -> bool:
        return self.table.slot(fingerprint(key)) >= 0

    def known(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key is in the index (no lock, no I/O)."""
        return self.table.contains(fingerprints(keys)).tolist()

    def lookup(self, keys: Sequence[bytes], fps: np.ndarray | None = None) -> list[bool]:
        """:meth:`known` for keys the caller did not find in :attr:`hot`; the found ones join
        it (no lock, no I/O): those of a batch of at most ``HOT_BATCH`` keys always (the set
        is emptied when full), those of a bigger batch only while they fit, so that a working
        set bigger than the set does not refill it on every call (the table answers a big
        batch of such keys faster than a dict that mostly misses). ``fps``: the keys'
        fingerprints, where the caller has them."""
        before = self.removals
        found = self.table.contains(fingerprints(keys) if fps is None else fps).tolist()
        hot = self.hot
        if len(hot) + found.count(True) > HOT_KEYS:
            if len(keys) > HOT_BATCH:
                return found
            hot.clear()
        new = list(compress(keys, found))
        if new:
            hot.update(dict.fromkeys(new))
            if self.removals != before:  # a removal raced with this lookup: keep nothing it found
                for k in new:
                    hot.pop(k, None)
        return found

    def clock_of(self, key: bytes) -> float | None:
        """The LRU clock of ``key`` (negative: foreign), or None."""
        return self.table.get(fingerprint(key))

    def _now(self) -> float:
        t = time.time()
        if t <= self._clock:  # strictly increasing: the order of this instance's uses is exact
            t = self._clock + 1e-6
        self._clock = t
        return t

    def _set(self, fp: int, clock: float) -> None:
        old = self.table.put(fp, clock)
        self.placed += (clock > 0) - (old is not None and old > 0)

    def _forget_hot(self, key: bytes | None) -> None:
        self.removals += 1  # before the hot set changes (see lookup)
        if key is None:
            self.hot.clear()
        else:
            self.hot.pop(key, None)

    def _remove(self, fp: int, key: bytes | None = None) -> float | None:
        self._forget_hot(key)
        old = self.table.remove(fp)
        if old is not None and old > 0:
            self.placed -= 1
        return old

    # -- updates (any thread) --------------------------------------------------------
    def add(self, key: bytes, nbytes: int | None = None) -> None:
        """``key`` is on disk, stored (or refreshed) by this instance: most recently used."""
        fp = fingerprint(key)
        with self.lock:
            self._set(fp, self._now())
            self.absent.pop_fp(fp)

    def add_found(self, key: bytes, nbytes: int | None = None) -> None:
        """``key`` is on disk, found by a probe or a load: a known key is marked used, an
        unknown one is foreign until a listing places it."""
        fp = fingerprint(key)
        with self.lock:
            old = self.table.get(fp)
            now = self._now()
            self._set(fp, now if old is not None and old > 0 else -now)
            self.absent.pop_fp(fp)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used; False if unknown."""
        fp = fingerprint(key)
        with self.lock:
            old = self.table.get(fp)
            if old is None:
                return False
            now = self._now()
            self._set(fp, now if old > 0 else -now)
            return True

    def drop(self, key: bytes, *, absent: bool = True) -> bool:
        """Forget ``key`` (gone from disk); True if it was known."""
        fp = fingerprint(key)
        with self.lock:
            old = self._remove(fp, key)
            self._dropped(fp)
            if absent:
                self.absent.add_fp(fp, time.monotonic() + self.negative_ttl)
            return old is not None

    def _dropped(self, fp: int) -> None:
        self.dropped.add(fp, self._now())  # O(1), fixed memory; stamped by the monotonic index clock

    def stamp(self) -> float:
        """The index clock now (strictly increasing: never earlier than any stamp or use it
        gave before, whatever the wall clock does): what a listing passes to
        :meth:`merge_listing` as ``started``."""
        with self.lock:
            return self._now()

    def mark_absent(self, keys: Iterable[bytes]) -> None:
        """A probe found ``keys`` absent: each one the index does not know meanwhile is a
        MISS for ``negative_ttl``, answered to the next lookup even after that."""
        until = time.monotonic() + self.negative_ttl
        fps = fingerprints(list(keys))
        with self.lock:
            add = self.absent.add_fp
            for fp in fps[~self.table.contains(fps)].tolist():
                add(fp, until, True)

    # -- listings --------------------------------------------------------------------
    def merge_listing(self, dirs: Iterable[int], fps: np.ndarray, mtimes: np.ndarray, started: float) -> int:
        """Make the view of directories ``dirs`` (numbers 0-65535) what a listing that began
        at ``started`` found there: chunk files with fingerprints ``fps`` and
        mtimes ``mtimes``. A listed key takes the later of its mtime and this instance's use
        as its clock; a known key of those directories that was not listed is forgotten,
        unless it was stored or used since ``started`` (what this instance did meanwhile
        wins); a key dropped since ``started`` is not brought back. ``started`` is a
        :meth:`stamp` taken before the listing began. Directories holding such a key, or all
        of ``dirs`` when more keys were dropped meanwhile than :class:`DropRing` remembers (new
        keys are then left out), are added to :attr:`relist`: the walker lists them again at
        its next pass. Returns how many keys were forgotten."""
        dirs = list(dirs)
        lut = np.zeros(65536, bool)
        lut[dirs] = True
        fps = np.asarray(fps, np.uint64)
        mtimes = np.asarray(mtimes, np.float64)
        with self.lock:
            if len(self.dropped) and len(fps):
                recent, complete = self.dropped.since(started)
                if len(recent):
                    keep = ~np.isin(fps, recent)
                    if not keep.all():
                        self.relist.update(dir_of(fps[~keep]).tolist())
                        fps, mtimes = fps[keep], mtimes[keep]
                if not complete:  # drops lost from the ring: only keys known already are trusted
                    self.relist.update(dirs)
                    keep = self.table.find(fps) >= 0
                    fps, mtimes = fps[keep], mtimes[keep]
            t = self.table
            slots = t.find(fps)
            have = slots >= 0
            if have.any():
                s = slots[have]
                t.clock[s] = np.maximum(mtimes[have], np.abs(t.clock[s]))
            t.put_many(fps[~have], mtimes[~have])
            t = self.table  # (may have grown)
            cand = t.in_dirs(lut)
            gone = cand[~np.isin(t.fp[cand], fps) & (np.abs(t.clock[cand]) < started)]
            if len(gone) and self._writing_fp:
                gone = gone[~np.isin(t.fp[gone], np.array(list(self._writing_fp), np.uint64))]
            if len(gone):
                self._forget_hot(None)
            t.remove_slots(gone)
            self.placed = t.placed_count()
            self._cand = []
            # (a remembered MISS of a key listed now is left alone: a key in the table answers
            # HIT before the MISSes are asked, and a pass over 65,536 of them here would cost
            # MiBs of temporaries on the scanner's thread every rescan)
            return len(gone)

    def load_table(self, table: KeyTable) -> None:
        """Start from ``table`` (a snapshot); what this instance did since it opened is kept."""
        with self.lock:
            mine = self.table
            live = np.flatnonzero(mine.fp > 1)
            if len(live):
                table.put_many(mine.fp[live], mine.clock[live])
            self._forget_hot(None)
            self.table = table
            self.placed = table.placed_count()
            self._cand = []

    # -- pins --------------------------------------------------------------------------
    def pin(self, key: bytes) -> None:
        fp = fingerprint(key)
        with self.lock:
            self.reading[fp] = self.reading.get(fp, 0) + 1

    def unpin(self, key: bytes) -> None:
        fp = fingerprint(key)
        with self.lock:
            n = self.reading[fp] - 1
            if n:
                self.reading[fp] = n
            else:
                del self.reading[fp]

    # -- capacity ----------------------------------------------------------------------
    def reserve(self, nbytes: int, max_bytes: int | None, key: bytes | None = None) -> int:
        """Reserve room for a file of ``nbytes`` (``key``: the chunk being stored, until
        :meth:`commit` or :meth:`unreserve`); return the bytes over ``max_bytes``."""
        with self.lock:
            self.reserved += nbytes
            if key is not None:
                self.writing[key] = self.writing.get(key, 0) + 1
                fp = fingerprint(key)
                self._writing_fp[fp] = self._writing_fp.get(fp, 0) + 1
            return 0 if max_bytes is None else max(0, self.used + self.reserved - max_bytes)

    def excess(self, max_bytes: int | None) -> int:
        """Bytes over ``max_bytes`` (placed keys and reservations)."""
        return 0 if max_bytes is None else max(0, self.used + self.reserved - max_bytes)

    def unreserve(self, nbytes: int, key: bytes | None = None) -> None:
        with self.lock:
            self._unreserve(nbytes, key)

    def commit(self, key: bytes, nbytes: int | None = None) -> None:
        """The store of ``key`` reserved with :meth:`reserve` is on disk: index it and
        release the reservation in one step (no window in which it counts twice)."""
        with self.lock:
            self._unreserve(self.file_bytes if nbytes is None else nbytes, key)
            fp = fingerprint(key)
            self._set(fp, self._now())
            self.absent.pop_fp(fp)

    def _unreserve(self, nbytes: int, key: bytes | None) -> None:
        self.reserved -= nbytes
        if key is not None:
            n = self.writing.pop(key) - 1
            if n:
                self.writing[key] = n
            fp = fingerprint(key)
            n = self._writing_fp.pop(fp) - 1
            if n:
                self._writing_fp[fp] = n

    # -- eviction ----------------------------------------------------------------------
    def victims(self, n: int) -> list[tuple[int, float]]:
        """Up to ``n`` eviction candidates ``(fingerprint, clock)``, least recently used
        first, none being read, stored or pinned; still in the index until :meth:`evicted`."""
        out: list[tuple[int, float]] = []
        with self.lock:
            # twice, and again while pinned keys are moved up (each round moves those it offered,
            # and asks for twice as many: a few rounds pass any number of pinned oldest keys)
            want = max(4 * n, 256)
            for i in range(3 + (len(self.table) // 256).bit_length()):
                moved = False
                while self._cand and len(out) < n:
                    fp, clock = self._cand.pop()
                    if fp in self.reading or fp in self._writing_fp or self.table.get(fp) != clock:
                        continue  # read, being stored, used since or gone
                    if self.pinned(fp):  # pinned for a time: counted as used now, so the oldest
                        self._set(fp, self._now())  # ones left to evict are not all pinned ones
                        moved = True
                        continue
                    out.append((fp, clock))
                if len(out) >= n or (i >= 1 and not moved):
                    break
                if moved:
                    want *= 2
                fps, clocks = self.table.oldest(want)
                taken = {f for f, _ in out}
                self._cand = [(f, c) for f, c in zip(fps.tolist()[::-1], clocks.tolist()[::-1], strict=True)
                              if f not in taken]
                if not self._cand:
                    break
        return out

    def evicted(self, fp: int, clock: float, key: bytes) -> bool:
        """Drop victim ``key`` if it is still as :meth:`victims` gave it (not used, read or
        stored since); True if the caller may now delete its file."""
        with self.lock:
            if self.table.get(fp) != clock or fp in self.reading or fp in self._writing_fp or self.pinned(fp):
                return False
            self._remove(fp, key)
            self._dropped(fp)
            self.absent.add_fp(fp, time.monotonic() + self.negative_ttl)
            return True

    def refresh(self, fp: int, clock: float, mtime: float) -> None:
        """Victim ``fp``'s file was used elsewhere (mtime newer than its clock): move it up, to
        its place by ``mtime`` among the eviction candidates too (the list :meth:`victims` keeps
        would otherwise offer newer keys before it, down to one just stored)."""
        with self.lock:
            if self.table.get(fp) == clock:
                self._set(fp, mtime)
                if self._cand and mtime < self._cand[0][1]:  # (newest first, popped from the end)
                    bisect.insort(self._cand, (fp, mtime), key=lambda c: -c[1])

    def forget(self, fp: int, clock: float) -> None:
        """Victim ``fp``'s file is gone (removed by someone else): forget it."""
        with self.lock:
            if self.table.get(fp) == clock:
                self._remove(fp)
                self._dropped(fp)


class Prober:
    """One thread that ``stat``s unknown keys in batches and records what it finds."""

    def __init__(self, index: Index, path_of: Callable[[bytes], str], name: str, file_bytes: int) -> None:
        self.index = index
        self.path_of = path_of
        self.file_bytes = file_bytes  # only regular files of this size are chunks of ours
        self._cond = threading.Condition()
        self._pending: dict[bytes, None] = {}
        self._stop = False
        self._busy = False  # inside a batch of stats now
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
                self._busy = True
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
                self._busy = False

    def pending(self, key: bytes) -> bool:
        return key in self._pending

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the thread; False if it is still stuck in a ``stat`` after ``timeout``. A thread
        still waiting for work then (not yet scheduled on a loaded machine) ends on its own."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout)
            with self._cond:
                return not (self._thread.is_alive() and self._busy)
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
                        if layout.remove_if_abandoned(e.path, now, stale_after):
                            removed.append(e.path)
                except FileNotFoundError:
                    continue  # another instance removed or published it meanwhile
                except OSError as err:
                    skip(e.path, err)
    if len(trouble) > 3:
        log.warning("fs tier: scan of %s skipped %d entries in all", nsdir, len(trouble))
    return found, removed
