"""kvtiers-sqlite: a persistent kvtiers tier on SQLite, from the standard library only.

One database file holds every namespace: a table ``chunks_<digest>`` per namespace, and a
``namespaces`` table recording each namespace's description, checked at open. Several
instances may share the file (WAL mode, a busy timeout, ``INSERT OR IGNORE``: concurrent
stores of one key leave one valid copy). Each chunk is stored with its CRC-32 and checked on
every load; a bad chunk is deleted, reported with ``self.evicted(keys, "corrupt")`` (so it
answers MISS and reaches ``ctx.removed``) and fails its key. SQLite's transactions make a
store killed half-way leave nothing behind.

With ``max_bytes`` the database is bounded: a store that takes a namespace's table past it
deletes the oldest rows (first stored, first out) in the same transaction and reports them
with ``self.evicted``. Such a tier takes pins (rule 13): ``pin`` keeps keys this instance
knows are stored from its own evictions until their time, at most half of ``max_bytes``;
pins live in the instance's memory (another instance on the same file does not see them).

Built on :class:`kvtiers.AsyncTier`: four coroutines, plus ``put_many``/``get_many_into`` so
that a job is one transaction; the base class does the rest. SQLite calls run on the tier's
own thread, never on the caller's.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import kvtiers

__version__ = "0.1.0"
T = TypeVar("T")


class SqliteTier(kvtiers.AsyncTier):
    """Chunks as rows ``(key, crc, data)`` of an SQLite database at ``path``; with
    ``max_bytes``, at most that many bytes of chunks per namespace."""

    levels = frozenset({"core", "durable", "shared", "bounded"})

    def __init__(self, ctx: kvtiers.TierContext, *, path: str, busy_timeout: float = 30.0,
                 max_bytes: int | None = None) -> None:
        super().__init__(ctx)
        if max_bytes is not None and max_bytes < 0:  # the SDK has checked the type (int | None)
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._pins: dict[bytes, float] = {}  # key -> monotonic end (inf: until unpinned)
        self._leaving: set[bytes] = set()  # chosen for eviction, not yet reported
        self._pins_lock = threading.Lock()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        ns = ctx.namespace
        self.table = f"chunks_{ns.digest}"  # hex digits only: safe as an identifier
        self.db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS namespaces (digest TEXT PRIMARY KEY, document TEXT)")
            self.db.execute("INSERT OR IGNORE INTO namespaces VALUES (?, ?)", (ns.digest, ns.document_bytes().decode()))
            (doc,) = self.db.execute("SELECT document FROM namespaces WHERE digest = ?", (ns.digest,)).fetchone()
            ns.check_document(doc, where=f"{path}: namespace {ns.digest}")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} (key BLOB PRIMARY KEY, crc INTEGER, data BLOB)")
        except BaseException:
            self.db.close()
            raise
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvtiers-sqlite")  # one thread owns the connection

    @classmethod
    def conformance_config(cls, scratch: Path) -> dict:
        """Options for a test instance of the conformance suite."""
        return {"path": str(scratch / "kv.sqlite3")}

    @classmethod
    def conformance_corrupt(cls, config: dict, namespace: kvtiers.Namespace, key: bytes) -> None:
        """Flip one byte of the stored chunk of ``key`` in place, as a disk fault would (the
        suite's rule 4 check; the CRC-32 must catch it)."""
        table = f"chunks_{namespace.digest}"
        db = sqlite3.connect(config["path"], timeout=float(config.get("busy_timeout", 30.0)))
        try:
            (blob,) = db.execute(f"SELECT data FROM {table} WHERE key = ?", (key,)).fetchone()
            bad = bytearray(blob)
            bad[len(bad) // 2] ^= 0xFF
            with db:
                db.execute(f"UPDATE {table} SET data = ? WHERE key = ?", (bytes(bad), key))
        finally:
            db.close()

    async def _sql(self, query: str, *args: object) -> list[tuple]:
        """Run one statement (its own transaction) on the tier's thread; return its rows."""
        run = lambda: self.db.execute(query, args).fetchall()  # noqa: E731
        return await asyncio.get_running_loop().run_in_executor(self.pool, run)

    async def _transaction(self, fn: Callable[[], T], begin: str = "BEGIN IMMEDIATE") -> T:
        """Run ``fn`` in one transaction on the tier's thread (rolled back if it raises)."""

        def run() -> T:
            self.db.execute(begin)
            try:
                out = fn()
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return out

        return await asyncio.get_running_loop().run_in_executor(self.pool, run)

    async def _drop_corrupt(self, keys: list[bytes]) -> None:
        """Report damaged chunks (they answer MISS from now on), then delete them."""
        self.evicted(keys, "corrupt")  # first: reported even if this coroutine is cancelled below
        rows = [(k,) for k in keys]
        query = f"DELETE FROM {self.table} WHERE key = ?"
        await self._transaction(lambda: self.db.executemany(query, rows).close())

    async def exists(self, key: bytes) -> bool:
        return bool(await self._sql(f"SELECT 1 FROM {self.table} WHERE key = ?", key))

    async def put(self, key: bytes, data: memoryview) -> None:
        await self.put_many([(key, data)])

    async def get_into(self, key: bytes, out: memoryview) -> bool:
        rows = await self._sql(f"SELECT crc, data FROM {self.table} WHERE key = ?", key)
        if not rows:
            return False
        crc, blob = rows[0]
        if len(blob) != len(out) or zlib.crc32(blob) != crc:
            await self._drop_corrupt([key])
            raise ValueError(f"chunk {key.hex()} is corrupt (size or CRC-32 mismatch); removed")
        out[:] = blob  # on the I/O loop, only if not cancelled: the slot is still ours
        return True

    # -- batches: one transaction per job ----------------------------------------------
    async def put_many(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """Store a whole job in one transaction: all of it or (on an error) none of it."""
        rows = []
        for key, data in items:  # copy now, on the loop: the thread never sees a slot (rule 6)
            blob = bytes(data)
            rows.append((key, zlib.crc32(blob), blob))
        size = len(rows[0][2]) if rows else 0
        if self.max_bytes is not None and size > self.max_bytes:
            raise ValueError(f"chunk of {size} bytes exceeds max_bytes={self.max_bytes}")
        query = f"INSERT OR IGNORE INTO {self.table} VALUES (?, ?, ?)"
        gone: list[bytes] = []

        def store() -> None:
            # close the cursor on the tier's thread: one returned to the loop would be finalised
            # there, racing the next statement ("InterfaceError: bad parameter or other API misuse")
            self.db.executemany(query, rows).close()
            self._evict_over_bound(size, gone)

        try:
            await self._transaction(store)
            if gone:
                self.evicted(gone)
        finally:
            if gone:
                with self._pins_lock:
                    self._leaving.difference_update(gone)

    # -- the bound and pins ----------------------------------------------------------------
    def _evict_over_bound(self, size: int, gone: list[bytes]) -> None:
        """On the tier's thread, inside the store's transaction: delete the oldest unpinned
        rows until the table fits ``max_bytes`` (every chunk is one slot of ``size``); their
        keys go to ``gone`` and, until reported, to ``_leaving`` (no pin takes them)."""
        if self.max_bytes is None or not size:
            return
        (rows,) = self.db.execute(f"SELECT COUNT(*) FROM {self.table}").fetchone()
        over = rows - self.max_bytes // size
        if over <= 0:
            return
        # the oldest rows, enough to pass over every pin (at most half the bound), not the whole table
        most_pinned = self.max_bytes // 2 // size
        oldest = self.db.execute(f"SELECT key FROM {self.table} ORDER BY rowid LIMIT ?", (over + most_pinned,))
        oldest = oldest.fetchall()
        with self._pins_lock:
            kept = self._pinned_now()
            gone.extend(k for (k,) in oldest if k not in kept)
            del gone[over:]
            self._leaving.update(gone)
        self.db.executemany(f"DELETE FROM {self.table} WHERE key = ?", [(k,) for k in gone]).close()

    def _pinned_now(self) -> set[bytes]:
        """The keys whose pins have not ended, dropping the ended ones (under ``_pins_lock``)."""
        now = time.monotonic()
        for k in [k for k, end in self._pins.items() if end <= now]:
            del self._pins[k]
        return set(self._pins)

    @kvtiers.hookimpl
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        """Keep ``keys`` from this instance's evictions for ``seconds`` (None: until unpinned).
        All or nothing: refused, with the reason, for a key this instance does not know is
        stored, or when the pinned chunks would pass half of ``max_bytes``."""
        keys = list(keys)
        end = math.inf if seconds is None else time.monotonic() + seconds
        stored = set(self.known_stored(keys))
        with self._pins_lock:
            absent = [k for k in keys if k not in stored or k in self._leaving]
            if absent:
                first = absent[0].hex()[:16]
                return f"sqlite tier: {len(absent)} of {len(keys)} key(s) not stored here (first {first})"
            if self.max_bytes is not None:
                total = len(self._pinned_now() | set(keys)) * self.ctx.arena.slot_bytes
                if total > self.max_bytes // 2:
                    return (f"sqlite tier: pinning {len(keys)} chunk(s) would pin {total} bytes, "
                            f"past half of max_bytes={self.max_bytes}")
            for k in keys:
                self._pins[k] = max(end, self._pins.get(k, end))
        return None

    @kvtiers.hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        """End the pins of ``keys`` now (unknown keys are ignored)."""
        with self._pins_lock:
            for k in keys:
                self._pins.pop(k, None)

    async def get_many_into(self, items: Sequence[tuple[bytes, memoryview]]) -> dict[bytes, object]:
        """Load a whole job in one read transaction; checks run on the tier's thread, the
        copies into the slots on the loop (skipped if cancelled)."""
        size = self.ctx.arena.slot_bytes
        keys = [key for key, _ in items]

        def select() -> dict[bytes, bytes | None]:
            found: dict[bytes, bytes | None] = {}
            for i in range(0, len(keys), 500):  # under SQLite's limit on parameters
                part = keys[i:i + 500]
                marks = ",".join("?" * len(part))
                for key, crc, blob in self.db.execute(
                        f"SELECT key, crc, data FROM {self.table} WHERE key IN ({marks})", part):
                    found[key] = blob if len(blob) == size and zlib.crc32(blob) == crc else None
            return found

        found = await self._transaction(select, begin="BEGIN")
        failed: dict[bytes, object] = {}
        corrupt = []
        for key, out in items:
            if key not in found:
                failed[key] = False  # not stored
            elif (blob := found[key]) is None:
                corrupt.append(key)
                failed[key] = ValueError(f"chunk {key.hex()} is corrupt (size or CRC-32 mismatch); removed")
            else:
                out[:] = blob
        if corrupt:
            await self._drop_corrupt(corrupt)
        return failed

    async def delete(self, key: bytes) -> None:
        await self._sql(f"DELETE FROM {self.table} WHERE key = ?", key)
        self.forget([key])

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self.db.close)
        self.pool.shutdown(wait=True)


@kvtiers.hookimpl
def register_tiers(register) -> None:
    """Offer the ``sqlite`` tier type (found through the ``kvtiers`` entry point)."""
    register("sqlite", SqliteTier)
