"""Proof the suite catches bugs: every deliberately broken tier fails on its own rule.

The checks run in-process through the runner API, restricted to the broken rule and with
tighter time bounds than the defaults (a lost result is noticed after 3 s, not 30 s).
"""

from __future__ import annotations

import pytest
from broken_tiers import BROKEN, DictAsyncTier, DirTier, WholeJobPresentTier
from kvtiers_conformance import Limits, run_conformance

FAST = Limits(finish_s=3.0, retry_s=2.0, examples=25, crash_rounds=3, shrink=False)


def _config(cls: type):
    if issubclass(cls, DirTier):
        return lambda scratch: {"root_dir": str(scratch)}
    if issubclass(cls, DictAsyncTier):
        return cls.conformance_config
    return {}


@pytest.mark.parametrize("cls", list(BROKEN), ids=[c.__name__ for c in BROKEN])
def test_broken_tier_fails_its_rule(cls: type) -> None:
    rule, level = BROKEN[cls]
    report = run_conformance(cls, _config(cls), levels={level}, rules={rule}, limits=FAST, seed=1234)
    line = next(r for r in report.rules() if (r.rule, r.level) == (rule, level))
    assert line.status == "FAIL", f"{cls.__name__} was not caught: {line.line()}"
    assert line.line().startswith(f"rule {rule} {line.name} [{level}]: FAIL (test_rule{rule:02d}_")


def test_every_rule_but_10_has_a_broken_tier() -> None:
    """Issue 3: one broken tier per rule 1-9, 11 and 12 (10 has one too)."""
    assert {rule for rule, _ in BROKEN.values()} == set(range(1, 13))



def test_one_job_over_the_bound_catches_what_small_jobs_miss() -> None:
    """Issue 11: keys evicted by later keys of the same job must not answer HIT; only a job
    larger than max_bytes shows it."""
    report = run_conformance(WholeJobPresentTier, {}, levels={"bounded"}, rules={11}, limits=FAST, seed=5)
    by_name = {r.check.test_name: r for r in report.results}
    assert by_name["test_rule11_bounded_capacity"].status == "PASS"
    one = by_name["test_rule11_one_job_over_the_bound"]
    assert one.status == "FAIL" and "answer HIT" in one.why, one.why


def test_corruption_hook_fails_an_unchecked_tier_and_passes_a_checked_one() -> None:
    """Issue 11: a tier without a checksum that implements conformance_corrupt fails rule 4
    (it keeps no files, so before the hook it passed); the same tier with its checksum passes."""
    from broken_tiers import UncheckedDictTier

    bad = run_conformance(UncheckedDictTier, None, levels="core", rules={4}, limits=FAST, seed=2)
    r = next(x for x in bad.results if x.check.test_name == "test_rule04_corrupt_chunks_fail")
    assert r.status == "FAIL" and "corrupted key" in r.why and "wrong bytes" in r.why, r.why
    good = run_conformance(DictAsyncTier, None, levels="core", rules={4}, limits=FAST, seed=2)
    r = next(x for x in good.results if x.check.test_name == "test_rule04_corrupt_chunks_fail")
    assert r.status == "PASS", r.why
