"""``kvtiers demo --scenario pd``: a prefill process and a decode process on loopback; the
decode process pulls the prefixes over p2p and checks every byte."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("zmq")
pytest.importorskip("torch")


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_pd_demo_two_processes_every_byte_verified(backend):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--scenario", "pd", "--conversations", "2",
                        "--p2p-backend", backend, "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    pre, dec = report["prefill"], report["decode"]
    assert report["backend"] == backend == pre["data_path"] == dec["data_path"]  # NIXL's canary passes here
    per_prompt = (256 + 768) // 64
    assert pre["chunks"] == per_prompt + 768 // 64  # the shared system prompt is stored once
    assert dec["mismatches"] == 0 and dec["failed"] == 0 and dec["chunks"] == 2 * per_prompt
    assert dec["sources"]["p2p"] == pre["chunks"] == pre["served"]  # every stored chunk crossed over p2p once
    assert dec["sources"]["host"] == 256 // 64  # the second prompt's system chunks: decode's own arena
