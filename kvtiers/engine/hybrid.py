"""What a store or load of a hybrid model copies, per KV group (see :mod:`.layout`).

Hybrid allocators hand out different blocks per group, so the engine may give block ids per
group; SSM groups are addressed by state slot instead. A *chunk spec* is what the DMA engine
takes for one chunk: a plain list of block ids (every attention group), or a mapping
``group name -> ids`` where ``-1`` skips a position.

- Stores keep whole chunks: every block of every group, and for SSM groups the state after
  the chunk's last token (``state_slots``, one per chunk). A later, longer prefix may need
  blocks a sliding window leaves out now.
- Loads copy what the model reads: full-attention and MLA groups every block; a
  sliding-window group only the blocks that can fall in the window ending at the load's last
  chunk; SSM groups the state of the last chunk only, into the engine's ``state_slot``.

The window is counted in whole blocks: the last token of a load lies somewhere in its last
block, so the copy covers the window ending at the first token of that block, which holds the
window ending at any token of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .layout import KVLayout
from .transfers import split_blocks

__all__ = ["chunk_specs", "copied_bytes", "window_first_block"]


def window_first_block(num_blocks: int, window: int, tokens_per_block: int) -> int:
    """The first of ``num_blocks`` blocks (0-based) that a ``window``-token sliding window
    ending in the last block can read."""
    if num_blocks <= 0:
        return 0
    return max(0, ((num_blocks - 1) * tokens_per_block - window + 1) // tokens_per_block)


def chunk_specs(layout: KVLayout, keys: tuple[bytes, ...], device_blocks: Any, blocks_per_chunk: int, *,
                load: bool, state_slots: Sequence[int] | None = None, state_slot: int | None = None,
                tokens_per_block: int | None = None) -> list[Any]:
    """One chunk spec per key for a store (``load=False``, ``state_slots``) or a load
    (``load=True``, ``state_slot``). Raises ``ValueError`` naming what is missing or wrong."""
    what = "load" if load else "store"
    bpc = blocks_per_chunk
    attn = [g for g in layout.groups if not g.is_state]
    state = [g for g in layout.groups if g.is_state]
    if isinstance(device_blocks, Mapping):
        names = {g.name for g in attn}
        given = set(device_blocks)
        if given != names:
            missing, extra = sorted(names - given), sorted(given - names)
            raise ValueError(f"{what}: device_blocks per group must name every attention group {sorted(names)}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
                             + (" (SSM groups take state slots, not blocks)" if set(extra) & {g.name for g in state}
                                else ""))
        per_group = {name: split_blocks(keys, blocks, bpc) for name, blocks in device_blocks.items()}
    else:
        shared = split_blocks(keys, device_blocks, bpc) if attn else [[] for _ in keys]
        per_group = {g.name: shared for g in attn}
    n = len(keys)
    states: dict[str, list[list[int]]] = {}
    if state:
        if load:
            if state_slot is None:
                raise ValueError(f"load: the layout has SSM groups {[g.name for g in state]}: pass state_slot, "
                                 "the state slot that receives the state after the last chunk")
            slot = _index(state_slot, "load: state_slot")
            col = [[-1] for _ in range(n - 1)] + [[slot]] if n else []
        else:
            if state_slots is None or len(state_slots) != n:
                got = "none" if state_slots is None else f"{len(state_slots)}"
                raise ValueError(f"store: the layout has SSM groups {[g.name for g in state]}: pass state_slots, "
                                 f"one state slot per chunk (the state after its last token); {n} chunks, got {got}")
            col = [[_index(s, "store: state_slots")] for s in state_slots]
        states = {g.name: col for g in state}
    elif (state_slots is not None and not load) or (state_slot is not None and load):
        raise ValueError(f"{what}: state slots given, but the layout has no SSM group")
    if load:
        total = n * bpc
        for g in attn:
            if g.kind != "sliding":
                continue
            if not tokens_per_block:
                raise ValueError(f"load: KV group {g.name!r} has a sliding window: the manager needs "
                                 "tokens_per_chunk (tokens_per_block) to find the blocks in it")
            first = window_first_block(total, g.window or 0, tokens_per_block)
            if first:
                per_group[g.name] = [[b if j * bpc + p >= first else -1 for p, b in enumerate(ids)]
                                     for j, ids in enumerate(per_group[g.name])]
    if not state and not isinstance(device_blocks, Mapping) and not (load and layout.is_hybrid):
        return per_group[attn[0].name]  # every group the same blocks: the plain spec
    return [{**{name: blocks[j] for name, blocks in per_group.items()},
             **{name: col[j] for name, col in states.items()}} for j in range(n)]


def copied_bytes(layout: KVLayout, blocks_per_chunk: int, spec: Any) -> int:
    """Bytes one chunk spec moves between the device and the arena."""
    total = 0
    for g in layout.groups:
        if isinstance(spec, Mapping):
            ids = spec.get(g.name, ())
        else:
            ids = () if g.is_state else spec
        total += sum(1 for b in ids if b >= 0) * g.num_tensors * g.block_bytes
    return total


def _index(x: Any, what: str) -> int:
    import operator

    try:
        v = operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(x).__name__}") from None
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return v
