"""kvtiers_nixl's canary: NIXL's native calls tried in a child process, a crash, hang or error
there turned into a verdict naming the cause and the stage, cached per process and per
boot, and :func:`kvtiers_nixl.use_nixl` falling back with one warning, or raising if strict.
Faults are injected into the child only (``KVTIERS_NIXL_CANARY_FAULT``); the checks whose
fault strikes before ``import nixl_cu12`` run without NIXL installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import kvtiers_nixl
import pytest
from kvtiers_nixl import canary

from kvtiers import TierError

needs_nixl = pytest.mark.skipif(kvtiers_nixl.installed() is not None, reason="nixl-cu12 is not installed")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Each test: its own per-boot cache directory, no verdicts of earlier tests."""
    monkeypatch.setenv(canary.CACHE_ENV, str(tmp_path / "canary"))
    monkeypatch.delenv(canary.FAULT_ENV, raising=False)
    monkeypatch.delenv(canary.TIMEOUT_ENV, raising=False)
    canary.forget()
    yield
    canary.forget()


@needs_nixl
@pytest.mark.parametrize("backend", ["UCX", "OBJ"])
def test_canary_passes_on_this_machine(backend):
    v = canary.run(backend)
    assert v.ok and v.cause is None and v.stage == "exit", v


@needs_nixl
@pytest.mark.parametrize("fault, stage", [("segv", "exit"), ("segv@transfer", "transfer"),
                                          ("abort@register", "register")])
def test_a_crash_in_the_child_is_a_verdict_naming_signal_and_stage(monkeypatch, fault, stage):
    monkeypatch.setenv(canary.FAULT_ENV, fault)
    v = canary.run("UCX")
    signame = "SIGABRT" if fault.startswith("abort") else "SIGSEGV"
    assert not v.ok and v.stage == stage
    assert v.cause == f"NIXL's UCX canary process was killed by {signame} at '{stage}'"


def test_a_crash_before_nixl_loads_is_caught_too(monkeypatch):
    monkeypatch.setenv(canary.FAULT_ENV, "segv@import")
    v = canary.run("OBJ")
    assert not v.ok and "SIGSEGV at 'import'" in v.cause


def _canary_children() -> list[int]:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:  # a zombie (another test's child not reaped yet, e.g. the engine phase's) runs nothing
            if "kvtiers_nixl.canary" in " ".join(p.cmdline()):
                out.append(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return out


def test_a_hung_child_is_killed_after_the_timeout(monkeypatch):
    monkeypatch.setenv(canary.FAULT_ENV, "hang@import")
    monkeypatch.setenv(canary.TIMEOUT_ENV, "2")
    t0 = time.monotonic()
    v = canary.run("UCX")
    assert not v.ok and v.cause == "NIXL's UCX canary hung for more than 2 s at 'import'"
    assert time.monotonic() - t0 < 60  # generous: it returns, it does not wait for the hang
    assert _canary_children() == []


def test_an_error_in_the_child_names_it(monkeypatch):
    monkeypatch.setenv(canary.FAULT_ENV, "error@import")
    v = canary.run("UCX")
    assert not v.ok and v.cause.startswith("NIXL's UCX canary failed at 'import': ")
    assert "injected canary fault" in v.cause


def test_bad_settings_are_one_line_errors(monkeypatch):
    monkeypatch.setenv(canary.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="KVTIERS_NIXL_CANARY_TIMEOUT must be a number of seconds, got 'soon'"):
        canary.run("UCX")
    monkeypatch.delenv(canary.TIMEOUT_ENV)
    with pytest.raises(ValueError, match="canary backend must be one of UCX, OBJ, got 'GDS'"):
        canary.probe("GDS")
    monkeypatch.setenv(canary.FAULT_ENV, "melt@import")
    v = canary.run("UCX")
    assert not v.ok and "unknown fault 'melt'" in v.cause


def test_verdicts_are_cached_per_process_and_per_boot(monkeypatch, tmp_path):
    monkeypatch.setenv(canary.FAULT_ENV, "segv@import")
    first = canary.probe("UCX")
    assert not first.ok and not first.cached
    assert canary.probe("UCX") is first  # per process
    files = [p for p in (tmp_path / "canary").iterdir() if p.suffix == ".json"]
    assert len(files) == 1 and json.loads(files[0].read_text())["cause"] == first.cause
    canary.forget()
    again = canary.probe("UCX")  # a new process would read the per-boot file
    assert again.cached and again.cause == first.cause
    monkeypatch.setenv(canary.FAULT_ENV, "error@import")  # what the outcome depends on changed: a fresh run
    other = canary.probe("UCX")
    assert not other.cached and "injected canary fault" in other.cause


def test_concurrent_processes_share_one_canary_run(monkeypatch, tmp_path):
    monkeypatch.setenv(canary.FAULT_ENV, "segv@import")
    code = "from kvtiers_nixl import canary; v = canary.probe('UCX'); print(int(v.cached), v.cause)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].split(" ", 1) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(int(cached) for cached, _ in outs) == [0, 1, 1, 1]  # one ran it, three read its verdict
    assert len({cause for _, cause in outs}) == 1


def test_cache_off_runs_every_process(monkeypatch, tmp_path):
    monkeypatch.setenv(canary.CACHE_ENV, "off")
    monkeypatch.setenv(canary.FAULT_ENV, "segv@import")
    assert not canary.probe("UCX").cached
    canary.forget()
    assert not canary.probe("UCX").cached
    assert not (tmp_path / "canary").exists()


@needs_nixl
def test_use_nixl_falls_back_with_one_warning_or_raises_if_strict(monkeypatch, caplog):
    monkeypatch.setenv(canary.FAULT_ENV, "segv")
    user = f"tier 'test-{os.getpid()}'"
    with caplog.at_level("WARNING", logger="kvtiers.nixl"):
        assert kvtiers_nixl.use_nixl(user, fallback="ZMQ") is False
        assert kvtiers_nixl.use_nixl(user, fallback="ZMQ") is False
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvtiers.nixl"]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{user}: NIXL is off in this process: NIXL's UCX canary process was killed by "
                                  "SIGSEGV at 'exit'; using ZMQ instead")
    assert kvtiers_nixl.data_paths()[user] == "zmq"
    with pytest.raises(TierError, match=r"NIXL is unsafe in this process \(.*SIGSEGV.*\); nixl_strict is set"):
        kvtiers_nixl.use_nixl(user, fallback="ZMQ", strict=True)
    monkeypatch.delenv(canary.FAULT_ENV)
    assert kvtiers_nixl.use_nixl(user, fallback="ZMQ", strict=True) is True
    assert kvtiers_nixl.data_paths()[user] == "nixl"


@needs_nixl
def test_agents_are_torn_down_in_the_process_that_made_them():
    code = r"""
import numpy as np, kvtiers_nixl as k
a = k.make_agent("t", "UCX")
buf = np.zeros(1 << 16, dtype=np.uint8)
reg = a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM", ["UCX"])
b = k.make_agent("t2", "UCX")  # left for the exit hook
assert k.live_agents() == 2
k.teardown(a, regs=[(reg, ["UCX"])])
assert k.live_agents() == 1 and a.agent is None
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
