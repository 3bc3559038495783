"""The suite's own parts: the I/O audit, level parsing, the report format, JUnit XML, and
TierTests collected by pytest (ids, skips, forced levels)."""

from __future__ import annotations

import os
import sys
import threading
import time
import xml.etree.ElementTree as ET

import pytest
from kvtiers_conformance import audit
from kvtiers_conformance.catalog import RULE_LEVELS, RULES, all_checks
from kvtiers_conformance.cli import write_junit
from kvtiers_conformance.runner import CheckResult, Report, parse_levels

from kvtiers.errors import ConfigError

pytest_plugins = ["pytester"]


def test_audit_sees_this_threads_io_only() -> None:
    with audit.watch() as seen:
        with open(os.devnull, "rb"):
            pass
        time.sleep(0)
        t = threading.Thread(target=lambda: open(os.devnull, "rb").close())
        t.start()
        t.join()
    assert any(e.startswith("open(") for e in seen)
    if sys.version_info >= (3, 12):  # CPython audits time.sleep from 3.12
        assert any(e.startswith("time.sleep") for e in seen)
    assert sum(e.startswith("open(") for e in seen) == 1  # the other thread's open is not ours
    with open(os.devnull, "rb"):  # outside the block nothing is recorded
        pass
    assert sum(e.startswith("open(") for e in seen) == 1


def test_parse_levels() -> None:
    assert parse_levels("core, durable") == {"core", "durable"}
    assert parse_levels(["bounded"]) == {"bounded"}
    assert parse_levels(None) is None
    with pytest.raises(ConfigError, match="unknown conformance level"):
        parse_levels("core,fast")


def test_every_rule_level_has_a_check_and_ids_carry_the_rule() -> None:
    checks = all_checks()
    assert {(c.rule, c.level) for c in checks} == set(RULE_LEVELS)
    assert set(RULES) == set(range(1, 14))
    for c in checks:
        assert c.test_name.startswith(f"test_rule{c.rule:02d}_"), c.test_name
        assert c.doc, f"{c.test_name} has no docstring"


def _report() -> Report:
    by_name = {c.test_name: c for c in all_checks()}
    rep = Report("t", frozenset({"core"}), 42, seconds=1.0)
    rep.results += [
        CheckResult(by_name["test_rule02_read_your_writes"], "PASS"),
        CheckResult(by_name["test_rule05_exactly_once_64_in_flight"], "FAIL", "rule 5: job 3 reported twice"),
        CheckResult(by_name["test_rule05_empty_job_reported"], "PASS"),
        CheckResult(by_name["test_rule10_crash_safety"], "SKIP", "level durable not claimed"),
        CheckResult(by_name["test_rule04_missing_keys_fail"], "PASS"),
        CheckResult(by_name["test_rule04_async_failing_coroutines"], "SKIP", "not an AsyncTier"),
        CheckResult(by_name["test_rule04_corrupt_chunks_fail"], "SKIP", "no directory"),
    ]
    return rep


def test_report_lines_and_summary() -> None:
    rep = _report()
    lines = {(r.rule, r.level): r.line() for r in rep.rules()}
    assert lines[2, "core"] == "rule 2 read-your-writes [core]: PASS"
    assert lines[5, "core"] == ("rule 5 exactly-once [core]: FAIL "
                                "(test_rule05_exactly_once_64_in_flight: rule 5: job 3 reported twice)")
    assert lines[10, "durable"] == "rule 10 crash-safety [durable]: SKIP (level durable not claimed)"
    assert lines[1, "core"] == "rule 1 non-blocking-lookup [core]: SKIP (not run)"
    assert lines[4, "core"] == ("rule 4 failure-is-a-result [core]: PASS "
                                "(2 of 3 checks skipped: not an AsyncTier; no directory)")
    assert rep.failed and rep.status(5) == "FAIL"
    assert rep.summary().startswith("summary: FAILED: 2 passed, 1 failed, 13 skipped "
                                    "(checks: 3 passed, 1 failed, 3 skipped; levels core)")
    assert rep.summary().endswith("seed 42")


def test_junit_xml(tmp_path) -> None:
    path = tmp_path / "r.xml"
    write_junit(_report(), str(path))
    suite = ET.parse(path).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("7", "1", "3")
    failed = [c for c in suite.iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["test_rule05_exactly_once_64_in_flight"]
    assert failed[0].find("failure").get("message") == "rule 5: job 3 reported twice"


def test_tiertests_subclass_forced_levels(pytester: pytest.Pytester) -> None:
    """A subclass forcing ``durable`` on the memory tier: the durable check runs and fails,
    shared is skipped with a reason, core passes."""
    pytester.makepyfile(test_mem="""
        import pytest
        from kvtiers_conformance import TierTests

        class TestMem(TierTests):
            levels = {"core", "durable"}

            @pytest.fixture
            def tier_config(self, tmp_path):
                return "memory", {}
    """)
    result = pytester.runpytest("-k", "rule02", "-rfs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "*FAILED*TestMem::test_rule02_read_your_writes_durable*",
        "*SKIPPED*level shared not claimed*",
    ])


def test_a_stored_key_that_does_not_answer_hit_is_said_removed_or_not() -> None:
    """Rule 2's failure says whether the tier reported the key removed (and why): a MISS after
    an eviction the tier reported is another fault than a key it lost without a word."""
    from kvtiers_conformance.harness import ConformanceFailure, Harness

    h = Harness("memory", levels=("core", "bounded"))
    try:
        t = h.open(max_bytes=2 * h.limits.slot_bytes)
        first = h.keys(1, b"A")
        t.store(first)
        t.store(h.keys(4, b"B"))  # over a bound of two chunks: the memory tier evicts the oldest
        with pytest.raises(ConformanceFailure, match=r"reported it removed \(evicted\)"):
            t.wait_hit(first, timeout=0.2)
        with pytest.raises(ConformanceFailure, match="did not report it removed"):
            t.wait_hit(h.keys(1, b"C"), timeout=0.2)  # never stored
    finally:
        h.close_all()
