"""Rule 13 (bounded, only for a tier with the optional ``pin`` hook): a pinned key is never
evicted before its time, and pins never make the tier exceed its bound (docs/pins.md).

An eighth of the bound is pinned, then four times the bound is stored over it: every pinned
key still answers HIT and loads exactly, and the HIT keys still fit in ``max_bytes``. A pin of
a key never stored, and a pin of the whole bound (nothing left to evict), are refused with a
reason. Expiry is not checked here: a tier's clock is its own (the fs tier's own tests advance
its clock, tests/test_pins.py). A tier without the hook is skipped, naming why.
"""

from __future__ import annotations

from ..harness import CheckSkipped, Harness, fail
from ..rules import check
from .bounded import _settled, _store_over_bound


@check(13, "pins_hold_within_the_bound", "bounded")
def pins_hold_within_the_bound(h: Harness) -> None:
    """Pin an eighth of max_bytes, store 4x max_bytes: the pinned keys stay and load exactly,
    the bound holds; pins of a key never stored or of the whole bound are refused."""
    lim = h.limits
    cap = lim.bounded_slots
    t = h.open(max_bytes=cap * lim.slot_bytes, num_slots=max(lim.num_slots, 4 * cap + 1))
    if not t.handle.takes_pins:
        raise CheckSkipped("the tier does not implement the optional pin hook (rule 13 applies to tiers that do)")
    pinned = h.keys(max(1, cap // 8), b"P")  # (compressed: pieces of a slot and more each)
    t.store(pinned)
    t.wait_hit(pinned)
    why = t.handle.pin(pinned, 3600.0)
    if why is not None:
        if not isinstance(why, str) or not why:
            fail(f"rule 13: a refused pin must say why in one line, got {why!r}")
        raise CheckSkipped(f"the tier refused a pin of {len(pinned)} of {cap} chunks of its bound: {why}")
    never = h.key(b"never-stored")
    why = t.handle.pin([never], 3600.0)
    if not why or not isinstance(why, str):
        fail(f"rule 13: a pin of a key never stored must be refused with a reason, got {why!r}")
    others = h.keys(4 * cap, b"Q")
    _store_over_bound(t, others, 4)
    answers, hits = _settled(h, t, pinned + others, cap)
    lost = [k for k in pinned if k not in hits]
    if lost:
        fail(f"rule 13: {len(lost)} of {len(pinned)} pinned key(s) were evicted before their time")
    t.load_all(pinned, why="rule 13")
    why = t.handle.pin(hits, 3600.0)
    if not why or not isinstance(why, str):
        fail(f"rule 13: a pin of all {len(hits)} chunks that fill max_bytes (nothing left to evict) was accepted; "
             "it must be refused with a reason")
    t.handle.unpin(pinned)
