"""A p2p tier on the NIXL path costs no CPU while idle: NIXL's progress thread spins a whole
core (3.0 s of CPU in 3 s, measured), so the agents run without it and are progressed by the
threads that wait for transfers."""

from __future__ import annotations

import resource
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("nixl_cu12")

from kvtiers_p2p.spawn import start_server  # noqa: E402

from kvtiers import Arena, Namespace, TierContext, open_tier  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def test_an_idle_nixl_client_and_server_burn_no_core():
    server = start_server(capacity=16 << 20, extra=["--nixl"])
    h = open_tier("p2p", {"host": "127.0.0.1", "port": server.port, "backend": "nixl"},
                  TierContext(Arena.allocate(4, 1 << 20), Namespace({"test": "p2p-idle"})))
    try:
        deadline = time.monotonic() + 15
        while not getattr(h.tier._client.peers.get(f"tcp://127.0.0.1:{server.port}"), "ready", False):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with open(f"/proc/{server.pid}/stat") as f:
            before = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        c0, t0 = _cpu(), time.monotonic()
        time.sleep(2.0)
        used, wall = _cpu() - c0, time.monotonic() - t0
        with open(f"/proc/{server.pid}/stat") as f:
            after = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
        server_cpu = (after - before) / 100  # clock ticks (USER_HZ 100 on Linux)
        # a spinning progress thread would use about `wall` seconds in each process
        assert used < 0.5 * wall, f"the idle client used {used:.2f} s of CPU in {wall:.2f} s"
        assert server_cpu < 0.5 * wall, f"the idle server used {server_cpu:.2f} s of CPU in {wall:.2f} s"
    finally:
        h.close()
        server.stop()
