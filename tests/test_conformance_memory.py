"""The reference tiers pass the whole suite, run the way third parties run it: by
subclassing TierTests. Also forcing a level the tier does not claim."""

from __future__ import annotations

import pytest
from kvtiers_conformance import TierTests

from kvtiers.memory import MemoryTier


class TestMemoryTier(TierTests):
    """The memory tier by its registered name: core and bounded."""

    @pytest.fixture
    def tier_config(self, tmp_path):
        return "memory", {}


class TestMemoryTierByClass(TierTests):
    """The same tier passed as a class; only core is checked (``levels`` forces it)."""

    levels = {"core"}

    @pytest.fixture
    def tier_config(self, tmp_path):
        return MemoryTier, {}
