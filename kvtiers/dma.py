"""The DMA engine: copies chunks between device KV-cache tensors and host-arena slots.

One code path for every accelerator torch knows (CUDA, ROCm, XPU, Ascend NPU, ...) through
``torch.Stream`` / ``torch.Event``: stores and loads run on their own side streams, each
after an event recorded on the caller's current stream (so a store sees the KV the model
just wrote, and a load does not overwrite blocks still being read); completion is one event
per transfer, queried by :meth:`DmaEngine.poll`. CPU tensors (no accelerator) are copied
with numpy / ``memmove`` on the caller's thread and complete at once.

Batching: when a group's tensors are views of one allocation at block-aligned offsets (one
KV pool, as many engines allocate), a chunk's blocks of *all* layers are one gather
(``index_select``) or one scatter (``index_copy_``) over the pool; otherwise one per tensor
per transfer. On an accelerator the gather lands in a device staging buffer laid out like
the slots, then one device->host copy per chunk (one per run of consecutive slots where the
slots hold exactly one chunk); loads mirror that. ``strategy="direct"`` instead copies each
(tensor, run of consecutive blocks) straight between device and slot; it exists to measure
against.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .arena import HostArena
from .layout import KVLayout, tensor_block_bytes

if TYPE_CHECKING:
    import torch

Chunks = Sequence[tuple[Sequence[int], int]]
_memmove = ctypes.memmove


@dataclass
class _Group:
    """One KV group's tensors, as the engine copies them."""

    name: str
    block_bytes: int
    num_blocks: int
    offset: int  # byte offset of the group's region in a slot
    tensors: list[Any]  # uint8 views [num_blocks, block_bytes], slot order (layer, tensor)
    rows: Any = None  # pooled: uint8 view [nrows, block_bytes] over the shared allocation
    row_off: np.ndarray | None = None  # pooled: first row of each tensor in `rows`
    np_rows: np.ndarray | None = None  # CPU, pooled
    np_pool3: np.ndarray | None = None  # CPU, pooled at a uniform stride: [num_tensors, num_blocks, block_bytes]
    np_tensors: list[np.ndarray] | None = None  # CPU
    addrs: list[int] | None = None  # CPU: address of each tensor's block 0
    row_off_dev: Any = None  # accelerator, pooled: row_off on the device

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)


