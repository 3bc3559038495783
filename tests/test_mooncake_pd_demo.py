"""``kvtiers demo --scenario pd --tier mooncake``: a prefill and a decode process sharing one
real Mooncake Store pool (a master and a serve process the demo starts and kills); every byte
decode loads is checked against what prefill computed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mooncake")
pytest.importorskip("torch")

from kvtiers_mooncake.client import missing  # noqa: E402

if missing():
    pytest.skip(missing(), allow_module_level=True)


def test_pd_over_one_mooncake_pool_verifies_every_byte():
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--scenario", "pd", "--tier", "mooncake",
                        "--conversations", "3", "--json"], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    pre, dec = report["prefill"], report["decode"]
    assert report["tier"] == "mooncake" and pre["chunks"] > 0
    assert dec["mismatches"] == 0 and dec["failed"] == 0
    assert dec["sources"].get("mooncake", 0) == pre["chunks"]  # every chunk prefill made came from the pool
    assert dec["sources"].get("host", 0) > 0  # the shared system prompt, from decode's own host cache
    assert dec["chunks"] == dec["sources"]["mooncake"] + dec["sources"]["host"]


def test_pd_demo_help_names_the_tier_option():
    r = subprocess.run([sys.executable, "-m", "kvtiers.commands", "demo", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--tier [p2p|mooncake]" in r.stdout
