"""The serving soak's summary (``kvtiers.commands.bench.serve_soak.summarize``) on reports written
here: the first full interval against the last full one, a last interval the soak's end cut
short left out of the ratio, and the verdict."""

from __future__ import annotations

import pytest

from kvtiers.commands.bench.serve_soak import summarize


def report(ends: list[float], rates: list[float], failed: int = 0) -> dict:
    proc = {"rss": 600 << 20, "fds": 30, "threads": 10}
    rows = [{"t": t, "fs": {"chunk_bytes": 1 << 20}, "servers": [{"req_s": r, "ttft_p50_s": 1.0, "api": proc,
                                                                 "engine_core": proc}]}
            for t, r in zip(ends, rates, strict=True)]
    return {"soak": {"interval_s": 60.0}, "intervals": rows, "errors": [], "shm_left": [], "greedy_mismatches": 0,
            "clients": [{"completed": 100, "failed": failed}]}


def test_a_last_interval_cut_short_is_not_the_last_rate():
    s = summarize(report([60, 120, 180, 240, 249], [0.2, 0.35, 0.3, 0.4, 0.0]))
    assert s["servers"][0]["req_s"] == [0.35, 0.4]
    assert s["servers"][0]["req_s_ratio"] == pytest.approx(0.4 / 0.35)
    assert s["ok"]


def test_a_last_interval_of_at_least_half_counts():
    s = summarize(report([60, 120, 180, 215], [0.2, 0.35, 0.3, 0.5]))
    assert s["servers"][0]["req_s"] == [0.35, 0.5]


def test_a_failed_request_fails_the_verdict():
    assert not summarize(report([60, 120, 180], [0.3, 0.3, 0.3], failed=1))["ok"]
