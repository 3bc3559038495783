"""A compact set of chunk keys: 64-bit fingerprints with a clock each, in numpy arrays.

:class:`KeyTable` is an open-addressing hash table (linear probing) of ``fingerprint ->
clock``: 16 bytes a slot (a ``uint64`` and a ``float64``), kept between half and three
quarters full, so 21-32 bytes of memory per key whatever the number of keys. The fingerprint
of a key is its xxh3-64 (:func:`fingerprint`), the same hash that names the key's directory,
so the table also knows which of the 65536 directories holds each key
(:func:`dir_of`). Two keys with one fingerprint are one entry (about one pair in 3e6 at 10M
keys): a lookup may then answer HIT for a key that is not stored, whose load then fails (the
full key is checked against the chunk file's trailer); it never loads wrong bytes.

The clock is a wall-clock time: positive for a key placed in the LRU order (counted against
``max_bytes``, a possible eviction victim), negative (minus the time) for a key found by a
probe or a load that no listing has placed yet.

Readers (:meth:`find`) take no lock: writers replace whole arrays when the table grows, and a
reader that races with an insert just does not see the new key yet (the tier then probes the
disk). Writers are serialised by the caller.
"""

from __future__ import annotations

import numpy as np
import xxhash

EMPTY = 0
TOMB = 1
MIN_CAP = 1024
_MAX_LOAD = 0.75
_GROW_TO = 0.5
_SCALAR = 16  # find: this few keys past their home slot finish their probe one by one
_WINDOW = 16  # find: the slots after the home slot gathered at once (16 bools are two uint64)
_STEPS = np.arange(_WINDOW)
_h64 = xxhash.xxh3_64_intdigest


