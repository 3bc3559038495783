"""Running the checks without pytest: the engine of ``kvtiers conformance`` and of the
suite's own tests. ``TierTests`` runs the same check functions under pytest."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import pathlib
import random
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtiers.errors import ConfigError
from kvtiers.options import tier_options
from kvtiers.registry import LEVELS, tier_levels

from .catalog import RULE_LEVELS, RULES, Check, all_checks
from .cleanup import Cleanup
from .harness import CheckSkipped, ConformanceFailure, Harness, NotCertified, resolve_tier
from .limits import DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check: ``status`` is ``PASS``, ``FAIL`` or ``SKIP``."""

    check: Check
    status: str
    why: str = ""
    seconds: float = 0.0
    details: str = ""
    #: a SKIP for want of something the tier could provide (``--strict`` makes it a FAIL)
    uncertified: bool = False


@dataclass(frozen=True)
class RuleResult:
    """One report line: a rule at a level, summarising its checks."""

    rule: int
    level: str
    status: str
    why: str = ""
    checks: tuple[CheckResult, ...] = ()

    @property
    def name(self) -> str:
        return RULES[self.rule]

    def line(self) -> str:
        """``rule N <name> [level]: PASS|FAIL|SKIP|NOT CERTIFIED (why)``; a PASS whose checks
        were partly skipped says so: ``PASS (1 of 3 checks skipped: why)``; a line with a
        check that could not run for want of something the tier could provide is ``NOT
        CERTIFIED (1 of 3 checks not run: why)``."""
        why = f" ({self.why})" if self.why else ""
        return f"rule {self.rule} {self.name} [{self.level}]: {self.status}{why}"


@dataclass
class Report:
    """Everything one conformance run found."""

    tier: str
    levels: frozenset[str]
    seed: int
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  #: e.g. what the suite could not clean up

    def rules(self) -> list[RuleResult]:
        """One :class:`RuleResult` per (rule, level), in report order."""
        return [self.rule_result(rule, level) for rule, level in RULE_LEVELS]

    def rule_result(self, rule: int, level: str) -> RuleResult:
        """The report line of ``rule`` at ``level``, from the checks run so far."""
        mine = tuple(r for r in self.results if (r.check.rule, r.check.level) == (rule, level))
        failed = [r for r in mine if r.status == "FAIL"]
        if failed:
            f = failed[0]
            more = f"; +{len(failed) - 1} more failing check(s)" if len(failed) > 1 else ""
            return RuleResult(rule, level, "FAIL", f"{f.check.test_name}: {f.why}{more}", mine)
        wanting = [r for r in mine if r.uncertified]
        if wanting:
            reasons = "; ".join(dict.fromkeys(f"{r.check.test_name}: {r.why}" for r in wanting))
            return RuleResult(rule, level, NOT_CERTIFIED, f"{len(wanting)} of {len(mine)} checks not run: {reasons}",
                              mine)
        if any(r.status == "PASS" for r in mine):
            skipped = [r for r in mine if r.status == "SKIP"]
            why = ""
            if skipped:
                reasons = "; ".join(dict.fromkeys(r.why for r in skipped))
                why = f"{len(skipped)} of {len(mine)} checks skipped: {reasons}"
            return RuleResult(rule, level, "PASS", why, mine)
        return RuleResult(rule, level, "SKIP", mine[0].why if mine else "not run", mine)

    def status(self, rule: int, level: str = "core") -> str:
        """The status of one report line."""
        return next(r.status for r in self.rules() if (r.rule, r.level) == (rule, level))

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.results)

    def uncertified(self) -> list[CheckResult]:
        """Checks of the levels run that could not run for want of something the tier could
        provide (a hook, an option): skips without ``strict``, failures with it."""
        return [r for r in self.results if r.uncertified]

    def check_counts(self) -> dict[str, int]:
        """How many checks passed, failed and were skipped (what the JUnit file counts)."""
        return {s: sum(1 for r in self.results if r.status == s) for s in ("PASS", "FAIL", "SKIP")}

    def summary(self) -> str:
        """``summary: PASSED|FAILED: <rule lines> (checks: <every check>; levels) in s, seed``.
        The first counts are report lines; ``checks:`` counts every check, skipped ones
        included, as the JUnit file does."""
        lines = self.rules()
        n = {s: sum(1 for r in lines if r.status == s) for s in ("PASS", "FAIL", "SKIP", NOT_CERTIFIED)}
        c = self.check_counts()
        wanting = [r.check.test_name for r in self.uncertified() if r.status == "SKIP"]
        if self.failed:
            verdict = "FAILED"
        elif wanting:
            verdict = f"{NOT_CERTIFIED}: {', '.join(dict.fromkeys(wanting))}"
        else:
            verdict = "PASSED"
        nc = f", {n[NOT_CERTIFIED]} not certified" if n[NOT_CERTIFIED] else ""
        return (f"summary: {verdict}: {n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped{nc} "
                f"(checks: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped; "
                f"levels {','.join(sorted(self.levels)) or 'none'}) "
                f"in {self.seconds:.1f} s, seed {self.seed}")


