"""Pins with a lifetime (docs/pins.md, issue 54 item 3): the real manager (CPU tensors, the DMA
engine) and the real fs tier. Time is a clock each test advances (``mgr.pins.clock``, the fs
tier's ``pins.clock``), so no assert depends on how fast the machine is."""

from __future__ import annotations

import pytest
import test_manager
from kvtiers_fs import layout as fs_layout
from test_manager import key, make_manager, settle, store_all
from tier_helpers import resolve_lookup

from kvtiers import Lookup


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


managers = test_manager.managers  # the fixture: make_manager, each closed at the end


def answers(tier, keys) -> list[Lookup]:
    """The tier's answers to ``keys``, asked again while any is RETRY (rule 1: within 5 s)."""
    return resolve_lookup(tier.handle, keys, timeout=10)


def in_host(mgr, keys) -> list[bool]:
    return [k in mgr.cache for k in keys]


def test_a_soft_pin_keeps_chunks_in_the_host_until_its_time(managers):
    mgr, _, _ = managers(4)
    clock = mgr.pins.clock = Clock()
    store_all(mgr, [key(i) for i in range(4)])
    res = mgr.pin([key(0), key(1)], ttl=60)
    assert res.host is None and res.pinned == ["host"] and res.until == clock.now + 60
    store_all(mgr, [key(i) for i in range(4, 8)], 4)  # LRU would take key(0) and key(1) first
    assert in_host(mgr, [key(0), key(1)]) == [True, True]
    assert sum(in_host(mgr, [key(i) for i in range(2, 8)])) == 2
    clock.now += 59
    store_all(mgr, [key(i) for i in range(8, 10)], 8)
    assert in_host(mgr, [key(0), key(1)]) == [True, True]  # not before its time
    clock.now += 2
    store_all(mgr, [key(i) for i in range(10, 14)], 10)
    assert in_host(mgr, [key(0), key(1)]) == [False, False]  # its time is over: evicted again
    assert mgr.pins.expire() == [key(0), key(1)] and mgr.pins.expired == 2 and len(mgr.pins) == 0


def test_a_hard_pin_holds_until_unpin(managers):
    mgr, _, _ = managers(4)
    clock = mgr.pins.clock = Clock()
    store_all(mgr, [key(0), key(1)])
    res = mgr.pin([key(0)], hard=True)
    assert res.until is None and res.host is None
    clock.now += 10 * 86400
    store_all(mgr, [key(i) for i in range(2, 8)], 2)
    assert key(0) in mgr.cache
    assert mgr.unpin([key(0)]) == 1 and mgr.pins.unpinned == 1
    store_all(mgr, [key(i) for i in range(8, 12)], 8)
    assert key(0) not in mgr.cache


def test_a_pin_past_the_host_cap_is_refused_whole_with_a_reason(managers):
    mgr, _, _ = managers(4, pins={"max_share": 0.5})
    store_all(mgr, [key(i) for i in range(4)])
    res = mgr.pin([key(0), key(1), key(2)], ttl=10)
    assert res.pinned == [] and "would hold 3 of at most 2" in res.refused["host"]
    assert len(mgr.pins) == 0 and mgr.pins.refused == 3
    assert mgr.pin([key(0), key(1)], ttl=10).host is None
    assert "at most 2" in mgr.pin([key(2)], ttl=10).host  # the cap counts what is pinned already
    store_all(mgr, [key(i) for i in range(4, 12)], 4)  # every store still finds room: 2 slots stay evictable
    assert in_host(mgr, [key(10), key(11)]) == [True, True]


