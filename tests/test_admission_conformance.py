"""The conformance suite through the ``"admit"`` option (docs/admission.md): fs at all four
levels (also sealed), the third-party example tier (examples/kvtiers-sqlite) and the p2p tier
against a real ``kvtiers p2p serve``, each at the levels it claims (the obj tier on SeaweedFS
admitted: with the other wrappers, in tests/test_encryption_conformance.py).

Admission lives in the manager's cascade: it decides which chunks are submitted to a tier at
all, and the tier answers for exactly those. So the suite, which submits directly, is the
tier's contract with the threshold met: the option is accepted and checked at open, and the
tier behind it keeps every rule. What admission itself promises (a declined chunk is never
submitted, so never a HIT; an admitted one loads exactly; write-back copies before the slot
is reused) is checked through the manager in tests/test_admission.py."""

from __future__ import annotations

import json

import pytest
import tier_helpers
from kvtiers_conformance import TierTests
from tier_helpers import WRAPPER_LIMITS, key_file, p2p_entry

p2p_server = tier_helpers.p2p_server  # one peer server for the module

ADMIT = {"min_offers": 2}


class TestAdmittedFs(TierTests):
    levels = frozenset({"core", "durable", "shared", "bounded"})
    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv"), "admit": ADMIT}


class TestAdmittedSealedFs(TierTests):
    """Write-back admission in front of sealing (DESIGN.md's order: admission, compression, sealing, the tier)."""

    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv"), "admit": {"when": "evicted"},
                      "encrypt": {"key_file": str(key_file(tmp_path)), "key_id": "conformance"}}


class TestAdmittedSqliteExample(TierTests):
    """A third-party tier found by entry point, at its claimed levels (core, durable, shared, bounded)."""

    limits = WRAPPER_LIMITS

    @pytest.fixture
    def tier_config(self, tmp_path):
        pytest.importorskip("kvtiers_sqlite")
        return "sqlite", {"path": str(tmp_path / "kv.sqlite3"), "admit": ADMIT}


class TestAdmittedP2P(TierTests):
    limits = WRAPPER_LIMITS.replace(examples=10)

    @pytest.fixture
    def tier_config(self, p2p_server):
        return p2p_entry(p2p_server, admit=ADMIT)


def test_conformance_cli_takes_admit_in_config(tmp_path):
    """``kvtiers conformance fs --config`` with ``"admit"``, in a real child process: the core
    rules pass; a bad ``"admit"`` (min_offers 0) is a one-line error, exit 2."""
    from test_conformance_cli import LOADED_LIMITS, run

    config = {"root_dir": str(tmp_path / "kv"), "admit": ADMIT}
    p = run("fs", "--config", json.dumps(config), "--level", "core", "--examples", "5", "--seed", "3", *LOADED_LIMITS)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("summary: PASSED: 10 passed, 0 failed")
    bad = {"root_dir": str(tmp_path / "kv"), "admit": {"min_offers": 0}}
    p = run("fs", "--config", json.dumps(bad), "--level", "core", "--examples", "5")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "'min_offers' expects an integer 1-65535, got 0" in p.stderr
    assert len([line for line in p.stderr.strip().splitlines() if line]) == 1, p.stderr
