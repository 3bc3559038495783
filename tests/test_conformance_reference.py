"""Reference tiers of the suite's own tests pass every level they claim, through TierTests:
a checksummed AsyncTier over a dict (core; also exercises the fault injection and the
corruption hook) and a
checksummed file-per-chunk tier (core, durable, shared; the crash test in a subprocess)."""

from __future__ import annotations

import pytest
from broken_tiers import DictAsyncTier, DirTier
from kvtiers_conformance import Limits, TierTests

QUICK = Limits(examples=20)


class TestDictAsyncTier(TierTests):
    limits = QUICK

    @pytest.fixture
    def tier_config(self, tmp_path):
        return DictAsyncTier, {"bucket": str(tmp_path)}


class TestDirTier(TierTests):
    limits = QUICK

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "broken_tiers:DirTier", {"root_dir": str(tmp_path / "kv")}


def test_dir_tier_is_claimed_durable_and_shared() -> None:
    assert DirTier.levels == {"core", "durable", "shared"}
