"""The fs tier's work on one key: a store into a locked temporary file published by rename,
a load straight into the arena slot with the trailer and checksum checked, and what a
corrupt or foreign file at a chunk's path becomes.

:class:`ChunkIO` is part of :class:`kvtiers_fs.tier.FsTier` (kept apart for its size); its
methods run on the tier's read and write pools, one call per key.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as _stat
import threading

from . import direct as _direct
from . import layout

log = logging.getLogger("kvtiers.fs")


class _JobState:
    __slots__ = ("job_id", "keys", "done", "remaining", "failed", "errors", "nbytes", "t0", "abandoned")

    def __init__(self, job_id: int, keys: tuple[bytes, ...], t0: float) -> None:
        self.job_id = job_id
        self.keys = keys
        self.done: set[bytes] = set()  # keys reported, failed or not
        self.remaining = len(keys)
        self.failed: list[bytes] = []
        self.errors: list[str] = []
        self.nbytes = 0
        self.t0 = t0
        self.abandoned = False  # reported failed by a close that timed out: nothing more to do


#: with O_DIRECT, a chunk this large or larger is read in pieces of this size, several at once
#: (``_read_pieces``)
PIECE_BYTES = 4 << 20
#: buffered, a chunk of two steps or more is copied from the page cache a step at a time, each
#: step hashed while it is still in the CPU's cache (``_read_steps``). Measured (32 MiB from the
#: page cache, copy and xxh3-128, AMD EPYC Milan): 4.3 ms in 128 KiB steps, 4.7 ms in 4 MiB
#: pieces, 4.9 ms as one read and one hash; a bare read 3.3 ms
STEP_BYTES = 128 << 10
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


class _Pieces:
    """The pieces of one chunk read: ``[0, PIECE_BYTES)``, ... of ``data``, the last one with
    the trailer page. Each piece is read once, by whichever thread claims it first: the
    loading thread (:meth:`get`, in order) or a pool thread (:meth:`helper`, any unclaimed
    piece). A short read or an error is kept as that piece's outcome."""

    __slots__ = ("fd", "views", "trailer", "cv", "next", "outcome", "running")

    def __init__(self, fd: int, data: memoryview, trailer: memoryview) -> None:
        self.fd = fd
        self.views = [data[off:off + PIECE_BYTES] for off in range(0, len(data), PIECE_BYTES)]
        self.trailer = trailer
        self.cv = threading.Condition(threading.Lock())
        self.next = 0  # the first piece nobody has claimed
        self.outcome: list[BaseException | bool | None] = [None] * len(self.views)  # None: not read yet
        self.running = 0  # pool threads inside a read

    def __len__(self) -> int:
        return len(self.views)

    def _claim(self) -> int | None:
        with self.cv:
            if self.next >= len(self.views):
                return None
            i, self.next = self.next, self.next + 1
            return i

    def _read(self, i: int) -> None:
        view = self.views[i]
        last = i == len(self.views) - 1
        want = len(view) + (len(self.trailer) if last else 0)
        try:
            n = os.preadv(self.fd, [view, self.trailer] if last else [view], i * PIECE_BYTES)
            got: BaseException | bool = True if n == want else Corrupt(
                f"file is {i * PIECE_BYTES + n} bytes long, expected "
                f"{(len(self.views) - 1) * PIECE_BYTES + len(self.views[-1]) + len(self.trailer)}")
        except BaseException as e:  # (an OSError: the load reports it)
            got = e
        with self.cv:
            self.outcome[i] = got
            self.cv.notify_all()

    def helper(self, _scratch: memoryview) -> None:
        """A pool task: read unclaimed pieces until none is left."""
        with self.cv:
            self.running += 1
        try:
            while (i := self._claim()) is not None:
                self._read(i)
        finally:
            with self.cv:
                self.running -= 1
                self.cv.notify_all()

    def get(self, i: int) -> None:
        """Piece ``i`` read (by this thread if nobody has claimed it yet), or its error raised."""
        with self.cv:
            mine = self.outcome[i] is None and self.next == i
            if mine:
                self.next += 1
        if mine:
            self._read(i)
        with self.cv:
            while self.outcome[i] is None:
                self.cv.wait()
            got = self.outcome[i]
        if got is not True:
            raise got

    def finish(self) -> None:
        """Claim every piece left (so no pool task starts one) and wait for the reads running."""
        with self.cv:
            self.next = len(self.views)
            while self.running:
                self.cv.wait()


