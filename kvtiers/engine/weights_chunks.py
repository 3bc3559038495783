"""A model's tensors as chunks of bytes: the table of tensors and the storages under them, the
cut of those storages into arena-slot-sized chunks, the manifest that describes the cut, and
the copies between the storages and arena slots (the DMA engine of :mod:`.weights`).

Every distinct storage is moved once, whole (tied weights and views share one), in the order
the model names its tensors; the storages are laid end to end in one byte stream, cut into
chunks of ``chunk_bytes``. A chunk may hold pieces of several small storages, and a large
storage spans several chunks.

Only what needs torch imports it, when called.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .dma import PARALLEL_MIN_BYTES
from .dma_copies import copy_all
from .weights_derived import derived_tensors

if TYPE_CHECKING:
    import torch

    from .arena import HostArena

__all__ = ["MANIFEST_MAGIC", "Piece", "StorageEntry", "TensorEntry", "WeightCopier", "WeightPlan",
           "manifest_bytes", "manifest_length", "named_tensors"]

MANIFEST_MAGIC = b"KVTW0001"  # then the JSON's length (8 bytes, little-endian), then the JSON
_HEADER = struct.Struct("<8sQ")


@dataclass(frozen=True)
class TensorEntry:
    """One named tensor: its dtype, shape and stride, and where it lies in which storage."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: int  # index into WeightPlan.storages; -1 for a tensor with no bytes
    offset: int  # storage offset, in elements

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride),
                "storage": self.storage, "offset": self.offset}


@dataclass(eq=False)
class StorageEntry:
    """One storage moved whole: its bytes, its place in the byte stream, the tensors on it."""

    nbytes: int
    start: int  # offset of its first byte in the stream
    device: str
    tensors: list[Any] = field(default_factory=list)  # the model's own tensor objects on it
    names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of storage ``storage`` from ``offset``, at ``slot_offset`` in a chunk's slot."""

    storage: int
    offset: int
    slot_offset: int
    length: int


