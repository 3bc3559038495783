"""The reuse ceiling (kvtiers.engine.reuse; docs/observability.md#the-reuse-ceiling): the share
of chunk offers that repeat an earlier one, estimated in bounded memory, checked against the
exact count on a recorded trace (a fixed seed) within the estimator's stated bound, per window,
and through the manager's store path."""

from __future__ import annotations

import random

import pytest
from test_manager import key, make_manager, store_all

from kvtiers.engine.reuse import WINDOWS, HyperLogLog, ReuseEstimator, key_hashes


def trace(seed: int, n: int, shared: int, p_shared: float) -> list[bytes]:
    """Chunk keys as a server sees them: a share from a pool of shared prefixes, the rest one-shot."""
    rng = random.Random(seed)
    return [b"shared-%d" % rng.randrange(shared) if rng.random() < p_shared else rng.randbytes(16)
            for _ in range(n)]


def exact(keys: list[bytes]) -> float:
    return 1 - len(set(keys)) / len(keys)


@pytest.mark.parametrize(("n", "shared", "p_shared"), [(3000, 200, 0.5), (120_000, 20_000, 0.7), (60_000, 50, 0.1)])
def test_ceiling_is_within_the_stated_bound_of_the_exact_share(n, shared, p_shared):
    keys = trace(11, n, shared, p_shared)
    est = ReuseEstimator(clock=lambda: 0.0)
    for i in range(0, n, 32):
        est.offer(keys[i:i + 32])
    want = exact(keys)
    bound = est.error_bound * len(set(keys)) / n
    for label in WINDOWS:
        got = est.ceiling(label)
        assert got is not None and abs(got - want) <= bound, (label, got, want, bound)
    assert est.offers == n


def test_windows_forget_offers_older_than_the_window():
    now = [0.0]
    est = ReuseEstimator({"short": 100.0, "long": 1000.0}, clock=lambda: now[0])
    keys = [b"k%d" % i for i in range(500)]
    est.offer(keys)
    assert est.ceiling("short") == pytest.approx(0.0, abs=0.02)
    now[0] = 150.0  # the first offers are out of the short window, still in the long one
    est.offer(keys)
    assert est.ceiling("short") == pytest.approx(0.0, abs=0.02)
    assert est.ceiling("long") == pytest.approx(0.5, abs=0.02)
    now[0] = 2000.0
    assert est.ceiling("long") is None  # nothing offered within the window


def test_hyperloglog_standard_error_and_memory():
    h = HyperLogLog(14)
    assert h.registers.nbytes == 16 * 1024 and h.standard_error == pytest.approx(0.008125)
    h.add(key_hashes(b"x%d" % i for i in range(100_000)))
    assert abs(h.count() - 100_000) <= 3 * h.standard_error * 100_000


def test_the_manager_offers_every_stored_key():
    mgr, _, _ = make_manager(8)
    try:
        keys = [key(i) for i in range(4)]
        store_all(mgr, keys)
        store_all(mgr, keys)  # the host holds them: skipped, and still offers
        store_all(mgr, [key(i) for i in range(4, 8)], 4)
        assert mgr.reuse.offers == 12
        assert mgr.reuse.ceiling("15m") == pytest.approx(4 / 12, abs=0.01)
    finally:
        mgr.close()
