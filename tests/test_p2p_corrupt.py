"""The p2p tier's ``conformance_corrupt``: rule 4's corruption check runs on p2p (not
skipped), a server started with ``--test-faults`` damages a stored chunk so its load fails
while intact keys load exact bytes, and a server without the flag refuses and keeps serving."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")

from kvtiers_conformance import run_conformance  # noqa: E402
from kvtiers_p2p import protocol as P  # noqa: E402
from kvtiers_p2p.faults import FaultRefused, corrupt_on_peer  # noqa: E402
from kvtiers_p2p.spawn import start_server  # noqa: E402
from kvtiers_p2p.tier import P2PTier  # noqa: E402
from tier_helpers import wait_job  # noqa: E402

from kvtiers import Arena, Job, Namespace, TierContext, open_tier  # noqa: E402

NS = Namespace({"test": "p2p-corrupt"})
CHUNK = 4096


def _stats(stderr_path) -> str:
    return next((ln for ln in stderr_path.read_text().splitlines() if "stats" in ln), "")


def _store_two(config: dict):
    """A tier on ``config`` that stored two keys; returns (tier, arena, keys, payloads)."""
    arena = Arena.allocate(8, CHUNK)
    payloads = [bytes([7 + i]) * (CHUNK // 2) + bytes(range(256)) * (CHUNK // 512) for i in range(2)]
    for i, data in enumerate(payloads):
        arena[i][:] = data
    keys = [b"corrupt-me", b"leave-me"]
    t = open_tier("p2p", config, TierContext(arena, NS))
    t.submit_store(Job(1, tuple(keys), (0, 1)))
    assert wait_job(t, 1).ok
    return t, arena, keys, payloads


def test_rule4_corruption_check_runs_and_passes_on_p2p():
    """Through conformance_config, as ``kvtiers conformance p2p`` runs it: the check uses the
    tier's hook (a hook doing nothing makes it FAIL: the corrupted key would load)."""
    assert getattr(P2PTier, "conformance_corrupt", None) is not None
    report = run_conformance("p2p", levels="core", rules=[4], seed=4)
    by_name = {r.check.test_name: r for r in report.results}
    r = by_name["test_rule04_corrupt_chunks_fail"]
    assert r.status == "PASS", (r.status, r.why)
    assert "conformance_corrupt" not in report.rule_result(4, "core").why
    assert not report.failed, report.summary()


def test_corrupted_key_fails_intact_key_loads_exact_bytes(tmp_path):
    err = tmp_path / "server.err"
    with open(err, "w") as f:
        srv = start_server(capacity=16 << 20, extra=["--test-faults"], stderr=f)
    config = {"host": "127.0.0.1", "port": srv.port, "timeout": 5.0}
    t, arena, keys, payloads = _store_two(config)
    try:
        P2PTier.conformance_corrupt(config, NS, keys[0])
        for s in (2, 3):
            arena[s][:] = b"\0" * CHUNK
        t.submit_load(Job(2, tuple(keys), (2, 3)))
        r = wait_job(t, 2)
        assert r.failed_keys == (keys[0],), r
        assert "xxh3" in (r.error or ""), r.error
        assert bytes(arena[3]) == payloads[1]
        # the damage stays: another load of it fails too, the intact key still loads
        t.submit_load(Job(3, (keys[0],), (4,)))
        assert wait_job(t, 3).failed_keys == (keys[0],)
        # a key no peer holds is an error of the hook, not a silent no-op (the server answers no offsets)
        assert corrupt_on_peer(f"tcp://127.0.0.1:{srv.port}", NS.digest, b"never-stored") == []
        with pytest.raises(FaultRefused, match="no peer"):
            P2PTier.conformance_corrupt(config, NS, b"never-stored")
    finally:
        t.close()
        srv.stop()
    assert '"corrupted": 1' in _stats(err), _stats(err)


def test_server_without_flag_refuses_corrupt_and_keeps_serving(tmp_path):
    err = tmp_path / "server.err"
    with open(err, "w") as f:
        srv = start_server(capacity=16 << 20, stderr=f)
    config = {"host": "127.0.0.1", "port": srv.port, "timeout": 5.0}
    t, arena, keys, payloads = _store_two(config)
    try:
        with pytest.raises(FaultRefused, match="--test-faults") as e:
            P2PTier.conformance_corrupt(config, NS, keys[0])
        assert "no-test-faults" in str(e.value)
        # a malformed CORRUPT (a namespace that is no string) drops only that connection
        with zmq.Context.instance().socket(zmq.DEALER) as raw:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(f"tcp://127.0.0.1:{srv.port}")
            raw.send(P.pack(P.CORRUPT, 1, 123, keys[0]))
            assert not raw.poll(300), "a malformed CORRUPT got an answer"
        assert srv.proc.poll() is None, "the server died"
        t.submit_load(Job(2, tuple(keys), (2, 3)))
        r = wait_job(t, 2)
        assert r.ok, r
        assert [bytes(arena[2]), bytes(arena[3])] == payloads
    finally:
        t.close()
        srv.stop()
    stats = _stats(err)
    assert '"refused": 1' in stats and '"malformed": 1' in stats and "corrupted" not in stats, stats