@pytest.mark.parametrize(("kw", "said"), [
    ({"ttl": -1}, "pin: ttl must be positive, got -1"),
    ({"ttl": 0}, "pin: ttl must be positive, got 0"),
    ({"ttl": 3601}, "pin: ttl 3601 s is longer than max_ttl 3600 s"),
    ({"ttl": float("nan")}, "pin: ttl must be a finite number of seconds, got nan"),
    ({"ttl": "60"}, "pin: ttl must be a finite number of seconds, got '60'"),
    ({}, "pin: a soft pin needs ttl=<seconds> (or hard=True to hold until unpin)"),
    ({"ttl": 5, "hard": True}, "pin: a hard pin has no ttl (got ttl=5); it holds until unpin"),
    ({"ttl": 5, "tiers": ["nvme"]}, "pin: unknown tier 'nvme' (tiers: none)"),
])
def test_bad_pins_are_one_line_errors(managers, kw, said):
    mgr, _, _ = managers(4, pins={"max_ttl": 3600})
    store_all(mgr, [key(0)])
    with pytest.raises(ValueError) as e:
        mgr.pin([key(0)], **kw)
    assert str(e.value) == said
    assert len(mgr.pins) == 0


def test_unknown_keys_and_options_are_one_line_errors(managers):
    mgr, _, _ = managers(4)
    store_all(mgr, [key(0)])
    with pytest.raises(ValueError, match=r"^pin: 1 of 2 key\(s\) are stored nowhere that could pin them") as e:
        mgr.pin([key(0), key(9)], ttl=5)
    assert "\n" not in str(e.value) and len(mgr.pins) == 0
    for opts, said in (({"max_ttl": 0}, "max_ttl must be a positive number"), ({"max_share": 1}, "max_share must"),
                       ({"ttl": 5}, "unknown option(s) ttl")):
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
            make_manager(2, pins=opts)


def fs_tier(tmp_path, mgr, files: int):
    fb = fs_layout.file_bytes(mgr.arena.slot_bytes)
    return {"root_dir": str(tmp_path / "kv"), "max_bytes": files * fb, "rescan_seconds": None}


def test_the_fs_tier_never_evicts_a_pinned_chunk_before_its_time(managers, tmp_path):
    mgr, _, _ = managers(8)
    mgr.add_tier("fs", fs_tier(tmp_path, mgr, 4))
    fs = mgr.tiers[0]
    clock = fs.handle.tier.pins.clock = Clock()
    first = [key(i) for i in range(4)]
    store_all(mgr, first)
    settle(mgr)
    res = mgr.pin(first[:2], ttl=30)
    assert res.pinned == ["host", "fs"], res
    for n in (4, 6):  # LRU would evict first[0] and first[1] first
        store_all(mgr, [key(n), key(n + 1)], n)
        settle(mgr)
    assert answers(fs, first[:2]) == [Lookup.HIT, Lookup.HIT]
    assert answers(fs, first[2:]) == [Lookup.MISS, Lookup.MISS]
    assert fs.handle.tier.index.used <= 4 * fs_layout.file_bytes(mgr.arena.slot_bytes)  # the bound holds
    clock.now += 31
    store_all(mgr, [key(8), key(9)], 8)
    settle(mgr)
    assert answers(fs, first[:2]) == [Lookup.MISS, Lookup.MISS]  # its time is over


def test_the_fs_tier_refuses_pins_it_cannot_keep(managers, tmp_path):
    mgr, _, _ = managers(8)
    # a bound of 5 files holds the 4 stored without evicting one (at 4, a loaded machine's
    # cleaner could evict one first: 'not stored here'); pins are capped at 2 of them
    mgr.add_tier("fs", fs_tier(tmp_path, mgr, 5))
    store_all(mgr, [key(i) for i in range(4)])
    settle(mgr)
    res = mgr.pin([key(i) for i in range(3)], ttl=30, tiers=["fs"])
    assert res.host is None  # 3 of the host's 4 (8 slots x 0.5)
    assert "would hold 3 of at most 2 (0.5 of max_bytes)" in res.refused["fs"]
    assert len(mgr.tiers[0].handle.tier.pins) == 0
    with pytest.raises(ValueError, match=r"^pin: 1 of 2 key\(s\) are stored nowhere .*fs: fs tier: 1 of 2 key\(s\) "
                       r"not stored here"):
        mgr.pin([key(0), b"never stored"], ttl=5)


