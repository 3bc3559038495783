"""The memory side of :mod:`.weights`: freeing a model's storages while the tensor objects stay,
giving them memory again (on CPU in huge pages of mappings of their own), returning freed memory
to the system, and the process's RSS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..types import PAGE
from .weights_chunks import StorageEntry

HUGE = 2 << 20  # a transparent huge page
MADV_HUGEPAGE = 14  # Linux

__all__ = ["advise_huge", "free_storages", "give_back_memory", "huge_host_storage", "restore_storages", "rss_bytes"]


def rss_bytes() -> int:
    """This process's resident set size in bytes (``VmRSS``), 0 where unknown."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_storages(storages: Iterable[StorageEntry]) -> None:
    """Free the memory of every storage: resized to zero bytes, the tensor objects staying (with
    no bytes) so an engine's references stay valid. A storage that cannot be resized (mapped
    from a safetensors file, or by :func:`restore_storages`) is first swapped for a fresh one
    under every tensor that uses it. Then the freed memory goes back to the system."""
    import torch

    storages = list(storages)
    for s in storages:
        st = s.tensors[0].untyped_storage()
        if not st.resizable():
            st = torch.UntypedStorage(s.nbytes, device=st.device)  # allocated, never touched
            swap_storage(s.tensors, st)
        st.resize_(0)
    give_back_memory({s.device for s in storages})


def restore_storages(storages: Iterable[StorageEntry], *, swap: bool = False) -> None:
    """Give every storage its bytes again (contents undefined until filled): on CPU, storages
    of 2 MiB and more get a huge-page mapping of their own (:func:`huge_host_storage`), others
    are resized back. ``swap``: the storages still have memory (a fresh model to fill); only
    the large CPU ones are swapped for huge-page mappings."""
    for s in storages:
        if s.device == "cpu" and s.nbytes >= HUGE:
            swap_storage(s.tensors, huge_host_storage(s.nbytes))
        elif not swap:
            s.tensors[0].untyped_storage().resize_(s.nbytes)


def advise_huge(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the 2 MiB-aligned inside of ``[addr, addr + nbytes)``
    (host memory about to be filled: one fault per 2 MiB instead of per 4 KiB, as numpy does for
    its large arrays). Best effort: nothing happens where the system says no."""
    lo, hi = -(-addr // HUGE) * HUGE, (addr + nbytes) // HUGE * HUGE
    if hi <= lo:
        return
    try:
        libc = _libc()
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def huge_host_storage(nbytes: int) -> Any:
    """A CPU ``UntypedStorage`` of ``nbytes`` in an anonymous mapping of its own, 2 MiB-aligned,
    advised to use transparent huge pages (one fault per 2 MiB when filled, where torch's
    allocator gives 4 KiB pages); unmapped when the storage goes."""
    import torch

    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(m, dtype=np.uint8).ctypes.data
    skew = (-base) % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE, skew, nbytes // HUGE * HUGE or PAGE)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=skew).untyped_storage()


def swap_storage(tensors: list[Any], storage: Any) -> None:
    """Point every tensor of one storage at ``storage`` instead (same offsets, sizes, strides)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.set_(storage, t.storage_offset(), t.size(), t.stride())


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def give_back_memory(devices: set[str]) -> None:
    """Return freed memory to the system: ``malloc_trim`` for CPU memory, the allocator's
    cache for accelerators."""
    if any(d == "cpu" for d in devices):
        try:
            _libc().malloc_trim(0)
        except (OSError, AttributeError):
            pass
    if any(d != "cpu" for d in devices):
        import torch

        empty = getattr(getattr(torch, "accelerator", None), "empty_cache", None)
        if empty is not None:
            empty()
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()
