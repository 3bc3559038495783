"""The kvtiers conformance suite: prove a tier keeps the contract (DESIGN.md's twelve rules).

Two ways in: subclass :class:`TierTests` in a tier's own pytest suite, or run
``kvtiers conformance TYPE`` (see :mod:`kvtiers_conformance.cli`). Both run the same checks,
listed in :data:`kvtiers_conformance.catalog.CHECKS`; :func:`run_conformance` is the
programmatic runner.
"""

from .catalog import RULES, Check, all_checks
from .harness import CheckSkipped, ConformanceFailure, Harness, Instance
from .limits import DEFAULT_LIMITS, Limits
from .runner import CheckResult, Report, RuleResult, run_conformance

__all__ = [
    "DEFAULT_LIMITS",
    "RULES",
    "Check",
    "CheckResult",
    "CheckSkipped",
    "ConformanceFailure",
    "Harness",
    "Instance",
    "Limits",
    "Report",
    "RuleResult",
    "TierTests",
    "all_checks",
    "run_conformance",
]


def __getattr__(name: str):  # TierTests needs pytest; the CLI must not
    if name == "TierTests":
        from .tiertests import TierTests

        return TierTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
