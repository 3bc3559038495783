"""The conformance suite against the obj tier on a real SeaweedFS server: core, durable,
shared (two instances on one bucket) and bounded (max_bytes), each test in a fresh prefix."""

from __future__ import annotations

import pytest
from kvtiers_conformance import TierTests
from s3_fixture import options_for, s3_limits

pytest_plugins = ["s3_fixture"]


class TestObjConformance(TierTests):
    """Every check of the suite at the levels the obj tier claims.

    The stateful check draws 30 examples here instead of 100, to keep CI short: every step
    is real S3 traffic. ``kvtiers conformance obj --config ...`` runs the full default.
    """

    limits = s3_limits(30)

    @pytest.fixture
    def tier_config(self, tmp_path, s3_server):
        return "obj", options_for(s3_server)
