"""The host arena: one region of ``num_slots x slot_bytes`` that tiers see as a :class:`kvtiers.Arena`.

Three ways to hold the memory, combinable:

- **plain / pinned**: an anonymous, page-aligned, pre-faulted mmap. With an accelerator it is
  page-locked for DMA (registered with the CUDA/ROCm runtime; other accelerators get torch's
  pinned allocator). Without one it is plain memory: no ``pin_memory`` call is made.
- **shared memory** (``shared_memory="name"``): the region is ``/dev/shm/<name>``; the first
  process creates it, the other ranks attach, and each writes its shard of a chunk into the
  same slot, side by side, so one file or object holds the whole chunk.
- **elastic**: the address range is reserved once and pages are backed on first write;
  :meth:`HostArena.release` gives the pages of idle slots back. The host cache keeps at most
  :meth:`HostArena.budget_slots` slots live, a budget that is the lesser of
  ``elastic_max_bytes`` and live ``MemAvailable`` minus ``elastic_reserve_bytes``.

A shortfall (``/dev/shm`` too small, not enough memory) is an :class:`ArenaSpaceError` at
creation, naming the numbers, never a SIGBUS later.

Only functions that need torch import it (``slot_tensor``, pinning), so this module imports
without torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import operator
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..types import PAGE, Arena

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtiers.engine.arena")

SHM_DIR = "/dev/shm"
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; Python < 3.13 lacks the name


class ArenaSpaceError(ConfigError, MemoryError):
    """The arena does not fit: not enough free memory or ``/dev/shm`` space. Names the numbers."""


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def slot_bytes_for(chunk_bytes: int) -> int:
    """Slot size for chunks of ``chunk_bytes``: padded up to a multiple of 4096 (O_DIRECT, DMA)."""
    chunk_bytes = operator.index(chunk_bytes)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return -(-chunk_bytes // PAGE) * PAGE


def arena_size(
    host_bytes: int | None,
    slot_bytes: int,
    *,
    host_blocks_factor: float | None = None,
    device_chunk_capacity: int | None = None,
    num_workers: int = 1,
) -> int:
    """Number of slots for this worker's arena.

    By bytes: ``host_bytes`` is the total over all ``num_workers`` workers, as vLLM's
    ``cpu_bytes_to_use``; each worker gets ``host_bytes // num_workers``. (A shared-memory
    arena whose slots hold every rank's shard is one arena: pass ``num_workers=1`` and the
    whole-chunk ``slot_bytes``.) By factor: ``host_blocks_factor`` times
    ``device_chunk_capacity`` (the chunks the device KV cache holds). Give exactly one.
    """
    slot_bytes = operator.index(slot_bytes)
    if slot_bytes <= 0 or slot_bytes % PAGE:
        raise ConfigError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if (host_bytes is None) == (host_blocks_factor is None):
        raise ConfigError("size the host arena by 'host_bytes' (alias 'cpu_bytes_to_use') or by "
                          "'host_blocks_factor', exactly one of them")
    if host_bytes is not None:
        per_worker = operator.index(host_bytes) // num_workers
        n = per_worker // slot_bytes
        if n < 1:
            raise ConfigError(
                f"host_bytes={host_bytes} over {num_workers} worker(s) gives {per_worker} bytes per worker, "
                f"less than one slot of {slot_bytes} bytes"
            )
        return n
    if device_chunk_capacity is None or device_chunk_capacity < 1:
        raise ConfigError("host_blocks_factor needs the device cache's capacity in chunks (device_chunk_capacity)")
    if not host_blocks_factor > 0:
        raise ConfigError(f"host_blocks_factor must be positive, got {host_blocks_factor}")
    n = int(math.floor(host_blocks_factor * device_chunk_capacity))
    if n < 1:
        raise ConfigError(
            f"host_blocks_factor={host_blocks_factor} x {device_chunk_capacity} device chunks is less than one slot"
        )
    return n


def mem_available() -> int | None:
    """Live ``MemAvailable`` from /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def shm_free(path: str = SHM_DIR) -> int:
    """Bytes free for an unprivileged user in the shared-memory file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def accelerator() -> Any:
    """The current accelerator (a ``torch.device``) or None: no torch, or no accelerator."""
    try:
        import torch
    except ImportError:
        return None
    acc = getattr(torch, "accelerator", None)
    if acc is None:  # torch < 2.6
        return torch.device("cuda") if torch.cuda.is_available() else None
    return acc.current_accelerator() if acc.is_available() else None


_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def _address(m: mmap.mmap) -> int:
    obj = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj  # drop the buffer export so the mmap can close later


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ConfigError(f"shared_memory must be a plain name (no '/'), got {name!r}")
    return name


class _Pin:
    """Undo for a page-locking registration."""

    def __init__(self, kind: str, addr: int = 0) -> None:
        self.kind, self.addr = kind, addr

    def undo(self) -> None:
        if self.kind == "cudart":
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.addr)
        self.kind = "none"


def _cuda_register(addr: int, size: int) -> _Pin | None:
    """Page-lock an existing mapping with the CUDA (or HIP) runtime; None if that fails."""
    import torch

    try:
        rt = torch.cuda.cudart()
        err = rt.cudaHostRegister(addr, size, 0)
    except Exception as e:  # noqa: BLE001 - any runtime trouble: fall back
        log.warning("host arena: cudaHostRegister unavailable (%s)", e)
        return None
    if int(err) != 0:
        log.warning("host arena: cudaHostRegister of %s failed (%s)", _gib(size), err)
        return None
    return _Pin("cudart", addr)


class HostArena:
    """Owns the arena memory; ``.arena`` is the :class:`kvtiers.Arena` tiers see.

    Build it with :func:`create_host_arena`.
    """

    arena: Arena
    num_slots: int
    slot_bytes: int
    pinned: bool
    shared_memory: str | None
    elastic: bool

    def __init__(self, *, mem: Any, buf: memoryview, num_slots: int, slot_bytes: int, pinned: bool,
                 pin: _Pin | None, shared_memory: str | None, creator: bool, fd: int | None,
                 elastic: bool, elastic_max_bytes: int, elastic_reserve_bytes: int,
                 keep: Any = None) -> None:
        self._mem = mem  # mmap.mmap, or a pinned torch tensor
        self._keep = keep
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.nbytes = num_slots * slot_bytes
        self.pinned = pinned
        self.shared_memory = shared_memory
        self.creator = creator
        self.elastic = elastic
        self.elastic_max_bytes = elastic_max_bytes
        self.elastic_reserve_bytes = elastic_reserve_bytes
        self.arena = Arena(buf, slot_bytes, owner=mem)
        self._addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        self._fd = fd
        self._pin = pin
        self._tensor: torch.Tensor | None = None
        self._array: np.ndarray | None = None
        self._closed = False
        path = os.path.join(SHM_DIR, shared_memory) if shared_memory and creator else None
        self._finalizer = weakref.finalize(self, _cleanup, fd, path)

    # --- views -----------------------------------------------------------------------------
    @property
    def address(self) -> int:
        """Address of the first byte (page-aligned), for runtime registration (NIXL, RDMA)."""
        return self._addr

    def ndarray(self) -> np.ndarray:
        """The whole arena as a writable ``uint8`` array ``[num_slots, slot_bytes]`` (zero-copy)."""
        if self._array is None:
            self._array = np.frombuffer(self.arena.buffer, dtype=np.uint8).reshape(self.num_slots, self.slot_bytes)
        return self._array

    def tensor(self) -> torch.Tensor:
        """The whole arena as a ``uint8`` CPU tensor ``[num_slots, slot_bytes]`` (zero-copy)."""
        if self._tensor is None:
            import torch

            if hasattr(self._mem, "data_ptr"):  # torch's pinned allocator
                t = self._mem[self._keep or 0 :][: self.nbytes]
            else:
                t = torch.from_numpy(self.ndarray().reshape(-1))
            self._tensor = t.view(self.num_slots, self.slot_bytes)
        return self._tensor

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """A ``uint8`` CPU tensor view of one slot (zero-copy), for DMA."""
        i = operator.index(slot)
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range: arena has {self.num_slots} slots")
        return self.tensor()[i]

    # --- elastic ---------------------------------------------------------------------------
    def release(self, slots: Iterable[int]) -> None:
        """Give the pages of these idle slots back to the system (elastic arenas only).

        The bytes of a released slot read as zeros afterwards; writing it backs it again. A
        no-op for non-elastic arenas, whose memory stays resident (and pinned).
        """
        if not self.elastic or self._closed:
            return
        advice = mmap.MADV_REMOVE if self.shared_memory else mmap.MADV_DONTNEED
        for start, count in _runs(sorted({self._slot_index(s) for s in slots})):
            self._mem.madvise(advice, start * self.slot_bytes, count * self.slot_bytes)

    def resident_bytes(self) -> int:
        """Bytes of the arena now backed by memory (counted with mincore)."""
        if self._closed:
            return 0
        if not self.elastic:
            return self.nbytes
        npages = self.nbytes // PAGE
        vec = (ctypes.c_ubyte * npages)()
        if _lib().mincore(ctypes.c_void_p(self._addr), ctypes.c_size_t(self.nbytes), vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * PAGE

    def budget_bytes(self) -> int:
        """Bytes the arena may hold backed now: ``num_slots * slot_bytes`` unless elastic; then
        the lesser of ``elastic_max_bytes`` and live ``MemAvailable`` (plus what the arena
        already holds) minus ``elastic_reserve_bytes``."""
        if not self.elastic:
            return self.nbytes
        held = self.resident_bytes()
        avail = mem_available()
        budget = self.elastic_max_bytes
        if avail is not None:
            budget = min(budget, held + avail - self.elastic_reserve_bytes)
        if self.shared_memory:
            budget = min(budget, held + shm_free())
        return max(0, min(budget, self.nbytes))

    def budget_slots(self) -> int:
        """Slots the host cache may keep live now (see :meth:`budget_bytes`)."""
        return self.budget_bytes() // self.slot_bytes

    # --- life cycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin and unmap; the creator of a shared-memory arena also unlinks it. Idempotent.

        Views handed out earlier (slot memoryviews, tensors) must not be used afterwards; if
        some are still alive the mapping is freed when they go.
        """
        if self._closed:
            return
        self._closed = True
        if self._pin is not None:
            self._pin.undo()
        self._tensor = None
        self._array = None
        self._finalizer()  # close the fd, unlink the shm name if we created it
        mem, self._mem = self._mem, None
        self.arena = Arena(bytearray(self.slot_bytes), self.slot_bytes)  # drop our views of mem
        if isinstance(mem, mmap.mmap):
            try:
                mem.close()
            except BufferError:  # e.g. a closed tier's context, in a cycle the collector has not freed yet
                # the pages go back now (reading a view gives zeros; a shared file keeps its
                # bytes), the address range when the last view goes
                mem.madvise(mmap.MADV_DONTNEED)
                log.debug("host arena: views still alive; pages given back, the mapping goes with them")

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_index(self, slot: int) -> int:
        i = operator.index(slot)
        if not 0 <= i < self.num_slots:
            raise IndexError(f"slot {i} out of range: arena has {self.num_slots} slots")
        return i

    def __repr__(self) -> str:
        bits = [f"{self.num_slots} slots x {self.slot_bytes} bytes"]
        if self.pinned:
            bits.append("pinned")
        if self.shared_memory:
            bits.append(f"shm={self.shared_memory}{'' if self.creator else ' (attached)'}")
        if self.elastic:
            bits.append("elastic")
        return f"HostArena({', '.join(bits)})"


