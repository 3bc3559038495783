"""``TierTests``: the pytest base class a tier's own test suite subclasses.

::

    from kvtiers_conformance import TierTests

    class TestMyTier(TierTests):
        @pytest.fixture
        def tier_config(self, tmp_path):
            return "mytier", {"root_dir": str(tmp_path / "kv")}

Every check of the suite becomes a test method named for its rule
(``test_rule02_read_your_writes``, ``test_rule10_crash_safety``...). Checks of levels the
tier does not claim are skipped with a reason; set ``levels`` on the subclass (or override
the ``conformance_levels`` fixture) to force levels. ``limits`` and ``seed`` tune the run;
``strict = True`` fails a check that could not run for want of something the tier could
provide (as ``kvtiers conformance --strict``), instead of skipping it as ``NOT CERTIFIED``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvtiers.registry import tier_levels

from .catalog import Check, all_checks
from .cleanup import Cleanup
from .harness import CheckSkipped, Harness, NotCertified, resolve_tier
from .limits import DEFAULT_LIMITS, Limits
from .runner import parse_levels, run_closing


class TierTests:
    """Base class of a tier's conformance tests; see the module docstring."""

    #: levels to check, claimed or not; ``None``: the levels the tier class claims
    levels: ClassVar[frozenset[str] | set[str] | None] = None
    #: the bounds and arena shape of the suite
    limits: ClassVar[Limits] = DEFAULT_LIMITS
    #: seed of the random choices (and the stateful test); ``None``: random per run
    seed: ClassVar[int | None] = None
    #: fail (not skip) a check that could not run for want of something the tier could
    #: provide, e.g. ``conformance_corrupt`` (``kvtiers conformance --strict``)
    strict: ClassVar[bool] = False

    @pytest.fixture
    def tier_config(self, tmp_path: Any) -> tuple[str | type, dict[str, Any]]:
        """Return ``(type, config)``: a registered name, ``pkg.mod:Class`` or a class,
        and the tier's options. Subclasses must override this fixture."""
        raise NotImplementedError("override the tier_config fixture: return (type, config)")

    @pytest.fixture
    def conformance_levels(self, tier_config: tuple[Any, dict]) -> frozenset[str]:
        """The levels checked: ``levels`` if set, else what the tier class claims."""
        if self.levels is not None:
            return parse_levels(self.levels) or frozenset()
        return tier_levels(resolve_tier(tier_config[0]).cls)

    @pytest.fixture
    def conformance_harness(self, tier_config: tuple[Any, dict], conformance_levels: frozenset[str],
                            request: pytest.FixtureRequest) -> Iterator[Harness]:
        """The harness a check drives the tier with; afterwards the tier class's
        ``conformance_cleanup(config)``, if it has one, removes what the check stored (what
        it says may remain is a warning)."""
        tier_type, config = tier_config
        seed = self.seed if self.seed is not None else random.randrange(2**32)
        h = Harness(tier_type, config, levels=conformance_levels, limits=self.limits, seed=seed)
        request.node.user_properties.append(("conformance_seed", seed))
        yield h
        if getattr(h.info.cls, "conformance_cleanup", None) is not None and h.instances:
            cleanup = Cleanup(None, h.info.cls)
            cleanup.run_hook(h.config)
            if cleanup.note():
                warnings.warn(cleanup.note(), stacklevel=1)


def _make_test(c: Check):
    def test(self: TierTests, conformance_harness: Harness) -> None:
        h = conformance_harness
        if c.level not in h.levels:
            pytest.skip(f"level {c.level} not claimed by the tier (set levels on the test class to force it)")
        wanting = None
        try:
            run_closing(c, h)
        except NotCertified as e:
            wanting = str(e)
        except CheckSkipped as e:
            pytest.skip(str(e))
        if wanting is not None:
            if self.strict:
                pytest.fail(f"not certified (strict): {wanting}", pytrace=False)
            pytest.skip(f"NOT CERTIFIED: {wanting}")

    test.__name__ = c.test_name
    test.__qualname__ = f"TierTests.{c.test_name}"
    test.__doc__ = f"Rule {c.rule} [{c.level}]: {c.doc}"
    return test


for _check in all_checks():
    setattr(TierTests, _check.test_name, _make_test(_check))
del _check
