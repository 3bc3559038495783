"""KvtiersCPUWorker: vLLM's offloading worker on its CPU platform, through kvtiers' DMA engine.

vLLM's own worker (``CPUOffloadingWorker``) copies between the device KV cache and the rows
of the shared offload region with CUDA/XPU kernels, so vLLM refuses to offload on CPU. This
worker does the same copies where the "device" KV cache is vLLM's CPU KV cache: the region's
rows are a kvtiers arena (row ``c`` is slot ``c``), and each job is one batched
:class:`~kvtiers.engine.dma.DmaEngine` transfer (strided ``np.copyto`` / ``memmove`` on the
caller's thread, no per-block Python work). A job is finished when its submit returns, and is
reported by the next ``get_finished``: the model step waits for the copy itself, nothing else.

Row layout, the same as vLLM's worker writes it (``SharedOffloadRegion.create_next_worker_view``):
for each canonical KV tensor in order, the chunk's ``blocks_per_chunk`` blocks of that tensor
back to back. The primary tier and every secondary tier see the same bytes as on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ...engine.arena import HostArena
from ...engine.dma import DmaEngine
from ...engine.layout import KVGroup, KVLayout

log = logging.getLogger("kvtiers.integrations.vllm")


def region_arena(flat: memoryview, num_slots: int, slot_bytes: int) -> HostArena:
    """A :class:`HostArena` over memory someone else owns (vLLM's offload region), unpinned.

    Closing it lets go of the views only; the owner unmaps the memory.
    """
    if len(flat) < num_slots * slot_bytes:
        raise ValueError(f"offload region of {len(flat)} bytes is smaller than {num_slots} rows of {slot_bytes}")
    return HostArena(mem=flat, buf=flat[: num_slots * slot_bytes], num_slots=num_slots, slot_bytes=slot_bytes,
                     pinned=False, pin=None, shared_memory=None, creator=False, fd=None, elastic=False,
                     elastic_max_bytes=0, elastic_reserve_bytes=0)


def kv_layout(kv_caches: CanonicalKVCaches) -> tuple[KVLayout, dict[str, list[list[Any]]]]:
    """The kvtiers layout of vLLM's canonical KV tensors, and the tensors per group and layer.

    One group of ``len(tensors)`` one-tensor layers when every tensor has the same page size
    (a plain decoder), else one group per tensor; both give the row layout above.
    """
    import torch

    if len(kv_caches.group_data_refs) != 1:
        raise NotImplementedError(
            f"KvtiersOffloadingSpec on CPU handles models with one KV cache group; this model has "
            f"{len(kv_caches.group_data_refs)} (a hybrid model): offload it on a GPU, where vLLM's own worker runs")
    tensors = []
    for i, ct in enumerate(kv_caches.tensors):
        t = ct.tensor.view(torch.int8).view(-1, ct.page_size_bytes) if ct.tensor.is_contiguous() else ct.tensor
        if not t.is_contiguous():
            raise NotImplementedError(f"KV tensor {i} has blocks {t.stride(0)} bytes apart but pages of "
                                      f"{ct.page_size_bytes} (a packed layout): not supported on CPU")
        tensors.append(t)
    pages = [t.shape[1] for t in tensors]
    if len(set(pages)) == 1:
        layout = KVLayout([KVGroup("kv", len(tensors), 1, pages[0])])
        return layout, {"kv": [[t] for t in tensors]}
    groups = [KVGroup(f"t{i}", 1, 1, p) for i, p in enumerate(pages)]
    return KVLayout(groups), {g.name: [[t]] for g, t in zip(groups, tensors, strict=True)}


class KvtiersCPUWorker(OffloadingWorker):
    """Copies KV chunks between vLLM's CPU KV cache and the shared offload region rows.

    ``region`` is vLLM's ``SharedOffloadRegion`` for this worker; the worker owns it from a
    successful construction on and cleans it up on :meth:`shutdown`.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: Any) -> None:
        layout, tensors = kv_layout(kv_caches)
        self.blocks_per_chunk = blocks_per_chunk
        self._region = region
        view = region.create_kv_memoryview()
        self._flat = view.cast("B")
        self.host = region_arena(self._flat, view.shape[0], view.shape[1])
        self.dma = DmaEngine(layout, tensors, self.host, blocks_per_chunk)
        self._group = layout.groups[0].name if len(layout.groups) == 1 else None
        self._names = [g.name for g in layout.groups]
        self._block_bytes = sum(g.num_layers * g.block_bytes for g in layout.groups)  # one block, every tensor
        self._done: list[TransferResult] = []
        log.info("kvtiers CPU offloading worker: %d KV tensors, %d-byte blocks, %d rows of %d bytes",
                 len(kv_caches.tensors), self._block_bytes, self.host.num_slots, self.host.slot_bytes)

    def _chunks(self, gpu: GPULoadStoreSpec, chunk_spec: LoadStoreSpec) -> tuple[list[tuple[Any, int]], int]:
        """The DMA chunks ``(block ids, row)`` of a job, and the number of blocks it copies.

        vLLM's first chunk of a job may start mid-chunk (``block_indices[0] % blocks_per_chunk``
        blocks in): those positions are ``-1``, not copied.
        """
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"kvtiers CPU worker: expected a CPU chunk spec, got {type(chunk_spec).__name__}")
        blocks = np.asarray(gpu.block_ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(chunk_spec.block_ids, dtype=np.int64).reshape(-1)
        (start,) = gpu.block_indices
        bpc = self.blocks_per_chunk
        skip = int(start) % bpc
        ids = np.concatenate([np.full(skip, -1, np.int64), blocks]) if skip else blocks
        n = -(-len(ids) // bpc)
        if n != len(rows):
            raise ValueError(f"kvtiers CPU worker: {len(blocks)} blocks from block {start} fill {n} chunks of "
                             f"{bpc}, but the job names {len(rows)} rows")
        pieces = [ids[i * bpc:(i + 1) * bpc] for i in range(n)]
        if skip:  # a position to skip needs the per-group form
            return [({name: p for name in self._names}, int(r)) for p, r in zip(pieces, rows, strict=True)], len(blocks)
        return [(p, int(r)) for p, r in zip(pieces, rows, strict=True)], len(blocks)

    def _run(self, job_id: int, gpu: GPULoadStoreSpec, chunk_spec: LoadStoreSpec, load: bool) -> bool:
        t0 = time.perf_counter()
        chunks, nblocks = self._chunks(gpu, chunk_spec)
        (self.dma.submit_load if load else self.dma.submit_store)(job_id, chunks)
        self.dma.poll()  # CPU transfers are finished when submit returns
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nblocks * self._block_bytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """KV cache blocks -> offload region rows."""
        return self._run(job_id, src_spec, dst_spec, load=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Offload region rows -> KV cache blocks."""
        return self._run(job_id, dst_spec, src_spec, load=True)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (each exactly once); never blocks."""
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        """Every submitted job is already finished on CPU: nothing to wait for."""
        return

    def shutdown(self) -> None:
        """Close the DMA engine, let go of the region's views, and clean the region up."""
        if self._region is None:
            return
        self.dma.close()
        self.dma = None  # type: ignore[assignment]  # drops its arrays over the region
        self.host.close()
        try:
            self._flat.release()
        except BufferError:  # a view still alive: vLLM's clean-up then logs that it could not unmap
            log.debug("kvtiers CPU worker: offload region views still alive at shutdown")
        region, self._region = self._region, None
        region.cleanup()
