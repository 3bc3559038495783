"""Copies between a transformers cache's tensors and host-arena slots: the DMA engine of a
:class:`~kvtiers.integrations.transformers.PrefixCache`.

A chunk is ``tokens_per_chunk`` tokens of one sequence. Its slot holds, for each layer, K then
V, each ``[kv_heads, tokens_per_chunk, head_dim]`` (the cache's own order, ``[batch, heads, seq,
head_dim]`` with batch 1): the layout :func:`chunk_layout` describes for the namespace. A run of
consecutive chunks going to consecutive slots is one strided ``copy_`` per layer and tensor,
straight from the cache tensor into the slots (or back): no staging buffer, no pool.

The tensors are the copier's :attr:`CacheCopier.target`, set by the prefix cache for the length
of one ``store`` or ``load``; a chunk's "device block id" is its index in the sequence. On an
accelerator a store runs on a side stream after an event recorded on the caller's current stream
(so it sees the KV the model just wrote) and keeps the source tensors alive until its event
completes; a load is enqueued on the caller's current stream, so the model's next kernels on that
stream run after it without a synchronisation. On CPU copies run on the caller's thread and
finish at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .geometry import KVGeometry

__all__ = ["CacheCopier", "chunk_layout"]


def chunk_layout(geometry: KVGeometry, tokens_per_chunk: int) -> Any:
    """The :class:`~kvtiers.engine.layout.KVLayout` of a chunk: one group ``kv`` of
    ``num_layers`` layers, K and V, one block per chunk of shape ``[kv_heads, tokens, head_dim]``."""
    from ...engine.layout import KVGroup, KVLayout

    block = geometry.tensor_bytes(tokens_per_chunk)
    return KVLayout([KVGroup("kv", geometry.num_layers, 2, block, dtype=geometry.dtype_name,
                             shape=(geometry.kv_heads, tokens_per_chunk, geometry.head_dim))])


class CacheCopier:
    """``submit_store`` / ``submit_load`` / ``poll`` / ``close`` over the tensors of :attr:`target`.

    ``target``: per layer ``(key, value)``, each ``[1, kv_heads, seq, head_dim]`` with ``seq``
    covering every chunk a transfer names. Calls come from one thread at a time."""

    def __init__(self, host: Any, geometry: KVGeometry, tokens_per_chunk: int) -> None:
        import torch

        self.geometry = geometry
        self.tokens_per_chunk = tokens_per_chunk
        self.chunk_bytes = 2 * geometry.num_layers * geometry.tensor_bytes(tokens_per_chunk)
        if self.chunk_bytes > host.slot_bytes:
            raise ValueError(f"a chunk of {tokens_per_chunk} tokens is {self.chunk_bytes} bytes; "
                             f"the arena's slots hold {host.slot_bytes}")
        self.target: Sequence[tuple[Any, Any]] | None = None
        self.device = torch.device(geometry.device)
        self._host_t = host.tensor()  # uint8 [num_slots, slot_bytes], pinned where an accelerator is
        self._accel = self.device.type != "cpu"
        self._store_stream = torch.Stream(device=self.device) if self._accel else None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Any, Any]] = {}  # transfer id -> (event, tensors kept alive)
        self._done: list[int] = []

    def submit_store(self, transfer_id: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        """Copy each ``([chunk index], slot)`` from the target tensors into its slot."""
        self._submit(transfer_id, chunks, load=False)

    def submit_load(self, transfer_id: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        """Copy each ``([chunk index], slot)`` from its slot into the target tensors."""
        self._submit(transfer_id, chunks, load=True)

    def poll(self) -> list[int]:
        """Transfer ids finished since the last call; never blocks."""
        with self._lock:
            for tid, (ev, _) in list(self._pending.items()):
                if ev.query():
                    del self._pending[tid]
                    self._done.append(tid)
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Wait for the copies in flight."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for ev, _ in pending.values():
            ev.synchronize()
        self._done.extend(pending)
        self.target = None

    # -- internals -----------------------------------------------------------------------
    def _submit(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]], *, load: bool) -> None:
        import torch

        if self.target is None:
            raise RuntimeError("CacheCopier: no target tensors (it copies for a PrefixCache's store or load)")
        runs = self._runs(chunks)
        if not self._accel:
            self._copy(runs, load=load)
            self._done.append(tid)
            return
        current = torch.accelerator.current_stream(self.device)
        if load:  # on the caller's stream: the model's next kernels there run after it
            self._copy(runs, load=True)
            done = torch.Event(device=self.device)
            done.record(current)
        else:
            ready = torch.Event(device=self.device)
            ready.record(current)
            with self._store_stream:
                self._store_stream.wait_event(ready)
                self._copy(runs, load=False)
                done = torch.Event(device=self.device)
                done.record(self._store_stream)
        with self._lock:
            self._pending[tid] = (done, list(self.target))

    def _runs(self, chunks: Sequence[tuple[Sequence[int], int]]) -> list[tuple[int, int, int]]:
        """``(first chunk, first slot, count)`` per run of consecutive chunks in consecutive slots."""
        runs: list[tuple[int, int, int]] = []
        for ids, slot in chunks:
            if len(ids) != 1:
                raise ValueError(f"CacheCopier: a chunk is one block (its index in the sequence), got {list(ids)}")
            c, s = int(ids[0]), int(slot)
            if runs and runs[-1][0] + runs[-1][2] == c and runs[-1][1] + runs[-1][2] == s:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((c, s, 1))
        return runs

    def _copy(self, runs: list[tuple[int, int, int]], *, load: bool) -> None:
        g, tpc = self.geometry, self.tokens_per_chunk
        target = self.target
        assert target is not None
        for first, slot, k in runs:
            region = (self._host_t[slot : slot + k, : self.chunk_bytes].view(g.dtype)
                      .view(k, g.num_layers, 2, g.kv_heads, tpc, g.head_dim))
            for layer, tensors in enumerate(target):
                for kv, t in enumerate(tensors):
                    # [1, H, seq, D] -> the run's tokens as [k, H, tokens, D], a view
                    part = (t[0, :, first * tpc : (first + k) * tpc]
                            .unflatten(1, (k, tpc)).permute(1, 0, 2, 3))
                    if load:
                        part.copy_(region[:, layer, kv], non_blocking=self._accel)
                    else:
                        region[:, layer, kv].copy_(part, non_blocking=self._accel)
