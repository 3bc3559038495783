"""Load or recompute under vLLM's tiering (issue 55 item 3): a kvtiers secondary tier whose
promotions take longer than the engine's prefill answers MISS (vLLM recomputes), counted as
``kvtiers_load_decisions``; ``recompute_when_faster: false`` in ``kv_connector_extra_config``
keeps promoting; the step meter takes the engine's step times and skips idle gaps.

Real vLLM tiering manager and real fs tier (tests/test_integration_vllm.py's ``Engine``); the
slowness is the injected fault (kvtiers/commands/bench/slowtier.py). The prefill cost is
reported through the public fit (``tier.costs.observe_prefill``), 8x under the slow load
time and far over the fs tier's own, so the decisions are deterministic."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

import numpy as np  # noqa: E402
from test_integration_vllm import MODULE, ROW, STEP, chunks_for, offloading_config  # noqa: E402
from test_integration_vllm import Engine as _Engine  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtiers import Lookup  # noqa: E402
from kvtiers.engine.costs import MIN_SAMPLES  # noqa: E402
from kvtiers.integrations.vllm import metrics  # noqa: E402
from kvtiers.integrations.vllm.step_costs import StepMeter  # noqa: E402


class Engine(_Engine):
    """test_integration_vllm's engine, with more keys in ``kv_connector_extra_config``."""

    def __init__(self, tier: dict, extra: dict | None = None) -> None:
        self.spec = TieringOffloadingSpec(offloading_config({"secondary_tiers": [tier], **(extra or {})}))
        self.m = self.spec.get_manager()
        self.rows = np.frombuffer(self.m.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(-1, ROW)
        self.tier = self.m.secondary_tiers[0]


def slow_engine(tmp_path, slow: bool = True, **kw) -> tuple[Engine, list[bytes], dict[bytes, bytes]]:
    """MIN_SAMPLES + 4 chunks cascaded to fs by one engine; a second engine on the same
    directory (empty primary), its fs tier's loads held back 0.4 s (the adapter's fault-injection
    option, unless not ``slow``), which has promoted the first MIN_SAMPLES one by one (its load
    samples) and been told a chunk prefills in 50 ms."""
    tier = {"type": "kvtiers_fs", "root_dir": str(tmp_path / "kv"), "module_path": MODULE}
    chunks = chunks_for(MIN_SAMPLES + 4, seed=5)
    a = Engine(tier)
    try:
        a.store("w", chunks)
    finally:
        a.close()
    b = Engine({**tier, "slow_loads": {"delay_ms": 400}} if slow else tier, **kw)
    keys = list(chunks)
    for i in range(MIN_SAMPLES):
        got, seen = b.load(f"r{i}", [keys[i]])
        assert got == {keys[i]: chunks[keys[i]]} and LookupResult.HIT_PENDING in seen  # promoted as today
        b.tier.costs.observe_prefill(b.tier.tokens_per_chunk, 0.05)
    assert b.tier.costs.loads[b.tier.tier_type].samples == MIN_SAMPLES
    return b, keys, chunks


def test_a_slow_tier_answers_miss_once_measured(tmp_path) -> None:
    e, keys, chunks = slow_engine(tmp_path)
    try:
        got, seen = e.load("late", keys[MIN_SAMPLES:])
        assert got == {} and set(seen) == {LookupResult.MISS}  # vLLM recomputes them
        assert e.tier.costs.decisions[(e.tier.tier_type, "recompute")] == 1  # one request: one decision
        stats = e.m.get_stats().reduce()
        assert stats[f"{metrics.LOAD_DECISIONS}:('kvtiers_fs', 'recompute')"] == 1
    finally:
        e.close()


def test_off_the_slow_tier_is_promoted(tmp_path) -> None:
    e, keys, chunks = slow_engine(tmp_path, extra={"recompute_when_faster": False})
    try:
        got, _ = e.load("late", keys[MIN_SAMPLES:])
        assert got == {k: chunks[k] for k in keys[MIN_SAMPLES:]}
        assert not e.tier.costs.decisions
    finally:
        e.close()


def test_a_fast_tier_is_promoted(tmp_path) -> None:
    e, keys, chunks = slow_engine(tmp_path, slow=False)
    try:
        got, _ = e.load("late", keys[MIN_SAMPLES:])
        assert got == {k: chunks[k] for k in keys[MIN_SAMPLES:]}
        decisions = e.tier.costs.decisions
        assert decisions[(e.tier.tier_type, "load")] == 1 and decisions[(e.tier.tier_type, "recompute")] == 0
    finally:
        e.close()


def known(e: Engine, keys: list[bytes]) -> None:
    """Ask the kvtiers tier itself until it answers HIT for every key (the fs tier answers RETRY
    for a key it has not seen yet while it looks), so a step's lookups are answered at once."""
    deadline = time.monotonic() + 30
    while e.tier.handle.lookup(keys) != [Lookup.HIT] * len(keys):
        assert time.monotonic() < deadline, "the fs tier does not know the keys"
        time.sleep(0.005)


def step_of(e: Engine, requests: dict[str, list[bytes]]) -> dict[str, list[LookupResult]]:
    """One scheduler step in which each request looks its keys up (as vLLM's scheduler does, each
    request's own ``ReqContext``); the answers per request."""
    known(e, [k for keys in requests.values() for k in keys])
    out = {}
    for req, keys in requests.items():
        ctx = ReqContext(req_id=req)
        e.m.on_new_request(ctx)
        out[req] = [e.m.lookup(k, ctx) for k in keys]
    e.m.on_schedule_end(STEP)
    return out


def unknown_slow_engine(tmp_path) -> tuple[Engine, list[bytes], dict[bytes, bytes]]:
    """9 chunks cascaded to fs by one engine; a second engine on the same directory, its fs
    tier's loads held back 0.4 s, which knows the prefill (10 ms a chunk) and nothing of the
    tier's loads."""
    tier = {"type": "kvtiers_fs", "root_dir": str(tmp_path / "kv"), "module_path": MODULE}
    chunks = chunks_for(9, seed=7)
    a = Engine(tier)
    try:
        a.store("w", chunks)
    finally:
        a.close()
    e = Engine({**tier, "slow_loads": {"delay_ms": 400}})
    for _ in range(MIN_SAMPLES):
        e.tier.costs.observe_prefill(e.tier.tokens_per_chunk, 0.01)
    return e, list(chunks), chunks


def test_a_new_slow_tier_loads_for_one_request_until_timed_then_for_none(tmp_path) -> None:
    e, keys, chunks = unknown_slow_engine(tmp_path)
    try:
        seen = step_of(e, {"r1": keys[:3], "r2": keys[3:6]})
        assert seen["r1"] == [LookupResult.HIT_PENDING] * 3  # the first request loads (and times the tier)
        assert seen["r2"] == [LookupResult.MISS] * 3  # the next recomputes rather than wait on the unknown
        got, _ = e.load("r1", keys[:3])  # r1's rows, once its 0.4 s promotion is in
        assert got == {k: chunks[k] for k in keys[:3]}
        assert e.tier.costs.loads[e.tier.tier_type].samples == 1
        # one load of 0.4 s for three chunks, each 10 ms to recompute: decided without more samples
        got, seen3 = e.load("r3", keys[6:])
        assert got == {} and set(seen3) == {LookupResult.MISS}
        assert e.tier.costs.decisions == {(e.tier.tier_type, "recompute"): 2}  # r2's and r3's
    finally:
        e.close()


def test_a_request_is_decided_again_in_its_next_step(tmp_path) -> None:
    """A request whose load began while the tier was unknown does not go on loading from it,
    chunk after chunk in later steps, once the tier is known to lose."""
    e, keys, chunks = unknown_slow_engine(tmp_path)
    try:
        known(e, keys)
        ctx = ReqContext(req_id="r1")
        e.m.on_new_request(ctx)
        assert [e.m.lookup(k, ctx) for k in keys[:3]] == [LookupResult.HIT_PENDING] * 3
        e.settle()  # scheduler steps until the 0.4 s promotion is in: the tier's first sample
        assert e.tier.costs.loads[e.tier.tier_type].samples == 1
        # a later step of the same request (its rows for more of the prefix were short, say)
        assert [e.m.lookup(k, ctx) for k in keys[:6]] == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
    finally:
        e.close()


def test_a_request_loads_all_its_chunks_from_the_tier_or_none_and_probes_wait(tmp_path) -> None:
    e, keys, chunks = slow_engine(tmp_path)
    e.tier.costs.probe_every = 2
    try:
        recomputed = step_of(e, {"p1": keys[MIN_SAMPLES:MIN_SAMPLES + 2]})
        assert recomputed["p1"] == [LookupResult.MISS] * 2
        # p2's decision is a probe: both its chunks load (not only the chunk the probe fell on);
        # p3's, in the same step, would be one too, but one load of the tier is out already
        seen = step_of(e, {"p2": keys[MIN_SAMPLES + 2:], "p3": keys[MIN_SAMPLES:MIN_SAMPLES + 2]})
        assert seen == {"p2": [LookupResult.HIT_PENDING] * 2, "p3": [LookupResult.MISS] * 2}
        got, _ = e.load("p2", keys[MIN_SAMPLES + 2:])
        assert got == {k: chunks[k] for k in keys[MIN_SAMPLES + 2:]}
        assert e.tier.costs.decisions == {(e.tier.tier_type, "recompute"): 2, (e.tier.tier_type, "load"): 1}
    finally:
        e.close()


def test_the_step_meter_fits_steps_and_skips_idle_gaps() -> None:
    class Tier:  # what the meter needs of a KvtiersTier: its costs
        from kvtiers.engine.costs import LoadCosts

        costs = LoadCosts()

    tier = Tier()
    meter = StepMeter([tier], min_samples=4)
    t = 0.0
    for tokens in [64, 128, 256, 512] * 3:  # 1 ms a step + 10 us a token
        meter.step(tokens, now=t)
        t += 0.001 + 1e-5 * tokens
    meter.step(64, now=t)
    assert tier.costs.prefill is meter.prefill and meter.prefill.samples == 12
    latency, per = meter.prefill.terms()
    assert latency == pytest.approx(0.001, rel=1e-3) and per == pytest.approx(1e-5, rel=1e-3)
    meter.step(0, now=t + 60.0)  # a minute idle after a 64-token step: not a step
    assert meter.skipped == 1 and meter.prefill.samples == 12
    meter.step(64, now=t + 61.0)  # a step of no tokens is no sample either
    assert meter.prefill.samples == 12


def test_a_bad_option_is_one_line(tmp_path) -> None:
    from kvtiers.errors import ConfigError

    tier = {"type": "kvtiers_fs", "root_dir": str(tmp_path / "kv"), "module_path": MODULE}
    with pytest.raises(ConfigError, match="'recompute_when_faster' must be true or false, got 'no'"):
        Engine(tier, extra={"recompute_when_faster": "no"})
    with pytest.raises(ConfigError, match="'slow_loads': 'delay_ms' must be a number of milliseconds >= 0, got -1"):
        Engine({**tier, "slow_loads": {"delay_ms": -1}})
