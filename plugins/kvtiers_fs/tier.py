"""``FsTier``: the ``fs`` tier, one checksummed file per chunk under ``root_dir``.

For local NVMe and for shared file systems (NFS, Lustre, CephFS, 3FS) that many instances
mount at once. See :mod:`kvtiers_fs.layout` for the files, :mod:`kvtiers_fs.index` for the
non-blocking lookup and the LRU bound, :mod:`kvtiers_fs.direct` for O_DIRECT.

The hooks only validate and enqueue: each key of a job is one task on the read pool
(loads) or the write pool (stores), so loads never wait behind stores and a large job is
spread over every thread. A store writes ``[slot, trailer]`` with one ``pwritev`` into a
unique temporary file and renames it into place (an existing chunk file means success);
a load reads both with one ``preadv`` straight into the arena slot and checks the trailer
and the xxh3-128 of the bytes before reporting success.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvtiers import Job, JobResult, Lookup, TierContext, hookimpl
from kvtiers.types import accept_job, check_keys, drain

from . import direct as _direct
from . import layout
from .index import Index, Prober, scan
from .pool import Pool

log = logging.getLogger("kvtiers.fs")

_HIT, _MISS, _RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY


class _JobState:
    __slots__ = ("job_id", "remaining", "failed", "errors", "nbytes", "t0")

    def __init__(self, job_id: int, n: int, t0: float) -> None:
        self.job_id = job_id
        self.remaining = n
        self.failed: list[bytes] = []
        self.errors: list[str] = []
        self.nbytes = 0
        self.t0 = t0


class Corrupt(Exception):
    """A chunk file that is not a valid copy of its key."""


class FsTier:
    """Chunks as files under ``root_dir/<namespace digest>/``.

    Options:
        root_dir: the directory (created if missing); may be shared by many instances.
        max_bytes: bound on this namespace's file bytes as this instance knows them; least
            recently used chunks are deleted (reported through ``ctx.removed``).
        n_read_threads / n_write_threads: sizes of the load and store pools.
        fsync: fsync each chunk file (and its directory) before publishing it.
        direct: O_DIRECT: ``None`` probes and falls back to buffered I/O, ``True`` requires
            it, ``False`` never uses it.
        negative_ttl: seconds a probed ``MISS`` is remembered before the file is checked
            again (files other instances write appear after at most this).
        stale_temp_seconds: age after which a temporary file of a writer on another host
            counts as abandoned (writers on this host are asked directly).
    """

    levels = frozenset({"core", "durable", "shared", "bounded"})

    def __init__(
        self,
        ctx: TierContext,
        *,
        root_dir: str,
        max_bytes: int | None = None,
        n_read_threads: int = 8,
        n_write_threads: int = 8,
        fsync: bool = False,
        direct: bool | None = None,
        negative_ttl: float = 1.0,
        stale_temp_seconds: float = 3600.0,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if n_read_threads < 1 or n_write_threads < 1:
            raise ValueError("n_read_threads and n_write_threads must be >= 1")
        if not root_dir:
            raise ValueError("root_dir must be a non-empty path")
        self.ctx = ctx
        self.arena = ctx.arena
        self.slot_bytes = ctx.arena.slot_bytes
        self.file_bytes = layout.file_bytes(self.slot_bytes)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.stale_temp_seconds = stale_temp_seconds
        self.root_dir = os.path.abspath(root_dir)
        self.nsdir = layout.ensure_namespace(self.root_dir, ctx.namespace)
        self.direct = direct_mode = direct_choice(self.nsdir, direct, ctx.arena)
        self._rflags = os.O_RDONLY | os.O_CLOEXEC | (_direct.O_DIRECT if direct_mode else 0)
        self._wflags = (
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (_direct.O_DIRECT if direct_mode else 0)
        )
        self.index = Index(negative_ttl)
        tag = ctx.namespace.digest[:6]
        self._reads = Pool(f"kvtiers-fs-read-{tag}", n_read_threads)
        self._writes = Pool(f"kvtiers-fs-write-{tag}", n_write_threads)
        self._prober = Prober(self.index, self.path, f"kvtiers-fs-probe-{tag}")
        self._finished: deque[JobResult] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._closed = False
        self._stopping = False
        self._dirs: set[str] = set()
        self.scanned = threading.Event()
        self.stale_removed: list[str] = []
        self.index.begin_scan()
        self._scanner = threading.Thread(target=self._scan, name=f"kvtiers-fs-scan-{tag}", daemon=True)
        self._scanner.start()

    @classmethod
    def conformance_config(cls, scratch) -> dict:
        """Options for a conformance test instance: a directory in the suite's scratch."""
        return {"root_dir": str(scratch)}

    @classmethod
    def bench_baseline(cls, tier: FsTier, chunk_bytes: int):
        """Raw pwritev/preadv beside ``tier``'s directory, same mode and threads, for
        ``kvtiers bench tier fs`` (see :mod:`kvtiers_fs.bench`)."""
        from .bench import baseline

        return baseline(tier, chunk_bytes)

    # -- paths ---------------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        """The chunk file of ``key``."""
        return layout.chunk_path(self.nsdir, key)

    # -- background scan -------------------------------------------------------------------
    def _scan(self) -> None:
        try:
            self._reads.start()  # here, not in the first submit: submits never wait on thread starts
            self._writes.start()
            self._prober.start()
            found, removed = scan(self.nsdir, stale_after=self.stale_temp_seconds, stopping=lambda: self._stopping)
            self.stale_removed = removed
            if removed:
                log.info("fs tier: removed %d stale temporary file(s) under %s", len(removed), self.nsdir)
            if not self._stopping:
                self.index.merge_scan(found)
                self._evict_to_bound()
        except Exception:
            log.exception("fs tier: scan of %s failed", self.nsdir)
        finally:
            self.index.dropped_during_scan = None
            self.scanned.set()

    def _evict_to_bound(self) -> None:
        victims = self.index.reserve(0, self.max_bytes)
        self._remove(victims, "evicted")

    def _remove(self, keys: list[bytes], reason: str) -> None:
        if not keys:
            return
        for k in keys:
            try:
                os.unlink(self.path(k))
            except FileNotFoundError:
                pass  # another instance removed it first
            except OSError as e:
                log.warning("fs tier: could not remove %s: %s", self.path(k), e)
        # a store of the same key may have found the old file and re-added it meanwhile
        for k in [k for k in keys if k in self.index.entries]:
            if not os.path.exists(self.path(k)):
                self.index.drop(k)
        self.ctx.removed(keys, reason)

    # -- hooks -------------------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        keys = check_keys(keys)
        entries = self.index.entries
        out = [_HIT if k in entries else None for k in keys]
        if None in out:
            absent, unread = self.index.absent, self.index.unread
            now = time.monotonic()
            probe = []
            for i, k in enumerate(keys):
                if out[i] is None:
                    exp = absent.get(k)
                    if exp is not None and (exp > now or k in unread):
                        unread.discard(k)
                        out[i] = _MISS
                    elif k in self.index.entries:  # a probe or store landed meanwhile
                        out[i] = _HIT
                    else:
                        out[i] = _RETRY
                        probe.append(k)
            if probe and not self._closed:
                self._prober.request(probe)
        return out

    def _accept(self, job: Job) -> _JobState:
        accept_job(job, self.arena, closed=self._closed)
        js = _JobState(job.job_id, len(job.keys), time.perf_counter())
        with self._lock:
            self._pending += 1
        if not job.keys:
            self._finish(js)
        return js

    @hookimpl
    def submit_store(self, job: Job) -> None:
        js = self._accept(job)
        if job.keys:
            store = self._store_key
            self._writes.submit_many([_bind(store, js, k, s) for k, s in zip(job.keys, job.slots, strict=True)])

    @hookimpl
    def submit_load(self, job: Job) -> None:
        js = self._accept(job)
        if job.keys:
            load = self._load_key
            self._reads.submit_many([_bind(load, js, k, s) for k, s in zip(job.keys, job.slots, strict=True)])

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        return drain(self._finished)

    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        for k in check_keys(keys):
            self.index.touch(k)

    @hookimpl
    def backlog(self) -> int:
        return self._pending

    @hookimpl
    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._pending:
                self._idle.wait()
        self._stopping = True
        self._prober.stop()
        self._scanner.join()
        self._reads.shutdown()
        self._writes.shutdown()

    # -- completion ------------------------------------------------------------------------
    def _key_done(self, js: _JobState, key: bytes, nbytes: int, error: str | None) -> None:
        with self._lock:
            if error is None:
                js.nbytes += nbytes
            else:
                js.failed.append(key)
                if len(js.errors) < 3:
                    js.errors.append(error)
            js.remaining -= 1
            done = js.remaining == 0
        if done:
            self._finish(js)

    def _finish(self, js: _JobState) -> None:
        error = None
        if js.failed:
            error = f"{len(js.failed)} key(s) failed: " + "; ".join(js.errors)
        self._finished.append(JobResult(js.job_id, tuple(js.failed), js.nbytes, time.perf_counter() - js.t0, error))
        with self._lock:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

    # -- one key -----------------------------------------------------------------------------
    def _store_key(self, js: _JobState, key: bytes, slot: int, scratch: memoryview) -> None:
        final = self.path(key)
        try:
            st = os.stat(final)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._key_done(js, key, 0, f"{key.hex()}: stat: {e.strerror or e}")
            return
        else:  # content-addressed: an existing chunk means success
            if st.st_size == self.file_bytes:
                self.index.add(key, st.st_size)
                _utime(final)
                self._key_done(js, key, 0, None)
                return
        nbytes = self.file_bytes
        if self.max_bytes is not None and nbytes > self.max_bytes:
            self._key_done(js, key, 0, f"chunk file of {nbytes} bytes exceeds max_bytes={self.max_bytes}")
            return
        self._remove(self.index.reserve(nbytes, self.max_bytes, key), "evicted")
        try:
            self._write(key, final, self.arena[slot], scratch)
        except BaseException as e:
            self.index.unreserve(nbytes, key)
            if not isinstance(e, OSError):
                raise
            self._key_done(js, key, 0, f"{key.hex()}: {_oserror(e)}")
            return
        self.index.commit(key, nbytes)
        self._key_done(js, key, self.slot_bytes, None)

    def _write(self, key: bytes, final: str, data: memoryview, trailer: memoryview) -> None:
        layout.pack_trailer(trailer, key, len(data), layout.data_digest(data))
        tmp = layout.temp_path(final)
        fd = self._open_temp(tmp)
        try:
            try:
                n = os.pwritev(fd, [data, trailer], 0)
                if n != len(data) + len(trailer):
                    raise OSError(errno.ENOSPC, f"short write ({n} of {len(data) + len(trailer)} bytes)")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self.fsync:
            _fsync_dir(os.path.dirname(final))

    def _open_temp(self, tmp: str) -> int:
        try:
            return os.open(tmp, self._wflags, 0o644)
        except FileNotFoundError:  # first chunk in this directory, or gc removed it
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            return os.open(tmp, self._wflags, 0o644)

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
                self._key_done(js, key, 0, f"{key.hex()}: open: {_oserror(e)}")
                return
            try:
                self._read(fd, key, self.arena[slot], scratch)
            except Corrupt as e:
                self._discard_corrupt(path, fd, key)
                self._key_done(js, key, 0, f"{key.hex()}: corrupt chunk removed: {e}")
                return
            except OSError as e:
                self._key_done(js, key, 0, f"{key.hex()}: read: {_oserror(e)}")
                return
            finally:
                os.close(fd)
        finally:
            self.index.unpin(key)
        if not self.index.touch(key):
            self.index.add(key, self.file_bytes)
        _utime(path)
        self._key_done(js, key, self.slot_bytes, None)

    def _read(self, fd: int, key: bytes, data: memoryview, trailer: memoryview) -> None:
        n = os.preadv(fd, [data, trailer], 0)
        if n != len(data) + len(trailer):
            raise Corrupt(f"file is {n} bytes long, expected {len(data) + len(trailer)}")
        try:
            digest = layout.check_trailer(trailer, key, len(data))
        except ValueError as e:
            size = os.fstat(fd).st_size
            if size != self.file_bytes and size >= layout.TRAILER_BYTES and size % _direct.ALIGN == 0:
                # a chunk of another slot size; not ours to delete
                raise OSError(errno.EINVAL, f"chunk file holds {size - layout.TRAILER_BYTES} bytes") from None
            raise Corrupt(str(e)) from None
        if layout.data_digest(data) != digest:
            raise Corrupt("checksum mismatch")

    def _discard_corrupt(self, path: str, fd: int, key: bytes) -> None:
        try:  # only the file we read: another instance may have published a good copy since
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass
        self.index.drop(key)
        log.warning("fs tier: removed corrupt chunk %s", path)
        self.ctx.removed([key], "corrupt")


def direct_choice(nsdir: str, want: bool | None, arena) -> bool:
    """Whether to use O_DIRECT for this arena under ``nsdir`` (probed once per root)."""
    return _direct.choose(nsdir, want, _direct.is_aligned(arena.buffer))


def _bind(fn, js: _JobState, key: bytes, slot: int):
    return lambda scratch: fn(js, key, slot, scratch)


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
