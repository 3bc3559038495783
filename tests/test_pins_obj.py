"""Lifetime pins in the obj tier (docs/pins.md), on a real SeaweedFS server: a pinned chunk
is never one of this instance's max_bytes victims before its time, a pin past half of
max_bytes or of a key not stored there is refused with the reason, and a key another
instance stored is found with a HEAD. Rule 13 of the conformance suite runs on obj in
tests/test_obj_conformance.py (TierTests)."""

from __future__ import annotations

import pytest
from s3_fixture import fill, make_ctx, open_obj, resolve, run_job

from kvtiers import Lookup

pytest_plugins = ["s3_fixture"]
layout = pytest.importorskip("kvtiers_obj.layout")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(h, ctx, keys, first_id: int) -> None:
    for i, k in enumerate(keys):
        fill(ctx, i % 4, first_id + i)
        assert run_job(h, True, [k], [i % 4], job_id=first_id + i).ok


def test_a_pinned_chunk_outlives_lru_eviction_until_its_time(obj_options):
    removed = []
    ctx = make_ctx(removed=removed)
    size = layout.object_size(ctx.arena.slot_bytes)
    h = open_obj(ctx, dict(obj_options, max_bytes=4 * size))
    try:
        clock = h.tier.pins.clock = Clock()
        first = [b"k0", b"k1", b"k2", b"k3"]
        store(h, ctx, first, 0)
        assert h.pin(first[:2], 30.0) is None
        store(h, ctx, [b"k4", b"k5", b"k6", b"k7"], 10)  # least recently used first: k0 and k1 would go
        gone = {k for keys, _ in removed for k in keys}
        assert gone == {b"k2", b"k3", b"k4", b"k5"}, sorted(gone)
        assert resolve(h, first) == [Lookup.HIT, Lookup.HIT, Lookup.MISS, Lookup.MISS]
        assert h.tier._lru.total <= 4 * size  # the bound holds
        assert run_job(h, False, [b"k0"], [7], job_id=50).ok
        clock.now += 31  # the pins' time is over: they go like any other chunk
        store(h, ctx, [b"k8", b"k9", b"k10", b"k11"], 20)
        assert resolve(h, first[:2]) == [Lookup.MISS, Lookup.MISS]
        assert h.tier.pins.expired == 2 and len(h.tier.pins) == 0
    finally:
        h.close()


def test_pins_the_obj_tier_cannot_keep_are_refused_with_the_reason(obj_options):
    ctx = make_ctx()
    size = layout.object_size(ctx.arena.slot_bytes)
    h = open_obj(ctx, dict(obj_options, max_bytes=5 * size))
    other = open_obj(make_ctx(), dict(obj_options))  # another instance on the same prefix, unbounded
    try:
        store(h, ctx, [b"k0", b"k1", b"k2"], 0)
        why = h.pin([b"k0", b"k1", b"k2"], 30.0)  # 3 of at most 2.5 chunks' bytes
        assert why and f"would pin {3 * size} of at most {int(2.5 * size)} bytes (0.5 of max_bytes)" in why, why
        assert len(h.tier.pins) == 0
        why = h.pin([b"k0", b"never stored"], 30.0)
        assert why == "obj tier: 1 of 2 key(s) not stored here (first " + b"never stored".hex()[:16] + ")"
        assert len(h.tier.pins) == 0
        assert h.pin([b"k0", b"k1"], None) is None  # hard: until unpin
        assert h.pin([b"k2"], 30.0) and len(h.tier.pins) == 2  # the cap counts the pins held
        h.unpin([b"k1", b"unknown"])
        assert len(h.tier.pins) == 1 and h.pin([b"k2"], 30.0) is None
        # a chunk another instance stored, unknown to this one: found with a HEAD, then pinned
        octx = other.tier.ctx
        fill(octx, 0, 99)
        assert run_job(other, True, [b"theirs"], [0], job_id=99).ok
        h.unpin([b"k0", b"k2"])
        assert h.pin([b"theirs"], 30.0) is None
        assert b"theirs" in h.tier._lru  # counted against this instance's bound from now on
    finally:
        other.close()
        h.close()


def test_an_unbounded_obj_tier_records_pins_of_stored_keys(obj_options):
    ctx = make_ctx()
    h = open_obj(ctx, dict(obj_options))
    try:
        store(h, ctx, [b"k0"], 0)
        assert h.tier.pins.cap is None
        assert h.pin([b"k0"], 5.0) is None and h.tier.pins.held(b"k0")
        assert h.pin([b"k9"], 5.0).startswith("obj tier: 1 of 1 key(s) not stored here")
        h.unpin([b"k0"])
        assert not h.tier.pins.held(b"k0") and h.tier.pins.unpinned == 1
    finally:
        h.close()
