"""The sealing wrapper: :class:`SealedTier`, the hooks of an encrypted tier, in front of the
tier opened on a staging arena (:mod:`kvtiers.encryption.sealing`).

A store seals ``arena[slot]`` into a staging slot (:func:`~kvtiers.encryption.sealed.seal_into`)
and hands the staging slot to the tier; a load lets the tier fill a staging slot, then
decrypts it into ``arena[slot]``; a key whose tag fails has its slot zeroed before the job is
reported (never another tenant's plaintext). Sealing and opening run on the wrapper's own
threads (``cryptography`` releases the GIL for the cipher), except for jobs of at most
:data:`INLINE_BYTES`; the tier's hooks are called on the caller's thread only, one at a time,
as the contract says.

Layer 1: no torch, no engine.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..hookspecs import hookimpl
from ..types import POLL_BUDGET_S, Arena, Job, JobResult, Lookup, TierContext, accept_job, drain
from .keys import Keyring
from .scope import TenantScope
from .sealed import OpenFailed, _ns_bytes, open_into, seal_into
from .tenants import CONFLICT, MIN_BOOK_KEYS, TenantBook, TenantKeys, check_tenant, tenant_label

#: a submit whose chunks hold at most this many bytes is sealed (a result opened) on the
#: caller's thread: cheaper than a hop to a worker; bigger ones go to the workers (rule 8)
INLINE_BYTES = 256 << 10
#: a big job goes to the tier (and to the workers) in pieces of about this many bytes
PIECE_BYTES = 8 << 20


class _Outer:
    """One job of the caller: its progress over staged pieces."""

    __slots__ = ("job_id", "kind", "remaining", "failed", "errors", "nbytes", "t0", "todo", "sel")

    def __init__(self, job: Job, kind: str) -> None:
        self.job_id = job.job_id
        self.kind = kind
        self.remaining = len(job.keys)
        self.failed: list[bytes] = []
        self.errors: list[str] = []
        self.nbytes = 0
        self.t0 = time.perf_counter()
        #: (key, caller slot) not yet given a staging slot
        self.todo = collections.deque(zip(job.keys, job.slots, strict=True))
        #: key -> (keys, tenant) where tenants are in play; empty: the default keys, no tenant
        self.sel: dict[bytes, tuple[Keyring, str | None]] = {}


#: one piece of a job: (outer job, [(key, caller slot, staging slot)])
_Piece = tuple[_Outer, list[tuple[bytes, int, int]]]


class SealedTier:
    """The hooks of an encrypted tier: seals stores and opens loads around the tier's
    handle ``inner`` (opened on the staging arena ``inner.ctx.arena``). See the module
    docstring; ``stats`` counts chunks sealed and opened, failures by reason, and keys not
    offloaded for their tenant (``tenant_skipped_store`` / ``_load``, ``tenant_conflict_*``);
    ``tenant_stats`` counts chunks sealed and opened by ``(tenant label, op)``.

    ``keys``: a :class:`Keyring` (one key for every chunk) or a
    :class:`~kvtiers.encryption.tenants.TenantKeys`. The engine passes the tenant with each
    call (:meth:`tenant_scope`: the lookups and jobs inside it are that tenant's, or no
    tenant's); a caller driving the tier itself may note keys' tenants instead
    (:meth:`note_tenant`) right before it submits them: a key never noted has no tenant
    (docs/security.md#tenants)."""

    def __init__(self, inner: Any, ctx: TierContext, keys: Keyring | TenantKeys, *, threads: int = 4) -> None:
        self.inner = inner
        self.ctx = ctx
        self.keys = keys if isinstance(keys, TenantKeys) else TenantKeys(keys)
        #: the default keys (None: tenants only)
        self.keyring = self.keys.default
        self.book = TenantBook(max(MIN_BOOK_KEYS, 8 * len(ctx.arena)))
        self.staging: Arena = inner.ctx.arena
        self.slot_bytes = ctx.arena.slot_bytes
        self.digest8 = _ns_bytes(ctx.namespace.digest)
        self._free = list(range(len(self.staging)))[::-1]
        self._waiting: collections.deque[_Outer] = collections.deque()
        self._inner_jobs: dict[int, tuple[str, _Piece]] = {}
        self._ids = iter(range(1, 1 << 62))
        self._done: collections.deque[tuple[str, _Piece, list[tuple[bytes, str, str]]]] = collections.deque()
        self._results: collections.deque[JobResult] = collections.deque()
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="kvtiers-seal")
        self._in_pool = 0
        self._pool_lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self.stats: collections.Counter[str] = collections.Counter()
        self.tenant_stats: collections.Counter[tuple[str, str]] = collections.Counter()
        self._labels: dict[str, str] = {}
        #: the tenant of the calls inside :meth:`tenant_scope`, per thread and asyncio task
        self._scope = TenantScope()
        from ..metrics import tier_metrics

        m = tier_metrics(ctx)
        self._m_chunks = m.counter("kvtiers_encrypt_chunks", "Chunks sealed (store) and opened (load)", ["op"])
        self._m_failed = m.counter("kvtiers_encrypt_open_failures",
                                   "Loaded chunks that failed to open, by reason", ["reason"])
        self._m_skipped = m.counter("kvtiers_encrypt_tenant_skipped",
                                    "Chunks not stored or loaded for want of their tenant's key, or because "
                                    "two tenants noted one key", ["op", "reason"])

    # -- tenants ----------------------------------------------------------------------------
    def note_tenant(self, keys: Sequence[bytes], tenant: str) -> None:
        """``keys`` are ``tenant``'s: they are sealed and opened with its keys and bound to it
        (called by the engine before it stores or loads them; a no-op for None)."""
        if tenant is not None:
            self.book.note(keys, tenant)

    @contextlib.contextmanager
    def tenant_scope(self, tenant: str | None) -> Iterator[None]:
        """Inside the block, the lookups and submitted jobs of this thread or asyncio task
        (and of callbacks it schedules there: :mod:`kvtiers.encryption.scope`) are
        ``tenant``'s (None: no tenant's), whatever was noted: the tenant travels with the
        call, so a job's keys are sealed or opened for it however long ago they were noted.
        The keys are noted for ``tenant`` too, and a key noted for another tenant is a
        conflict (offloaded for neither), as with :meth:`note_tenant`."""
        check_tenant(tenant)
        with self._scope.enter(tenant):
            yield

    def _selector(self, keys: Sequence[bytes]) -> Callable[[bytes], tuple[Keyring, str | None] | str] | None:
        """How this call picks each key's keys and tenant (see :meth:`_select`), or None:
        every key under the default keys with no tenant."""
        scoped = self._scope.current()
        if scoped is None:  # no tenant given with the call: the book's
            return None if self._plain() else self._select
        tenant = scoped[0]
        if tenant is not None:
            self.book.note(keys, tenant)
        elif self._plain():
            return None
        kr = self.keys.keyring_for(tenant)
        get = self.book.get

        def select(key: bytes) -> tuple[Keyring, str | None] | str:
            noted = get(key)
            if noted is not None and noted != tenant:  # CONFLICT, or another tenant's
                return "conflict"
            return "skipped" if kr is None else (kr, tenant)

        return select

    def _select(self, key: bytes) -> tuple[Keyring, str | None] | str:
        """The keys and tenant of ``key``, or why it is not offloaded (``"skipped"``: its
        tenant has no key; ``"conflict"``: noted for two tenants)."""
        tenant = self.book.get(key)
        if tenant is CONFLICT:
            return "conflict"
        kr = self.keys.keyring_for(tenant)
        return "skipped" if kr is None else (kr, tenant)

    def _plain(self) -> bool:
        """Every key goes under the default keys with no tenant: none was ever noted."""
        return not self.book and self.keyring is not None

    def _label(self, tenant: str | None) -> str:
        if tenant is None:
            return "-"
        label = self._labels.get(tenant)
        if label is None:
            if len(self._labels) > 4096:
                self._labels.clear()
            label = self._labels[tenant] = tenant_label(tenant)
        return label

    # -- hooks ------------------------------------------------------------------------------
    @hookimpl
    def lookup(self, keys: Sequence[bytes]) -> list[Lookup]:
        select = self._selector(keys)
        if select is None:
            return self.inner.lookup(keys)
        sel = [select(k) for k in keys]
        ask = [k for k, s in zip(keys, sel, strict=True) if not isinstance(s, str)]
        answers = iter(self.inner.lookup(ask) if ask else ())
        return [Lookup.MISS if isinstance(s, str) else next(answers) for s in sel]

    @hookimpl
    def submit_store(self, job: Job) -> None:
        self._submit(job, "store")

    @hookimpl
    def submit_load(self, job: Job) -> None:
        self._submit(job, "load")

    @hookimpl
    def get_finished_jobs(self) -> list[JobResult]:
        self._drive(budget_s=POLL_BUDGET_S)
        return drain(self._results)

    @hookimpl
    def touch(self, keys: Sequence[bytes]) -> None:
        self.inner.touch(keys)

    @hookimpl
    def pin(self, keys: Sequence[bytes], seconds: float | None) -> str | None:
        return self.inner.pin(keys, seconds)  # (the same keys below: a tier without the hook says so)

    @hookimpl
    def unpin(self, keys: Sequence[bytes]) -> None:
        self.inner.unpin(keys)

    @hookimpl
    def backlog(self) -> int:
        return self._pending

    @hookimpl
    def close(self) -> None:
        """Finish every accepted job: seal and hand over what waits, collect the tier's
        results until only its own close can finish the rest (bounded), close it, then fail
        what never reached it."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            self._drive()
            if not self._waiting and not self._busy():
                break
            time.sleep(0.001)
        self._drive()
        self.inner.close()
        self._pool.shutdown(wait=True)
        self._drive(final=True)
        for outer in list(self._waiting):
            n = len(outer.todo)
            outer.failed.extend(k for k, _s in outer.todo)
            outer.todo.clear()
            outer.errors.append(f"{n} key(s): tier closed before they were staged")
            self._account(outer, n)
        self._waiting.clear()

    # -- work -------------------------------------------------------------------------------
    def _busy(self) -> bool:
        with self._pool_lock:
            return self._in_pool > 0 or bool(self._done)

    def _submit(self, job: Job, kind: str) -> None:
        accept_job(job, self.ctx.arena, closed=self._closed)
        outer = _Outer(job, kind)
        self._pending += 1
        if not job.keys:
            self._finish(outer)
            return
        select = self._selector(job.keys)
        if select is not None:
            self._select_keys(outer, select)
            if not outer.todo:  # every key skipped: finished already
                return
        self._waiting.append(outer)
        self._drive(budget_s=POLL_BUDGET_S)

    def _select_keys(self, outer: _Outer, select: Callable[[bytes], tuple[Keyring, str | None] | str]) -> None:
        """Pick each key's keys and tenant (once, when the job comes: the job keeps them);
        fail the keys that are not offloaded, saying why."""
        keep: collections.deque[tuple[bytes, int]] = collections.deque()
        out: dict[str, list[bytes]] = {}
        for k, s in outer.todo:
            r = select(k)
            if isinstance(r, str):
                out.setdefault(r, []).append(k)
            else:
                outer.sel[k] = r
                keep.append((k, s))
        outer.todo = keep
        for reason, ks in out.items():
            self.stats[f"tenant_{reason}_{outer.kind}"] += len(ks)
            self._m_skipped.labels(op=outer.kind, reason=reason).inc(len(ks))
            outer.failed.extend(ks)
            why = ("their tenant has no key (unknown_tenant 'skip')" if reason == "skipped"
                   else "each was noted for two tenants")
            outer.errors.append(f"{len(ks)} key(s) not offloaded: {why}")
            self._account(outer, len(ks))

    def _stage(self) -> None:
        """Give waiting jobs staging slots, in order, and start their pieces."""
        while self._waiting and self._free:
            outer = self._waiting[0]
            items = []
            while outer.todo and self._free:
                k, s = outer.todo.popleft()
                items.append((k, s, self._free.pop()))
            if not outer.todo:
                self._waiting.popleft()
            if outer.kind == "load":
                for piece in self._split(outer, items):
                    self._to_inner("load", piece)
            elif len(items) * self.slot_bytes <= INLINE_BYTES:
                self._done.append(("sealed", (outer, items), self._seal((outer, items))))
            else:
                for piece in self._split(outer, items):
                    self._spawn("sealed", piece, self._seal)

    def _split(self, outer: _Outer, items: list) -> list[_Piece]:
        """Pieces of about :data:`PIECE_BYTES`: sealing, the tier's I/O and opening overlap
        piece by piece, and the workers share a big job."""
        n = max(1, PIECE_BYTES // self.slot_bytes)
        return [(outer, items[i:i + n]) for i in range(0, len(items), n)]

    def _spawn(self, what: str, piece: _Piece, fn: Callable[[_Piece], list]) -> None:
        with self._pool_lock:
            self._in_pool += 1

        def run() -> None:
            try:
                errs = fn(piece)
            except BaseException as e:  # never lose a piece: every key fails with the reason
                errs = [(k, "error", f"{type(e).__name__}: {e}") for k, _s, _t in piece[1]]
            with self._pool_lock:
                self._done.append((what, piece, errs))
                self._in_pool -= 1

        self._pool.submit(run)

    def _seal(self, piece: _Piece) -> list[tuple[bytes, str, str]]:
        d8 = self.digest8
        return self._each(piece, lambda kr, k, slot, staged, tenant: seal_into(kr, d8, k, slot, staged, tenant))

    def _open(self, piece: _Piece) -> list[tuple[bytes, str, str]]:
        d8 = self.digest8
        return self._each(piece, lambda kr, k, slot, staged, tenant: open_into(kr, d8, k, staged, slot, tenant))

    def _each(self, piece: _Piece, crypt: Callable[..., None]) -> list[tuple[bytes, str, str]]:
        """``crypt(keyring, key, arena slot, staging slot, tenant)`` for each item of ``piece``
        (its tenant's keyring where the piece selects one); ``(key, reason, message)`` of each
        that failed."""
        outer, items = piece
        arena, staging, sel = self.ctx.arena, self.staging, outer.sel
        default = (self.keyring, None)
        errs = []
        for k, s, t in items:
            kr, tenant = sel.get(k, default) if sel else default
            try:
                crypt(kr, k, arena[s], staging[t], tenant)
            except OpenFailed as e:  # only opening raises it
                errs.append((k, e.reason, str(e)))
            except Exception as e:
                errs.append((k, "error", f"{type(e).__name__}: {e}"))
        return errs

    def _to_inner(self, kind: str, piece: _Piece) -> None:
        outer, items = piece
        jid = next(self._ids)
        job = Job(jid, tuple(k for k, _s, _t in items), tuple(t for _k, _s, t in items))
        try:
            (self.inner.submit_store if kind == "store" else self.inner.submit_load)(job)
        except Exception as e:  # the tier refused a job we built: fail its keys, keep going
            self._release(items)
            outer.failed.extend(job.keys)
            outer.errors.append(f"tier refused the {kind}: {type(e).__name__}: {e}")
            self._account(outer, len(items))
            return
        self._inner_jobs[jid] = (kind, piece)

    def _release(self, items: list[tuple[bytes, int, int]]) -> None:
        self._free.extend(t for _k, _s, t in items)

    def _account(self, outer: _Outer, n: int) -> None:
        if not n:
            return
        outer.remaining -= n
        if outer.remaining == 0 and not outer.todo:
            self._finish(outer)

    def _finish(self, outer: _Outer) -> None:
        error = None
        if outer.failed:
            error = f"{len(outer.failed)} key(s) failed: " + "; ".join(outer.errors)
        self._results.append(JobResult(outer.job_id, tuple(outer.failed), outer.nbytes,
                                       time.perf_counter() - outer.t0, error))
        self._pending -= 1

    def _drive(self, final: bool = False, budget_s: float | None = None) -> None:
        """Move every job on, on the caller's thread: hand sealed pieces to the tier,
        collect its results (opening loads), stage waiting jobs into freed slots. With
        ``budget_s`` (the hooks' calls) it returns once that long has passed and the next
        call goes on: while the workers keep finishing pieces, a poll would otherwise drive
        a big job to its end (rule 5)."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        while True:
            progressed = False
            while self._done:
                if deadline is not None and progressed and time.monotonic() > deadline:
                    return
                with self._pool_lock:
                    what, piece, errs = self._done.popleft()
                progressed = True
                self._after(what, piece, errs, final)
            for r in self.inner.get_finished_jobs():
                entry = self._inner_jobs.pop(r.job_id, None)
                if entry is None:
                    continue
                progressed = True
                self._inner_result(entry, r, final)
            if self._waiting and self._free and not final:
                self._stage()
                progressed = True
            if not progressed or not self._done:
                return
            if deadline is not None and time.monotonic() > deadline:
                return

    def _after(self, what: str, piece: _Piece, errs: list[tuple[bytes, str, str]], final: bool) -> None:
        outer, items = piece
        bad = {k for k, _r, _m in errs}
        if errs:
            outer.failed.extend(k for k, _r, _m in errs)
            outer.errors.append(_summary(what, errs))
        if what == "sealed":
            good = [it for it in items if it[0] not in bad]
            self._release([it for it in items if it[0] in bad])
            self._account(outer, len(bad))
            if good:
                if final:  # the tier is closed: nothing more reaches it
                    self._release(good)
                    outer.failed.extend(k for k, _s, _t in good)
                    outer.errors.append(f"{len(good)} key(s): tier closed before they were stored")
                    self._account(outer, len(good))
                else:
                    self._to_inner("store", (outer, good))
            return
        # opened
        for _k, reason, _m in errs:
            self.stats[f"open_failed_{reason}"] += 1
            self._m_failed.labels(reason=reason).inc()
        ok = len(items) - len(bad)
        if outer.sel:
            self._count_tenants(outer, [it[0] for it in items if it[0] not in bad], "opened")
        self.stats["opened"] += ok
        self._m_chunks.labels(op="open").inc(ok)
        outer.nbytes += ok * self.slot_bytes
        self._release(items)
        self._account(outer, len(items))

    def _inner_result(self, entry: tuple[str, _Piece], r: JobResult, final: bool) -> None:
        kind, (outer, items) = entry
        failed = set(r.failed_keys)
        if failed:
            outer.failed.extend(k for k, _s, _t in items if k in failed)
            outer.errors.append(r.error or f"{len(failed)} key(s) failed in the tier")
        good = [it for it in items if it[0] not in failed]
        if kind == "store":
            if outer.sel:
                self._count_tenants(outer, [it[0] for it in good], "sealed")
            self.stats["sealed"] += len(good)
            self._m_chunks.labels(op="seal").inc(len(good))
            outer.nbytes += len(good) * self.slot_bytes
            self._release(items)
            self._account(outer, len(items))
            return
        self._release([it for it in items if it[0] in failed])
        self._account(outer, len(failed))
        if not good:
            return
        if final or len(good) * self.slot_bytes <= INLINE_BYTES:
            self._done.append(("opened", (outer, good), self._open((outer, good))))
        else:
            self._spawn("opened", (outer, good), self._open)

    def _count_tenants(self, outer: _Outer, keys: list[bytes], op: str) -> None:
        for k in keys:
            entry = outer.sel.get(k)
            if entry is not None:
                self.tenant_stats[self._label(entry[1]), op] += 1


def _summary(what: str, errs: list[tuple[bytes, str, str]]) -> str:
    """One clause for a job's error: how many keys, the first one's reason."""
    k, _reason, msg = errs[0]
    verb = "sealing" if what == "sealed" else "opening"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"DecryptionFailed: {k.hex()[:32]}: {msg}{more}" if what == "opened" else \
        f"{verb} {k.hex()[:32]} failed: {msg}{more}"
