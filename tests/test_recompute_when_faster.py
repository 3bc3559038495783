"""Load or recompute (issue 55 item 3, kvtiers/engine/costs.py): a lookup does not offer a
tier's chunks whose load is expected to take longer than the engine's prefill of their tokens,
once the manager has measured both; off with ``recompute_when_faster: false``; a fast tier is
loaded as before. Real manager, real fs tier; the slowness is the injected fault
(kvtiers/commands/bench/slowtier.py holds the fs tier's load results back). The prefill times
are reported through the public API (``observe_prefill``), so each decision is deterministic:
the slow tier's loads take 10x the reported recompute time, the fs tier's own a small share
of it; no tight wall-clock bound."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from test_manager import chunk_blocks, key, make_manager, settle, store_all

from kvtiers.commands.bench.slowtier import slow_down
from kvtiers.config import parse_config
from kvtiers.engine.costs import MIN_SAMPLES, CostFit, LoadCosts
from kvtiers.errors import ConfigError
from kvtiers.metrics import attach_metrics

TOKENS_PER_CHUNK = 32  # test_manager's TOKENS_PER_BLOCK x BPC
PER_TOKEN_S = 1e-3  # the prefill reported: 32 ms a chunk, 10x under the slow tier's 0.3 s, far over fs's own


def fs_manager(tmp_path, *, delay_s: float = 0.0, **kw):
    """Two host slots and a real fs tier; keys 0-7 stored one by one, so 0-5 are on fs only."""
    mgr, kv, _ = make_manager(2, tiers=[("fs", {"root_dir": str(tmp_path / "fs")}, "fs")], **kw)
    if delay_s:
        slow_down(mgr.tiers[0].handle, delay_s=delay_s)
    for i in range(8):
        store_all(mgr, [key(i)], first_block_chunk=i)
        settle(mgr)
    return mgr


def learn(mgr, *, per_token_s: float) -> None:
    """MIN_SAMPLES real loads from fs (keys 0-7, each absent from the host when loaded) and
    MIN_SAMPLES prefills reported at ``per_token_s`` seconds a token."""
    for i in range(MIN_SAMPLES):
        look = mgr.lookup([key(i)])
        assert look.sources == ("fs",), (i, look)  # nothing decided yet: loaded as without the feature
        (res,) = mgr.wait([mgr.load([key(i)], [chunk_blocks(40 + i)])], timeout=30)
        assert res.ok and res.sources == {key(i): "fs"}
        mgr.observe_prefill(TOKENS_PER_CHUNK * (1 + i % 4), TOKENS_PER_CHUNK * (1 + i % 4) * per_token_s)
    settle(mgr)
    assert mgr.costs.loads["fs"].samples >= MIN_SAMPLES


def test_a_slow_tier_is_not_waited_for_once_measured(tmp_path) -> None:
    mgr = fs_manager(tmp_path, delay_s=0.3)
    with mgr:
        learn(mgr, per_token_s=PER_TOKEN_S)  # a chunk recomputes in 32 ms; it loads in >= 300 ms
        look = mgr.lookup([key(i) for i in range(4)])
        assert look.num_chunks == 0 and look.sources == () and not look.retry
        assert mgr.costs.decisions[("fs", "recompute")] >= 1
        assert mgr.costs.decisions[("fs", "load")] == 0
        # the host's chunks are never cut: keys 6, 7 are in the host cache after their loads
        host_look = mgr.lookup([key(MIN_SAMPLES - 2), key(MIN_SAMPLES - 1)])
        assert host_look.sources == ("host", "host")


def test_off_the_slow_tier_is_loaded_as_before(tmp_path) -> None:
    mgr = fs_manager(tmp_path, delay_s=0.3, recompute_when_faster=False)
    with mgr:
        learn(mgr, per_token_s=PER_TOKEN_S)
        look = mgr.lookup([key(i) for i in range(4)])
        assert look.sources == ("fs",) * 4
        assert not mgr.costs.decisions
        # the fits learned all the same: the decision it would make
        assert mgr.costs.decide("fs", 4, 4 * TOKENS_PER_CHUNK) == "recompute"


def test_a_fast_tier_changes_nothing(tmp_path) -> None:
    mgr = fs_manager(tmp_path)
    with mgr:
        learn(mgr, per_token_s=PER_TOKEN_S)  # the same 32 ms a chunk; fs loads it in milliseconds
        look = mgr.lookup([key(i) for i in range(4)])
        assert look.sources == ("fs",) * 4
        assert mgr.costs.decisions[("fs", "load")] >= 1 and mgr.costs.decisions[("fs", "recompute")] == 0


def test_the_cut_is_at_the_slow_tiers_first_chunk_and_counted_on_metrics(tmp_path) -> None:
    mgr = fs_manager(tmp_path)
    with mgr:
        reg = CollectorRegistry()
        attach_metrics(mgr, {"interval": 0}, registry=reg)
        for _ in range(MIN_SAMPLES):  # injected through the public observe API: deterministic
            mgr.costs.observe_load("fs", 1, 0.5)
            mgr.observe_prefill(TOKENS_PER_CHUNK, 0.001)
        keys = [key(6), key(7), key(0), key(1)]  # host, host, fs, fs
        look = mgr.lookup(keys)
        assert look.sources == ("host", "host")
        mgr.metrics.tick(force=True)
        text = generate_latest(reg).decode()
        assert 'kvtiers_load_decisions_total{decision="recompute",tier="fs"} 1.0' in text


def test_the_fits() -> None:
    fit = CostFit()
    for n in (1, 2, 4, 8) * 4:
        fit.add(n, 0.010 + 0.002 * n)  # 10 ms a job, 2 ms a chunk
    latency, per = fit.terms()
    assert latency == pytest.approx(0.010, rel=1e-6) and per == pytest.approx(0.002, rel=1e-6)
    same = CostFit()
    for _ in range(4):
        same.add(4, 0.04)  # one size only: a ratio
    assert same.terms() == (0.0, pytest.approx(0.01))
    costs = LoadCosts(min_samples=2)
    costs.observe_load("t", 1, 1.0)
    costs.observe_prefill(32, 0.001)
    assert costs.decide("t", 1, 32) is None  # too few samples: load as today
    costs.observe_load("t", 1, 1.0)
    costs.observe_prefill(32, 0.001)
    assert costs.decide("t", 1, 32) == "recompute"
    assert costs.decide("t", 1, 32 * 10_000) == "load"  # 10 s of prefill against 1 s of load


def test_a_left_out_tier_is_probed_and_found_again_once_fast() -> None:
    costs = LoadCosts(min_samples=2, probe_every=4)
    for _ in range(2):
        costs.observe_load("t", 1, 1.0)
        costs.observe_prefill(32, 0.001)
    assert [costs.decide("t", 1, 32) for _ in range(8)] == ["recompute"] * 3 + ["load"] + ["recompute"] * 3 + ["load"]
    for _ in range(60):  # what the probes (and later loads) measure: the tier got fast
        costs.observe_load("t", 1, 0.0001)
    assert costs.decide("t", 1, 32) == "load"


def test_the_option() -> None:
    base = {"host_bytes": 1 << 20}
    assert parse_config(base).recompute_when_faster is True
    assert parse_config({**base, "recompute_when_faster": False}).recompute_when_faster is False
    with pytest.raises(ConfigError, match="'recompute_when_faster' expects true or false, got str 'no'"):
        parse_config({**base, "recompute_when_faster": "no"})


def test_until_its_first_load_is_timed_a_tier_loads_one_at_a_time() -> None:
    costs = LoadCosts(min_samples=2)
    assert costs.decide("t", 4, 128) is None  # nothing known, nothing in flight: load (and find out)
    assert costs.decide("t", 4, 128, loading=1) == "recompute"  # one load of unknown time is out already
    assert costs.decisions == {}  # decide() counts nothing itself: cut() and the vLLM tier do
    costs.observe_load("t", 4, 0.001)
    assert costs.decide("t", 4, 128, loading=3) is None  # timed once: loads go on while the fits learn
    assert costs.cut(["t"] * 4, 32, "host", {"t": 0}) == 4
    fresh = LoadCosts(min_samples=2)
    assert fresh.cut(["host", "u", "u"], 32, "host", {"u": 1}) == 1  # cut at the new tier's first chunk
    assert fresh.decisions == {("u", "recompute"): 1}


def test_a_decisively_slow_tier_loses_before_its_fit_has_its_samples() -> None:
    costs = LoadCosts(min_samples=8)
    for _ in range(8):
        costs.observe_prefill(32, 0.010)  # 10 ms a chunk's tokens
    costs.observe_load("slow", 4, 0.4)  # one load: 100 ms a chunk, 10x its recompute
    assert costs.decide("slow", 4, 128) == "recompute"
    costs.observe_load("mild", 4, 0.1)  # 2.5x its recompute: not decisive, the fit learns on
    assert costs.decide("mild", 4, 128) is None
    costs.observe_load("mild", 4, 0.1)  # two loads each over 2x: decisive (4x / 2 loads)
    assert costs.decide("mild", 4, 128) == "recompute"
    near = LoadCosts(min_samples=8)
    for _ in range(8):
        near.observe_prefill(32, 0.010)
    for n, expected in ((1, None), (2, None), (3, None), (4, None)):  # 1.2x: never below MARGIN's 1.25x
        near.observe_load("near", 4, 0.048)
        assert near.decide("near", 4, 128) is expected, n
    costs.observe_load("slow", 4, 0.02)  # one fast load is enough doubt until the fit has its samples
    assert costs.decide("slow", 4, 128) is None
    unknown_prefill = LoadCosts(min_samples=8)
    unknown_prefill.observe_load("slow", 4, 0.4)
    assert unknown_prefill.decide("slow", 4, 128) is None  # nothing to compare with yet


def test_a_probe_waits_until_none_of_the_tiers_loads_is_in_flight() -> None:
    costs = LoadCosts(min_samples=2, probe_every=2)
    for _ in range(2):
        costs.observe_load("t", 1, 1.0)
        costs.observe_prefill(32, 0.001)
    assert costs.decide("t", 1, 32) == "recompute"
    assert [costs.decide("t", 1, 32, loading=1) for _ in range(5)] == ["recompute"] * 5  # a probe is due, held
    assert costs.decide("t", 1, 32) == "load"  # the probe, once nothing is in flight
    assert costs.decide("t", 1, 32) == "recompute"
