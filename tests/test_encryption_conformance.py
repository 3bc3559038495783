"""The conformance suite through the ``"encrypt"`` option (docs/security.md): fs at all four
levels, the memory tier, the third-party example tier (examples/kvtiers-sqlite) and the obj
tier on a real SeaweedFS server, each at the levels it claims. The tiers are unchanged: the
core seals and opens around them."""

from __future__ import annotations

import os

import pytest
from kvtiers_conformance import DEFAULT_LIMITS, TierTests
from s3_fixture import options_for

pytest_plugins = ["s3_fixture"]


def _encrypt(tmp_path) -> dict:
    key = tmp_path / "kvtiers.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    return {"key_file": str(key), "key_id": "conformance"}


class TestEncryptedFs(TierTests):
    levels = frozenset({"core", "durable", "shared", "bounded"})

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv"), "encrypt": _encrypt(tmp_path)}


class TestEncryptedMemory(TierTests):
    @pytest.fixture
    def tier_config(self, tmp_path):
        return "memory", {"encrypt": _encrypt(tmp_path)}


class TestEncryptedSqliteExample(TierTests):
    """A third-party tier found by entry point, at its claimed levels (core, durable, shared)."""

    @pytest.fixture
    def tier_config(self, tmp_path):
        pytest.importorskip("kvtiers_sqlite")
        return "sqlite", {"path": str(tmp_path / "kv.sqlite3"), "encrypt": _encrypt(tmp_path)}


@pytest.mark.slow
class TestEncryptedObj(TierTests):
    """The obj tier on SeaweedFS (every step is real S3 traffic: about 8 minutes with 30
    stateful examples on a busy 2-core machine, so 10 here; the plain obj run has 30)."""

    limits = DEFAULT_LIMITS.replace(examples=10)

    @pytest.fixture
    def tier_config(self, tmp_path, s3_server):
        return "obj", {**options_for(s3_server), "encrypt": _encrypt(tmp_path)}
