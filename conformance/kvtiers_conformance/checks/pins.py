"""Rule 13 (bounded, only for a tier with the optional ``pin`` hook): a pinned key is never
evicted before its time, and pins never make the tier exceed its bound (docs/pins.md). An
eighth of the bound is pinned, then four times the bound is stored over it: every pinned key
still answers HIT and loads exactly, and the HIT keys still fit in ``max_bytes``. A pin of a
key never stored is refused with a reason. Then the tier is filled (fresh keys stored one at a
time until one makes it evict) and a pin of every chunk it holds (nothing left to evict) must
be refused with a reason; were it accepted, storing four times the bound again would have to
evict none of them and leave no more chunks answering HIT than filled the bound (never
accepted and then broken). Expiry is not checked here: a tier's clock is its own (the fs
tier's own tests advance its clock, tests/test_pins.py). A tier without the hook is skipped,
naming why.
"""

from __future__ import annotations

from ..harness import CheckSkipped, Harness, Instance, fail
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
    if _refused(why):
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
    known, full, most = _filled(h, t, pinned + others, hits, cap)
    # every chunk of a full tier pinned: nothing is left to evict, so storing more breaks something
    if not _refused(t.handle.pin(full, 3600.0)):
        again = h.keys(4 * cap, b"R")
        _store_over_bound(t, again, 4)
        _answers, held = _settled(h, t, known + again, cap)
        lost = [k for k in full if k not in held]
        if lost or len(held) > most:
            fail(f"rule 13: a pin of all {len(full)} chunks of the full tier (nothing left to evict) was accepted, "
                 f"then {f'{len(lost)} of them were evicted' if lost else f'{len(held)} chunks answered HIT'}"
                 f"{'' if lost else f' where {most} filled max_bytes'}; it must be refused with a reason")
        t.handle.unpin(full)
    t.handle.unpin(pinned)


def _refused(why: object) -> bool:
    """Whether ``pin`` answered a refusal; a refusal must name its reason (a non-empty string)."""
    if why is None:
        return False
    if not isinstance(why, str) or not why:
        fail(f"rule 13: a refused pin must say why in one line, got {why!r}")
    return True


def _filled(
    h: Harness, t: Instance, known: list[bytes], hits: list[bytes], cap: int
) -> tuple[list[bytes], list[bytes], int]:
    """Store fresh keys one at a time until one leaves no more chunks answering HIT than before
    (the tier is full: it evicted to make room; a tier that evicted below its bound, or that
    keeps whole chunks only while all their pieces are held, fills again first). Returns every
    key stored so far (``known`` and the fresh ones), the HIT keys then, and the most that
    answered HIT at once."""
    known = list(known)
    most = len(hits)
    for _ in range(2 * cap):
        known += [h.key(b"F")]
        t.store(known[-1:])
        _answers, now = _settled(h, t, known, cap)
        most = max(most, len(now))
        if len(now) <= len(hits):
            return known, now, most
        hits = now
    return known, hits, most