def _cleanup(fd: int | None, path: str | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _runs(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``(start, count)`` of sorted distinct integers."""
    runs: list[tuple[int, int]] = []
    for i in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def create_host_arena(
    num_slots: int,
    slot_bytes: int,
    *,
    pin: bool | None = None,
    shared_memory: str | None = None,
    attach: bool = False,
    elastic: bool = False,
    elastic_max_bytes: int | None = None,
    elastic_reserve_bytes: int = 1 << 30,
) -> HostArena:
    """Create (or, with ``attach=True``, attach to) a host arena of ``num_slots x slot_bytes``.

    ``pin``: None pins iff an accelerator is present; True requires one; False never pins.
    ``shared_memory``: a name under /dev/shm; the first process creates it (``attach=False``),
    the other ranks attach (``attach=True``, same sizes). ``elastic``: reserve, back on
    demand, release idle slots (see the module doc). Raises :class:`ArenaSpaceError` when the
    memory or /dev/shm space is not there.
    """
    num_slots = operator.index(num_slots)
    slot_bytes = operator.index(slot_bytes)
    if num_slots <= 0:
        raise ConfigError(f"num_slots must be positive, got {num_slots}")
    if slot_bytes <= 0 or slot_bytes % PAGE:
        raise ConfigError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
    if attach and not shared_memory:
        raise ConfigError("attach=True needs the shared_memory name of an existing arena")
    size = num_slots * slot_bytes
    max_bytes = size if elastic_max_bytes is None else min(size, operator.index(elastic_max_bytes))
    what = f"host arena of {_gib(size)} ({num_slots} slots x {slot_bytes} bytes)"

    acc = accelerator() if pin is not False else None
    if pin is True and acc is None:
        raise ConfigError("pin=True needs an accelerator (torch.accelerator found none)")
    want_pin = acc is not None
    if want_pin and elastic:
        if pin is True:
            raise ConfigError("an elastic arena cannot be pinned: pinned pages cannot be given back")
        log.warning("host arena: elastic mode gives pages back, so it is not pinned; DMA will be slower")
        want_pin = False

    if not attach and not elastic:
        avail = mem_available()
        if avail is not None and size > avail:
            raise ArenaSpaceError(f"{what} does not fit: MemAvailable is {_gib(avail)}; "
                                  f"lower host_bytes / cpu_bytes_to_use or use elastic mode")
    if elastic:
        avail = mem_available()
        budget = max_bytes if avail is None else min(max_bytes, avail - elastic_reserve_bytes)
        if budget < slot_bytes:
            raise ArenaSpaceError(
                f"elastic {what}: budget {_gib(max(budget, 0))} (min of max {_gib(max_bytes)} and MemAvailable "
                f"{_gib(avail or 0)} - reserve {_gib(elastic_reserve_bytes)}) holds no slot of {slot_bytes} bytes"
            )

    if shared_memory:
        return _shm_arena(num_slots, slot_bytes, _check_name(shared_memory), attach, elastic,
                          want_pin, acc, max_bytes, elastic_reserve_bytes, what)

    if want_pin and acc.type not in ("cuda",):
        return _torch_pinned_arena(num_slots, slot_bytes, acc, what)

    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_NORESERVE if elastic else 0)
    m = mmap.mmap(-1, size, flags=flags)
    buf = memoryview(m)
    pinned, pinh = False, None
    if not elastic:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses for copies and DMA
        np.frombuffer(buf, dtype=np.uint8)[::PAGE] = 0  # pre-fault every page now
        if want_pin:
            pinh = _cuda_register(_address(m), size)
            pinned = pinh is not None
            if not pinned:  # e.g. a sandbox that refuses registration: torch's pinned allocator
                buf.release()
                m.close()
                return _torch_pinned_arena(num_slots, slot_bytes, acc, what)
    return HostArena(mem=m, buf=buf, num_slots=num_slots, slot_bytes=slot_bytes, pinned=pinned, pin=pinh,
                     shared_memory=None, creator=True, fd=None, elastic=elastic,
                     elastic_max_bytes=max_bytes, elastic_reserve_bytes=elastic_reserve_bytes)


def _torch_pinned_arena(num_slots: int, slot_bytes: int, acc: Any, what: str) -> HostArena:
    """Pinned memory from torch's allocator, for accelerators whose runtime cannot register an mmap."""
    import torch

    size = num_slots * slot_bytes
    try:
        t = torch.empty(size + PAGE, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise ArenaSpaceError(f"{what}: pinned allocation failed on {acc}: {e}") from None
    skew = (-t.data_ptr()) % PAGE  # page-align the start
    view = t[skew : skew + size]
    view[::PAGE] = 0
    buf = memoryview(view.numpy())
    return HostArena(mem=t, buf=buf, num_slots=num_slots, slot_bytes=slot_bytes, pinned=True, pin=None,
                     shared_memory=None, creator=True, fd=None, elastic=False,
                     elastic_max_bytes=size, elastic_reserve_bytes=0, keep=skew)


def _shm_arena(num_slots: int, slot_bytes: int, name: str, attach: bool, elastic: bool, want_pin: bool,
               acc: Any, max_bytes: int, reserve: int, what: str) -> HostArena:
    size = num_slots * slot_bytes
    path = os.path.join(SHM_DIR, name)
    if attach:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConfigError(f"shared-memory arena {name!r} does not exist ({path}); "
                              f"the first rank creates it (attach=False)") from None
        have = os.fstat(fd).st_size
        if have != size:
            os.close(fd)
            raise ConfigError(f"shared-memory arena {name!r} holds {have} bytes, expected {what}")
    else:
        free = shm_free()
        if not elastic and size > free:
            raise ArenaSpaceError(f"{what} does not fit in {SHM_DIR}: {_gib(free)} free "
                                  f"(enlarge it, e.g. docker --shm-size, or lower host_bytes)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"shared-memory arena {name!r} already exists ({path}); attach to it "
                              f"with attach=True, or remove it if it is stale") from None
        try:
            os.ftruncate(fd, size)
            if not elastic:
                os.posix_fallocate(fd, 0, size)  # reserve tmpfs pages now: no SIGBUS later
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise ArenaSpaceError(f"{what} does not fit in {SHM_DIR} ({e.strerror}); "
                                  f"{_gib(shm_free())} free") from None
    flags = mmap.MAP_SHARED | (0 if elastic else mmap.MAP_POPULATE)
    m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pinned, pinh = False, None
    if want_pin:
        if acc.type == "cuda":
            pinh = _cuda_register(_address(m), size)
            pinned = pinh is not None
        else:
            log.warning("host arena: cannot page-lock shared memory on %s; it stays unpinned", acc)
    return HostArena(mem=m, buf=memoryview(m), num_slots=num_slots, slot_bytes=slot_bytes, pinned=pinned,
                     pin=pinh, shared_memory=name, creator=not attach, fd=fd, elastic=elastic,
                     elastic_max_bytes=max_bytes, elastic_reserve_bytes=reserve)