def named_tensors(model: Any) -> list[tuple[str, Any]]:
    """The named tensors of ``model``: an ``nn.Module`` (its parameters and buffers, shared ones
    under every name they have, and the weight copies its engine computes with:
    :mod:`.weights_derived`) or a mapping name -> tensor. Raises ``TypeError`` / ``ValueError``
    naming what is wrong (:class:`~.weights_derived.UnreachableCopy` for a copy no tensor reaches)."""
    import torch

    if isinstance(model, torch.nn.Module):
        items = list(model.named_parameters(remove_duplicate=False))
        items += list(model.named_buffers(remove_duplicate=False))
        items += derived_tensors(model)  # copies the engine computes with (vLLM CPU's packed weights)
    elif isinstance(model, Mapping):
        items = list(model.items())
    else:
        raise TypeError(f"weights: expected an nn.Module or a mapping name -> tensor, got {type(model).__name__}")
    if not items:
        raise ValueError("weights: the model has no tensors")
    seen: set[str] = set()
    for name, t in items:
        if not isinstance(name, str):
            raise TypeError(f"weights: tensor names must be strings, got {name!r}")
        if name in seen:
            raise ValueError(f"weights: tensor {name!r} is named twice")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights: {name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided:
            raise ValueError(f"weights: tensor {name!r} has layout {t.layout}; only strided tensors can be moved")
        if t.device.type == "meta":
            raise ValueError(f"weights: tensor {name!r} is on the meta device; give it memory first "
                             f"(e.g. model.to_empty(device='cpu'))")
    return items


class WeightPlan:
    """The tensor table of a model and its cut into chunks of ``chunk_bytes``."""

    def __init__(self, model: Any, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.tensors: list[TensorEntry] = []
        self.storages: list[StorageEntry] = []
        by_ptr: dict[tuple[str, int], int] = {}
        pos = 0
        for name, t in named_tensors(model):
            st = t.untyped_storage()
            if st.nbytes() == 0:
                if t.numel():
                    raise ValueError(f"weights: tensor {name!r} has no memory (is the model asleep?)")
                idx = -1
            else:
                key = (str(t.device), st.data_ptr())
                idx = by_ptr.get(key, -1)
                if idx < 0:
                    idx = by_ptr[key] = len(self.storages)
                    self.storages.append(StorageEntry(st.nbytes(), pos, str(t.device)))
                    pos += st.nbytes()
                self.storages[idx].tensors.append(t)
                self.storages[idx].names.append(name)
            self.tensors.append(TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                            tuple(t.stride()), idx, t.storage_offset()))
        self.total_bytes = pos
        self.num_chunks = -(-pos // chunk_bytes)
        self._starts = np.array([s.start for s in self.storages], dtype=np.int64)

    def pieces(self, chunk: int) -> list[Piece]:
        """The storage pieces chunk ``chunk`` holds, in slot order."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"weights: chunk {chunk} out of range: the model has {self.num_chunks} chunks")
        lo = chunk * self.chunk_bytes
        hi = min(lo + self.chunk_bytes, self.total_bytes)
        out = []
        i = int(np.searchsorted(self._starts, lo, side="right")) - 1
        while lo < hi:
            s = self.storages[i]
            take = min(hi, s.start + s.nbytes) - lo
            out.append(Piece(i, lo - s.start, lo - chunk * self.chunk_bytes, take))
            lo += take
            i += 1
        return out

    def tensors_in(self, chunks: Sequence[int], limit: int = 4) -> str:
        """The names of (up to ``limit``) tensors whose bytes lie in ``chunks``, for errors."""
        names: list[str] = []
        for c in sorted(set(chunks)):
            for p in self.pieces(c):
                for n in self.storages[p.storage].names[:1]:
                    if n not in names:
                        names.append(n)
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more

    # -- checks ----------------------------------------------------------------------------
    def check_current(self) -> None:
        """Raise ``ValueError`` naming the first tensor whose dtype or shape changed since the
        plan was made (the engine replaced or resized it)."""
        for s in self.storages:
            for name, t in zip(s.names, s.tensors, strict=True):
                e = self.entry(name)
                if str(t.dtype).removeprefix("torch.") != e.dtype or tuple(t.shape) != e.shape:
                    raise ValueError(f"weights: tensor {name!r} is now {t.dtype} {tuple(t.shape)}, "
                                     f"was {e.dtype} {e.shape}")

    def entry(self, name: str) -> TensorEntry:
        if not hasattr(self, "_by_name"):
            self._by_name = {e.name: e for e in self.tensors}
        return self._by_name[name]

    def describe(self) -> dict[str, Any]:
        """The manifest: what a forked process checks its own model against."""
        return {"kvtiers_weights": 1, "chunk_bytes": self.chunk_bytes, "total_bytes": self.total_bytes,
                "storages": [{"nbytes": s.nbytes, "start": s.start} for s in self.storages],
                "tensors": [e.describe() for e in self.tensors]}

    def check_manifest(self, manifest: Mapping[str, Any], what: str) -> None:
        """Raise ``ValueError`` naming the first tensor of this model that does not match the
        published ``manifest`` (missing, extra, another dtype, shape, stride or storage)."""
        theirs = {t["name"]: t for t in manifest.get("tensors", [])}
        for e in self.tensors:
            t = theirs.get(e.name)
            if t is None:
                raise ValueError(f"weights: tensor {e.name!r} is not in the weights of {what}")
            for label, mine, other in (("dtype", e.dtype, t["dtype"]), ("shape", list(e.shape), t["shape"]),
                                       ("stride", list(e.stride), t["stride"]),
                                       ("storage offset", e.offset, t["offset"])):
                if mine != other:
                    raise ValueError(f"weights: tensor {e.name!r} has {label} {mine}, the weights of {what} "
                                     f"have {other}")
        extra = sorted(set(theirs) - {e.name for e in self.tensors})
        if extra:
            raise ValueError(f"weights: tensor {extra[0]!r} of {what} is not in this model")
        mine_st = [{"nbytes": s.nbytes, "start": s.start} for s in self.storages]
        if mine_st != manifest.get("storages") or self.total_bytes != manifest.get("total_bytes"):
            for s, other in zip(self.storages, manifest.get("storages", []), strict=False):
                if s.nbytes != other.get("nbytes") or s.start != other.get("start"):
                    raise ValueError(f"weights: tensor {s.names[0]!r} lies in a storage of {s.nbytes} bytes at "
                                     f"{s.start}; the weights of {what} have {other.get('nbytes')} bytes at "
                                     f"{other.get('start')} (tied or shared tensors differ)")
            raise ValueError(f"weights: this model's storages ({len(self.storages)}, {self.total_bytes} bytes) "
                             f"differ from those of {what}")


def manifest_bytes(doc: Mapping[str, Any]) -> bytes:
    """The manifest as stored: magic, length, JSON."""
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return _HEADER.pack(MANIFEST_MAGIC, len(raw)) + raw


def manifest_length(head: bytes | memoryview | np.ndarray) -> int:
    """The stored manifest's whole length (header included) from its first bytes; ``ValueError``
    when they are not a manifest."""
    magic, n = _HEADER.unpack(bytes(head[: _HEADER.size]))
    if magic != MANIFEST_MAGIC:
        raise ValueError(f"weights: the stored manifest does not start with {MANIFEST_MAGIC!r}")
    return _HEADER.size + n


#: how deep a manifest's JSON may nest: it nests 4 deep (the document, its ``tensors`` list, a
#: tensor, its shape); more is a damaged or forged manifest, refused before it is parsed
MANIFEST_MAX_DEPTH = 8
_OPEN, _CLOSE = np.frombuffer(b"[{", dtype=np.uint8), np.frombuffer(b"]}", dtype=np.uint8)
_QUOTE, _BACKSLASH = 0x22, 0x5C


def json_depth(text: bytes) -> int:
    """How deep ``text``'s arrays and objects nest (brackets inside strings do not count),
    found without recursion and in one linear pass (numpy, no regular expression): a forged
    document of a million ``[``, or of half a megabyte of escaped quotes in a string that never
    ends, costs a few array passes over its bytes. Text that is not JSON gets some depth; the
    parser then refuses it."""
    b = np.frombuffer(text, dtype=np.uint8)
    n = len(b)
    if not n:
        return 0
    wide = np.int32 if n < 1 << 31 else np.int64  # 4 bytes per byte of text where that will do
    idx = np.arange(n, dtype=wide)
    # before each byte, the run of backslashes that ends there: a quote after an odd run is escaped
    plain = np.maximum.accumulate(np.where(b != _BACKSLASH, idx, -1))  # the last non-backslash so far
    run = np.zeros(n, dtype=wide)
    run[1:] = idx[:-1] - plain[:-1]
    del idx, plain
    quotes = (b == _QUOTE) & (run % 2 == 0)
    del run
    inside = np.cumsum(quotes, dtype=wide) % 2 == 1  # after an opening quote, up to its closing one
    steps = np.isin(b, _OPEN).astype(np.int8) - np.isin(b, _CLOSE).astype(np.int8)
    steps[inside] = 0
    return max(0, int(np.cumsum(steps, dtype=wide).max()))


def parse_manifest(raw: bytes | memoryview | np.ndarray) -> dict[str, Any]:
    """The manifest document from its stored bytes (header included). ``ValueError`` when they
    are not one: a wrong magic, text that is not JSON, or JSON nested deeper than
    :data:`MANIFEST_MAX_DEPTH` (which never reaches the parser, so it is never a
    ``RecursionError``)."""
    n = manifest_length(raw)
    text = bytes(raw[_HEADER.size : n])
    depth = json_depth(text)
    if depth > MANIFEST_MAX_DEPTH:
        raise ValueError(f"its JSON nests {depth} levels deep; a manifest nests at most {MANIFEST_MAX_DEPTH}")
    try:
        return json.loads(text)
    except RecursionError:  # not reached after the depth check; kept so that it never escapes
        raise ValueError("its JSON nests too deep to parse") from None


def uint8_view(storage: Any) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over the whole of ``storage`` (zero-copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class WeightCopier:
    """The DMA engine of a :class:`~kvtiers.engine.manager.TieringManager` that moves weights.

    A chunk's "device blocks" are one id: ``0 .. num_chunks - 1`` for the model's chunks,
    ``num_chunks + j`` for chunk ``j`` of the manifest buffer. Before each operation the owner
    sets :attr:`regions` (one ``uint8`` view per storage, numpy for CPU storages, a tensor
    otherwise) and :attr:`manifest` (a ``uint8`` numpy array). CPU copies are ``np.copyto`` on
    the caller's thread (a transfer of 4 MiB or more split over ``cpu_threads`` threads, default
    ``min(2, cpu_count)``) and complete at once; accelerator copies run on a side stream of their
    own, one event per transfer, queried by :meth:`poll`.
    """

    def __init__(self, host: HostArena, plan: WeightPlan, cpu_threads: int | None = None) -> None:
        self.host = host
        self.cpu_threads = max(1, cpu_threads if cpu_threads is not None else min(2, os.cpu_count() or 1))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.plan = plan
        self.regions: list[Any] = []
        self.manifest: np.ndarray = np.zeros(0, dtype=np.uint8)
        self._done: list[int] = []
        self._pending: dict[int, Any] = {}
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()

    # the DMA engine interface the manager drives
    def submit_store(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        """Copy each chunk's bytes into its slot."""
        self._submit(tid, chunks, load=False)

    def submit_load(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]]) -> None:
        """Copy each slot's bytes into its chunk's storages."""
        self._submit(tid, chunks, load=True)

    def poll(self) -> list[int]:
        """Transfers whose copies completed since the last call."""
        with self._lock:
            out, self._done = self._done, []
            for tid, ev in list(self._pending.items()):
                if ev.query():
                    del self._pending[tid]
                    out.append(tid)
        return out

    def synchronize(self) -> None:
        """Wait for every accelerator copy in flight."""
        with self._lock:
            events = list(self._pending.values())
        for ev in events:
            ev.synchronize()

    def close(self) -> None:
        self.synchronize()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _copy_cpu(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """The CPU copies of one transfer; from :data:`~.dma.PARALLEL_MIN_BYTES` on, split in two
        halves by bytes, one on a helper thread (numpy releases the GIL while it copies), as the
        KV DMA engine does: one core does not saturate memory bandwidth."""
        total = sum(d.nbytes for d, _ in pairs)
        if self.cpu_threads < 2 or total < PARALLEL_MIN_BYTES or len(pairs) < 2:
            copy_all(pairs)
            return
        acc, cut = 0, len(pairs) - 1
        for i, (d, _) in enumerate(pairs):
            acc += d.nbytes
            if 2 * acc >= total:
                cut = min(i + 1, len(pairs) - 1)
                break
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.cpu_threads - 1,
                                                               thread_name_prefix="kvtiers-weights")
        fut = self._pool.submit(copy_all, pairs[cut:])
        try:
            copy_all(pairs[:cut])
        finally:
            fut.result()

    def _submit(self, tid: int, chunks: Sequence[tuple[Sequence[int], int]], load: bool) -> None:
        rows = self.host.ndarray()
        accel: list[tuple[Any, int, int, int, int]] = []  # region, off, slot, slot_off, length
        pairs: list[tuple[np.ndarray, np.ndarray]] = []  # CPU copies: (dst, src)
        n = self.plan.num_chunks
        for blocks, slot in chunks:
            (cid,) = blocks
            if cid >= n:
                j = cid - n
                lo, hi = j * self.plan.chunk_bytes, min((j + 1) * self.plan.chunk_bytes, len(self.manifest))
                mine, theirs = self.manifest[lo:hi], rows[slot, : hi - lo]
                pairs.append((mine, theirs) if load else (theirs, mine))
                continue
            for p in self.plan.pieces(cid):
                region = self.regions[p.storage]
                if isinstance(region, np.ndarray):
                    mine = region[p.offset : p.offset + p.length]
                    theirs = rows[slot, p.slot_offset : p.slot_offset + p.length]
                    pairs.append((mine, theirs) if load else (theirs, mine))
                else:
                    accel.append((region, p.offset, slot, p.slot_offset, p.length))
        self._copy_cpu(pairs)
        if not accel:
            with self._lock:
                self._done.append(tid)
            return
        import torch

        slots = self.host.tensor()
        by_dev: dict[str, list[tuple[Any, int, int, int, int]]] = {}
        for item in accel:
            by_dev.setdefault(str(item[0].device), []).append(item)
        events = []
        for name, items in by_dev.items():
            dev = items[0][0].device
            stream = self._streams.get(name)
            if stream is None:
                stream = self._streams[name] = torch.Stream(device=dev)
            ready = torch.Event(device=dev)
            ready.record(torch.accelerator.current_stream(dev))
            with stream:
                stream.wait_event(ready)
                for region, off, slot, soff, length in items:
                    d, h = region[off : off + length], slots[slot, soff : soff + length]
                    (d.copy_(h, non_blocking=True) if load else h.copy_(d, non_blocking=True))
                done = torch.Event(device=dev)
                done.record(stream)
            events.append(done)
        with self._lock:
            self._pending[tid] = _Events(events)


class _Events:
    """Several devices' completion events as one."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()
