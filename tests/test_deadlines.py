"""kvtiers.misscache.Deadlines: the table behind every lifetime pin."""

from __future__ import annotations

import math

from kvtiers.misscache import Deadlines


def test_a_key_keeps_its_later_deadline_and_comes_due_once() -> None:
    d: Deadlines[bytes] = Deadlines()
    assert d.extend(b"a", 10.0) is True
    assert d.extend(b"a", 5.0) is False and d.get(b"a") == 10.0  # an earlier end does not shorten it
    assert d.extend(b"a", 20.0) is False and d.get(b"a") == 20.0  # a later one renews it
    d.extend(b"b", 15.0)
    d.extend(b"hard", math.inf)
    assert d.held(b"a", 19.9) and not d.held(b"a", 20.0) and not d.held(b"zzz", 0.0)
    assert d.due(12.0) == []  # a's stale entry at 10 is skipped: it holds until 20
    assert d.due(20.0) == [b"b", b"a"]  # soonest first
    assert d.due(1e12) == [] and b"hard" in d and len(d) == 1  # a deadline of inf never comes due


def test_a_removed_key_never_comes_due() -> None:
    d: Deadlines[tuple[str, bytes, str]] = Deadlines()
    d.extend(("ns", b"k", "o1"), 1.0)
    d.extend(("ns", b"k", "o2"), 1.0)
    assert d.pop(("ns", b"k", "o1")) == 1.0 and d.pop(("ns", b"k", "o1")) is None
    assert d.due(2.0) == [("ns", b"k", "o2")]
    d.extend(("ns", b"k", "o1"), 3.0)  # pinned again after its removal: the new deadline counts
    assert d.due(2.9) == [] and d.due(3.0) == [("ns", b"k", "o1")]


def test_renewals_do_not_grow_the_heap_without_bound() -> None:
    d: Deadlines[int] = Deadlines()
    for t in range(50_000):  # one key renewed over and over: every old entry goes stale
        d.extend(7, float(t + 1))
    assert len(d._heap) <= 2 * len(d) + 1024
    assert d.due(49_999.0) == [] and d.due(50_000.0) == [7]
