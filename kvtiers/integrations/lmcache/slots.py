"""Where a chunk's bytes sit for the tier: LMCache's L1 memory itself, or a staging arena.

LMCache hands its L2 adapters memory objects inside one contiguous L1 region (described by
``L1MemoryDesc``: base address, size, allocation alignment). For a namespace whose objects
are ``S`` bytes, :class:`L1Grid` is a kvtiers :class:`~kvtiers.Arena` over that region with
``S``-byte slots (``S`` rounded up to a page where LMCache pads allocations to pages): an
object that starts on a slot boundary *is* that slot, and the tier reads and writes it in
place (zero-copy). LMCache's allocator places equal-sized objects back to back from the
region's start, so in a server with one layout every object is on the grid. Where there is
no such region, or the object size does not allow it, a :class:`~kvtiers.Arena` of
``staging_slots`` slots is the tier's arena and bytes are copied in and out.
"""

from __future__ import annotations

import ctypes

from ...types import PAGE, Arena


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def grid_slot_bytes(nbytes: int, align_bytes: int) -> int | None:
    """The slot size of an L1 grid for objects of ``nbytes``: ``nbytes`` when it is a multiple
    of a page; rounded up to a page when LMCache pads each allocation to ``align_bytes``, a
    multiple of a page (the padding is the object's own); else None (no grid)."""
    if nbytes <= 0:
        return None
    if nbytes % PAGE == 0:
        return nbytes
    if align_bytes > 0 and align_bytes % PAGE == 0:
        return round_up(nbytes)
    return None


class L1Grid:
    """An arena of ``slot_bytes`` slots over LMCache's L1 region ``[ptr, ptr + size)``."""

    def __init__(self, ptr: int, size: int, slot_bytes: int) -> None:
        self.ptr = ptr
        region = (ctypes.c_ubyte * size).from_address(ptr)
        self.arena = Arena(memoryview(region).cast("B"), slot_bytes, owner=region)
        self.slot_bytes = slot_bytes

    def slot_of(self, address: int) -> int | None:
        """The slot that starts at ``address``, or None where no slot does."""
        off = address - self.ptr
        if off < 0 or off % self.slot_bytes:
            return None
        slot = off // self.slot_bytes
        return slot if slot < len(self.arena) else None


def staging_arena(nbytes: int, slots: int) -> Arena:
    """A page-aligned arena of ``slots`` slots for objects of ``nbytes`` (padding zeroed)."""
    return Arena.allocate(slots, round_up(nbytes))
