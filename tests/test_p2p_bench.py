"""``kvtiers bench p2p`` and ``kvtiers bench tier p2p``: the p2p tier on the one tier-bench
harness, against its raw baseline (plain ZMQ DEALER/ROUTER to a raw peer in another process
on loopback; raw NIXL UCX writes for NIXL loads). Real processes and sockets throughout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

pytest.importorskip("zmq")

from kvtiers_p2p.spawn import start_server  # noqa: E402
from kvtiers_p2p.tier import P2PTier  # noqa: E402

from kvtiers import Arena, Namespace, TierContext, open_tier  # noqa: E402
from kvtiers.commands.cli import main  # noqa: E402
from kvtiers.ioloop import get_loop  # noqa: E402


def _children(what: str) -> list[int]:
    """This process's children whose command line names ``what``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and what.encode() in cmd:
            out.append(int(pid))
    return out


def _gone(what: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _children(what):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _check_rows(rows: list[dict], expect: set[tuple]) -> None:
    assert {(r["op"], r["backend"], r["chunk_bytes"]) for r in rows} == expect
    for r in rows:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"], rel=0.01)


def test_bench_p2p_json(capsys):
    """The old command line still works (--total), against raw ZMQ, and leaves no process behind."""
    assert main(["bench", "p2p", "--chunk-bytes", "1MiB", "--total", "8MiB", "--rounds", "1", "--no-concurrency",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tier"] == "p2p" and "raw ZMQ DEALER/ROUTER" in report["baseline"]
    _check_rows(report["results"], {("store", "zmq", 1 << 20), ("load", "zmq", 1 << 20)})
    assert all(r["baseline_kind"] == "raw zmq" and r["chunks"] == 8 for r in report["results"])
    assert report["lookup"][0]["hits"] == report["lookup"][0]["batch"]
    assert _gone("kvtiers_p2p.rawpeer") and _gone("kvtiers_p2p")


def test_bench_tier_p2p_starts_its_server_and_compares_with_raw_zmq(capsys):
    """The harness form: no --config, so conformance_config starts the server; the
    concurrency sweep has its baseline too."""
    assert main(["bench", "tier", "p2p", "--chunk-bytes", "256K", "--chunks", "8", "--rounds", "1",
                 "--concurrency", "2x2", "--lookup-batch", "100"]) == 0
    out = capsys.readouterr().out
    assert "baseline: raw ZMQ DEALER/ROUTER" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("store", "load"))]
    assert len(rows) == 4 and all(r[-1].endswith("x") and float(r[-1][:-1]) > 0 for r in rows), out
    assert _gone("kvtiers_p2p.rawpeer")


def test_raw_baseline_moves_the_same_bytes_and_cleans_up():
    """The baseline is honest: what it puts to the raw peer comes back byte for byte into
    the slots; a missing key fails, and so does a call to a raw peer that died; close ends
    the raw peer. Peers off loopback get none."""
    srv = start_server(capacity=16 << 20)
    arena = Arena.allocate(4, 64 << 10)
    data = [os.urandom(64 << 10) for _ in range(4)]
    for i, d in enumerate(data):
        arena[i][:] = d
    h = open_tier("p2p", {"host": "127.0.0.1", "port": srv.port}, TierContext(arena, Namespace({"t": "raw"})))
    try:
        base = P2PTier.bench_baseline(h.tier, 64 << 10)
        assert base is not None and len(_children("kvtiers_p2p.rawpeer")) == 1

        def run(coro):
            return asyncio.run_coroutine_threadsafe(coro, get_loop()).result(30)

        for i in range(4):
            run(base.put(b"k%d" % i, arena[i]))
        for i in range(4):
            arena[i][:] = b"\0" * (64 << 10)
        for i in (3, 2, 1, 0):
            run(base.get(b"k%d" % i, arena[i]))
        assert [bytes(arena[i]) for i in range(4)] == data
        with pytest.raises(RuntimeError, match="sent 0 bytes"):
            run(base.get(b"never-put", arena[0]))
        base.close([])
        assert _gone("kvtiers_p2p.rawpeer")
        base = P2PTier.bench_baseline(h.tier, 64 << 10)  # a raw peer that dies fails the call, never hangs
        (pid,) = _children("kvtiers_p2p.rawpeer")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="raw peer exited"):
            run(base.get(b"k0", arena[0]))
        base.close([])
    finally:
        h.close()
        srv.stop()
    far = open_tier("p2p", {"host": "10.255.255.1", "port": 5710}, TierContext(arena, Namespace({"t": "far"})))
    try:
        assert P2PTier.bench_baseline(far.tier, 64 << 10) is None
    finally:
        far.close()


def test_bench_p2p_both_backends_against_their_own_baselines(capsys):
    """--backend both: one harness run per data path; NIXL loads against raw NIXL UCX writes."""
    pytest.importorskip("nixl_cu12")
    assert main(["bench", "p2p", "--backend", "both", "--chunk-bytes", "1MiB", "--total-bytes", "4MiB",
                 "--rounds", "1", "--no-concurrency", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    _check_rows(report["results"], {(op, b, 1 << 20) for op in ("store", "load") for b in ("zmq", "nixl")})
    kinds = {(r["op"], r["backend"]): r["baseline_kind"] for r in report["results"]}
    assert kinds == {("store", "zmq"): "raw zmq", ("load", "zmq"): "raw zmq", ("store", "nixl"): "raw zmq",
                     ("load", "nixl"): "raw nixl ucx write"}
    assert "nixl: raw ZMQ DEALER/ROUTER stores, raw NIXL UCX WRITEs" in report["baseline"]
    assert _gone("kvtiers_p2p.rawpeer") and _gone("kvtiers_p2p")
