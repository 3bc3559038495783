"""Eviction policies: LRU order, a real ARC (T1/T2/B1/B2, adaptive p), plugin policies."""

from __future__ import annotations

import random
import sys
import textwrap

import pytest

import kvtiers
from kvtiers.engine.hostcache import READY, STORING, HostCache
from kvtiers.engine.policies import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from kvtiers.errors import ConfigError


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def use(cache: HostCache, key: bytes) -> None:
    """What the tiering manager does for a chunk: hit -> touch, miss -> allocate + fill."""
    if key in cache:
        cache.touch(key)
        return
    slot = cache.allocate(key, STORING)
    assert slot is not None
    cache.mark_ready(key)
    cache.unpin(slot)


def test_lru_victim_order_and_skip() -> None:
    p = LRUPolicy(3)
    for i in range(3):
        p.insert(k(i))
    p.touch(k(0))
    assert p.victim(lambda key: True) == k(1)
    assert p.victim(lambda key: key != k(2)) == k(0)  # k2 is older but not evictable
    assert p.victim(lambda key: False) is None
    assert len(p) == 1


def test_arc_is_scan_resistant_where_lru_is_not() -> None:
    hot = [k(1000), k(1001)]

    def run(policy_name: str) -> set[bytes]:
        cache = HostCache(4, make_policy(policy_name, 4))
        for key in hot:  # seen twice: frequent
            use(cache, key)
            use(cache, key)
        for i in range(20):  # a one-off scan
            use(cache, k(i))
        return set(cache.keys())

    assert set(hot) <= run("arc")
    assert not set(hot) & run("lru")


def test_arc_ghost_hits_adapt_p() -> None:
    arc = ARCPolicy(4)
    cache = HostCache(4, arc)
    use(cache, k(0))
    use(cache, k(0))  # k0 -> T2
    for i in (1, 2, 3):
        use(cache, k(i))  # T1 = k1 k2 k3
    use(cache, k(4))  # |T1| > p = 0: T1's LRU k1 becomes a B1 ghost
    assert list(arc.b1) == [k(1)] and k(1) not in cache
    use(cache, k(1))  # B1 ghost hit: recency undervalued -> p grows, k1 enters T2
    assert arc.p == 1
    assert k(1) in arc.t2 and k(1) not in arc.b1
    assert list(arc.b1) == [k(2)]  # and the victim came from T1 again (|T1| = 3 > p)
    use(cache, k(3))
    use(cache, k(4))  # T1 empty, T2 = k0 k1 k3 k4
    use(cache, k(5))  # |T1| = 1 is not > p: the victim is T2's LRU, k0, now a B2 ghost
    assert list(arc.b2) == [k(0)] and k(0) not in cache
    use(cache, k(0))  # B2 ghost hit: frequency undervalued -> p shrinks
    assert arc.p == 0
    assert k(0) in arc.t2 and not arc.b2


def test_arc_discards_without_ghost_when_t1_alone_is_full() -> None:
    arc = ARCPolicy(4)
    cache = HostCache(4, arc)
    for i in range(6):  # a pure scan: ARC case IV, |T1| == c, the LRU of T1 is dropped
        use(cache, k(i))
    assert not arc.b1 and not arc.b2
    assert list(arc.t1) == [k(2), k(3), k(4), k(5)]


def test_arc_invariants_under_random_use() -> None:
    c = 8
    arc = ARCPolicy(c)
    cache = HostCache(c, arc)
    rng = random.Random(7)
    for _ in range(3000):
        key = k(int(rng.paretovariate(1.2)) % 40)
        use(cache, key)
        assert len(arc.t1) + len(arc.t2) == len(cache) <= c
        assert len(arc.t1) + len(arc.b1) <= c
        assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * c
        assert 0 <= arc.p <= c
        live = set(arc.t1) | set(arc.t2)
        assert live == set(cache.keys())
        assert not live & (set(arc.b1) | set(arc.b2))


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_pinned_keys_are_never_victims(name: str) -> None:
    cache = HostCache(3, make_policy(name, 3))
    slots = {}
    for i in range(3):
        slots[i] = cache.allocate(k(i), STORING)
        cache.mark_ready(k(i))
    cache.unpin(slots[1])  # only k1 is evictable
    assert cache.allocate(k(9), STORING) == slots[1]
    assert k(1) not in cache and cache.state(k(9)) == STORING
    assert cache.allocate(k(10), STORING) is None  # everything pinned or filling
    assert k(10) not in cache
    assert len(cache.policy) == 3


def test_policies_satisfy_the_protocol() -> None:
    assert isinstance(LRUPolicy(1), EvictionPolicy)
    assert isinstance(ARCPolicy(1), EvictionPolicy)


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown eviction_policy 'nope'"):
        make_policy("nope", 4)


PLUGIN = '''
import kvtiers


class MRUPolicy:
    """Most recently used first out (a plugin policy for the test)."""

    def __init__(self, capacity):
        self.order = []

    def insert(self, key):
        self.order.append(key)

    def touch(self, key):
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)

    def remove(self, key):
        if key in self.order:
            self.order.remove(key)

    def victim(self, evictable):
        for key in reversed(self.order):
            if evictable(key):
                self.order.remove(key)
                return key
        return None


@kvtiers.hookimpl
def register_eviction_policies(register):
    register("mru-test", MRUPolicy)
'''


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A real installed distribution (dist-info + entry point) offering a policy."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "mrupolicy_test.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "mrupolicy_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mrupolicy-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvtiers]\nmrupolicy = mrupolicy_test\n")
    monkeypatch.syspath_prepend(str(site))
    kvtiers.get_registry(reload=True)
    yield
    monkeypatch.undo()
    sys.modules.pop("mrupolicy_test", None)
    kvtiers.get_registry(reload=True)


def test_plugin_policy_through_the_registration_hook(plugin_dist) -> None:
    assert "mru-test" in kvtiers.get_registry().eviction_policies()
    cache = HostCache(3, make_policy("mru-test", 3))
    for i in range(3):
        use(cache, k(i))
    use(cache, k(3))  # MRU: evicts k2
    assert set(cache.keys()) == {k(0), k(1), k(3)}
    assert cache.state(k(3)) == READY


class PinIgnoringPolicy(LRUPolicy):
    def victim(self, evictable):  # breaks the interface: ignores evictable
        key = next(iter(self._order), None)
        if key is not None:
            del self._order[key]
        return key


def test_a_policy_naming_a_pinned_key_is_refused() -> None:
    cache = HostCache(1, PinIgnoringPolicy(1))
    cache.allocate(k(0), STORING)  # pinned and filling
    with pytest.raises(RuntimeError, match="chose a pinned key"):
        cache.allocate(k(1), STORING)
    assert cache.state(k(0)) == STORING and k(1) not in cache
