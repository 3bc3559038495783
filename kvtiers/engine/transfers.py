"""Transfer bookkeeping: from an engine's ``store`` or ``load`` call to its result.

A :class:`Transfer` carries what one call needs while it runs (its keys' device blocks,
the slots it pinned, what failed). :class:`TransferBook` hands out transfer ids, owns the
device copies in flight on the DMA engine, and turns finished transfers into
:class:`~kvtiers.engine.types.TransferResult` s until the engine collects them.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .events import log
from .hostcache import HostCache
from .types import ManagerStats, Request, TransferResult

__all__ = ["Transfer", "TransferBook", "split_blocks"]


@dataclass(eq=False)
class Transfer:
    """One ``store`` or ``load`` in progress."""

    tid: int
    kind: str  # "store" | "load"
    keys: tuple[bytes, ...]
    request: Request | None
    t0: float
    blocks: dict[bytes, Sequence[int]] = field(default_factory=dict)
    pins: dict[bytes, int] = field(default_factory=dict)  # key -> pinned slot
    waiting: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)
    skipped: list[bytes] = field(default_factory=list)
    sources: dict[bytes, str] = field(default_factory=dict)
    deferred: list[bytes] = field(default_factory=list)  # no slot yet: the next wave
    copied: set[bytes] = field(default_factory=set)  # loads: on the device after earlier waves
    wave_keys: list[bytes] = field(default_factory=list)  # stores: the previous wave's chunks
    wave_t0: float = 0.0  # stores: when the previous wave reached the host
    dma_started: float | None = None
    error: str | None = None
    tenant: str | None = None  # whose chunks (TieringManager's tenant=): every tier call of the transfer carries it


class TransferBook:
    """Transfer ids, the device copies in flight, and the results not collected yet.

    ``dma`` is the manager's DMA engine (``submit_store``, ``submit_load``, ``poll``). The
    store and load paths register what happens when a copy of their kind completes
    (:meth:`on_copied`); :meth:`finish` releases a transfer's pins and records its result.
    """

    def __init__(self, dma: Any, cache: HostCache, stats: ManagerStats, chunk_bytes: int) -> None:
        self.dma = dma
        self.finished: dict[int, TransferResult] = {}  # tid -> result, until collected
        self._cache = cache
        self._stats = stats
        self._chunk_bytes = chunk_bytes
        self._ids = itertools.count(1)
        self._dma_ids = itertools.count(1)
        self._dma_pending: dict[int, Transfer] = {}  # DMA transfer id -> transfer
        self._on_copied: dict[str, Callable[[Transfer], None]] = {}

    def on_copied(self, kind: str, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(transfer)`` when the device copy of a ``kind`` transfer completes."""
        self._on_copied[kind] = fn

    def start(self, kind: str, keys: tuple[bytes, ...], request: Request | None,
              tenant: str | None) -> Transfer:
        """A new transfer with the next id (``tenant``: whose chunks, for its tier calls)."""
        return Transfer(next(self._ids), kind, keys, request, time.perf_counter(), tenant=tenant)

    def pending(self) -> int:
        """Device copies in flight."""
        return len(self._dma_pending)

    def copy(self, tr: Transfer, chunks: list[tuple[Sequence[int], int]]) -> None:
        """Submit the device copy of ``chunks`` (device blocks, slot) for ``tr``, in the
        direction of its kind. Raises what the DMA engine raises (nothing is in flight then);
        the caller polls (:meth:`poll_dma`) when it is ready for the copy to complete."""
        tr.dma_started = time.perf_counter()
        dma_id = next(self._dma_ids)
        (self.dma.submit_store if tr.kind == "store" else self.dma.submit_load)(dma_id, chunks)
        self._dma_pending[dma_id] = tr

    def poll_dma(self) -> None:
        """Hand every completed device copy to the handler of its kind."""
        if not self._dma_pending:
            return
        for dma_id in self.dma.poll():
            tr = self._dma_pending.pop(dma_id, None)
            if tr is None:
                log.warning("kvtiers: DMA engine reported unknown transfer %s", dma_id)
            else:
                self._on_copied[tr.kind](tr)

    def finish(self, tr: Transfer) -> None:
        """Release ``tr``'s pins and record its result (loads: count hits and failures)."""
        now = time.perf_counter()
        cancelled = tr.request is not None and tr.request.cancelled
        nbytes = 0
        if tr.kind == "load":
            if cancelled:  # what a wave had not copied yet is not on the device
                tr.failed.update(k for k in tr.pins if k not in tr.copied)
            ok = [k for k in tr.keys if k in tr.copied and k not in tr.failed]
            nbytes = len(ok) * self._chunk_bytes
            for k in ok:
                self._stats.hits[tr.sources[k]] += 1
            self._stats.failed_loads += len(tr.failed)
        for slot in tr.pins.values():
            self._cache.unpin(slot)
        failed = tuple(k for k in tr.keys if k in tr.failed)
        sources = {k: v for k, v in tr.sources.items() if k not in tr.failed}
        self.finished[tr.tid] = TransferResult(
            tr.tid, tr.kind, tr.keys, failed, tuple(tr.skipped), sources, nbytes, now - tr.t0,
            tr.request.request_id if tr.request is not None else None, cancelled, tr.error,
        )


def split_blocks(keys: tuple[bytes, ...], device_blocks: Sequence[Any], blocks_per_chunk: int) -> list[Sequence[int]]:
    """``device_blocks`` as one list of ``blocks_per_chunk`` block ids per key: given either
    that way or as one flat sequence. Raises ``ValueError`` for any other shape."""
    bpc = blocks_per_chunk
    items = list(device_blocks)
    if len(items) == len(keys) and all(not _is_int(b) for b in items):
        out = [list(map(operator.index, b)) for b in items]
    elif len(items) == len(keys) * bpc and all(_is_int(b) for b in items):
        flat = [operator.index(b) for b in items]
        out = [flat[i * bpc : (i + 1) * bpc] for i in range(len(keys))]
    else:
        raise ValueError(
            f"device_blocks: expected {len(keys)} sequences of {bpc} block ids or "
            f"{len(keys) * bpc} block ids for {len(keys)} chunks, got {len(items)} items"
        )
    for b in out:
        if len(b) != bpc:
            raise ValueError(f"device_blocks: a chunk has {len(b)} block ids, expected {bpc}")
    return out


def _is_int(x: Any) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
