"""The compressing wrapper: :class:`CompressedTier`, the hooks of a compressed tier, in front
of the tier opened on a staging arena of smaller slots, *pieces*
(:mod:`kvtiers.compression.compressing`).

A store encodes ``arena[slot]`` on the wrapper's threads (:mod:`kvtiers.compression.codecs`),
copies the encoded bytes into one staging slot (a chunk that does not fit takes more: its
further pieces go under keys derived from its key, :func:`piece_key`) with the rest of the
slot zeroed, and stores them in one job of the tier. A load lets the tier fill one staging
slot, reads how many pieces the chunk has, loads the others if any, then decodes into
``arena[slot]``. The caller's slots and arena never hold encoded bytes, and the tier's never
hold the caller's. The tier's hooks are called on the caller's thread only, one at a time,
as the contract says; a tenant given with a submit (``as_tenant``) goes with the tier's jobs
of that submit, so an encrypted tier under it seals for that tenant.

Layer 1: no torch, no engine.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..encryption.scope import TenantScope
from ..hookspecs import hookimpl
from ..types import POLL_BUDGET_S, Arena, Job, JobResult, Lookup, TierContext, accept_job, drain
from .codecs import HEADER, PIECES_AT, Codec, DecodeFailed, decode_into, read_header

#: a job is encoded (decoded) by the workers in pieces of about this many chunk bytes
BATCH_BYTES = 8 << 20


def piece_key(key: bytes, i: int) -> bytes:
    """The key of piece ``i`` (1, 2, ...) of the chunk under ``key``: 32 bytes that no
    caller's key of another length can be, and that differ for every ``(key, i)``."""
    return hashlib.blake2b(key, digest_size=32, person=b"kvtiers-piece", salt=i.to_bytes(8, "little")).digest()


class PieceBook:
    """What the wrapper remembers of pieces, bounded (``capacity`` keys each): the caller's
    key of each further piece it stored or loaded, so the tier's removal of a piece is
    reported as the removal of its chunk (which can no longer load), and the keys whose
    load found a piece missing or damaged: those answer MISS until stored again.
    :meth:`removed` is the sink of the tier's context."""

    def __init__(self, removed: Callable[[Sequence[bytes], str], None], capacity: int = 1 << 16) -> None:
        self._outer = removed
        self._cap = capacity
        self._lock = threading.Lock()
        self._owner: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # piece key -> key
        self._count: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> pieces (> 1)
        self._broken: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def note(self, key: bytes, pieces: int) -> None:
        """``key``'s chunk is stored (or was loaded) whole, in ``pieces`` pieces."""
        with self._lock:
            self._broken.pop(key, None)
            if pieces < 2:
                return
            self._count[key] = pieces
            self._count.move_to_end(key)
            for i in range(1, pieces):
                self._owner[piece_key(key, i)] = key
            while len(self._count) > self._cap:
                old, n = self._count.popitem(last=False)
                for i in range(1, n):
                    self._owner.pop(piece_key(old, i), None)

    def broken(self, key: bytes) -> None:
        """``key`` did not load whole: it answers MISS until stored again."""
        with self._lock:
            self._broken[key] = None
            while len(self._broken) > self._cap:
                self._broken.popitem(last=False)

    def is_broken(self, key: bytes) -> bool:
        return key in self._broken

    def chunk_of(self, tier_key: bytes) -> bytes:
        """The caller's key that ``tier_key`` (a key the tier got) is a piece of, as far as
        this instance knows; ``tier_key`` itself otherwise."""
        return self._owner.get(tier_key, tier_key)

    def pieces(self, key: bytes) -> int:
        """How many pieces ``key`` has, as far as this instance knows (1: one, or unknown)."""
        return self._count.get(key, 1)

    def removed(self, keys: Sequence[bytes], reason: str) -> None:
        """The tier dropped ``keys``: a piece's removal is its chunk's."""
        out = []
        with self._lock:
            for k in keys:
                owner = self._owner.pop(k, None)
                if owner is not None:
                    self._broken[owner] = None
                    out.append(owner)
                else:
                    self._count.pop(k, None)
                    out.append(k)
        if out:
            self._outer(out, reason)


