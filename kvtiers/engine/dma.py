"""The DMA engine: copies chunks between device KV-cache tensors and host-arena slots.

One code path for every accelerator torch knows (CUDA, ROCm, XPU, Ascend NPU, ...) through
``torch.Stream`` / ``torch.Event``: stores and loads run on their own side streams, each
after an event recorded on the caller's current stream (so a store sees the KV the model
just wrote, and a load does not overwrite blocks still being read); completion is one event
per transfer, queried by :meth:`DmaEngine.poll`. CPU tensors (no accelerator) are copied
with numpy / ``memmove`` on the caller's thread and complete at once.

Accelerators: every KV tensor of every group is reached through one *span*, a row view over
the device memory from the lowest tensor to the end of the highest (rows of the largest size
that divides every block and every tensor's offset; an alias made with
``torch._C._construct_storage_from_data_pointer``, so separate per-layer allocations, as vLLM
makes them, cost the same as one pool). A store is one ``index_select`` from the span into a
device staging buffer laid out like the slots, then one device->host copy per run of
consecutive slots (per chunk where slots are padded); a load is the host->device copies, then
one ``index_copy_`` into the span. Indices are computed on the device from the block ids: no
per-block or per-tensor Python work, no synchronisation.

CPU tensors (no accelerator) are copied with numpy / ``memmove`` on the caller's thread. A
group's tensors are cut into runs that lie at one address stride (a pool is one run; separate
allocations made one after another one or a few), each reached through one strided view. Full
chunks of consecutive blocks whose first blocks step evenly, going to slots that step evenly
(consecutive chunks to consecutive slots, or every other slot, ...), cost one strided
``np.copyto`` per run of tensors for the whole run of chunks; other chunks one copy per run of
tensors per run of blocks, or one gather / scatter per run of tensors (per group for a pool)
when the blocks are scattered. A strided
copy is still one ``memmove`` per contiguous piece inside numpy: a slot holds each tensor's
blocks of a chunk back to back, the device each tensor's blocks, so a piece is one tensor's
blocks of one chunk (``blocks_per_chunk * block_bytes``) whatever the batching.

Hybrid layouts (see :mod:`.layout`): a chunk may name its block ids per group (a mapping),
with ``-1`` for a position not to copy (a sliding-window block outside the window, the state of a chunk
that is not the last of a load). SSM groups have one position per chunk, a state slot. Such
transfers take a masked path: one gather / scatter per group on CPU; on an accelerator the
same staging copies with the span rows of the copied positions only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import math
import operator
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dma_copies as copies
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
    positions: int = 1  # pieces per tensor in a chunk: blocks_per_chunk, or 1 (SSM state)
    is_state: bool = False  # SSM: positions are state slots
    rows: Any = None  # CPU, pooled: uint8 view [nrows, block_bytes] over the shared allocation
    row_off: np.ndarray | None = None  # CPU, pooled: first row of each tensor in `rows`
    np_rows: np.ndarray | None = None  # CPU, pooled
    segs: list[tuple[int, int, np.ndarray, tuple[np.ndarray, int]]] | None = None  # CPU: runs of tensors
    # (slot order) at one address stride (a pool, or separate allocations placed one after
    # another): (first tensor, count, strided view [count, num_blocks, block_bytes], (flat
    # buffer, the view's offset in it)); a lone tensor is a run of one
    np_tensors: list[np.ndarray] | None = None  # CPU
    addrs: list[int] | None = None  # CPU: address of each tensor's block 0
    span_first: np.ndarray | None = None  # accelerator: span row of each tensor's block 0 (host copy)
    span_rows: Any = None  # accelerator: [num_tensors, 1, rows per block]: span row of each
    # (tensor, block 0, sub-row); block b adds b * rows per block
    stage_rows: Any = None  # accelerator: [num_tensors, 1, rows per block]: row of each
    # (tensor, position 0, sub-row) in a chunk's staging rows; position p adds p * rows per block

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


PARALLEL_MIN_BYTES = 4 << 20  # CPU: transfers at least this large are shared with helper threads
PARALLEL_PARTS = 4  # ... in this many parts per thread


class _PerGroup:
    """A transfer's chunks given per group, checked: ``ids[g]`` is an int64 matrix
    ``(chunks, positions of group g)``, ``-1`` where a position is skipped; ``slots[c]`` is
    chunk ``c``'s slot. One matrix per group, so planning a transfer costs a few numpy calls
    per group, not per chunk."""

    __slots__ = ("ids", "slots")

    def __init__(self, ids: list[np.ndarray], slots: list[int]) -> None:
        self.ids = ids
        self.slots = slots

    def __len__(self) -> int:
        return len(self.slots)

    def select(self, keep: Any) -> _PerGroup:
        """The chunks picked by ``keep`` (a slice, or a boolean mask over the chunks)."""
        if isinstance(keep, slice):
            return _PerGroup([m[keep] for m in self.ids], self.slots[keep])
        return _PerGroup([m[keep] for m in self.ids], [s for s, k in zip(self.slots, keep.tolist(), strict=True) if k])


class DmaEngine:
    """Copies chunks device -> arena (store) and arena -> device (load).

    ``kv_caches``: group name -> per layer -> ``tensors_per_layer`` tensors
    ``[num_blocks, *block_shape]``, contiguous, matching ``layout``. A chunk is given as
    ``(device block ids, slot)``; it may have fewer than ``blocks_per_chunk`` blocks (the
    last partial chunk of a request): what is given is copied. Every submitted transfer id
    is reported by :meth:`poll` exactly once. Calls come from one thread at a time.

    Hybrid layouts: a chunk's block ids may be a mapping ``group name -> ids`` (a group left
    out is not copied; ``-1`` skips a position); SSM groups take one id, the state slot. A
    plain sequence applies to every attention group and skips the SSM groups.
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
        staging_bytes: int = 64 << 20,
        cpu_threads: int | None = None,
        _torch_path_on_cpu: bool = False,
    ) -> None:
        import torch

        bpc = operator.index(blocks_per_chunk)
        if bpc <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {bpc}")
        self.layout = layout
        self.host = host
        self.blocks_per_chunk = bpc
        self.chunk_bytes = layout.chunk_bytes(bpc)
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
            self._groups.append(_Group(g.name, g.block_bytes, min(t.shape[0] for t in flat), goff, flat,
                                       positions=g.positions(bpc), is_state=g.is_state))
        if len(devices) != 1:
            raise ValueError(f"all KV tensors must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.kind = self.device.type
        # _torch_path_on_cpu: run the accelerator code (torch gathers, staging) on CPU tensors,
        # with no streams or events, so tests without an accelerator cover its index logic.
        self._cpu = self.kind == "cpu" and not _torch_path_on_cpu
        self._min_blocks = min(g.num_blocks for g in self._groups)
        self._has_state = any(g.is_state for g in self._groups)  # every transfer takes the masked path
        self._batch_chunks = max(1, staging_bytes // self.chunk_bytes)  # staging chunks per batch
        self._slot_rows = host.slot_bytes == self.chunk_bytes
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # transfer id -> event (accelerator)
        self._done: list[int] = []  # finished, not yet polled
        self._closed = False
        # CPU copies of large transfers are split over this many threads (caller included)
        self._cpu_threads = max(1, cpu_threads if cpu_threads is not None else min(2, os.cpu_count() or 1))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if self._cpu:
            self._arena_np = host.ndarray()
            for grp in self._groups:
                pooled = _pooled_rows(grp.tensors, grp.block_bytes)
                if pooled is not None:
                    grp.rows, grp.row_off = pooled
                grp.np_tensors = [t.numpy() for t in grp.tensors]
                grp.addrs = [t.data_ptr() for t in grp.tensors]
                if grp.rows is not None:
                    grp.np_rows = grp.rows.numpy()
                grp.segs = copies.address_segments(grp.tensors, grp.np_tensors, grp.num_blocks, grp.block_bytes)
        else:
            self._host_t = host.tensor()
            if not host.pinned and self.kind != "cpu":
                import logging

                logging.getLogger("kvtiers.engine.dma").warning(
                    "DMA engine on %s with an unpinned arena: copies will be synchronous and slow", self.device)
            self._store_stream = self._load_stream = None
            if self.kind != "cpu":
                self._store_stream = torch.Stream(device=self.device)
                self._load_stream = torch.Stream(device=self.device)
            self._span, self._unit, self._span_base = _make_span(self._groups, self.device)
            self._chunk_rows = self.chunk_bytes // self._unit
            for grp in self._groups:
                rpb = grp.block_bytes // self._unit
                sub = torch.arange(rpb, dtype=torch.int64).view(1, 1, rpb)
                grp.span_first = np.asarray([(t.data_ptr() - self._span_base) // self._unit for t in grp.tensors],
                                            dtype=np.int64)
                first = torch.from_numpy(grp.span_first).view(-1, 1, 1)
                grp.span_rows = (first + sub).to(self.device)
                k = torch.arange(grp.num_tensors, dtype=torch.int64).view(-1, 1, 1)
                grp.stage_rows = (grp.offset // self._unit + k * (grp.positions * rpb) + sub).to(self.device)

    # --- public API ------------------------------------------------------------------------
    def submit_store(self, transfer_id: int, chunks: Chunks) -> None:
        """Copy each ``(device block ids, slot)`` chunk from the device into its arena slot."""
        self._submit(transfer_id, chunks, load=False)

    def submit_load(self, transfer_id: int, chunks: Chunks) -> None:
        """Copy each ``(device block ids, slot)`` chunk from its arena slot into the device blocks."""
        self._submit(transfer_id, chunks, load=True)

    def _submit(self, transfer_id: int, chunks: Chunks, load: bool) -> None:
        tid, plan = self._check(transfer_id, chunks, load=load)
        if self._cpu:
            self._cpu_transfer(plan, load=load)
            self._finish_now(tid)
        else:
            self._submit_accel(tid, plan, load=load)

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
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # --- validation ------------------------------------------------------------------------
    def _check(self, transfer_id: int, chunks: Chunks, load: bool) -> tuple[int, list[tuple[Any, int]] | _PerGroup]:
        if self._closed:
            raise ValueError("DMA engine is closed")
        try:
            tid = operator.index(transfer_id)
        except TypeError:
            raise TypeError(f"transfer_id must be an integer, got {type(transfer_id).__name__}") from None
        with self._lock:
            if tid in self._pending or tid in self._done:
                raise ValueError(f"transfer {tid} is already in flight")
        plan: list[tuple[Any, int]] = []
        slots = set()
        nslots = self.host.num_slots
        masked = self._has_state  # chunks given per group (or SSM groups): checked per group below
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
            if not masked and (type(ids) is dict or isinstance(ids, Mapping)):
                masked = True
            plan.append((ids, slot))
        if masked:
            return tid, self._group_plan(tid, plan, load)
        for c, (ids, slot) in enumerate(plan):
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            if len(arr) > self.blocks_per_chunk:
                raise ValueError(f"transfer {tid}: chunk for slot {slot} has {len(arr)} blocks, "
                                 f"more than blocks_per_chunk={self.blocks_per_chunk}")
            plan[c] = (arr, slot)
        all_ids = np.concatenate([a for a, _ in plan]) if plan else np.zeros(0, np.int64)
        if len(all_ids) and (all_ids.min() < 0 or all_ids.max() >= self._min_blocks):  # name the first bad one
            for arr, _ in plan:
                lo, hi = (int(arr.min()), int(arr.max())) if len(arr) else (0, 0)
                for grp in self._groups:
                    if lo < 0 or hi >= grp.num_blocks:
                        bad = lo if lo < 0 else hi
                        raise IndexError(f"transfer {tid}: device block {bad} out of range: KV group "
                                         f"{grp.name!r} has {grp.num_blocks} blocks")
        if load and copies.repeats(all_ids):
            raise ValueError(f"transfer {tid}: a device block is loaded twice")
        return tid, plan

    def _group_plan(self, tid: int, plan: list[tuple[Any, int]], load: bool) -> _PerGroup:
        """Every chunk's ids per group, each padded to the group's positions with ``-1`` (skip),
        checked against each group: one ``(chunks, positions)`` matrix per group."""
        n = len(plan)
        names = [g.name for g in self._groups]
        known = set(names)
        specs = [ids for ids, _ in plan]
        is_map = [type(x) is dict or isinstance(x, Mapping) for x in specs]
        for x, m, (_, slot) in zip(specs, is_map, plan, strict=True):
            if m and not known.issuperset(x):
                raise ValueError(f"transfer {tid}: chunk for slot {slot} names KV groups "
                                 f"{sorted(set(x) - known)}; the layout has {names}")
        mats = []
        for grp in self._groups:
            rows = [x.get(grp.name, ()) if m else (() if grp.is_state else x)
                    for x, m in zip(specs, is_map, strict=True)]
            mat = None
            with contextlib.suppress(ValueError, TypeError):  # ragged or scalars: one chunk at a time below
                mat = np.asarray(rows, dtype=np.int64)
            if mat is None or mat.shape != (n, grp.positions):
                mat = np.full((n, grp.positions), -1, dtype=np.int64)
                for c, gids in enumerate(rows):
                    arr = np.asarray(gids, dtype=np.int64).reshape(-1)
                    if len(arr) > grp.positions:
                        what = "a state slot" if grp.is_state else f"blocks_per_chunk={grp.positions} blocks"
                        raise ValueError(f"transfer {tid}: chunk for slot {plan[c][1]} has {len(arr)} ids for "
                                         f"KV group {grp.name!r}, which takes {what}")
                    mat[c, : len(arr)] = arr
            what = "state slot" if grp.is_state else "device block"
            # one reduction for both bounds: shifted by one, -1 is 0 and anything below wraps high
            if mat.size and int((mat + 1).view(np.uint64).max()) > grp.num_blocks:
                bad = (mat < -1) | (mat >= grp.num_blocks)
                raise IndexError(f"transfer {tid}: {what} {int(mat[bad][0])} out of range: KV group {grp.name!r} has "
                                 f"{grp.num_blocks} (-1 skips a position)")
            if load and copies.repeats(mat[mat >= 0]):
                raise ValueError(f"transfer {tid}: a {what} of KV group {grp.name!r} is loaded twice")
            mats.append(mat)
        return _PerGroup(mats, [slot for _, slot in plan])

    def _finish_now(self, tid: int) -> None:
        with self._lock:
            self._done.append(tid)

    # --- CPU -------------------------------------------------------------------------------
    def _cpu_transfer(self, plan: list[tuple[np.ndarray, int]] | _PerGroup, load: bool) -> None:
        """Copy on the caller's thread. Full chunks of consecutive blocks, the chunks at one
        block step going to slots at one slot step (consecutive chunks into consecutive slots,
        or every other slot, ...), are merged into one strided copy per run of tensors at one
        address stride (one per group for a pool); other chunks are copied one by one."""
        if isinstance(plan, _PerGroup):
            self._cpu_masked(plan, load)
            return
        bpc, n = self.blocks_per_chunk, len(plan)
        if n > 1:  # which chunks are full runs of consecutive blocks, and their first blocks
            full = np.fromiter((len(a) == bpc for a, _ in plan), dtype=bool, count=n)
            run = np.zeros(n, dtype=bool)
            first = np.zeros(n, dtype=np.int64)
            if full.any():
                ids = np.stack([a for (a, _), f in zip(plan, full.tolist(), strict=True) if f])
                run[full] = (np.diff(ids, axis=1) == 1).all(axis=1) if bpc > 1 else True
                first[full] = ids[:, 0]
            runs, firsts = run.tolist(), first.tolist()
        else:
            runs, firsts = [False] * n, [0] * n
        slots = [s for _, s in plan]
        pairs: list[tuple[np.ndarray, np.ndarray]] = []  # (dst, src)
        for i, j, db, ds in copies.merged_runs(runs, firsts, slots, bpc):
            if j - i > 1:
                for grp in self._groups:
                    pairs += self._cpu_merged(grp, firsts[i], db, slots[i], ds, j - i, load, bpc)
            elif len(plan[i][0]):
                self._cpu_chunk(plan[i][0], slots[i], load)
        self._copy_pairs(pairs)

    def _cpu_masked(self, plan: _PerGroup, load: bool) -> None:
        """Chunks given per group. Per group: chunks whose positions are all kept, with ids
        consecutive inside each chunk, the chunks' first ids stepping evenly into slots that
        step evenly, are merged into one strided copy per run of tensors at one address stride;
        other chunks one copy per such run of tensors per run of kept positions, or one
        gather/scatter when scattered."""
        pairs: list[tuple[np.ndarray, np.ndarray]] = []  # (dst, src)
        slots = plan.slots
        for grp, ids in zip(self._groups, plan.ids, strict=True):  # ids: (chunk, position), -1: skip
            lt, npos, bb = grp.num_tensors, grp.positions, grp.block_bytes
            width = lt * npos * bb
            segs = grp.segs or []
            kept = ids >= 0
            full = kept.all(axis=1)
            if npos > 1:
                full &= (np.diff(ids, axis=1) == 1).all(axis=1)
            any_kept = kept.any(axis=1).tolist()
            for i, j, db, ds in copies.merged_runs(full.tolist(), ids[:, 0].tolist(), slots, npos):
                if j - i > 1:
                    pairs += self._cpu_merged(grp, int(ids[i, 0]), db, slots[i], ds, j - i, load, npos)
                    continue
                if not any_kept[i]:
                    continue
                arr, slot = ids[i], slots[i]
                region = self._arena_np[slot, grp.offset : grp.offset + width].reshape(lt, npos, bb)
                runs = copies.masked_runs(arr)
                if len(runs) > 4:  # scattered: one gather / scatter over the positions kept
                    pos = np.flatnonzero(arr >= 0)
                    kept_ids = arr[pos]
                    for t0, cnt, view, _ in segs:
                        if load:
                            view[:, kept_ids] = region[t0 : t0 + cnt, pos]
                        else:
                            region[t0 : t0 + cnt, pos] = view[:, kept_ids]
                    continue
                for pos, first, count in runs:
                    for t0, cnt, view, _ in segs:
                        dev, reg = view[:, first : first + count], region[t0 : t0 + cnt, pos : pos + count]
                        pairs.append((dev, reg) if load else (reg, dev))
        self._copy_pairs(pairs)

    def _cpu_merged(self, grp: _Group, first: int, block_step: int, slot: int, slot_step: int, k: int,
                    load: bool, npos: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(dst, src)`` copies of one group's part of ``k`` full chunks, chunk ``c`` being
        blocks ``first + c * block_step ..`` (``npos`` of them) and going to slot
        ``slot + c * slot_step``: one strided copy per run of tensors at one address stride,
        covering every chunk."""
        lt, bb = grp.num_tensors, grp.block_bytes
        slots = self._arena_np[slot : slot + (k - 1) * slot_step + 1 : slot_step]
        region = slots[:, grp.offset : grp.offset + lt * npos * bb].reshape(k, lt, npos, bb)
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for t0, cnt, view, base in grp.segs or []:
            st, sb, su = view.strides
            dev = copies.strided(base, first * sb, (k, cnt, npos, bb), (block_step * sb, st, sb, su))
            reg = region[:, t0 : t0 + cnt]
            pairs.append((dev, reg) if load else (reg, dev))
        return pairs

    def _copy_pairs(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy ``src`` into ``dst`` for each pair. A large batch is cut into parts of about
        equal bytes that the caller's thread and ``cpu_threads - 1`` helper threads take in
        turn (numpy releases the GIL while it copies): one core cannot saturate memory
        bandwidth. A helper that has not started by the time the caller has taken the last
        part is cancelled, so on a busy machine the copy costs what one thread's does, not
        that plus the wait for a helper to be scheduled."""
        total = sum(d.nbytes for d, _ in pairs)
        if self._cpu_threads < 2 or total < PARALLEL_MIN_BYTES:
            copies.copy_all(pairs)
            return
        parts = iter(copies.split_pairs(pairs, PARALLEL_PARTS * self._cpu_threads))  # next() is atomic under the GIL
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._cpu_threads - 1, thread_name_prefix="kvtiers-dma")
        helpers = [self._pool.submit(copies.copy_all, parts) for _ in range(self._cpu_threads - 1)]
        try:
            copies.copy_all(parts)
        finally:
            for fut in helpers:
                if not fut.cancel():
                    fut.result()

    def _cpu_chunk(self, ids: np.ndarray, slot: int, load: bool) -> None:
        n = len(ids)
        bpc = self.blocks_per_chunk
        slot_arr = self._arena_np[slot]
        runs = copies.runs(ids)
        for grp in self._groups:
            lt, bb = grp.num_tensors, grp.block_bytes
            segs = grp.segs or []
            region = slot_arr[grp.offset : grp.offset + lt * bpc * bb].reshape(lt, bpc, bb)
            if len(segs) < lt and len(runs) <= 4:  # runs of tensors at one stride: one copy per run each
                for pos, first, count in runs:
                    for t0, cnt, view, _ in segs:
                        dev, reg = view[:, first : first + count], region[t0 : t0 + cnt, pos : pos + count]
                        if load:
                            np.copyto(dev, reg)
                        else:
                            np.copyto(reg, dev)
            elif grp.np_rows is not None:  # pooled: one gather / scatter over the pool's rows
                idx = grp.row_off[:, None] + ids[None, :]
                if load:
                    grp.np_rows[idx] = region[:, :n]
                else:
                    np.take(grp.np_rows, idx, axis=0, out=region[:, :n], mode="clip")
            elif len(runs) > 4:  # scattered blocks: one gather / scatter per run of tensors
                for t0, cnt, view, _ in segs:
                    if load:
                        view[:, ids] = region[t0 : t0 + cnt, :n]
                    else:
                        np.take(view, ids, axis=1, out=region[t0 : t0 + cnt, :n], mode="clip")
            else:  # tensors at no common stride: one memmove per tensor per run
                base = self.host.address + slot * self.host.slot_bytes + grp.offset
                piece = bpc * bb
                for k, addr in enumerate(grp.addrs or []):
                    dst = base + k * piece
                    for pos, first, count in runs:
                        if load:
                            _memmove(addr + first * bb, dst + pos * bb, count * bb)
                        else:
                            _memmove(dst + pos * bb, addr + first * bb, count * bb)

    # --- accelerators ----------------------------------------------------------------------
    def _submit_accel(self, tid: int, plan: list[tuple[np.ndarray, int]] | _PerGroup, load: bool) -> None:
        import torch

        stream = self._load_stream if load else self._store_stream
        if isinstance(plan, _PerGroup):  # chunks with a position kept in some group
            kept = np.zeros(len(plan), dtype=bool)
            for m in plan.ids:
                kept |= (m >= 0).any(axis=1)
            plan = plan.select(kept)
        else:
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
            step = self._batch_chunks
            for i in range(0, len(plan), step):
                if isinstance(plan, _PerGroup):
                    self._staged_masked(plan.select(slice(i, i + step)), load)
                else:
                    self._staged(plan[i : i + step], load)
            if stream is None:
                self._finish_now(tid)
                return
            done = torch.Event(device=self.device)
            done.record(stream)
        with self._lock:
            self._pending[tid] = done

    def _staged(self, plan: list[tuple[np.ndarray, int]], load: bool) -> None:
        """One batch of chunks through a staging buffer laid out like the slots."""
        import torch

        n, bpc = len(plan), self.blocks_per_chunk
        counts = np.fromiter((len(a) for a, _ in plan), dtype=np.int64, count=n)
        full = bool((counts == bpc).all())
        # block ids per position; a partial chunk's missing positions repeat its first block
        # (a store copies it to the unused part of the slot; a load writes that block again
        # with its own bytes, see below)
        pos = np.broadcast_to(np.arange(bpc, dtype=np.int64), (n, bpc))
        if not full:
            pos = np.where(pos < counts[:, None], pos, 0)
        ids = np.empty((2 if load and not full else 1, n, bpc), dtype=np.int64)
        for c, (a, _) in enumerate(plan):
            ids[0, c, : len(a)] = a
            ids[0, c, len(a) :] = a[0]
        if len(ids) == 2:
            ids[1] = pos
        ids_d = torch.from_numpy(ids).to(self.device, non_blocking=True)
        span_idx = self._rows_index([g.span_rows for g in self._groups], ids_d[0], n)
        staging = torch.empty((n, self.chunk_bytes), dtype=torch.uint8, device=self.device)
        srows = staging.view(self._span.dtype).view(n * self._chunk_rows, -1)
        slots = [s for _, s in plan]
        if not load:
            torch.index_select(self._span, 0, span_idx, out=srows)
            self._host_copies(staging, slots, load=False)
            return
        self._host_copies(staging, slots, load=True)
        if not full:  # read each padded position from the chunk's position 0: same block, same bytes
            base = torch.arange(n, dtype=torch.int64, device=self.device).view(n, 1, 1, 1) * self._chunk_rows
            srows = srows.index_select(0, self._rows_index([g.stage_rows for g in self._groups], ids_d[1], n, base))
        self._span.index_copy_(0, span_idx, srows)

    def _staged_masked(self, plan: _PerGroup, load: bool) -> None:
        """One batch of chunks given per group through a staging buffer laid out like the
        slots, moving only the span rows of positions not skipped (indices built on the host)."""
        import torch

        n, unit = len(plan), self._unit
        span_parts, mask_parts = [], []
        for grp, ids in zip(self._groups, plan.ids, strict=True):
            rpb = grp.block_bytes // unit
            valid = ids >= 0
            rows = (grp.span_first[None, :, None, None] + np.where(valid, ids, 0)[:, None, :, None] * rpb
                    + np.arange(rpb, dtype=np.int64)[None, None, None, :])  # (chunk, tensor, position, sub-row)
            span_parts.append(rows.reshape(n, -1))
            mask_parts.append(np.broadcast_to(valid[:, None, :, None], rows.shape).reshape(n, -1))
        sel = np.flatnonzero(np.concatenate(mask_parts, axis=1).reshape(-1))
        span_idx = np.concatenate(span_parts, axis=1).reshape(-1)[sel]
        stage_d = torch.from_numpy(sel).to(self.device, non_blocking=True)
        span_d = torch.from_numpy(span_idx).to(self.device, non_blocking=True)
        staging = torch.empty((n, self.chunk_bytes), dtype=torch.uint8, device=self.device)
        srows = staging.view(self._span.dtype).view(n * self._chunk_rows, -1)
        slots = plan.slots
        if not load:
            srows.index_copy_(0, stage_d, self._span.index_select(0, span_d))
            self._host_copies(staging, slots, load=False)
            return
        self._host_copies(staging, slots, load=True)
        self._span.index_copy_(0, span_d, srows.index_select(0, stage_d))

    def _rows_index(self, firsts: list[torch.Tensor], per_pos: torch.Tensor, n: int, base: Any = 0) -> torch.Tensor:
        """Rows of every (chunk, group, tensor, position, sub-row), in slot order, flat:
        ``firsts[g][k, 0, r] + per_pos[c, p] * rows_per_block (+ base[c])``."""
        import torch

        bpc = self.blocks_per_chunk
        parts = []
        for grp, first in zip(self._groups, firsts, strict=True):
            rpb = grp.block_bytes // self._unit
            parts.append((first.unsqueeze(0) + per_pos.view(n, 1, bpc, 1) * rpb + base).view(n, -1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).view(-1)

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


def _make_span(groups: list[_Group], device: torch.device) -> tuple[torch.Tensor, int, int]:
    """A row view over the device memory of every group's tensors, from the lowest to the end
    of the highest: ``(rows, unit, base address)``; rows are ``unit`` bytes (the largest size
    dividing every block and every tensor's offset from the base) as the widest integer type
    that divides ``unit``. Only rows inside the tensors are ever indexed."""
    import torch

    tensors = [(t, g.block_bytes) for g in groups for t in g.tensors]
    base = min(t.data_ptr() for t, _ in tensors)
    end = max(t.data_ptr() + t.shape[0] * bb for t, bb in tensors)
    unit = 0
    for t, bb in tensors:
        unit = math.gcd(unit, bb, t.data_ptr() - base)
    elsz = 8
    while unit % elsz or base % elsz:
        elsz //= 2
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[elsz]
    storage = torch._C._construct_storage_from_data_pointer(base, device, end - base)
    rows = torch.empty(0, dtype=dtype, device=device)
    w = unit // elsz
    rows.set_(storage, 0, ((end - base) // unit, w), (w, 1))
    return rows, unit, base