#: the status of a report line with a check that could not run for want of something the
#: tier could provide, and the verdict of a run with one (without ``strict``)
NOT_CERTIFIED = "NOT CERTIFIED"


def parse_levels(text: str | Iterable[str] | None) -> frozenset[str] | None:
    """``"core,durable"`` (or an iterable) -> a validated set; ``None`` stays ``None``."""
    if text is None:
        return None
    items = [x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    unknown = sorted(set(items) - set(LEVELS))
    if unknown:
        raise ConfigError(f"unknown conformance level(s) {', '.join(unknown)} (known: {', '.join(LEVELS)})")
    return frozenset(items)


class CheckStuck(Exception):
    """A check outlived ``Limits.check_s``: some hook of the tier never returned."""


def run_check(check: Check, harness: Harness) -> CheckResult:
    """Run one check on ``harness`` (closing what it opened) and classify the outcome.

    The check runs on a watchdog thread: if it is still running after
    ``harness.limits.check_s`` it FAILs, and the run goes on (the stuck thread is left
    behind as a daemon; :func:`stuck_checks` tells the CLI to exit without waiting for it).
    """
    t0 = time.monotonic()
    outcome: list[BaseException | None] = []
    tb: list[str] = []

    def body() -> None:
        try:
            run_closing(check, harness)
            outcome.append(None)
        except BaseException as e:  # handed to the caller's thread below
            tb.append(traceback.format_exc())
            outcome.append(e)

    worker = threading.Thread(target=body, name=f"kvtiers-conformance:{check.test_name}", daemon=True)
    worker.start()
    worker.join(harness.limits.check_s)
    if worker.is_alive():
        _stuck.append(check.test_name)
        why = (f"did not finish within {harness.limits.check_s:g} s: a hook of the tier never "
               f"returned (nothing may hang: rules 1, 5, 8 and 9)")
        return CheckResult(check, "FAIL", why, time.monotonic() - t0)
    err = outcome[0] if outcome else None
    if err is None:
        return CheckResult(check, "PASS", "", time.monotonic() - t0)
    if isinstance(err, CheckSkipped):
        return CheckResult(check, "SKIP", str(err), time.monotonic() - t0, uncertified=isinstance(err, NotCertified))
    if isinstance(err, ConformanceFailure):
        return CheckResult(check, "FAIL", _one_line(str(err)), time.monotonic() - t0, tb[0])
    if isinstance(err, Exception):  # a hook raising outside the harness's guards, or a broken open
        why = _one_line(f"{type(err).__name__}: {err}")
        return CheckResult(check, "FAIL", why, time.monotonic() - t0, tb[0])
    raise err  # KeyboardInterrupt and the like stop the run


_stuck: list[str] = []


def stuck_checks() -> list[str]:
    """Names of checks abandoned by the watchdog in this process."""
    return list(_stuck)


def run_closing(check: Check, harness: Harness) -> None:
    """Run ``check`` and close every instance it left open. When the check failed, a
    failure while closing is not allowed to hide the first one."""
    try:
        check.func(harness)
    except BaseException:
        try:
            harness.close_all()
        except Exception:
            pass
        raise
    harness.close_all()


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_conformance(
    tier_type: str | type,
    config: Mapping[str, Any] | Callable[[pathlib.Path], Mapping[str, Any]] | None = None,
    *,
    levels: Iterable[str] | str | None = None,
    rules: Iterable[int] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    seed: int | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    on_start: Callable[[Report], None] | None = None,
    keep: bool = False,
    strict: bool = False,
) -> Report:
    """Run the suite against a tier type and return a :class:`Report`.

    ``config`` is the tier's options, or a function of a fresh scratch directory returning
    them (called once per check); ``None`` uses the tier class's
    ``conformance_config(scratch)``, or ``{}`` for a tier that has none and no required
    option. What the run stored is removed afterwards (see
    :mod:`~kvtiers_conformance.cleanup`: the tier's ``conformance_cleanup``, else new files
    and ``delete`` in the location fixed options name) unless ``keep``. ``levels`` defaults
    to the levels the tier claims; checks of other levels are reported as SKIP. ``rules`` restricts the run to some rule
    numbers. ``on_start`` sees the (empty) report before the first check, ``on_result``
    each check result as it comes. With ``strict``, a check of a level run that could not
    run for want of something the tier could provide (a hook such as
    ``conformance_corrupt``, an option) FAILs, naming it; without, the report line and the
    summary say ``NOT CERTIFIED``. Checks that do not apply to the kind of tier stay skips.
    """
    info = resolve_tier(tier_type)
    claimed = tier_levels(info.cls)
    chosen = parse_levels(levels) if levels is not None else claimed
    if config is None:
        config = _default_config(info.name, info.cls)
    # before anything is stored: a snapshot of the paths fixed options name
    cleanup = None if keep else Cleanup(None if callable(config) else config, info.cls)
    seed = random.randrange(2**32) if seed is None else seed
    with _scratch(config) as options:  # a bad option is one clear error, not a FAIL per check
        preflight = Harness(tier_type, options, levels=chosen, limits=limits, seed=seed)
        try:
            preflight.open()
        finally:
            with contextlib.suppress(ConformanceFailure):
                preflight.close_all()
            if cleanup is not None:  # what opening made (a namespace document, a scratch server)
                _clean_after(cleanup, preflight)
    report = Report(info.name, chosen, seed)
    if on_start:
        on_start(report)
    t_start = time.monotonic()
    wanted = set(rules) if rules is not None else None
    try:
        for i, c in enumerate(all_checks()):
            if wanted is not None and c.rule not in wanted:
                continue
            if c.level not in chosen:
                why = f"level {c.level} not claimed" if c.level not in claimed else f"level {c.level} not selected"
                result = CheckResult(c, "SKIP", why)
            else:
                with _scratch(config) as options:
                    harness = Harness(tier_type, options, levels=chosen, limits=limits, seed=seed + i)
                    result = run_check(c, harness)
                    if strict and result.uncertified:
                        result = dataclasses.replace(result, status="FAIL",
                                                     why=f"not certified (--strict): {result.why}")
                    if cleanup is not None and c.test_name not in _stuck:
                        _clean_after(cleanup, harness)
            report.results.append(result)
            if on_result:
                on_result(result)
    finally:
        if cleanup is not None:
            cleanup.finish()
            if cleanup.note():
                report.notes.append(cleanup.note())
    report.seconds = time.monotonic() - t_start
    return report


def _default_config(name: str, cls: type) -> Any:
    """The tier's ``conformance_config``, or ``{}`` when every option has a default."""
    factory = getattr(cls, "conformance_config", None)
    if factory is not None:
        return factory
    required = [n for n, p in tier_options(cls).items() if p.default is inspect.Parameter.empty]
    if required:
        raise ConfigError(f"tier {name!r} needs option(s) {', '.join(required)} and has no "
                          "conformance_config(scratch); pass --config")
    return {}


def _clean_after(cleanup: Cleanup, harness: Harness) -> None:
    try:
        cleanup.after_check(harness)
    except Exception as e:  # cleaning up must never change a check's outcome
        cleanup.kept.append(f"cleaning up failed: {type(e).__name__}: {e}")


@contextlib.contextmanager
def _scratch(config: Any) -> Iterator[dict[str, Any]]:
    if not callable(config):
        yield dict(config)
        return
    path = pathlib.Path(tempfile.mkdtemp(prefix="kvtiers-conformance-"))
    try:
        yield dict(config(path))
    finally:
        shutil.rmtree(path, ignore_errors=True)
