"""The fs tier through the conformance suite, at all four levels it claims."""

from __future__ import annotations

import pytest
from kvtiers_conformance import TierTests


class TestFsConformance(TierTests):
    levels = frozenset({"core", "durable", "shared", "bounded"})

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "fs", {"root_dir": str(tmp_path / "kv")}
