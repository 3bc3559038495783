"""The catalogue of checks: each one a function of a :class:`~.harness.Harness`, filed under
a rule number and a level (:mod:`.rules`). ``TierTests`` and the CLI runner both run exactly
these."""

from __future__ import annotations

from .rules import CHECKS, RULE_LEVELS, RULES, Check, CheckFunc, check

__all__ = ["CHECKS", "RULE_LEVELS", "RULES", "Check", "CheckFunc", "all_checks", "check"]


def all_checks() -> list[Check]:
    """Every check, in report order (rule, level, then definition order)."""
    from . import checks  # noqa: F401  (fills CHECKS)

    order = {rl: i for i, rl in enumerate(RULE_LEVELS)}
    return sorted(CHECKS, key=lambda c: order[(c.rule, c.level)])
