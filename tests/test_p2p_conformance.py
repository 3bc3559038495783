"""The p2p tier through the conformance suite: core, shared (two clients on one server) and
bounded (the namespace cap a client asks its peers for), against one peer server in a child
process (keys are salted per check); one more test runs checks through conformance_config,
which starts a server per check as ``kvtiers conformance p2p`` does."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")

from kvtiers_conformance import DEFAULT_LIMITS, TierTests, run_conformance  # noqa: E402
from kvtiers_p2p import spawn  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    srv = start_server(capacity=256 << 20, extra=["--test-faults"])  # rule 4's conformance_corrupt
    yield srv
    srv.stop()  # by its own PID


class TestP2PConformance(TierTests):
    """Every check at the levels the p2p tier claims; the stateful check draws 20 examples."""

    limits = DEFAULT_LIMITS.replace(examples=20)

    @pytest.fixture
    def tier_config(self, server):
        assert server.proc.poll() is None, "the peer server died during an earlier check"
        return "p2p", {"host": "127.0.0.1", "port": server.port}


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