def _any_in_rows(rows: np.ndarray) -> np.ndarray:
    """Whether each row of a (n, 16) bool array has a True: its two halves read as uint64
    (far faster than ``any(axis=1)``, numpy's reduction along a short axis)."""
    halves = rows.view(np.uint64)
    return (halves[:, 0] | halves[:, 1]) != 0


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint of ``key``: its xxh3-64, with 0 and 1 (reserved) moved to 2 and 3."""
    h = _h64(key)
    return h + 2 if h < 2 else h


def fingerprints(keys) -> np.ndarray:
    """:func:`fingerprint` of each key, as a ``uint64`` array."""
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)
    a = np.fromiter(map(_h64, keys), np.uint64, len(keys))
    small = a < 2
    if small.any():
        a[small] += np.uint64(2)
    return a


def dir_of(fp) -> int:
    """The directory number (``h1 * 256 + h2``, 0-65535) of a fingerprint (or an array)."""
    return fp >> 48 if isinstance(fp, int) else (fp >> np.uint64(48)).astype(np.int64)


def _home(fps: np.ndarray, cap: int) -> np.ndarray:
    return (((fps & np.uint64(0xFFFFFFFF)) * np.uint64(cap)) >> np.uint64(32)).astype(np.int64)


def _check_placement(fpa: np.ndarray) -> None:
    """Raise ``ValueError`` unless every key of ``fpa`` is where a probe finds it (no empty
    slot between its home and its slot) and no fingerprint is there twice. A few vectorised
    passes: a probe of every key would take seconds at 10M keys."""
    cap = len(fpa)
    empties = np.zeros(cap + 1, np.int64)  # empties[i]: empty slots before slot i
    np.cumsum(fpa == EMPTY, out=empties[1:])
    live = np.flatnonzero(fpa > TOMB)
    fps = fpa[live]
    home = _home(fps, cap)
    between = empties[live + 1] - empties[home]  # empty slots from home to slot, both included
    between += empties[cap] * (home > live)  # (a probe that wrapped past the end)
    if between.any():
        raise ValueError("keys out of their probe sequence")
    fps.sort()
    if (fps[1:] == fps[:-1]).any():
        raise ValueError("a fingerprint stored twice")


class KeyTable:
    """``fingerprint -> clock`` in two numpy arrays (see the module docstring)."""

    def __init__(self, cap: int = MIN_CAP) -> None:
        self._set_arrays(np.zeros(max(cap, MIN_CAP), np.uint64), np.zeros(max(cap, MIN_CAP), np.float64))
        self.live = 0
        self.tombs = 0

    def _set_arrays(self, fp: np.ndarray, clock: np.ndarray) -> None:
        self.arrays = (fp, clock)  # one attribute: readers see both of one generation
        self.fp, self.clock = fp, clock
        self.cap = len(fp)

    @classmethod
    def from_arrays(cls, fp: np.ndarray, clock: np.ndarray) -> KeyTable:
        """A table over arrays saved with :attr:`arrays` (a snapshot). Raises ``ValueError``
        for arrays that no table of this class holds (a crafted or damaged snapshot): more
        than three quarters of the slots used (every probe relies on a free slot to stop),
        a clock that is not finite (NaN is neither old nor new: never counted or evicted), or
        a key its probe sequence cannot reach, or reaches twice (it would count against
        ``max_bytes`` but could never be found, so never evicted)."""
        if fp.ndim != 1 or fp.shape != clock.shape or not len(fp):
            raise ValueError(f"arrays of {fp.shape} fingerprints and {clock.shape} clocks")
        t = cls.__new__(cls)
        t._set_arrays(fp, clock)
        t.live = int(np.count_nonzero(fp > TOMB))
        t.tombs = int(np.count_nonzero(fp == TOMB))
        if t.live + t.tombs > _MAX_LOAD * t.cap:
            raise ValueError(f"{t.live + t.tombs} of {t.cap} slots used: no free slot kept")
        if not np.isfinite(clock).all():
            raise ValueError("clocks that are not finite (NaN or infinity)")
        _check_placement(fp)
        return t

    @property
    def nbytes(self) -> int:
        return self.fp.nbytes + self.clock.nbytes

    def __len__(self) -> int:
        return self.live

    # -- reads (any thread, no lock) ------------------------------------------------------------
    def find(self, fps: np.ndarray) -> np.ndarray:
        """The slot of each fingerprint, -1 where absent.

        Every key's home slot comes in one gather of single slots (most keys end there:
        found, or at an empty slot); the rest take the next _WINDOW slots of their probe
        sequence in one gather of windows; the few whose run is longer still go one by one.
        """
        fpa, _ = self.arrays
        cap = len(fpa)
        out = np.full(len(fps), -1, np.int64)
        if not len(fps):
            return out
        pos = _home(fps, cap)
        cur = fpa[pos]
        hit = cur == fps
        out[hit] = pos[hit]
        todo = np.flatnonzero(~hit & (cur != EMPTY))
        if len(todo) > _SCALAR:
            start = pos[todo] + 1
            win = np.take(fpa, start[:, None] + _STEPS, mode="wrap")
            want = fps[todo]
            at = win == want[:, None]
            found = _any_in_rows(at)
            ended = found | _any_in_rows(win == EMPTY)
            where = np.flatnonzero(at)  # row * _WINDOW + offset, at most one a row
            rows = where // _WINDOW
            out[todo[rows]] = (start[rows] + where % _WINDOW) % cap
            todo = todo[~ended]
            pos = (start[~ended] + _WINDOW - 1) % cap  # the last slot looked at
        else:
            pos = pos[todo]
        for j, i in zip(todo.tolist(), pos.tolist(), strict=True):
            out[j] = self._probe(fpa, int(fps[j]), i + 1 if i + 1 < cap else 0)
        return out

    def contains(self, fps: np.ndarray) -> np.ndarray:
        """Whether each fingerprint is in the table (a bool array)."""
        return self.find(fps) >= 0

    @staticmethod
    def _probe(fpa: np.ndarray, fp: int, i: int) -> int:
        """The slot of ``fp`` by its probe sequence from slot ``i``, -1 if absent. At most
        one lap of the table, even one with no free slot (which no writer makes)."""
        cap = len(fpa)
        for _ in range(cap):
            cur = int(fpa[i])
            if cur == fp:
                return i
            if cur == EMPTY:
                return -1
            i = i + 1 if i + 1 < cap else 0
        return -1

    def slot(self, fp: int) -> int:
        """The slot of one fingerprint, -1 if absent."""
        fpa, _ = self.arrays
        return self._probe(fpa, fp, ((fp & 0xFFFFFFFF) * len(fpa)) >> 32)

    def get(self, fp: int) -> float | None:
        """The clock of ``fp``, or None."""
        i = self.slot(fp)
        return None if i < 0 else float(self.clock[i])

    # -- writes (one writer at a time) ----------------------------------------------------------
    def put(self, fp: int, clock: float) -> float | None:
        """Set the clock of ``fp`` (inserting it); return its previous clock, or None."""
        i = self.slot(fp)
        if i >= 0:
            old = float(self.clock[i])
            self.clock[i] = clock
            return old
        self._reserve(1)
        fpa = self.fp
        cap = self.cap
        i = ((fp & 0xFFFFFFFF) * cap) >> 32
        for _ in range(cap):  # _reserve kept a free slot: at most one lap
            if int(fpa[i]) <= TOMB:
                break
            i = i + 1 if i + 1 < cap else 0
        else:
            raise RuntimeError(f"key table of {cap} slots has no free slot")
        if int(fpa[i]) == TOMB:
            self.tombs -= 1
        self.clock[i] = clock  # the clock before the fingerprint: a reader never sees a stale clock
        fpa[i] = fp
        self.live += 1
        return None

    def remove(self, fp: int) -> float | None:
        """Forget ``fp``; return its clock, or None if it was absent."""
        i = self.slot(fp)
        if i < 0:
            return None
        old = float(self.clock[i])
        self.fp[i] = TOMB
        self.live -= 1
        self.tombs += 1
        return old

    def put_many(self, fps: np.ndarray, clocks: np.ndarray) -> None:
        """Insert or update many fingerprints at once (duplicates: the last wins)."""
        if not len(fps):
            return
        fps, first = np.unique(fps[::-1], return_index=True)
        clocks = clocks[::-1][first]
        slots = self.find(fps)
        have = slots >= 0
        self.clock[slots[have]] = clocks[have]
        fps, clocks = fps[~have], clocks[~have]
        if not len(fps):
            return
        self._reserve(len(fps))
        fpa, cla, cap = self.fp, self.clock, self.cap
        pos = _home(fps, cap)
        for _ in range(cap + 1):  # _reserve kept a free slot for each: each is placed within a lap
            if not len(fps):
                break
            free = fpa[pos] <= TOMB
            if free.any():
                cand = np.flatnonzero(free)
                _, first = np.unique(pos[cand], return_index=True)  # one new key per free slot
                take = cand[first]
                p = pos[take]
                self.tombs -= int(np.count_nonzero(fpa[p] == TOMB))
                cla[p] = clocks[take]
                fpa[p] = fps[take]
                self.live += len(take)
                keep = np.ones(len(fps), bool)
                keep[take] = False
                fps, clocks, pos = fps[keep], clocks[keep], pos[keep]
            pos = pos + 1
            pos[pos == cap] = 0
        if len(fps):
            raise RuntimeError(f"key table of {cap} slots has no free slot for {len(fps)} keys")

    def remove_slots(self, slots: np.ndarray) -> None:
        """Forget the keys at ``slots`` (from :meth:`find`; -1 entries ignored)."""
        slots = np.unique(slots[slots >= 0])
        slots = slots[self.fp[slots] > TOMB]
        self.fp[slots] = TOMB
        self.live -= len(slots)
        self.tombs += len(slots)

    def _reserve(self, n: int) -> None:
        if self.live + self.tombs + n <= _MAX_LOAD * self.cap:
            return
        need = self.live + n
        cap = self.cap if need <= _GROW_TO * self.cap else int(need / _GROW_TO) + 1
        old_fp, old_clock = self.fp, self.clock
        keep = old_fp > TOMB
        fresh = KeyTable(cap)
        fresh.put_many(old_fp[keep], old_clock[keep])
        self._set_arrays(fresh.fp, fresh.clock)
        self.live, self.tombs = fresh.live, 0

    # -- whole-table views ----------------------------------------------------------------------
    def placed_count(self) -> int:
        """How many keys have a positive clock (placed in the LRU order)."""
        return int(np.count_nonzero((self.fp > TOMB) & (self.clock > 0)))

    def oldest(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Fingerprints and clocks of (up to) the ``n`` placed keys of smallest clock, oldest first."""
        live = np.flatnonzero((self.fp > TOMB) & (self.clock > 0))
        if not len(live):
            return np.empty(0, np.uint64), np.empty(0)
        if n < len(live):
            live = live[np.argpartition(self.clock[live], n - 1)[:n]]
        live = live[np.argsort(self.clock[live], kind="stable")]
        return self.fp[live].copy(), self.clock[live].copy()

    def in_dirs(self, lut: np.ndarray) -> np.ndarray:
        """Slots of live keys whose directory ``lut`` (bool[65536]) marks."""
        live = np.flatnonzero(self.fp > TOMB)
        return live[lut[dir_of(self.fp[live])]]