def test_a_tier_without_the_hook_says_so_and_unpin_reaches_the_tiers(managers, tmp_path):
    mgr, _, _ = managers(8, tiers=["memory"])
    mgr.add_tier("fs", {"root_dir": str(tmp_path / "kv")})
    store_all(mgr, [key(0)])
    settle(mgr)
    res = mgr.pin([key(0)], hard=True)
    assert res.tiers == {"memory": "tier 'memory' does not take pins (no pin hook)", "fs": None}
    assert res.pinned == ["host", "fs"]
    fs = mgr.tiers[1].handle.tier
    assert len(fs.pins) == 1
    mgr.unpin([key(0)])
    assert len(fs.pins) == 0 and len(mgr.pins) == 0


def test_an_encrypted_fs_tier_takes_pins_through_the_sealing_wrapper(managers, tmp_path):
    import os

    keyfile = tmp_path / "k.key"
    keyfile.write_bytes(os.urandom(32))
    keyfile.chmod(0o600)
    mgr, _, _ = managers(8)
    mgr.add_tier("fs", {"root_dir": str(tmp_path / "kv"), "encrypt": {"key_file": str(keyfile), "key_id": "k1"}})
    store_all(mgr, [key(0)])
    settle(mgr)
    assert mgr.pin([key(0)], ttl=5).pinned == ["host", "fs"]
    with pytest.raises(ValueError, match="fs: fs tier: 1 of 1 key"):  # the fs tier's own answer, through the wrapper
        mgr.pin([b"elsewhere"], ttl=5)


