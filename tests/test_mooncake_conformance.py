"""The conformance suite against the mooncake tier on a real Mooncake Store pool: a real
``mooncake_master`` on loopback and a ``serve`` process holding the memory, one per test
session (what ``conformance_config`` starts); core, shared (the second instance in another
process), durable (a new instance after close, the data held by the serve process) and
bounded (``max_bytes``: the instance's own share of the pool)."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake")

from kvtiers_conformance import DEFAULT_LIMITS, TierTests, run_conformance  # noqa: E402
from kvtiers_mooncake.client import missing  # noqa: E402
from kvtiers_mooncake.pool import shared_test_pool  # noqa: E402

if missing():
    pytest.skip(missing(), allow_module_level=True)


@pytest.fixture(scope="session")
def mooncake_pool():
    return shared_test_pool()  # one master and serve process per test session, killed at exit


class TestMooncakeConformance(TierTests):
    """Every check at the levels the mooncake tier claims; the stateful check draws 30 examples."""

    limits = DEFAULT_LIMITS.replace(examples=30)

    @pytest.fixture
    def tier_config(self, mooncake_pool):
        assert mooncake_pool.master.alive(), "the session's mooncake_master died during an earlier test"
        return "mooncake", {"master_server_address": mooncake_pool.address, "global_segment_size": 0,
                            "timeout": 10.0}


def test_conformance_config_needs_no_options():
    """``kvtiers conformance mooncake`` with no config: conformance_config points the suite at
    the process's test pool (started on first use)."""
    report = run_conformance("mooncake", levels="core,durable", rules=[2, 4], seed=3)
    assert not report.failed, report.summary()
    assert report.status(2, "durable") == "PASS" and report.status(4, "core") == "PASS"
