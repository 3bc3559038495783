"""kvtiers-sqlite: a persistent kvtiers tier on SQLite, from the standard library only.

One database file holds every namespace: a table ``chunks_<digest>`` per namespace, and a
``namespaces`` table recording each namespace's description, checked at open. Several
instances may share the file (WAL mode, a busy timeout, ``INSERT OR IGNORE``: concurrent
stores of one key leave one valid copy). Each chunk is stored with its CRC-32 and checked on
every load; a bad chunk is deleted, reported with ``self.evicted(keys, "corrupt")`` (so it
answers MISS and reaches ``ctx.removed``) and fails its key. SQLite's transactions make a
store killed half-way leave nothing behind.

Built on :class:`kvtiers.AsyncTier`: four coroutines, plus ``put_many``/``get_many_into`` so
that a job is one transaction; the base class does the rest. SQLite calls run on the tier's
own thread, never on the caller's.
"""

from __future__ import annotations

import asyncio
import sqlite3
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import kvtiers

__version__ = "0.1.0"
T = TypeVar("T")


class SqliteTier(kvtiers.AsyncTier):
    """Chunks as rows ``(key, crc, data)`` of an SQLite database at ``path``."""

    levels = frozenset({"core", "durable", "shared"})

    def __init__(self, ctx: kvtiers.TierContext, *, path: str, busy_timeout: float = 30.0) -> None:
        super().__init__(ctx)
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
        blob = bytes(data)  # copy now: once this coroutine ends or is cancelled, the slot is not ours
        await self._sql(f"INSERT OR IGNORE INTO {self.table} VALUES (?, ?, ?)", key, zlib.crc32(blob), blob)

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
        query = f"INSERT OR IGNORE INTO {self.table} VALUES (?, ?, ?)"
        # close the cursor on the tier's thread: one returned to the loop would be finalised
        # there, racing the next statement ("InterfaceError: bad parameter or other API misuse")
        await self._transaction(lambda: self.db.executemany(query, rows).close())

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
