"""``kvtiers mooncake master`` and ``kvtiers mooncake serve`` as real processes: the master on
loopback stopped by its own PID, a serve process holding the memory engine clients with
``global_segment_size: 0`` store into, unmounting on SIGTERM; and what ``kvtiers tiers`` says
when Mooncake's system library is missing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mooncake")

from kvtiers_mooncake import client as mc  # noqa: E402
from kvtiers_mooncake.master import start_master  # noqa: E402
from tier_helpers import resolve_lookup, wait_job  # noqa: E402

from kvtiers import Arena, Job, Lookup, Namespace, TierContext, open_tier  # noqa: E402

if mc.missing():
    pytest.skip(mc.missing(), allow_module_level=True)

KVTIERS = [sys.executable, "-m", "kvtiers.commands"]


def first_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_master_command_prints_its_address_and_stops_by_pid():
    proc = subprocess.Popen([*KVTIERS, "mooncake", "master"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = first_line(proc)
        m = re.match(r"mooncake_master pid (\d+) at 127\.0\.0\.1:(\d+) \(metrics 127\.0\.0\.1:(\d+)\)", line)
        assert m, line
        pid, port = int(m.group(1)), int(m.group(2))
        assert pid_alive(pid)
        c = mc.acquire(mc.Setup(f"127.0.0.1:{port}"))  # a real client reaches it
        assert c.store.health_check() == 0
        mc.release(c)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(pid), "the master outlived its command"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_holds_the_memory_for_clients_without_a_segment():
    master = start_master(client_ttl=2, default_kv_lease_ttl=1000)
    proc = subprocess.Popen([*KVTIERS, "mooncake", "serve", "--master", master.address, "--segment", "64MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first_line(proc).startswith("ready 127.0.0.1 segment=67108864")
        arena = Arena.allocate(4, 1 << 20)
        arena[0][:] = os.urandom(1 << 20)
        h = open_tier("mooncake", {"master_server_address": master.address, "global_segment_size": 0},
                      TierContext(arena, Namespace({"cli": os.urandom(3).hex()})))
        h.submit_store(Job(1, (b"served",), (0,)))
        assert wait_job(h, 1).ok
        h.submit_load(Job(2, (b"served",), (1,)))
        assert wait_job(h, 2).ok and bytes(arena[1]) == bytes(arena[0])
        proc.send_signal(signal.SIGTERM)  # unmounts: its objects leave the pool
        assert proc.wait(30) == 0
        h.tier.forget([b"served"])
        deadline = time.monotonic() + 15
        while resolve_lookup(h, [b"served"]) != [Lookup.MISS] and time.monotonic() < deadline:
            h.tier.forget([b"served"])
            time.sleep(0.1)
        assert resolve_lookup(h, [b"served"]) == [Lookup.MISS]
        h.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        master.kill()


def test_serve_rejects_a_segment_of_nothing():
    r = subprocess.run([*KVTIERS, "mooncake", "serve", "--master", "127.0.0.1:1", "--segment", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--segment" in r.stderr and "must be > 0" in r.stderr
    r = subprocess.run([*KVTIERS, "mooncake", "serve", "--master", "127.0.0.1:1", "--segment", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'lots' is not a size" in r.stderr


def test_missing_names_the_system_library(monkeypatch, capsys):
    """Fault injection: a machine without libibverbs.so.1 (Debian's libibverbs1): the tier
    says so, and `kvtiers tiers` still lists it and names what is missing."""
    import ctypes
    import ctypes.util

    def no_lib(*a, **k):
        raise OSError("libibverbs.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    why = mc.missing()
    assert why and "libibverbs.so.1" in why and "apt-get install --no-install-recommends libibverbs1" in why
    from kvtiers.commands.cli import main

    assert main(["tiers"]) == 0
    out = capsys.readouterr()
    assert "mooncake\t" in out.out  # still listed
    assert "# tier mooncake cannot open here: the system library libibverbs.so.1" in out.err
