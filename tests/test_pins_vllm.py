"""Pins from vLLM requests (docs/pins.md#from-vllm): a request whose ``kv_transfer_params``
hold ``kvtiers_pin`` pins its chunks in a kvtiers secondary tier, those vLLM's cascade stores
for it and those a lookup of it finds there. On vLLM's real tiering manager (scheduler side)
with KvtiersOffloadingSpec and the fs tier; the engine end to end in
tests/test_pins_vllm_engine.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33.0 is installed by `make test`")

from test_vllm_namespace import MODULE, ROW, STEP, Engine  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext, make_offload_key  # noqa: E402

from kvtiers.integrations.vllm import KvtiersOffloadingSpec, metrics  # noqa: E402
from kvtiers.integrations.vllm.pins import requested_pin  # noqa: E402


def chunks(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    return {make_offload_key(rng.bytes(32), 0): rng.bytes(ROW) for _ in range(n)}


def store(e: Engine, data: dict, ctx: ReqContext) -> None:
    """``Engine.store`` with the request's own context."""
    e.store(data, ctx)


def pin_stats(e: Engine) -> dict[str, float]:
    """The fs tier's kvtiers_pin_chunks increments in vLLM's stats since the last call, by event."""
    stats = e.m.get_stats().reduce()
    head = f"{metrics.PIN_EVENTS}:('{e.tier.tier_type}', '"
    return {k[len(head):-2]: v for k, v in stats.items() if k.startswith(head) and v}


@pytest.fixture
def engine(tmp_path):
    e = Engine({"type": "kvtiers_fs", "module_path": MODULE, "root_dir": str(tmp_path / "kv")},
               spec=KvtiersOffloadingSpec)
    yield e
    e.close()


def test_a_request_field_pins_what_vllm_stores_for_it_and_what_it_finds(engine):
    e = engine
    fs = e.tier.handle.tier
    store(e, chunks(0, 4), ReqContext(req_id="a", kv_transfer_params={"kvtiers_pin": {"ttl": 600}}))
    assert len(fs.pins) == 4 and e.tier.pins.counts["pinned"] == 4
    assert pin_stats(e) == {"pinned": 4}  # on vLLM's /metrics: kvtiers_pin_chunks_total{tier,event}
    plain = chunks(1, 3)
    store(e, plain, ReqContext(req_id="b"))  # no field: nothing more pinned
    assert len(fs.pins) == 4
    ctx = ReqContext(req_id="c", kv_transfer_params={"kvtiers_pin": {"hard": True}})
    e.answers(list(plain))  # stored and settled
    # c looks up in a later step: in the same one, the tier's load for "look" (of unknown time:
    # nothing loaded yet) would make it recompute instead (kvtiers.engine.costs, one at a time)
    e.m.on_schedule_end(STEP)
    for k in plain:
        e.tier.lookup(k, ctx)  # found there: pinned at the step's end
    e.m.on_schedule_end(STEP)
    e.tier.get_finished_jobs()
    assert len(fs.pins) == 7 and e.tier.pins.counts["pinned"] == 7
    assert pin_stats(e) == {"pinned": 3}  # what was pinned since the last stats


def test_a_bad_field_pins_nothing_and_says_so_once(engine, caplog):
    e = engine
    caplog.set_level(logging.WARNING, logger="kvtiers.integrations.vllm")
    for rid in ("a", "b"):
        store(e, chunks(ord(rid), 2), ReqContext(req_id=rid, kv_transfer_params={"kvtiers_pin": {"ttl": -1}}))
    assert len(e.tier.handle.tier.pins) == 0 and e.tier.pins.counts["bad_field"] == 2
    assert pin_stats(e) == {"bad_field": 2}
    said = [r.getMessage() for r in caplog.records if "not pinned" in r.getMessage()]
    assert said == ["kvtiers tier 'fs': request not pinned: kv_transfer_params.kvtiers_pin: ttl must be positive, "
                    "got -1"]


@pytest.mark.parametrize("value, said", [
    ({"ttl": 10, "hard": True}, "a hard pin has no ttl"),
    ({"ttl": 10 ** 9}, "longer than max_ttl"),
    ("600", 'must be {"ttl": seconds} or {"hard": true}'),
    ({"hard": "yes"}, "hard must be true or false"),
    ({}, "must be"),
])
def test_bad_fields_are_one_line_errors(value, said):
    with pytest.raises(ValueError, match=None) as e:
        requested_pin(ReqContext(req_id="x", kv_transfer_params={"kvtiers_pin": value}))
    assert said in str(e.value) and "\n" not in str(e.value)
    assert requested_pin(ReqContext(req_id="y")) == (False, None)
    assert requested_pin(ReqContext(req_id="z", kv_transfer_params={"kvtiers_pin": {"ttl": 5}})) == (True, 5.0)