def test_pins_are_counted_in_metrics(tmp_path):
    """kvtiers_pin_chunks_total{medium,event} and kvtiers_host_lifetime_pinned_chunks (docs/pins.md)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from tier_helpers import CopyDma

    from kvtiers import Arena
    from kvtiers.engine.manager import TieringManager
    from kvtiers.metrics import attach_metrics

    reg = CollectorRegistry()
    mgr = TieringManager(arena=Arena.allocate(6, 4096), dma=CopyDma())  # at most 3 pinned
    mgr.add_tier("memory", name="mem")
    mgr.add_tier("fs", {"root_dir": str(tmp_path / "kv")})
    clock = mgr.pins.clock = Clock()
    attach_metrics(mgr, {"interval": 0}, registry=reg)
    keys = [bytes([i]) for i in range(4)]
    mgr.wait([mgr.store(keys, [[0]] * 4)])
    settle(mgr)
    assert mgr.pin(keys[:2], ttl=10).pinned == ["host", "fs"]
    assert mgr.pin(keys[2:3], hard=True).host is None
    assert mgr.pin(keys, hard=True).host is not None  # 4 of at most 3: refused
    mgr.unpin(keys[2:3])
    clock.now += 11
    mgr.poll()  # a manager call: the metrics refresh
    mgr.close()
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}

    def n(medium, event):
        return found.get(("kvtiers_pin_chunks_total", (("event", event), ("medium", medium))), 0)

    assert (n("host", "pinned"), n("host", "refused"), n("host", "unpinned"), n("host", "expired")) == (3, 4, 1, 2)
    assert (n("fs", "pinned"), n("mem", "refused"), n("fs", "unpinned")) == (7, 7, 1)
    assert found["kvtiers_host_lifetime_pinned_chunks", ()] == 0


def test_the_config_takes_a_pins_block(tmp_path):
    from test_manager import kv_caches

    from kvtiers.engine.manager import TieringManager
    from kvtiers.errors import ConfigError

    kv = kv_caches()
    cfg = {"host_bytes": 1 << 20, "blocks_per_chunk": 2, "pins": {"max_ttl": 60, "max_share": 0.25}}
    with TieringManager.from_config(cfg, kv) as mgr:
        assert mgr.pins.max_ttl == 60 and mgr.pins.cap == len(mgr.arena) // 4
    with pytest.raises(ConfigError, match=r"^pins: max_share must be a fraction in \[0, 1\), got 2$"):
        TieringManager.from_config({**cfg, "pins": {"max_share": 2}}, kv)
    with pytest.raises(ConfigError, match="'pins' expects an object"):
        TieringManager.from_config({**cfg, "pins": 5}, kv)


def test_fs_victims_are_found_past_hundreds_of_pinned_oldest_keys():
    """The index offers the oldest 256+ keys as candidates: with more pinned keys than that at
    the old end, eviction must still find the unpinned ones (it found none, and the bound broke)."""
    from kvtiers_fs.index import Index
    from kvtiers_fs.keytable import fingerprint

    idx = Index(negative_ttl=1.0, file_bytes=4096)
    keys = [b"k%d" % i for i in range(1000)]
    for k in keys:
        idx.add(k)
    pinned = {fingerprint(k) for k in keys[:600]}  # the 600 oldest
    idx.pinned = pinned.__contains__
    got = idx.victims(10)
    assert len(got) == 10 and not {fp for fp, _ in got} & pinned
    assert [fp for fp, _ in got] == [fingerprint(k) for k in keys[600:610]]  # the oldest unpinned, in order


def test_host_evictions_do_not_walk_past_the_pinned_keys_each_time():
    """Pinned keys at the LRU end are passed once, then moved up: 100 evictions with 500 pinned
    ask about a tenth of 100 x 500 keys or fewer (each eviction walked all 500: 12 ms per store at
    20,000 slots)."""
    from kvtiers.engine.hostcache import HostCache
    from kvtiers.engine.pins import LifetimePins
    from kvtiers.engine.policies import LRUPolicy

    cache = HostCache(1000, LRUPolicy(1000))
    pins = LifetimePins(500)
    asked = []
    cache.held = lambda k: asked.append(k) or pins.held(k)
    for i in range(1000):
        k = b"k%d" % i
        cache.unpin(cache.allocate(k, "storing"))
        cache.mark_ready(k)
    assert pins.add([b"k%d" % i for i in range(500)], 60) is None
    for i in range(100):
        cache.unpin(cache.allocate(b"n%d" % i, "storing"))
        cache.mark_ready(b"n%d" % i)
    assert all(b"k%d" % i in cache for i in range(500))  # the pinned stayed
    assert len(asked) < 5000, len(asked)  # walking past them each time: over 50,000


def test_a_compressed_fs_tier_pins_every_piece(managers, tmp_path):
    """"compress" keeps a chunk in pieces under other keys: a pin reaches each of them."""
    mgr, _, _ = managers(8)
    mgr.add_tier("fs", {"root_dir": str(tmp_path / "kv"), "compress": {"codec": "lz4"}})
    store_all(mgr, [key(0), key(1)])
    settle(mgr)
    fs = mgr.tiers[0].handle
    tier_keys = fs.hooks._tier_keys([key(0), key(1)])
    assert mgr.pin([key(0), key(1)], ttl=5).pinned == ["host", "fs"]
    assert len(fs.tier.pins) == len(tier_keys) >= 2
    mgr.unpin([key(0), key(1)])
    assert len(fs.tier.pins) == 0


def test_renewing_a_pin_keeps_its_memory_in_proportion():
    """A system prompt pinned again on every request: the deadlines' heap stays within a
    constant of the pinned keys (it grew by one entry per renewal)."""
    from kvtiers_fs.pins import PinTable

    from kvtiers.engine.pins import LifetimePins

    clock = Clock()
    host, fs = LifetimePins(10, clock=clock), PinTable(10, clock=clock)
    for _ in range(5000):
        clock.now += 0.01
        assert host.add([b"a", b"b"], 60) is None and fs.add([b"a", b"b"], 60) is None
    assert len(host._until._heap) <= 2 * 2 + 1024 and len(fs._until._heap) <= 2 * 2 + 1024  # Deadlines
    clock.now += 61
    assert host.expire() == [b"a", b"b"] and fs.expire() == 2
