"""KvtiersCPUWorker: vLLM's offloading worker on its CPU platform.

vLLM's own worker (``CPUOffloadingWorker``) copies between the device KV cache and the rows
of the shared offload region with CUDA/XPU kernels, so vLLM refuses to offload on CPU. This
worker does the same copies where the "device" KV cache is vLLM's CPU KV cache: one strided
numpy copy per (KV cache group, tensor the group's refs name) of a job, on the caller's
thread, no per-block Python work. A job is finished when its submit returns and is reported
by the next ``get_finished``: the model step waits for the copy itself, nothing else.

Row layout, the same as vLLM's worker writes it (``SharedOffloadRegion.create_next_worker_view``):
a row is one chunk of one KV cache group; this worker's slot of it starts at ``slot_offset``
(``rank * cpu_page_size_per_worker`` with tensor parallelism: the ranks' slots side by side)
and holds, for each canonical KV tensor in order, ``blocks_per_chunk`` pages of that
tensor's page size back to back. A group copies only into the tensors its refs name, and
only the ref's ``page_size_bytes`` of each page (a page may be padded). Hybrid models (a
sliding-window and a full-attention group sharing tensors, SSM state) therefore work as on a
GPU: each group's blocks come in ``group_sizes`` order, each group's first chunk may start
mid-chunk (``block_indices[g] % blocks_per_chunk`` positions skipped), and a sliding-window
group stores and reloads only the blocks vLLM's scheduler asks for (its window). The primary
tier and every secondary tier see the same bytes as on a GPU.

The device side of a job is what the installed vLLM passes (:mod:`.compat`): block ids
(``GPULoadStoreSpec``, vLLM 0.32 and 0.33) or a ``DevicePointers`` (vLLM 0.34: each block's
address in each data reference's tensor), which the worker maps back to block ids of its own
tensors and refuses when an address is not a page of the tensor the reference names.
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

from .compat import is_device_pointers

log = logging.getLogger("kvtiers.integrations.vllm")

__all__ = ["KvtiersCPUWorker", "slot_bytes"]


def slot_bytes(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> int:
    """Bytes of one worker's slot of a row: every canonical tensor's page, ``blocks_per_chunk`` times."""
    return sum(ct.page_size_bytes for ct in kv_caches.tensors) * blocks_per_chunk


def _kv_pages(kv_caches: CanonicalKVCaches) -> list[np.ndarray]:
    """Each canonical KV tensor as ``uint8 [num_blocks, page_size_bytes]`` over its memory."""
    import torch

    out = []
    for i, ct in enumerate(kv_caches.tensors):
        t = ct.tensor
        if not t.is_contiguous():
            raise NotImplementedError(f"KV tensor {i} of shape {tuple(t.shape)} is not contiguous (a packed layout): "
                                      f"not supported on CPU")
        pages = t.view(torch.int8).view(-1, ct.page_size_bytes)
        out.append(pages.numpy().view(np.uint8))
    return out


class KvtiersCPUWorker(OffloadingWorker):
    """Copies KV chunks between vLLM's CPU KV cache and this worker's slot of the offload region rows.

    ``region`` is vLLM's ``SharedOffloadRegion`` for this worker; the worker owns it from a
    successful construction on and cleans it up on :meth:`shutdown`. ``slot_offset``: where this
    worker's slot starts in each row (``rank * cpu_page_size_per_worker``; 0 with one worker).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: Any, *,
                 slot_offset: int = 0) -> None:
        if blocks_per_chunk <= 0:
            raise ValueError(f"kvtiers CPU worker: blocks_per_chunk must be positive, got {blocks_per_chunk}")
        self.blocks_per_chunk = bpc = int(blocks_per_chunk)
        self._kv = _kv_pages(kv_caches)
        self._refs = [[(int(r.tensor_idx), int(r.page_size_bytes)) for r in refs]
                      for refs in kv_caches.group_data_refs]
        for g, refs in enumerate(self._refs):
            for t, size in refs:
                if not 0 <= t < len(self._kv):
                    raise ValueError(f"kvtiers CPU worker: group {g} names KV tensor {t}; there are {len(self._kv)}")
                if not 0 < size <= self._kv[t].shape[1]:
                    raise ValueError(f"kvtiers CPU worker: group {g}'s ref to tensor {t} has pages of {size} bytes; "
                                     f"the tensor's pages are {self._kv[t].shape[1]}")
        self._region = region
        self._view = region.create_kv_memoryview()
        rows = np.asarray(self._view).view(np.uint8)
        num_rows, row_stride = rows.shape
        need = slot_bytes(kv_caches, bpc)
        if slot_offset < 0 or slot_offset + need > row_stride:
            raise ValueError(f"kvtiers CPU worker: a slot of {need} bytes at offset {slot_offset} does not fit in "
                             f"offload region rows of {row_stride} bytes")
        self._rows: list[np.ndarray] = []  # per tensor: uint8 [num_rows, bpc, page] over its part of every row
        off = slot_offset
        for kv in self._kv:
            page = kv.shape[1]
            self._rows.append(np.lib.stride_tricks.as_strided(
                rows[:, off:], shape=(num_rows, bpc, page), strides=(row_stride, page, 1), writeable=True))
            off += bpc * page
        self._done: list[TransferResult] = []
        log.info("kvtiers CPU offloading worker: %d KV tensors, %d KV cache group(s), slot of %d bytes at %d in "
                 "%d rows of %d bytes", len(self._kv), len(self._refs), need, slot_offset, num_rows, row_stride)

    def _device_blocks(self, device: Any) -> tuple[np.ndarray, list[int], list[int]]:
        """The job's device side as (block ids, blocks per group, first block index per group),
        from a ``GPULoadStoreSpec`` or from vLLM 0.34's ``DevicePointers``."""
        if not is_device_pointers(device):
            return (np.asarray(device.block_ids, dtype=np.int64).reshape(-1), [int(s) for s in device.group_sizes],
                    [int(s) for s in device.block_indices])
        counts = [int(n) for n in device.group_block_counts]
        nrefs = [int(n) for n in device.group_data_ref_counts]
        if len(counts) != len(self._refs) or len(nrefs) != len(counts):
            raise ValueError(f"kvtiers CPU worker: the job's pointers cover {len(counts)} KV cache groups; "
                             f"the model has {len(self._refs)}")
        ptrs = np.asarray(device.ptrs, dtype=np.uint64).reshape(-1).astype(np.int64)
        ids: list[np.ndarray] = []
        off = 0
        for g, (n, nref) in enumerate(zip(counts, nrefs, strict=True)):
            if n == 0:
                continue
            if nref != len(self._refs[g]):
                raise ValueError(f"kvtiers CPU worker: the job's group {g} has {nref} data references; "
                                 f"the model's has {len(self._refs[g])}")
            seg = ptrs[off:off + n * nref]
            if len(seg) != n * nref:
                raise ValueError(f"kvtiers CPU worker: the job has {len(ptrs)} pointers, too few for its groups")
            group_ids = None
            for r, (t, _) in enumerate(self._refs[g]):
                pages = self._kv[t]
                b, rem = np.divmod(seg[r * n:(r + 1) * n] - pages.ctypes.data, pages.strides[0])
                if rem.any() or b.min() < 0 or b.max() >= pages.shape[0] or \
                        (group_ids is not None and not np.array_equal(b, group_ids)):
                    raise ValueError(f"kvtiers CPU worker: a pointer of group {g} is not a block of KV tensor {t} "
                                     f"(or not the same block as the group's other tensors)")
                group_ids = b
            ids.append(group_ids)
            off += n * nref
        if off != len(ptrs):
            raise ValueError(f"kvtiers CPU worker: the job has {len(ptrs)} pointers; its groups name {off}")
        blocks = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        return blocks, counts, [int(s) for s in device.block_indices]

    def _plan(self, gpu: Any, chunk_spec: LoadStoreSpec) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per KV cache group with blocks in the job: ``(group, block ids, rows, positions in the row)``.

        Blocks come group by group (``group_sizes``); group ``g``'s first block is the
        request's block ``block_indices[g]``, so its first chunk starts
        ``block_indices[g] % blocks_per_chunk`` positions in. Rows come group by group too.
        """
        if not isinstance(chunk_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"kvtiers CPU worker: expected a CPU chunk spec, got {type(chunk_spec).__name__}")
        blocks, sizes, starts = self._device_blocks(gpu)
        rows = np.asarray(chunk_spec.block_ids, dtype=np.int64).reshape(-1)
        if len(sizes) != len(self._refs) or len(starts) != len(sizes):
            raise ValueError(f"kvtiers CPU worker: the job has {len(sizes)} group sizes and {len(starts)} block "
                             f"indices; the model has {len(self._refs)} KV cache groups")
        bpc = self.blocks_per_chunk
        plan = []
        b0 = r0 = 0
        for g, (n, start) in enumerate(zip(sizes, starts, strict=True)):
            if n == 0:
                continue
            skip = start % bpc
            nrows = -(-(n + skip) // bpc)
            if b0 + n <= len(blocks) and r0 + nrows <= len(rows):
                pos = np.arange(skip, skip + n)
                plan.append((g, blocks[b0:b0 + n], rows[r0:r0 + nrows][pos // bpc], pos % bpc))
            b0, r0 = b0 + n, r0 + nrows
        if b0 != len(blocks) or r0 != len(rows):
            what = (f"{len(blocks)} blocks from block {starts[0]}" if len(sizes) == 1 else
                    f"{len(blocks)} blocks in groups of {sizes} from blocks {starts}")
            raise ValueError(f"kvtiers CPU worker: {what} fill {r0} chunks of {bpc}, "
                             f"but the job names {len(rows)} rows")
        return plan

    def _run(self, job_id: int, gpu: Any, chunk_spec: LoadStoreSpec, load: bool) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for g, blocks, rows, pos in self._plan(gpu, chunk_spec):
            for t, size in self._refs[g]:
                kv, cells = self._kv[t], self._rows[t]
                if load:
                    kv[blocks, :size] = cells[rows, pos, :size]
                else:
                    cells[rows, pos, :size] = kv[blocks, :size]
                nbytes += len(blocks) * size
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec | Any, dst_spec: LoadStoreSpec) -> bool:
        """KV cache blocks (block ids, or vLLM 0.34's ``DevicePointers``) -> offload region rows."""
        return self._run(job_id, src_spec, dst_spec, load=False)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec | Any,
                    expedited: bool = False) -> bool:
        """Offload region rows -> KV cache blocks (block ids, or ``DevicePointers``). Every job is
        copied on the caller's thread, so an expedited one (vLLM 0.34) is no different."""
        return self._run(job_id, dst_spec, src_spec, load=True)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (each exactly once); never blocks."""
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        """Every submitted job is already finished on CPU: nothing to wait for."""
        return

    def shutdown(self) -> None:
        """Let go of the arrays over the region and the KV cache, and clean the region up."""
        if self._region is None:
            return
        self._rows.clear()
        self._kv.clear()
        try:
            self._view.release()
        except BufferError:  # a view still alive: vLLM's clean-up then logs that it could not unmap
            log.debug("kvtiers CPU worker: offload region views still alive at shutdown")
        region, self._region = self._region, None
        region.cleanup()
