"""The rules the suite checks, and the decorator that files a check function under a rule
number and a level. The check modules (:mod:`.checks`) import this; :mod:`.catalog` lists
what they filed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .harness import Harness

RULES: dict[int, str] = {
    1: "non-blocking-lookup",
    2: "read-your-writes",
    3: "exact-bytes",
    4: "failure-is-a-result",
    5: "exactly-once",
    6: "buffer-ownership",
    7: "idempotent-stores",
    8: "non-blocking-submit",
    9: "clean-close",
    10: "crash-safety",
    11: "bounded-capacity",
    12: "hostile-keys",
    13: "pins-hold",
}

#: (rule, level) pairs the suite has checks for, in report order.
RULE_LEVELS: list[tuple[int, str]] = [
    (1, "core"), (2, "core"), (2, "durable"), (2, "shared"), (3, "core"), (4, "core"),
    (5, "core"), (6, "core"), (7, "core"), (7, "shared"), (8, "core"), (9, "core"),
    (10, "durable"), (11, "bounded"), (12, "core"), (13, "bounded"),
]


@dataclass(frozen=True)
class Check:
    """One conformance check."""

    rule: int
    level: str
    name: str  #: e.g. ``read_your_writes``; the test is ``test_rule02_read_your_writes``
    func: Callable[[Harness], None]

    @property
    def test_name(self) -> str:
        return f"test_rule{self.rule:02d}_{self.name}"

    @property
    def doc(self) -> str:
        return (self.func.__doc__ or "").strip().split("\n")[0]


CHECKS: list[Check] = []


CheckFunc = Callable[[Harness], None]


def check(rule: int, name: str, level: str = "core") -> Callable[[CheckFunc], CheckFunc]:
    """Decorator filing a check function under ``rule`` and ``level``."""
    if (rule, level) not in RULE_LEVELS:
        raise ValueError(f"no rule {rule} at level {level}")

    def deco(func: Callable[[Harness], None]) -> Callable[[Harness], None]:
        c = Check(rule, level, name, func)
        if any(x.test_name == c.test_name for x in CHECKS):
            raise ValueError(f"duplicate check {c.test_name}")
        CHECKS.append(c)
        return func

    return deco