def _u8_rows(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    import torch

    return t.view(torch.uint8).reshape(t.shape[0], block_bytes)


def _pooled_rows(tensors: list[torch.Tensor], block_bytes: int) -> tuple[Any, np.ndarray] | None:
    """A rows view over one shared allocation, if every tensor lies in it at a block-aligned offset."""
    import torch

    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != 1:
        return None
    ptrs = [t.data_ptr() for t in tensors]
    base = min(ptrs)
    offs = [p - base for p in ptrs]
    if any(o % block_bytes for o in offs):
        return None
    storage = tensors[0].untyped_storage()
    end = max(o + t.shape[0] * block_bytes for o, t in zip(offs, tensors, strict=True))
    rows = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    rows.set_(storage, base - storage.data_ptr(), (end // block_bytes, block_bytes), (block_bytes, 1))
    return rows, np.asarray([o // block_bytes for o in offs], dtype=np.int64)


def _uniform_view(rows: np.ndarray, row_off: np.ndarray, num_blocks: int) -> np.ndarray | None:
    """``[num_tensors, num_blocks, block_bytes]`` strided view of a pool whose tensors start at
    equally spaced rows (e.g. one ``[layers, 2, blocks, ...]`` allocation), else None."""
    step = int(row_off[1] - row_off[0]) if len(row_off) > 1 else num_blocks
    if step <= 0 or np.any(np.diff(row_off) != step):
        return None
    base = rows[int(row_off[0]) :]
    bb = rows.shape[1]
    return np.lib.stride_tricks.as_strided(base, shape=(len(row_off), num_blocks, bb),
                                           strides=(step * bb, bb, 1), writeable=True)


def _is_run(ids: np.ndarray) -> bool:
    return len(ids) > 0 and int(ids[-1]) - int(ids[0]) == len(ids) - 1 and bool(np.all(np.diff(ids) == 1))


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in position order: ``(position, first id, count)``."""
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class DmaEngine:
    """Copies chunks device -> arena (store) and arena -> device (load).

    ``kv_caches``: group name -> per layer -> ``tensors_per_layer`` tensors
    ``[num_blocks, *block_shape]``, contiguous, matching ``layout``. A chunk is given as
    ``(device block ids, slot)``; it may have fewer than ``blocks_per_chunk`` blocks (the
    last partial chunk of a request): what is given is copied. Every submitted transfer id
    is reported by :meth:`poll` exactly once. Calls come from one thread at a time.
    """

    device: torch.device
    kind: str

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: Mapping[str, Sequence[Sequence[torch.Tensor]]],
        host: HostArena,
        blocks_per_chunk: int,
        *,
        strategy: str = "gather",
        staging_bytes: int = 64 << 20,
        _torch_path_on_cpu: bool = False,
    ) -> None:
        import torch

        bpc = operator.index(blocks_per_chunk)
        if bpc <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {bpc}")
        if strategy not in ("gather", "direct"):
            raise ValueError(f"strategy must be 'gather' or 'direct', got {strategy!r}")
        self.layout = layout
        self.host = host
        self.blocks_per_chunk = bpc
        self.chunk_bytes = layout.chunk_bytes(bpc)
        self.strategy = strategy
        if self.chunk_bytes > host.slot_bytes:
            raise ValueError(f"a chunk of {bpc} blocks is {self.chunk_bytes} bytes; "
                             f"the arena's slots hold {host.slot_bytes}")
        missing = [g.name for g in layout.groups if g.name not in kv_caches]
        extra = [n for n in kv_caches if n not in {g.name for g in layout.groups}]
        if missing or extra:
            raise ValueError(f"kv_caches groups {list(kv_caches)} do not match the layout's "
                             f"{[g.name for g in layout.groups]}")
        self._groups: list[_Group] = []
        devices = set()
        for g, goff in zip(layout.groups, layout.group_offsets(bpc), strict=True):
            layers = kv_caches[g.name]
            if len(layers) != g.num_layers:
                raise ValueError(f"KV group {g.name!r}: {len(layers)} layers given, layout says {g.num_layers}")
            flat = []
            for li, tensors in enumerate(layers):
                if len(tensors) != g.tensors_per_layer:
                    raise ValueError(f"KV group {g.name!r} layer {li}: {len(tensors)} tensors, "
                                     f"layout says {g.tensors_per_layer}")
                for ti, t in enumerate(tensors):
                    bb = tensor_block_bytes(t, f"KV group {g.name!r} layer {li} tensor {ti}")
                    if bb != g.block_bytes:
                        raise ValueError(f"KV group {g.name!r} layer {li} tensor {ti}: block of {bb} bytes, "
                                         f"layout says {g.block_bytes}")
                    devices.add(t.device)
                    flat.append(_u8_rows(t, bb))
            grp = _Group(g.name, g.block_bytes, min(t.shape[0] for t in flat), goff, flat)
            pooled = _pooled_rows(flat, g.block_bytes)
            if pooled is not None:
                grp.rows, grp.row_off = pooled
            self._groups.append(grp)
        if len(devices) != 1:
            raise ValueError(f"all KV tensors must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.kind = self.device.type
        # _torch_path_on_cpu: run the accelerator code (torch gathers, staging) on CPU tensors,
        # with no streams or events, so tests without an accelerator cover its index logic.
        self._cpu = self.kind == "cpu" and not _torch_path_on_cpu
        self._batch_chunks = max(1, staging_bytes // self.chunk_bytes)  # staging chunks per batch
        self._slot_rows = host.slot_bytes == self.chunk_bytes
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # transfer id -> event (accelerator)
        self._done: list[int] = []  # finished, not yet polled
        self._closed = False
        if self._cpu:
            self._arena_np = host.ndarray()
            for grp in self._groups:
                grp.np_tensors = [t.numpy() for t in grp.tensors]
                grp.addrs = [t.data_ptr() for t in grp.tensors]
                if grp.rows is not None:
                    grp.np_rows = grp.rows.numpy()
                    grp.np_pool3 = _uniform_view(grp.np_rows, grp.row_off, grp.num_blocks)
            self._cpu_merge = all(g.np_pool3 is not None for g in self._groups)
        else:
            self._host_t = host.tensor()
            if not host.pinned and self.kind != "cpu":
                import logging

                logging.getLogger("kvtiers.dma").warning(
                    "DMA engine on %s with an unpinned arena: copies will be synchronous and slow", self.device)
            self._store_stream = self._load_stream = None
            if self.kind != "cpu":
                self._store_stream = torch.Stream(device=self.device)
                self._load_stream = torch.Stream(device=self.device)
            for grp in self._groups:
                if grp.row_off is not None:
                    grp.row_off_dev = torch.from_numpy(grp.row_off).to(self.device)

    # --- public API ------------------------------------------------------------------------
    def submit_store(self, transfer_id: int, chunks: Chunks) -> None:
        """Copy each ``(device block ids, slot)`` chunk from the device into its arena slot."""
        tid, plan = self._check(transfer_id, chunks, load=False)
        if self._cpu:
            self._cpu_transfer(plan, load=False)
            self._finish_now(tid)
        else:
            self._submit_accel(tid, plan, load=False)

    def submit_load(self, transfer_id: int, chunks: Chunks) -> None:
        """Copy each ``(device block ids, slot)`` chunk from its arena slot into the device blocks."""
        tid, plan = self._check(transfer_id, chunks, load=True)
        if self._cpu:
            self._cpu_transfer(plan, load=True)
            self._finish_now(tid)
        else:
            self._submit_accel(tid, plan, load=True)

    def poll(self) -> list[int]:
        """Transfer ids finished since the last call; never blocks."""
        with self._lock:
            if self._pending:
                for tid, ev in list(self._pending.items()):
                    if ev.query():
                        del self._pending[tid]
                        self._done.append(tid)
            done, self._done = self._done, []
        return done

    def wait(self, transfer_id: int, timeout: float | None = None) -> None:
        """Block until ``transfer_id`` has finished (it is still reported by :meth:`poll`).

        Returns at once for an id that is not in flight. Raises ``TimeoutError``.
        """
        with self._lock:
            ev = self._pending.get(transfer_id)
        if ev is None:
            return
        if timeout is None:
            ev.synchronize()
            return
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while not ev.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"DMA transfer {transfer_id} not finished after {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def in_flight(self) -> int:
        """Transfers submitted and not yet finished."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Wait for every transfer in flight; their ids are still returned by :meth:`poll`."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            events = list(self._pending.values())
        for ev in events:
            ev.synchronize()

    # --- validation ------------------------------------------------------------------------
    def _check(self, transfer_id: int, chunks: Chunks, load: bool) -> tuple[int, list[tuple[np.ndarray, int]]]:
        if self._closed:
            raise ValueError("DMA engine is closed")
        try:
            tid = operator.index(transfer_id)
        except TypeError:
            raise TypeError(f"transfer_id must be an integer, got {type(transfer_id).__name__}") from None
        with self._lock:
            if tid in self._pending or tid in self._done:
                raise ValueError(f"transfer {tid} is already in flight")
        plan: list[tuple[np.ndarray, int]] = []
        slots = set()
        nslots = self.host.num_slots
        for item in chunks:
            try:
                ids, slot = item
            except (TypeError, ValueError):
                raise TypeError(f"transfer {tid}: each chunk is (device block ids, slot), got {item!r}") from None
            slot = operator.index(slot)
            if not 0 <= slot < nslots:
                raise IndexError(f"transfer {tid}: slot {slot} out of range: arena has {nslots} slots")
            if slot in slots and not load:
                raise ValueError(f"transfer {tid}: slot {slot} given twice")
            slots.add(slot)
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            if len(arr) > self.blocks_per_chunk:
                raise ValueError(f"transfer {tid}: chunk for slot {slot} has {len(arr)} blocks, "
                                 f"more than blocks_per_chunk={self.blocks_per_chunk}")
            if len(arr):
                lo, hi = int(arr.min()), int(arr.max())
                for grp in self._groups:
                    if lo < 0 or hi >= grp.num_blocks:
                        bad = lo if lo < 0 else hi
                        raise IndexError(f"transfer {tid}: device block {bad} out of range: KV group "
                                         f"{grp.name!r} has {grp.num_blocks} blocks")
            plan.append((arr, slot))
        if load:
            all_ids = np.concatenate([a for a, _ in plan]) if plan else np.zeros(0, np.int64)
            if len(np.unique(all_ids)) != len(all_ids):
                raise ValueError(f"transfer {tid}: a device block is loaded twice")
        return tid, plan

    def _finish_now(self, tid: int) -> None:
        with self._lock:
            self._done.append(tid)

    # --- CPU -------------------------------------------------------------------------------
    def _cpu_transfer(self, plan: list[tuple[np.ndarray, int]], load: bool) -> None:
        """Copy on the caller's thread. Full chunks of consecutive blocks going to consecutive
        slots are merged into one strided copy per group where every group is a uniform pool."""
        bpc = self.blocks_per_chunk
        i, n = 0, len(plan)
        while i < n:
            ids, slot = plan[i]
            j = i + 1
            if self._cpu_merge and len(ids) == bpc and _is_run(ids):
                while (j < n and plan[j][1] == plan[j - 1][1] + 1 and len(plan[j][0]) == bpc
                       and plan[j][0][0] == plan[j - 1][0][-1] + 1 and _is_run(plan[j][0])):
                    j += 1
            if j - i > 1:
                self._cpu_merged(int(ids[0]), slot, j - i, load)
            elif len(ids):
                self._cpu_chunk(ids, slot, load)
            i = j

    def _cpu_merged(self, first: int, slot: int, k: int, load: bool) -> None:
        bpc = self.blocks_per_chunk
        slots = self._arena_np[slot : slot + k]
        for grp in self._groups:
            lt, bb = grp.num_tensors, grp.block_bytes
            region = slots[:, grp.offset : grp.offset + lt * bpc * bb].reshape(k, lt, bpc, bb)
            dev = grp.np_pool3[:, first : first + k * bpc].reshape(lt, k, bpc, bb).transpose(1, 0, 2, 3)
            if load:
                np.copyto(dev, region)
            else:
                np.copyto(region, dev)

    def _cpu_chunk(self, ids: np.ndarray, slot: int, load: bool) -> None:
        n = len(ids)
        bpc = self.blocks_per_chunk
        slot_arr = self._arena_np[slot]
        runs = _runs(ids)
        for grp in self._groups:
            lt, bb = grp.num_tensors, grp.block_bytes
            region = slot_arr[grp.offset : grp.offset + lt * bpc * bb].reshape(lt, bpc, bb)
            if grp.np_pool3 is not None and len(runs) <= 4:  # uniform pool: one strided copy per run
                for pos, first, count in runs:
                    dev = grp.np_pool3[:, first : first + count]
                    if load:
                        np.copyto(dev, region[:, pos : pos + count])
                    else:
                        np.copyto(region[:, pos : pos + count], dev)
            elif grp.np_rows is not None:  # pooled: one gather / scatter over the pool's rows
                idx = grp.row_off[:, None] + ids[None, :]
                if load:
                    grp.np_rows[idx] = region[:, :n]
                else:
                    np.take(grp.np_rows, idx, axis=0, out=region[:, :n], mode="clip")
            elif len(runs) > 4:  # separate tensors, scattered blocks: one gather per tensor
                for k, t in enumerate(grp.np_tensors):
                    if load:
                        t[ids] = region[k, :n]
                    else:
                        np.take(t, ids, axis=0, out=region[k, :n], mode="clip")
            else:  # separate tensors: one memmove per tensor per run
                base = self.host.address + slot * self.host.slot_bytes + grp.offset
                piece = bpc * bb
                for k, addr in enumerate(grp.addrs):
                    dst = base + k * piece
                    for pos, first, count in runs:
                        if load:
                            _memmove(addr + first * bb, dst + pos * bb, count * bb)
                        else:
                            _memmove(dst + pos * bb, addr + first * bb, count * bb)

    # --- accelerators ----------------------------------------------------------------------
    def _submit_accel(self, tid: int, plan: list[tuple[np.ndarray, int]], load: bool) -> None:
        import torch

        stream = self._load_stream if load else self._store_stream
        plan = [(ids, slot) for ids, slot in plan if len(ids)]
        if stream is None:  # _torch_path_on_cpu: synchronous, no events
            ctx: Any = contextlib.nullcontext()
        else:
            ready = torch.Event(device=self.device)
            ready.record(torch.accelerator.current_stream(self.device))
            ctx = stream
        with ctx:
            if stream is not None:
                stream.wait_event(ready)
            if self.strategy == "direct":
                for ids, slot in plan:
                    self._direct(ids, slot, load)
            else:
                step = self._batch_chunks
                for i in range(0, len(plan), step):
                    if load:
                        self._gather_load(plan[i : i + step])
                    else:
                        self._gather_store(plan[i : i + step])
            if stream is None:
                self._finish_now(tid)
                return
            done = torch.Event(device=self.device)
            done.record(stream)
        with self._lock:
            self._pending[tid] = done

    def _direct(self, ids: np.ndarray, slot: int, load: bool) -> None:
        bpc = self.blocks_per_chunk
        slot_t = self._host_t[slot]
        runs = _runs(ids)
        for grp in self._groups:
            bb = grp.block_bytes
            piece = bpc * bb
            for lt, t in enumerate(grp.tensors):
                base = grp.offset + lt * piece
                for pos, first, count in runs:
                    h = slot_t[base + pos * bb : base + (pos + count) * bb].view(count, bb)
                    d = t[first : first + count]
                    if load:
                        d.copy_(h, non_blocking=True)
                    else:
                        h.copy_(d, non_blocking=True)

    def _host_copies(self, staging: torch.Tensor, slots: list[int], load: bool) -> None:
        """Copy staging rows <-> slots: one copy per run of consecutive slots when slots hold
        exactly one chunk, else one per chunk."""
        cb = self.chunk_bytes
        i = 0
        n = len(slots)
        while i < n:
            j = i + 1
            if self._slot_rows:
                while j < n and slots[j] == slots[j - 1] + 1:
                    j += 1
            h = self._host_t[slots[i] : slots[i] + (j - i), :cb]
            s = staging[i:j]
            if load:
                s.copy_(h, non_blocking=True)
            else:
                h.copy_(s, non_blocking=True)
            i = j

    def _group_staging(self, staging: torch.Tensor, grp: _Group) -> torch.Tensor:
        """The group's region of every staging chunk: [N, num_tensors * bpc, block_bytes]."""
        nb = grp.num_tensors * self.blocks_per_chunk
        region = staging[:, grp.offset : grp.offset + nb * grp.block_bytes]
        return region.view(len(staging), nb, grp.block_bytes) if region.is_contiguous() else region.reshape(
            len(staging), nb, grp.block_bytes)

    def _gather_store(self, plan: list[tuple[np.ndarray, int]]) -> None:
        import torch

        n, bpc = len(plan), self.blocks_per_chunk
        staging = torch.empty((n, self.chunk_bytes), dtype=torch.uint8, device=self.device)
        ids = np.empty((n, bpc), dtype=np.int64)
        for c, (a, _) in enumerate(plan):  # pad partial chunks with their first block
            ids[c, : len(a)] = a
            ids[c, len(a) :] = a[0]
        ids_d = torch.from_numpy(ids).to(self.device, non_blocking=True)
        for grp in self._groups:
            lt, bb = grp.num_tensors, grp.block_bytes
            gathered: torch.Tensor
            single = len(self._groups) == 1
            if grp.rows is not None:
                rows = (grp.row_off_dev.view(1, lt, 1) + ids_d.view(n, 1, bpc)).reshape(-1)
                if single:
                    torch.index_select(grp.rows, 0, rows, out=staging.view(n * lt * bpc, bb))
                    continue
                gathered = grp.rows.index_select(0, rows).view(n, lt * bpc, bb)
            else:
                flat = ids_d.view(-1)
                tmp = torch.empty((lt, n * bpc, bb), dtype=torch.uint8, device=self.device)
                for k, t in enumerate(grp.tensors):
                    torch.index_select(t, 0, flat, out=tmp[k])
                gathered = tmp.view(lt, n, bpc, bb).permute(1, 0, 2, 3)
            dst = staging[:, grp.offset : grp.offset + lt * bpc * bb].view(n, lt, bpc, bb)
            dst.copy_(gathered.view(n, lt, bpc, bb) if gathered.is_contiguous() else gathered)
        self._host_copies(staging, [s for _, s in plan], load=False)

    def _gather_load(self, plan: list[tuple[np.ndarray, int]]) -> None:
        import torch

        n, bpc = len(plan), self.blocks_per_chunk
        staging = torch.empty((n, self.chunk_bytes), dtype=torch.uint8, device=self.device)
        self._host_copies(staging, [s for _, s in plan], load=True)
        full = all(len(a) == bpc for a, _ in plan)
        ids_np = np.concatenate([a for a, _ in plan])
        ids_d = torch.from_numpy(ids_np).to(self.device, non_blocking=True)
        counts = [len(a) for a, _ in plan]
        for grp in self._groups:
            lt, bb = grp.num_tensors, grp.block_bytes
            src = self._group_staging(staging, grp).reshape(-1, bb)  # rows in (chunk, tensor, block) order
            if grp.rows is not None:
                if full:
                    rows = (grp.row_off_dev.view(1, lt, 1) + ids_d.view(n, 1, bpc)).reshape(-1)
                else:
                    rows_np = np.concatenate([(grp.row_off[:, None] + a[None, :]).reshape(-1) for a, _ in plan])
                    rows = torch.from_numpy(rows_np).to(self.device, non_blocking=True)
                    src = src.index_select(0, self._dev(_positions(counts, lt, bpc, tensor_major=False)))
                grp.rows.index_copy_(0, rows, src)
            else:
                per = src.index_select(0, self._dev(_positions(counts, lt, bpc, tensor_major=True)))
                per = per.view(lt, len(ids_np), bb)
                for k, t in enumerate(grp.tensors):
                    t.index_copy_(0, ids_d, per[k])

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        import torch

        return torch.from_numpy(a).to(self.device, non_blocking=True)


def _positions(counts: list[int], lt: int, bpc: int, tensor_major: bool) -> np.ndarray:
    """Row positions in a staging region [n, lt, bpc] of the real (non-padding) blocks."""
    parts = []
    if tensor_major:
        for k in range(lt):
            for c, m in enumerate(counts):
                parts.append(c * lt * bpc + k * bpc + np.arange(m))
    else:
        for c, m in enumerate(counts):
            for k in range(lt):
                parts.append(c * lt * bpc + k * bpc + np.arange(m))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
