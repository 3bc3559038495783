"""``FsTier``: the ``fs`` tier, one checksummed file per chunk under ``root_dir``.

For local NVMe and for shared file systems (NFS, Lustre, CephFS, 3FS) that many instances
mount at once. See :mod:`kvtiers_fs.layout` for the files, :mod:`kvtiers_fs.index` for the
non-blocking lookup and the LRU bound, :mod:`kvtiers_fs.bound` for eviction under ``max_bytes``,
:mod:`kvtiers_fs.chunkio` for the store and load of one key, :mod:`kvtiers_fs.direct` for O_DIRECT.

The hooks only validate and enqueue: each key of a job is one task on the read pool
(loads) or the write pool (stores), so loads never wait behind stores and a large job is
spread over every thread. A store writes ``[slot, trailer]`` with one ``pwritev`` into a
unique temporary file and renames it into place (an existing chunk file means success);
a load reads both with one ``preadv`` straight into the arena slot (a chunk of 8 MiB or
more: 4 MiB pieces, hashed as they land; with O_DIRECT several read at once) and checks the trailer and the
xxh3-128 of the bytes before reporting success.

Nothing at a chunk's path can block or mislead a load: files are opened ``O_NONBLOCK |
O_NOFOLLOW`` and anything but a regular file (a FIFO, directory, device, symbolic link) is a
failed key, left alone. ``close`` is bounded by ``close_timeout``: jobs still stuck in I/O
then are reported failed as abandoned and their threads left behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvtiers import Job, JobResult, Lookup, TierContext, hookimpl
from kvtiers.types import accept_job, check_keys, drain, plain_bytes

from . import direct as _direct
from . import layout
from . import snapshot as _snapshot
from .bound import BoundMixin
from .chunkio import ChunkIO, _JobState
from .index import HOT_BATCH, HOT_KEYS, Index, Prober
from .keytable import fingerprints
from .lease import Lease, read_passes
from .pins import PIN_SHARE, PinTable
from .pool import Pool
from .share import Share, budget_for
from .walker import Walker

log = logging.getLogger("kvtiers.fs")

_HIT, _MISS, _RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY


class FsTier(BoundMixin, ChunkIO):
    """Chunks as files under ``root_dir/<namespace digest>/``.

    Options:
        root_dir: the directory (created if missing); may be shared by many instances.
        max_bytes: bound on the namespace directory's chunk bytes, every instance's files
            together: the instance holding the cleaner's lease deletes the least recently used
            (by file mtime and its own use) and lists the directories that changed every
            ``rescan_seconds``; each of the others keeps what it stored that the cleaner has
            not counted yet within a share of the bound (:mod:`kvtiers_fs.share`).
        n_read_threads / n_write_threads: sizes of the load and store pools.
        fsync: fsync each chunk file (and its directory) before publishing it.
        direct: O_DIRECT: ``None`` probes and falls back to buffered I/O, ``True`` requires
            it, ``False`` never uses it.
        negative_ttl: seconds a probed ``MISS`` is remembered before the file is checked
            again (files other instances write appear after at most this).
        stale_temp_seconds: age after which a temporary file whose writer cannot be asked
            counts as abandoned (a writer on another host, or locks unsupported); a writer
            holding its file's lock is never judged abandoned.
        rescan_seconds: with ``max_bytes``, how often the cleaner lists again the
            directories that changed, to learn what other instances stored and removed, and
            how often the others try to take the cleaner's lease (``None``: never).
        snapshot_seconds: how often the cleaner writes the index snapshot (also written at
            close), so that a restart has its full view at once (``None``: only at close).
        close_timeout: the most seconds ``close`` waits for jobs in flight; jobs still stuck
            in I/O then are reported failed ("abandoned on close") and their threads are left
            behind (``None``: wait without bound).
        read_only: never write: no directories, no temporary files, no deletions, no mtime
            updates; stores fail every key. Also implied for a root on a read-only mount.
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
        rescan_seconds: float | None = 30.0,
        snapshot_seconds: float | None = 300.0,
        close_timeout: float | None = 10.0,
        read_only: bool = False,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if n_read_threads < 1 or n_write_threads < 1:
            raise ValueError("n_read_threads and n_write_threads must be >= 1")
        if not root_dir:
            raise ValueError("root_dir must be a non-empty path")
        if read_only and max_bytes is not None:
            raise ValueError("read_only and max_bytes exclude each other: a read-only tier deletes nothing")
        if rescan_seconds is not None and rescan_seconds <= 0:
            raise ValueError(f"rescan_seconds must be > 0 or null, got {rescan_seconds}")
        if close_timeout is not None and close_timeout < 0:
            raise ValueError(f"close_timeout must be >= 0 or null, got {close_timeout}")
        if snapshot_seconds is not None and snapshot_seconds <= 0:
            raise ValueError(f"snapshot_seconds must be > 0 or null, got {snapshot_seconds}")
        self.ctx = ctx
        self.arena = ctx.arena
        self.slot_bytes = ctx.arena.slot_bytes
        self.file_bytes = layout.file_bytes(self.slot_bytes)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.stale_temp_seconds = stale_temp_seconds
        self.rescan_seconds = rescan_seconds
        self.snapshot_seconds = snapshot_seconds
        self.close_timeout = close_timeout
        self.root_dir = os.path.abspath(root_dir)
        self.read_only = read_only
        # why stores fail without trying (None: writable)
        self._no_write = "the tier is read_only" if read_only else None
        if self._no_write is None and _mounted_read_only(self.root_dir):
            self._no_write = f"{self.root_dir} is on a read-only file system"
            log.info("fs tier: %s; loads only, stores fail", self._no_write)
        if self._no_write is not None and not os.path.isdir(self.root_dir):
            # it cannot be created: a typo would look like an empty cache forever
            raise ValueError(f"fs tier: root_dir {self.root_dir} does not exist and cannot be created "
                             f"({self._no_write})")
        self.nsdir = layout.ensure_namespace(self.root_dir, ctx.namespace, read_only=self._no_write is not None)
        self._ns = layout.namespace_tag(ctx.namespace.digest)
        self.direct = direct_mode = _direct.choose(
            self.nsdir, direct, _direct.is_aligned(ctx.arena.buffer), read_only=self._no_write is not None
        )
        # O_NONBLOCK: opening a FIFO never waits for a writer; O_NOFOLLOW: a link is refused
        self._rflags = (
            os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW | (_direct.O_DIRECT if direct_mode else 0)
        )
        self._wflags = (
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (_direct.O_DIRECT if direct_mode else 0)
        )
        self.index = Index(negative_ttl, self.file_bytes)
        # lifetime pins (pin/unpin hooks): at most PIN_SHARE of max_bytes, so eviction keeps the bound
        self.pins = PinTable(None if max_bytes is None else int(PIN_SHARE * max_bytes) // self.file_bytes)
        self.index.pinned = self.pins.held
        tag = ctx.namespace.digest[:6]
        self._reads = Pool(f"kvtiers-fs-read-{tag}", n_read_threads)
        self._writes = Pool(f"kvtiers-fs-write-{tag}", n_write_threads)
        self._prober = Prober(self.index, self.path, f"kvtiers-fs-probe-{tag}", self.file_bytes)
        self._finished: deque[JobResult] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._jobs: set[_JobState] = set()  # accepted, not yet reported
        self._closed = False
        self._stopping = False
        self._wake = threading.Event()  # ends the rescan wait at close
        self.view_ready = threading.Event()  # the full view is there (a snapshot, or the first listing)
        self.scanned = threading.Event()  # ... and reconciled with the directory (the first listing done)
        self.snapshot_loaded = False
        self._opened_at = time.time()
        self._snapshot_at = 0.0  # when this instance last wrote the snapshot
        self._evicting = threading.Lock()
        self.walker = Walker(self.nsdir, self.index, self.file_bytes)
        # the cleaner's lease: one bounded instance at a time evicts and lists for everyone
        self.lease = Lease(self.nsdir, max_bytes)
        self._bound_warned: set[tuple[str, int]] = set()
        if self._no_write is None:  # the walker reads the file system's clock off the lease file's mtime
            self.walker.clock_path = self.lease.path
        # while another instance is the cleaner: the bytes this one added that it has not counted yet
        self._share = (Share(budget_for(max_bytes, self.file_bytes), lambda: read_passes(self.nsdir))
                       if max_bytes is not None and self._no_write is None else None)
        self._passes: tuple[int, int] | None = None  # as the cleaner: (begun, completed) pass numbers
        if max_bytes is not None and self._no_write is None and not self.lease.try_take():
            self._check_bound()
        self.stale_removed: list[str] = []
        self.scan_problems: list[str] = []  # entries the last scan skipped (unreadable, cannot remove)
        self.last_scan: tuple[float, float] | None = None  # wall-clock start and end of the last scan
        self.abandoned: list[threading.Thread] = []  # threads a timed-out close left behind
        self._scanning = True  # the scanner is at work (not waiting for its next pass)
        self._scanner = threading.Thread(target=self._scan_loop, name=f"kvtiers-fs-scan-{tag}", daemon=True)
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

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace, key: bytes) -> None:
        """Damage the stored chunk of ``key`` in place as a disk fault would: flip bits in
        its payload (first, middle and last data byte), keeping its length and trailer."""
        path = layout.chunk_path(os.path.join(os.path.abspath(config["root_dir"]), namespace.digest), key)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            data_len = size - layout.TRAILER_BYTES
            if data_len <= 0:
                raise ValueError(f"{path}: {size} bytes is no chunk file")
            for off in sorted({0, data_len // 2, data_len - 1}):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x5A]))

    # -- paths ---------------------------------------------------------------------------
    def path(self, key: bytes) -> str:
        """The chunk file of ``key``."""
        return layout.chunk_path(self.nsdir, key)

    # -- background scan -------------------------------------------------------------------
    @property
    def is_cleaner(self) -> bool:
        """Whether this instance keeps the shared bound: it holds the cleaner's lease (or
        the file system has no locks, and every bounded instance cleans)."""
        return self.max_bytes is not None and self._no_write is None and self.lease.held

    @property
    def listed_entries(self) -> int:
        """Directory entries this instance has listed since it opened."""
        return self.walker.listed

    def _scan_loop(self) -> None:
        try:
            self._reads.start()  # here, not in the first submit: submits never wait on thread starts
            self._writes.start()
            self._prober.start()
            self._load_snapshot()
            # the cleaner lists at once, besides what changed, every directory the snapshot
            # vouched for (a snapshot is a hint: it must not hide files from the bound)
            self._scan_once(clean=self._no_write is None, full=not self.snapshot_loaded, verify=self.is_cleaner)
        except ValueError:  # closed before this thread got going: the pools are shut down
            return
        finally:
            self.view_ready.set()
            self.scanned.set()
            self._scanning = False
        every = self.rescan_seconds
        if self.max_bytes is None or every is None or self._no_write is not None:
            return
        while not self._wake.wait(every):
            with self._lock:  # close sets _stopping, then reads _scanning under this lock
                if self._stopping:
                    return
                self._scanning = True
            try:
                self._rescan()
            finally:
                self._scanning = False

    def _rescan(self) -> None:
        """One periodic pass: as the cleaner, scan what changed (and write the snapshot when
        due); otherwise check the bound only."""
        if not self.lease.try_take():
            self._check_bound()
            return  # another instance cleans: this one only stores and reads
        # the directories that changed, and (once, after taking the lease over) those only
        # the snapshot loaded at open vouched for
        self._scan_once(clean=False, full=False, verify=True)
        if self.snapshot_seconds is not None and time.time() - self._snapshot_at >= self.snapshot_seconds:
            self._write_snapshot()

    def _load_snapshot(self) -> None:
        t0 = time.perf_counter()
        got = _snapshot.load(self.nsdir, self.file_bytes, self._ns)
        if got is None:
            return
        table, dirs, _written = got
        self.index.load_table(table)
        self.walker.restore(dirs)
        self.snapshot_loaded = True
        self.view_ready.set()
        log.info("fs tier: index snapshot of %d keys loaded in %.2f s", len(table), time.perf_counter() - t0)

    def _write_snapshot(self) -> None:
        """Write the index snapshot (copies taken under the index lock, written outside it)."""
        if self._no_write is not None or not os.path.isdir(self.nsdir):
            return  # (a namespace directory removed under the tier, e.g. by gc --drop: nothing to describe)
        try:
            with self.index.lock:
                fp, clock = self.index.table.fp.copy(), self.index.table.clock.copy()
                dirs = self.walker.state()
            at = time.time()
            _snapshot.remove_stale_temps(self.nsdir)
            _snapshot.save(self.nsdir, fp, clock, dirs, self.file_bytes, self._ns, at)
            self._snapshot_at = at
        except OSError as e:
            log.warning("fs tier: could not write the index snapshot under %s: %s", self.nsdir, e)

    def _snapshot_due_at_close(self) -> bool:
        """At close: the cleaner writes it; another instance only if nobody wrote one since it opened."""
        if self._no_write is not None or not self.scanned.is_set() or self._stopped_mid_scan:
            return False
        if self.is_cleaner:
            return True
        try:
            return os.stat(_snapshot.path(self.nsdir)).st_mtime < self._opened_at
        except FileNotFoundError:
            return True
        except OSError:
            return False

    _stopped_mid_scan = False

    def _scan_once(self, *, clean: bool, full: bool = True, verify: bool = False) -> None:
        t0 = time.time()
        begun = self._begin_pass()
        try:
            self.walker.removed = []
            self.walker.run(full=full, clean=clean, stale_after=self.stale_temp_seconds,
                            stopping=lambda: self._stopping, verify=verify)
            self.scan_problems = self.walker.problems
            if self.walker.removed:
                self.stale_removed = self.walker.removed
                log.info("fs tier: removed %d stale temporary file(s) under %s", len(self.walker.removed), self.nsdir)
            if self._stopping:
                self._stopped_mid_scan = True
            else:
                self._evict_to_bound()
                self._end_pass(begun)
                self.last_scan = (t0, time.time())
        except Exception:
            log.exception("fs tier: scan of %s failed", self.nsdir)

    # -- hooks -------------------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        index = self.index
        hot = index.hot  # keys found lately: one dict membership test each
        plain = plain_bytes(keys)
        if not plain:
            keys = check_keys(keys)
        # a full hot set asked a big batch: a working set bigger than the set, which the
        # table answers faster than a dict that mostly misses
        out = None
        if hot and (len(hot) < HOT_KEYS or len(keys) <= HOT_BATCH):
            out = [_HIT if k in hot else None for k in keys]
            if None not in out:  # (plain bytes equal to keys found lately are valid keys)
                return out
        if plain:
            keys = check_keys(keys)  # the same objects in the same order, or an error
        if out is None or out.count(None) == len(keys):  # one vectorised pass over them all
            rest = None
            asked = keys
        else:
            rest = [i for i, a in enumerate(out) if a is None]
            asked = [keys[i] for i in rest]
        fps = fingerprints(asked)
        found = index.lookup(asked, fps)
        if rest is None:
            out = [_HIT if known else None for known in found]
        else:
            for i, known in zip(rest, found, strict=True):
                if known:
                    out[i] = _HIT
        if not all(found):
            # the others: a remembered MISS (one vectorised pass of the fixed-size table), a
            # probe or store that landed meanwhile, else RETRY and a probe
            unknown = [j for j, known in enumerate(found) if not known]
            miss = index.absent.answer_fps(fps[unknown], time.monotonic()).tolist()
            probe = []
            for j, m in zip(unknown, miss, strict=True):
                i = j if rest is None else rest[j]
                if m:
                    out[i] = _MISS
                elif keys[i] in index:
                    out[i] = _HIT
                else:
                    out[i] = _RETRY
                    probe.append(keys[i])
            if probe and not self._closed:
                self._prober.request(probe)
        return out

    def _accept(self, job: Job, per_key, pool: Pool) -> None:
        """Take a job and queue ``per_key`` (the store or the load of one key) for each of
        its keys on ``pool``; an empty job is finished at once."""
        accept_job(job, self.arena, closed=self._closed)
        js = _JobState(job.job_id, job.keys, time.perf_counter())
        with self._lock:
            self._pending += 1
            self._jobs.add(js)
        if not job.keys:
            self._finish(js)
        else:
            pool.submit_many([_bind(per_key, js, k, s) for k, s in zip(job.keys, job.slots, strict=True)])

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._accept(job, self._store_key, self._writes)

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._accept(job, self._load_key, self._reads)

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
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Keep ``keys`` (stored here) from eviction by this instance for ``seconds`` (None: until
        unpinned); refused whole for keys not stored here, past the pin cap, or when another
        instance evicts for this bounded root (kvtiers_fs.pins)."""
        keys = check_keys(keys)
        if self.max_bytes is not None and not self.is_cleaner:
            return "fs tier: this instance is not the cleaner of its bounded root: another instance evicts there"
        absent = [k for k in keys if k not in self.index]
        if absent:
            return f"fs tier: {len(absent)} of {len(keys)} key(s) not stored here (first {absent[0].hex()[:16]})"
        why = self.pins.add(keys, seconds)
        if why is None:
            for k in keys:  # a pin is a use: pinned keys start away from the old end eviction searches
                self.index.touch(k)
        return why

    @hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        self.pins.remove(check_keys(keys))

    @hookimpl
    def close(self) -> None:
        """Wait for the jobs in flight, at most ``close_timeout`` seconds; report the ones
        still stuck in I/O as failed ("abandoned on close") and leave their threads behind.
        Returns within about ``close_timeout`` seconds, whatever the file system does."""
        limit = self.close_timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._lock:
            self._closed = True
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            stuck = list(self._jobs)
            for js in stuck:
                js.abandoned = True  # a task that starts or ends from now on reports nothing
        for js in sorted(stuck, key=lambda j: j.job_id):
            self._abandon(js)
        self._stopping = True
        self._wake.set()

        def left() -> float | None:
            return None if deadline is None else max(0.1, deadline - time.monotonic())

        behind = [] if self._prober.stop(left()) else [self._prober._thread]
        self._scanner.join(left())
        with self._lock:  # one waiting for its next pass is not stuck: it ends on its own
            if self._scanner.is_alive() and self._scanning:
                behind.append(self._scanner)
        behind += self._reads.shutdown(left()) + self._writes.shutdown(left())
        if not behind and self._snapshot_due_at_close():
            self._write_snapshot()
        self.lease.release()
        if behind:
            self.abandoned = behind
            log.warning("fs tier: close left %d thread(s) stuck in I/O under %s after %s s: %s",
                        len(behind), self.nsdir, limit, ", ".join(t.name for t in behind))

    def _abandon(self, js: _JobState) -> None:
        with self._lock:
            unfinished = [k for k in js.keys if k not in js.done]
            failed = js.failed + unfinished
            self._jobs.discard(js)
            self._pending -= 1
        error = "; ".join(js.errors) or None
        if unfinished:
            error = (f"{len(failed)} key(s) failed: abandoned on close: {len(unfinished)} key(s) still in I/O "
                     f"after close_timeout={self.close_timeout} s" + (f"; {error}" if error else ""))
        elif failed:
            error = f"{len(failed)} key(s) failed: {error}"
        self._finished.append(JobResult(js.job_id, tuple(failed), js.nbytes, time.perf_counter() - js.t0, error))

    # -- completion ------------------------------------------------------------------------
    def _key_done(self, js: _JobState, key: bytes, nbytes: int, error: str | None) -> None:
        with self._lock:
            if js.abandoned:  # close already reported this job failed
                return
            js.done.add(key)
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
        with self._lock:
            if js.abandoned:
                return
            self._jobs.discard(js)
            self._finished.append(JobResult(js.job_id, tuple(js.failed), js.nbytes, time.perf_counter() - js.t0, error))
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()

def _mounted_read_only(path: str) -> bool:
    """Whether ``path`` (or its nearest existing parent) is on a read-only mount."""
    while True:
        try:
            return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent
        except OSError:
            return False


def _bind(fn, js: _JobState, key: bytes, slot: int):
    def task(scratch: memoryview) -> None:
        if not js.abandoned:  # a job close gave up on never touches its slots again
            fn(js, key, slot, scratch)

    return task
