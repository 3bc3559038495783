"""SGLang host-pool pages as kvtiers arena slots.

SGLang's host pool (``HostKVCache``) describes a run of pages with
``get_page_buffer_meta(indices) -> (pointers, sizes)``: for each page, in order, the pieces
it is made of (K and V of a ``page_first`` MHA pool, one latent piece of MLA, K and V of
every layer in ``layer_first``). Host index ``i`` belongs to page ``i // page_size``.

**Zero-copy** when every piece has the same size, a multiple of 4096, and piece ``j`` of page
``p`` sits at ``base_j + p * size`` with each ``base_j`` a whole number of pieces from the
lowest: then one :class:`kvtiers.Arena` over the pool's memory has a slot for every piece of
every page, and the tier reads and writes the pool directly, one key per piece.

**Staged** otherwise: pieces are copied into (and out of) a private arena whose slots hold a
whole page, one key per page.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...types import PAGE, Arena


@dataclass(frozen=True)
class PageLayout:
    """How a host pool's pages map to arena slots."""

    page_size: int  # tokens per page
    pieces: tuple[int, ...]  # bytes of each piece of a page
    zero_copy: bool
    base: int = 0  # zero-copy: address of slot 0
    piece_slot: tuple[int, ...] = ()  # zero-copy: slot of piece j of page 0
    num_slots: int = 0  # zero-copy: slots in the arena over the pool

    @property
    def page_bytes(self) -> int:
        return sum(self.pieces)

    def slots(self, page: int) -> list[int]:
        """Zero-copy: the arena slots of the pieces of page ``page``."""
        return [s + page for s in self.piece_slot]


def probe(pool: Any, zero_copy: bool | None = None) -> PageLayout:
    """Read a host pool's page layout from ``get_page_buffer_meta`` of its first two pages.

    ``zero_copy``: None picks it where the layout allows; True requires it (a ``ValueError``
    says why not); False always stages.
    """
    import torch  # SGLang's pool takes its indices as a tensor

    page_size = int(pool.page_size)
    num_pages = int(pool.size) // page_size
    if num_pages < 2:
        raise ValueError(f"host pool of {pool.size} tokens holds fewer than 2 pages of {page_size}")
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * page_size, dtype=torch.int64))
    if len(ptrs) != len(sizes) or not ptrs or len(ptrs) % 2:
        raise ValueError(f"get_page_buffer_meta gave {len(ptrs)} pointers and {len(sizes)} sizes for 2 pages")
    m = len(ptrs) // 2
    pieces = tuple(int(s) for s in sizes[:m])
    why = _why_not_zero_copy(ptrs, sizes, m)
    if zero_copy is True and why:
        raise ValueError(f"zero_copy: this host pool's pages cannot be arena slots: {why}")
    if zero_copy is False or why:
        return PageLayout(page_size, pieces, zero_copy=False)
    size = pieces[0]
    lo = min(ptrs[:m])
    piece_slot = tuple((p - lo) // size for p in ptrs[:m])
    return PageLayout(page_size, pieces, zero_copy=True, base=lo, piece_slot=piece_slot,
                      num_slots=max(piece_slot) + num_pages)


def _why_not_zero_copy(ptrs: Sequence[int], sizes: Sequence[int], m: int) -> str:
    size = sizes[0]
    if any(s != size for s in sizes):
        return f"pieces of different sizes {sorted(set(sizes))}"
    if size % PAGE:
        return f"pieces of {size} bytes, not a multiple of {PAGE}"
    if any(ptrs[m + j] - ptrs[j] != size for j in range(m)):
        return "a piece of the next page does not follow the piece of this one"
    lo = min(ptrs[:m])
    if any((p - lo) % size for p in ptrs[:m]):
        return "the pieces of a page are not a whole number of pieces apart"
    if len({(p - lo) // size for p in ptrs[:m]}) != m:
        return "pieces overlap"
    return ""


def pool_arena(layout: PageLayout) -> Arena:
    """Zero-copy: an arena over the pool's memory, slot ``piece_slot[j] + page`` = piece ``j``."""
    size = layout.pieces[0]
    raw = (ctypes.c_ubyte * (layout.num_slots * size)).from_address(layout.base)
    return Arena(memoryview(raw), size, owner=raw)


def staging_arena(layout: PageLayout, num_pages: int) -> Arena:
    """Staged: a private arena of ``num_pages`` slots, each holding a whole page."""
    return Arena.allocate(num_pages, math.ceil(layout.page_bytes / PAGE) * PAGE)


def copy_pieces(ptrs: Sequence[int], sizes: Sequence[int], slot: memoryview, to_slot: bool) -> None:
    """Copy a page's pieces into its staging slot, side by side (``to_slot``), or back out."""
    addr = ctypes.addressof(ctypes.c_char.from_buffer(slot))
    off = 0
    for p, n in zip(ptrs, sizes, strict=True):
        if to_slot:
            ctypes.memmove(addr + off, p, n)
        else:
            ctypes.memmove(p, addr + off, n)
        off += n