class _Outer:
    """One job of the caller and its progress."""

    __slots__ = ("job_id", "kind", "remaining", "failed", "errors", "nbytes", "t0", "tenant")

    def __init__(self, job: Job, kind: str, tenant: tuple[str | None] | None) -> None:
        self.job_id = job.job_id
        self.kind = kind
        self.remaining = len(job.keys)
        self.failed: list[bytes] = []
        self.errors: list[str] = []
        self.nbytes = 0
        self.t0 = time.perf_counter()
        #: the tenant given with the submit (None: none given)
        self.tenant = tenant


class _Item:
    """One chunk waiting for staging slots: a store with its encoded bytes, a load of its
    first piece (``data`` None), or a load of its further pieces (``data``: the first)."""

    __slots__ = ("outer", "key", "slot", "data", "need", "staged")

    def __init__(self, outer: _Outer, key: bytes, slot: int, data: bytes | None, need: int) -> None:
        self.outer = outer
        self.key = key
        self.slot = slot
        self.data = data
        self.need = need
        self.staged: list[int] = []


class CompressedTier:
    """The hooks of a compressed tier around the tier's handle ``inner`` (opened on the
    staging arena ``inner.ctx.arena``, whose slots are the pieces). See the module docstring.
    ``stats`` counts chunks encoded and decoded, their bytes (``raw_bytes``, ``stored_bytes``:
    the pieces' bytes the tier got), chunks of more than one piece, and failures by reason."""

    def __init__(self, inner: Any, ctx: TierContext, codec: Codec, book: PieceBook, *, threads: int = 4) -> None:
        self.inner = inner
        self.book = book
        self.ctx = ctx
        self.codec = codec
        self.staging: Arena = inner.ctx.arena
        self.piece_bytes = self.staging.slot_bytes
        self.slot_bytes = ctx.arena.slot_bytes
        self._free = list(range(len(self.staging)))[::-1]
        self._waiting: collections.deque[_Item] = collections.deque()
        self._inner_jobs: dict[int, tuple[str, list[_Item]]] = {}
        self._ids = iter(range(1, 1 << 62))
        self._done: collections.deque[tuple[str, _Outer, list]] = collections.deque()
        self._results: collections.deque[JobResult] = collections.deque()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="kvtiers-compress")
        self._in_pool = 0
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._scope = TenantScope()
        self.stats: collections.Counter[str] = collections.Counter()
        from ..metrics import tier_metrics

        m = tier_metrics(ctx)
        self._m_bytes = m.counter("kvtiers_compress_bytes",
                                  "Bytes of chunks compressed, before (raw) and after (stored)", ["op", "kind"])
        self._m_failed = m.counter("kvtiers_compress_failures", "Chunks that failed to encode or decode",
                                   ["op"])

    @property
    def ratio(self) -> float:
        """Chunk bytes stored over the bytes the tier got for them (1.0 before any store)."""
        return self.stats["raw_bytes"] / self.stats["stored_bytes"] if self.stats["stored_bytes"] else 1.0

    # -- tenants (an encrypted tier under this one) -----------------------------------------
    def note_tenant(self, keys: Sequence[bytes], tenant: str | None) -> None:
        """Passed to the tier below (an encrypted one notes the keys' tenant)."""
        note = getattr(getattr(self.inner, "hooks", None), "note_tenant", None)
        if note is not None:
            note(keys, tenant)

    @contextlib.contextmanager
    def tenant_scope(self, tenant: str | None) -> Iterator[None]:
        """Inside the block, the lookups and submits are ``tenant``'s: the tier below gets
        the tenant with each of its calls made for them, however much later."""
        with self._scope.enter(tenant), self._inner_scope((tenant,)):
            yield

    def _inner_scope(self, tenant: tuple[str | None] | None) -> contextlib.AbstractContextManager:
        scope = getattr(getattr(self.inner, "hooks", None), "tenant_scope", None)
        if scope is None or tenant is None:
            return contextlib.nullcontext()
        return scope(tenant[0])

    # -- hooks ------------------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        answers = self.inner.lookup(keys)
        broken = self.book.is_broken
        return [Lookup.MISS if a is Lookup.HIT and broken(k) else a for k, a in zip(keys, answers, strict=True)]

    @hookimpl
    def submit_store(self, job: Job) -> None:
        outer = self._accept(job, "store")
        if outer is None:
            return
        arena = self.ctx.arena
        items = list(zip(job.keys, job.slots, strict=True))
        for batch in self._batches(items):
            self._spawn("encoded", outer, batch, lambda b: self._encode(arena, b))

    @hookimpl
    def submit_load(self, job: Job) -> None:
        outer = self._accept(job, "load")
        if outer is None:
            return
        self._waiting.extend(_Item(outer, k, s, None, 1) for k, s in zip(job.keys, job.slots, strict=True))
        self._drive(budget_s=POLL_BUDGET_S)

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        self._drive(budget_s=POLL_BUDGET_S)
        return drain(self._results)

    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        pieces = self.book.pieces
        self.inner.touch([pk for k in keys for pk in [k, *(piece_key(k, i) for i in range(1, pieces(k)))]])

    def _tier_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Every key the tier holds for ``keys``: each chunk's first piece and the others."""
        pieces = self.book.pieces
        return [pk for k in keys for pk in [k, *(piece_key(k, i) for i in range(1, pieces(k)))]]

    @hookimpl
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        return self.inner.pin(self._tier_keys(keys), seconds)  # every piece (a tier without the hook says so)

    @hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        self.inner.unpin(self._tier_keys(keys))

    @hookimpl
    def backlog(self) -> int:
        return self._pending

    @hookimpl
    def close(self) -> None:
        """Finish every accepted job (bounded), close the tier, fail what never reached it."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            self._drive()
            if not self._busy() and not (self._waiting and len(self._free) >= self._waiting[0].need):
                break
            time.sleep(0.001)
        self.inner.close()
        self._pool.shutdown(wait=True)
        self._drive(final=True)
        for it in self._waiting:
            self._fail(it.outer, [it.key], "tier closed before it was staged")
        self._waiting.clear()
        for _kind, items in self._inner_jobs.values():
            for it in items:
                self._fail(it.outer, [it.key], "tier closed before it finished")
        self._inner_jobs.clear()

    # -- work -------------------------------------------------------------------------------
    def _accept(self, job: Job, kind: str) -> _Outer | None:
        accept_job(job, self.ctx.arena, closed=self._closed)
        outer = _Outer(job, kind, self._scope.current())
        self._pending += 1
        if not job.keys:
            self._finish(outer)
            return None
        return outer

    def _busy(self) -> bool:
        with self._lock:
            return self._in_pool > 0 or bool(self._done)

    def _batches(self, items: list) -> list[list]:
        n = max(1, BATCH_BYTES // self.slot_bytes)
        return [items[i:i + n] for i in range(0, len(items), n)]

    def _spawn(self, what: str, outer: _Outer, batch: list, fn: Any) -> None:
        with self._lock:
            self._in_pool += 1

        def run() -> None:
            try:
                out = fn(batch)
            except BaseException as e:  # never lose a batch: its keys fail with the reason
                why = f"{type(e).__name__}: {e}"
                out = [(b[0], b[1], why) for b in batch] if what == "encoded" else [(b[0], why) for b in batch]
            with self._lock:
                self._done.append((what, outer, out))
                self._in_pool -= 1

        self._pool.submit(run)

    def _encode(self, arena: Arena, batch: list[tuple[bytes, int]]) -> list[tuple[bytes, int, bytes | str]]:
        out: list[tuple[bytes, int, bytes | str]] = []
        for k, s in batch:
            try:
                data = self.codec.encode(arena[s])
                need = -(-len(data) // self.piece_bytes)
                if need > 1:  # the header says how many pieces, so a load knows what else to fetch
                    data = b"".join((data[:PIECES_AT], need.to_bytes(2, "little"), data[PIECES_AT + 2:]))
                out.append((k, s, data))
            except Exception as e:
                out.append((k, s, f"{type(e).__name__}: {e}"))
        return out

    def _decode(self, batch: list[tuple[bytes, int, Any]]) -> list[tuple[bytes, str | None]]:
        arena, dtype = self.ctx.arena, self.codec.dtype
        out: list[tuple[bytes, str | None]] = []
        for k, s, data in batch:
            try:
                decode_into(data, arena[s], dtype)
                out.append((k, None))
            except DecodeFailed as e:
                out.append((k, f"CorruptChunk: {e}"))
            except Exception as e:
                out.append((k, f"{type(e).__name__}: {e}"))
        return out

    def _stage(self, deadline: float | None = None) -> None:
        """Give waiting chunks staging slots, in order, and hand them to the tier: one job
        per kind and caller's job each pass; past ``deadline`` (monotonic) no more chunks
        than the first are staged in this pass."""
        jobs: dict[tuple[int, str], list[_Item]] = {}
        while self._waiting and len(self._free) >= self._waiting[0].need:
            if jobs and deadline is not None and time.monotonic() > deadline:
                break
            it = self._waiting.popleft()
            it.staged = [self._free.pop() for _ in range(it.need)]
            kind = "store" if it.outer.kind == "store" else ("more" if it.data is not None else "load")
            if kind == "store":
                self.book.note(it.key, it.need)  # before the tier sees a piece: it may evict one at once
                data, pb = it.data, self.piece_bytes
                for i, t in enumerate(it.staged):
                    part = data[i * pb:(i + 1) * pb]
                    view = self.staging[t]
                    view[:len(part)] = part
                    if len(part) < pb:
                        view[len(part):] = bytes(pb - len(part))
            jobs.setdefault((id(it.outer), kind), []).append(it)
        for (_o, kind), items in jobs.items():
            self._to_inner(kind, items)

    def _to_inner(self, kind: str, items: list[_Item]) -> None:
        keys: list[bytes] = []
        slots: list[int] = []
        for it in items:
            first = 1 if kind == "more" else 0
            keys += [it.key if first + i == 0 else piece_key(it.key, first + i) for i in range(len(it.staged))]
            slots += it.staged
        jid = next(self._ids)
        job = Job(jid, tuple(keys), tuple(slots))
        outer = items[0].outer
        try:
            with self._inner_scope(outer.tenant):
                (self.inner.submit_store if kind == "store" else self.inner.submit_load)(job)
        except Exception as e:  # the tier refused a job we built: fail its keys, keep going
            for it in items:
                self._release(it)
            self._fail(outer, [it.key for it in items], f"tier refused the {kind}: {type(e).__name__}: {e}")
            return
        self._inner_jobs[jid] = (kind, items)

    def _release(self, it: _Item) -> None:
        self._free.extend(it.staged)
        it.staged = []

    def _fail(self, outer: _Outer, keys: list[bytes], why: str) -> None:
        if not keys:
            return
        outer.failed.extend(keys)
        outer.errors.append(f"{len(keys)} key(s): {why}" if len(keys) > 1 else f"{keys[0].hex()[:32]}: {why}")
        self._account(outer, len(keys))

    def _account(self, outer: _Outer, n: int) -> None:
        if not n:
            return
        outer.remaining -= n
        if outer.remaining == 0:
            self._finish(outer)

    def _finish(self, outer: _Outer) -> None:
        error = None
        if outer.failed:
            error = f"{len(outer.failed)} key(s) failed: " + "; ".join(outer.errors)
        self._results.append(JobResult(outer.job_id, tuple(outer.failed), outer.nbytes,
                                       time.perf_counter() - outer.t0, error))
        self._pending -= 1

    def _drive(self, final: bool = False, budget_s: float | None = None) -> None:
        """Move every job on, on the caller's thread: stage encoded chunks, collect the
        tier's results, hand loaded chunks to the workers to decode. With ``budget_s`` (the
        hooks' calls) it returns once that long has passed and the next call goes on, so a
        poll never blocks for long (rule 5)."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return
            progressed = False
            while self._done:
                if deadline is not None and progressed and time.monotonic() > deadline:
                    return
                with self._lock:
                    what, outer, out = self._done.popleft()
                progressed = True
                self._after(what, outer, out, final)
            for r in self.inner.get_finished_jobs():
                entry = self._inner_jobs.pop(r.job_id, None)
                if entry is not None:
                    progressed = True
                    self._inner_result(entry, r, final)
            if self._waiting and not final and len(self._free) >= self._waiting[0].need:
                self._stage(deadline)
                progressed = True
            if not progressed:
                return

    def _after(self, what: str, outer: _Outer, out: Any, final: bool) -> None:
        if what == "encoded":
            for k, s, data in out:
                if isinstance(data, str):
                    self.stats["encode_failed"] += 1
                    self._m_failed.labels(op="encode").inc()
                    self._fail(outer, [k], f"not encoded: {data}")
                elif final:
                    self._fail(outer, [k], "tier closed before it was stored")
                else:
                    need = -(-len(data) // self.piece_bytes)
                    self._waiting.append(_Item(outer, k, s, data, need))
            return
        # decoded
        bad = [(k, why) for k, why in out if why is not None]
        ok = len(out) - len(bad)
        for k, why in bad:
            self.book.broken(k)
            self.stats["decode_failed"] += 1
            self._m_failed.labels(op="decode").inc()
            self._fail(outer, [k], why)
        self.stats["decoded"] += ok
        outer.nbytes += ok * self.slot_bytes
        self._account(outer, ok)

    def _inner_result(self, entry: tuple[str, list[_Item]], r: JobResult, final: bool) -> None:
        kind, items = entry
        failed = set(r.failed_keys)
        outer = items[0].outer
        why = r.error or "failed in the tier"
        if kind == "store":
            good = 0
            for it in items:
                pieces = len(it.staged)
                self._release(it)
                if it.key in failed or (pieces > 1 and any(piece_key(it.key, i) in failed for i in range(1, pieces))):
                    self._fail(outer, [it.key], why)
                    continue
                good += 1
                raw, stored = self.slot_bytes, pieces * self.piece_bytes
                self.stats["encoded"] += 1
                self.stats["raw_bytes"] += raw
                self.stats["stored_bytes"] += stored
                self.stats["encoded_bytes"] += len(it.data or b"")
                if pieces > 1:
                    self.stats["multi_piece"] += 1
                self._m_bytes.labels(op="store", kind="raw").inc(raw)
                self._m_bytes.labels(op="store", kind="stored").inc(stored)
                it.data = None
            outer.nbytes += good * self.slot_bytes
            self._account(outer, good)
            return
        decode: list[tuple[bytes, int, Any]] = []
        for it in items:
            if kind == "load":
                if it.key in failed:
                    self._release(it)
                    self._fail(outer, [it.key], why)
                    continue
                (t,) = it.staged
                view = self.staging[t]
                try:
                    _c, _w, pieces, _b, _n, _d, plen = read_header(view)
                except DecodeFailed as e:
                    self._release(it)
                    self.book.broken(it.key)
                    self.stats["decode_failed"] += 1
                    self._fail(outer, [it.key], f"CorruptChunk: {e}")
                    continue
                total = HEADER.size + plen
                if pieces == 1 and total <= self.piece_bytes:
                    decode.append((it.key, it.slot, bytes(view[:total])))
                    self._release(it)
                    continue
                need = -(-total // self.piece_bytes) - 1
                if pieces < 2 or need != pieces - 1 or need > len(self.staging):
                    self._release(it)
                    self.book.broken(it.key)
                    self.stats["decode_failed"] += 1
                    self._fail(outer, [it.key], "CorruptChunk: its header's piece count does not match its length")
                    continue
                first = bytes(view)
                self._release(it)
                if final:
                    self._fail(outer, [it.key], "tier closed before its further pieces were loaded")
                else:
                    self._waiting.append(_Item(outer, it.key, it.slot, first, need))
                continue
            # "more": the further pieces
            keys = [piece_key(it.key, i) for i in range(1, len(it.staged) + 1)]
            if any(k in failed for k in keys):
                self._release(it)
                self.book.broken(it.key)
                self._fail(outer, [it.key], f"a further piece is missing: {why}")
                continue
            data = it.data + b"".join(bytes(self.staging[t]) for t in it.staged)
            self.book.note(it.key, len(it.staged) + 1)
            self._release(it)
            decode.append((it.key, it.slot, data))
        if not decode:
            return
        if final or len(decode) * self.slot_bytes <= (256 << 10):
            self._done.append(("decoded", outer, self._decode(decode)))
        else:
            for batch in self._batches(decode):
                self._spawn("decoded", outer, batch, self._decode)