class Corrupt(Exception):
    """A chunk file that is not a valid copy of its key."""


class Refused(Exception):
    """Something at a chunk's path that is not a regular file: never read, never deleted."""


class ChunkIO:
    """Per-key store and load of :class:`~kvtiers_fs.tier.FsTier` (uses its index, arena,
    flags, bound and ``_key_done``)."""

    def _store_key(self, js: _JobState, key: bytes, slot: int, scratch: memoryview) -> None:
        if self._no_write is not None:
            self._key_done(js, key, 0, f"{key.hex()}: not stored: {self._no_write}")
            return
        final = self.path(key)
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._key_done(js, key, 0, f"{key.hex()}: stat: {e.strerror or e}")
            return
        else:
            if _stat.S_ISREG(st.st_mode):
                if st.st_size == self.file_bytes:  # content-addressed: an existing chunk means success
                    self.index.add(key, st.st_size)
                    _utime(final)
                    self._key_done(js, key, 0, None)
                    return
                if _other_geometry(st.st_size):
                    self._key_done(js, key, 0, f"{key.hex()}: holds a chunk of {st.st_size - layout.TRAILER_BYTES} "
                                               f"bytes (another slot size), left alone")
                    return
            elif _stat.S_ISDIR(st.st_mode):
                self._key_done(js, key, 0, f"{key.hex()}: a directory is in the way at {final}")
                return
            # a torn file, a FIFO, a device node or a link: the rename below replaces the name
        nbytes = self.file_bytes
        if self.max_bytes is not None and nbytes > self.max_bytes:
            self._key_done(js, key, 0, f"chunk file of {nbytes} bytes exceeds max_bytes={self.max_bytes}")
            return
        shared = self._share is not None and not self.is_cleaner
        if self.index.reserve(nbytes, self.max_bytes, key) > 0 and self.is_cleaner:
            self._make_room()
        elif shared and self._share.reserve(nbytes) > 0:
            self._evict_share()
        try:
            self._write(key, final, self.arena[slot], scratch)
        except BaseException as e:
            self.index.unreserve(nbytes, key)
            if shared:
                self._share.unreserve(nbytes)
            if not isinstance(e, OSError):
                raise
            self._key_done(js, key, 0, f"{key.hex()}: {_oserror(e)}")
            return
        self.index.commit(key, nbytes)
        if shared:
            self._share.published(key, nbytes)
        self._key_done(js, key, self.slot_bytes, None)

    def _write(self, key: bytes, final: str, data: memoryview, trailer: memoryview) -> None:
        layout.pack_trailer(trailer, key, len(data), layout.data_digest(data), self._ns)
        tmp, fd = self._locked_temp(final)
        with layout.Publishing(tmp, fd):
            n = os.pwritev(fd, [data, trailer], 0)
            if n != len(data) + len(trailer):
                raise OSError(errno.ENOSPC, f"short write ({n} of {len(data) + len(trailer)} bytes)")
            if self.fsync:
                os.fsync(fd)
            os.rename(tmp, final)
        if self.fsync:
            _fsync_dir(os.path.dirname(final))

    def _locked_temp(self, final: str) -> tuple[str, int]:
        """Create a temporary file next to ``final``, locked before any cleaner can see it
        (:func:`layout.create_locked_temp`); the lock is held until the file is published,
        so cleaners in any PID namespace see a live writer."""
        try:
            tmp, fd, self._anon_temps = layout.create_locked_temp(final, self._wflags, self._anon_temps)
        except FileNotFoundError:  # first chunk in this directory, or gc removed it
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp, fd, self._anon_temps = layout.create_locked_temp(final, self._wflags, self._anon_temps)
        return tmp, fd

    _anon_temps = True  # O_TMPFILE works here (False once it did not)

    def _load_key(self, js: _JobState, key: bytes, slot: int, scratch: memoryview) -> None:
        path = self.path(key)
        self.index.pin(key)
        try:
            try:
                fd = os.open(path, self._rflags)
            except FileNotFoundError:
                if self.index.drop(key):
                    self.ctx.removed([key], "missing")
                self._key_done(js, key, 0, f"{key.hex()}: not stored")
                return
            except OSError as e:
                kind = _not_regular(path)  # ELOOP (a link), EINVAL (O_DIRECT on a FIFO), ...
                if kind is not None:
                    self._refuse(js, key, path, kind)
                else:
                    self._key_done(js, key, 0, f"{key.hex()}: open: {_oserror(e)}")
                return
            try:
                st = os.fstat(fd)
                if not _stat.S_ISREG(st.st_mode):
                    raise Refused(layout.file_kind(st.st_mode))
                if st.st_size != self.file_bytes:
                    self._check_other(fd, st.st_size, key, scratch)
                self._read(fd, key, self.arena[slot], scratch)
            except Refused as e:
                self._refuse(js, key, path, str(e))
                return
            except layout.NotOurs as e:
                self.index.drop(key)
                self._key_done(js, key, 0, f"{key.hex()}: not loaded, file left alone: {e}")
                return
            except Corrupt as e:
                what = self._discard_corrupt(path, fd, key, str(e))
                self._key_done(js, key, 0, f"{key.hex()}: corrupt chunk {what}: {e}")
                return
            except OSError as e:
                self._key_done(js, key, 0, f"{key.hex()}: read: {_oserror(e)}")
                return
            finally:
                os.close(fd)
        finally:
            self.index.unpin(key)
        self.index.add_found(key, self.file_bytes)
        if self._no_write is None:
            _utime(path)
        self._key_done(js, key, self.slot_bytes, None)

    def _refuse(self, js: _JobState, key: bytes, path: str, kind: str) -> None:
        if self.index.drop(key):
            self.ctx.removed([key], "corrupt")
        log.warning("fs tier: %s is %s, not a chunk file; left alone", path, kind)
        self._key_done(js, key, 0, f"{key.hex()}: not a chunk file: {kind} at {path}, left alone")

    def _check_other(self, fd: int, size: int, key: bytes, page: memoryview) -> None:
        """A file of the wrong size: raise :class:`layout.NotOurs` if it is a valid chunk of
        ``key`` with another slot size (its trailer says so), :class:`Corrupt` otherwise."""
        if not _other_geometry(size):
            raise Corrupt(f"file is {size} bytes long, expected {self.file_bytes}")
        if os.preadv(fd, [page], size - layout.TRAILER_BYTES) != layout.TRAILER_BYTES:
            raise Corrupt(f"file is {size} bytes long, expected {self.file_bytes}")
        try:
            layout.check_trailer(page, key, size - layout.TRAILER_BYTES, self._ns)
        except layout.NotOurs:
            raise
        except ValueError as e:
            raise Corrupt(f"file is {size} bytes long, expected {self.file_bytes} ({e})") from None
        raise layout.NotOurs(f"chunk holds {size - layout.TRAILER_BYTES} bytes, slot is {self.slot_bytes} "
                             "(another slot size)")

    def _read(self, fd: int, key: bytes, data: memoryview, trailer: memoryview) -> None:
        if self.direct and len(data) >= 2 * PIECE_BYTES:
            digest = self._read_pieces(fd, data, trailer)
        elif not self.direct and len(data) >= 2 * STEP_BYTES:
            digest = self._read_steps(fd, data, trailer)
        else:
            n = os.preadv(fd, [data, trailer], 0)
            if n != len(data) + len(trailer):
                raise Corrupt(f"file is {n} bytes long, expected {len(data) + len(trailer)}")
            digest = None
        try:
            recorded = layout.check_trailer(trailer, key, len(data), self._ns)
        except layout.NotOurs:
            raise
        except ValueError as e:
            raise Corrupt(str(e)) from None
        if (digest if digest is not None else layout.data_digest(data)) != recorded:
            raise Corrupt("checksum mismatch")

    def _read_pieces(self, fd: int, data: memoryview, trailer: memoryview) -> bytes:
        """O_DIRECT: read a large chunk as :data:`PIECE_BYTES` pieces and return the xxh3-128
        of its bytes, hashed piece by piece in order as they land (the same digest as one
        pass: the check is unchanged), and return only when no read into ``data`` is still
        running. The read pool's idle threads read pieces ahead, several requests in flight
        on the device while this thread hashes; this thread reads any piece none has taken yet
        itself (a busy pool only slows this down to one piece at a time, it never waits on a
        queued task)."""
        pieces = _Pieces(fd, data, trailer)
        try:
            self._reads.submit_many([pieces.helper] * min(len(pieces) - 1, self._reads.n - 1))
        except ValueError:
            pass  # the pool is shut down (a close that gave up on this job): read alone
        hasher = layout.data_hasher()
        try:
            for i in range(len(pieces)):
                pieces.get(i)
                hasher.update(pieces.views[i])
        finally:
            pieces.finish()  # no piece read may still write into the slot when this returns
        return hasher.digest()

    def _read_steps(self, fd: int, data: memoryview, trailer: memoryview) -> bytes:
        """Buffered: copy a chunk from the page cache :data:`STEP_BYTES` at a time and return
        the xxh3-128 of its bytes, each step hashed right after its copy, while it is still in
        the CPU's cache (the same digest as one pass). The CPU does the copy, so more threads
        would only contend for it; the kernel is asked to read the whole file ahead
        (``POSIX_FADV_WILLNEED``) while this thread copies and hashes."""
        if _WILLNEED is not None:
            try:
                os.posix_fadvise(fd, 0, 0, _WILLNEED)
            except OSError:
                pass  # a hint only
        hasher = layout.data_hasher()
        size = len(data)
        for off in range(0, size, STEP_BYTES):
            view = data[off:off + STEP_BYTES]
            last = off + STEP_BYTES >= size
            n = os.preadv(fd, [view, trailer] if last else [view], off)
            if n != len(view) + (len(trailer) if last else 0):
                raise Corrupt(f"file is {off + n} bytes long, expected {size + len(trailer)}")
            hasher.update(view)
        return hasher.digest()

    def _discard_corrupt(self, path: str, fd: int, key: bytes, why: str) -> str:
        """Delete corrupt chunk ``path`` (open as ``fd``) if it is still the file that was
        read, and say what happened. Only a file that really went is reported removed
        (``ctx.removed``, ``"corrupt"``); one that stays (a read-only root, an unlink that
        failed) is logged as left in place, and its key is forgotten like a probed miss (a
        later probe may find it again; each load of it fails, never with wrong bytes)."""
        kept = self._no_write
        if kept is None:
            try:  # only the file we read: another instance may have published a good copy since
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    log.info("fs tier: corrupt chunk %s was replaced meanwhile; the new file is kept", path)
                    return "replaced meanwhile"
                os.unlink(path)
            except FileNotFoundError:
                pass  # removed by someone else: gone all the same
            except OSError as e:
                kept = f"could not remove it: {_oserror(e)}"
        self.index.drop(key)
        if kept is not None:
            log.warning("fs tier: corrupt chunk %s left in place (%s): %s", path, kept, why)
            return f"left in place ({kept})"
        log.warning("fs tier: removed corrupt chunk %s: %s", path, why)
        self.ctx.removed([key], "corrupt")
        return "removed"


def _other_geometry(size: int) -> bool:
    """Whether a file of ``size`` bytes could be a chunk file (of some slot size)."""
    return size >= 2 * layout.TRAILER_BYTES and size % _direct.ALIGN == 0


def _not_regular(path: str) -> str | None:
    """What is at ``path`` if it exists and is not a regular file (without following a link)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if _stat.S_ISREG(mode) else layout.file_kind(mode)


def _utime(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _oserror(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{name} {e.strerror or e}".strip()
