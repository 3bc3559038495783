"""The p2p tier through the conformance suite: core, shared (two clients on one server) and
bounded (the namespace cap a client asks its peers for), against one peer server in a child
process (keys are salted per check); one more test runs checks through conformance_config,
which starts a server per check as ``kvtiers conformance p2p`` does."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

import tier_helpers  # noqa: E402
from kvtiers_conformance import DEFAULT_LIMITS, TierTests, run_conformance  # noqa: E402
from kvtiers_p2p import spawn  # noqa: E402
from tier_helpers import p2p_entry  # noqa: E402

server = tier_helpers.p2p_server  # one peer server for the module


class TestP2PConformance(TierTests):
    """Every check at the levels the p2p tier claims; the stateful check draws 20 examples."""

    limits = DEFAULT_LIMITS.replace(examples=20)

    @pytest.fixture
    def tier_config(self, server):
        return p2p_entry(server)


def test_conformance_config_starts_a_server_per_check():
    """``kvtiers conformance p2p`` needs no config: conformance_config starts a server for
    each check, and each server exits when its check's scratch directory is removed."""
    before = set(spawn._children)
    report = run_conformance("p2p", levels="core,shared,bounded", rules=[2, 7, 11], seed=1)
    assert not report.failed, report.summary()
    assert report.status(2, "shared") == "PASS" and report.status(11, "bounded") == "PASS"
    started = [p for p in spawn._children if p not in before]
    assert started, "no server process was started"
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.poll() is not None for p in started), "a conformance server outlived its check"
