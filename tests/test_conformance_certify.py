"""What the suite could not certify is not PASSED (issue 27): a check that could not run for
want of something the tier could provide is ``NOT CERTIFIED`` in its line and the summary,
and a FAIL under ``strict``; a corruption hook the backend refuses is such a skip; checks
that do not apply to the kind of tier stay plain skips. And ``conformance_cleanup``: the
suite calls it at the end of every run."""

from __future__ import annotations

import pathlib

import pytest
from broken_tiers import _BUCKETS, DictAsyncTier, NoCorruptionCheckTier
from kvtiers_conformance import Limits, run_conformance

pytest_plugins = ["pytester"]

FAST = Limits(finish_s=5.0, retry_s=2.0, examples=5, shrink=False)
CORRUPT = "test_rule04_corrupt_chunks_fail"


def _check(report, name: str):
    return next(r for r in report.results if r.check.test_name == name)


def test_a_tier_that_never_checks_corruption_is_not_certified_and_fails_under_strict() -> None:
    report = run_conformance(NoCorruptionCheckTier, None, levels="core", rules=[4], limits=FAST, seed=1)
    r = _check(report, CORRUPT)
    assert r.status == "SKIP" and r.uncertified and "define conformance_corrupt" in r.why, r
    line = report.rule_result(4, "core")
    assert line.status == "NOT CERTIFIED", line.line()
    assert line.line().startswith("rule 4 failure-is-a-result [core]: NOT CERTIFIED (1 of 4 checks not run: "
                                  f"{CORRUPT}: "), line.line()
    assert not report.failed
    assert report.summary().startswith(f"summary: NOT CERTIFIED: {CORRUPT}: 0 passed, 0 failed, 15 skipped, "
                                       "1 not certified (checks: "), report.summary()

    strict = run_conformance(NoCorruptionCheckTier, None, levels="core", rules=[4], limits=FAST, seed=1,
                             strict=True)
    r = _check(strict, CORRUPT)
    assert r.status == "FAIL" and r.why.startswith("not certified (--strict): "), r
    assert strict.failed and strict.status(4) == "FAIL"
    assert strict.summary().startswith("summary: FAILED: "), strict.summary()


@pytest.mark.parametrize("tier", ["memory", "fs"])
def test_first_party_tiers_pass_rule_4_under_strict(tier: str) -> None:
    """memory keeps its chunks in its instance (nothing to damage: a plain skip, not a want);
    fs has conformance_corrupt."""
    report = run_conformance(tier, None, rules=[4], limits=FAST, seed=2, strict=True)
    assert not report.failed and not report.uncertified(), report.summary()
    assert report.summary().startswith("summary: PASSED: "), report.summary()
    if tier == "memory":
        assert "keeps its chunks in its instance" in _check(report, CORRUPT).why


class RefusingCorruptTier(DictAsyncTier):
    """A tier whose backend refuses fault injection, as a production p2p server does."""

    @classmethod
    def conformance_corrupt(cls, config, namespace, key) -> None:
        raise NotImplementedError("this server takes no fault injection")


def test_a_refused_corruption_hook_is_a_named_skip_and_a_failure_under_strict() -> None:
    report = run_conformance(RefusingCorruptTier, None, levels="core", rules=[4], limits=FAST, seed=3)
    r = _check(report, CORRUPT)
    assert r.status == "SKIP" and r.uncertified, r
    assert "conformance_corrupt was refused by the backend" in r.why and "no fault injection" in r.why, r.why
    assert not report.failed and report.summary().startswith("summary: NOT CERTIFIED: ")
    strict = run_conformance(RefusingCorruptTier, None, levels="core", rules=[4], limits=FAST, seed=3, strict=True)
    assert strict.failed and "refused by the backend" in _check(strict, CORRUPT).why


def test_a_refusing_p2p_server_is_certified_except_for_corruption() -> None:
    """A `kvtiers p2p serve` without --test-faults: rule 4 is NOT CERTIFIED naming the refusal,
    not FAILED as if the healthy server were broken."""
    pytest.importorskip("zmq")
    from kvtiers_p2p.spawn import start_server

    srv = start_server(capacity=64 << 20)
    try:
        config = {"host": "127.0.0.1", "port": srv.port}
        report = run_conformance("p2p", config, levels="core", rules=[4], limits=FAST, seed=4)
        r = _check(report, CORRUPT)
        assert r.status == "SKIP" and r.uncertified and "refused CORRUPT" in r.why, r
        assert not report.failed, report.summary()
        strict = run_conformance("p2p", config, levels="core", rules=[4], limits=FAST, seed=4, strict=True)
        assert strict.failed and strict.status(4) == "FAIL"
        assert any("p2p protocol has no delete" in n for n in report.notes), report.notes
    finally:
        srv.stop()  # by its own PID


def test_tiertests_strict_fails_what_it_cannot_certify(pytester: pytest.Pytester) -> None:
    tests = pathlib.Path(__file__).parent
    pytester.makeconftest(f"import sys; sys.path.insert(0, {str(tests)!r})")
    pytester.makepyfile(test_strict="""
        import pytest
        from broken_tiers import NoCorruptionCheckTier
        from kvtiers_conformance import TierTests

        class TestLax(TierTests):
            @pytest.fixture
            def tier_config(self, tmp_path):
                return NoCorruptionCheckTier, {"bucket": str(tmp_path)}

        class TestStrict(TestLax):
            strict = True
    """)
    result = pytester.runpytest("-k", "corrupt", "-rfs", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["not certified (strict): the tier has no conformance_corrupt*",
                                 "FAILED*TestStrict::test_rule04_corrupt_chunks_fail*"])
    result.stdout.fnmatch_lines(["*SKIPPED*NOT CERTIFIED: the tier has no conformance_corrupt*"])


# -- conformance_cleanup ----------------------------------------------------------------------

CLEANED: list[dict] = []


class CleaningDictTier(DictAsyncTier):
    """DictAsyncTier whose conformance_cleanup drops the bucket its options name."""

    @classmethod
    def conformance_cleanup(cls, config: dict) -> str | None:
        CLEANED.append(dict(config))
        _BUCKETS.pop(config["bucket"], None)
        return "one thing stays" if config["bucket"] == "kept" else None


def test_cleanup_hook_runs_after_every_check_without_config() -> None:
    """Options from conformance_config (a scratch bucket per check): the hook runs after each
    check, so nothing the suite stored is left."""
    CLEANED.clear()
    before = set(_BUCKETS)
    report = run_conformance(CleaningDictTier, None, levels="core", rules=[2, 3, 7], limits=FAST, seed=5)
    assert not report.failed and not report.notes, (report.summary(), report.notes)
    ran = [r for r in report.results if r.status != "SKIP"]
    # after each check, and after the first instance the suite opens to check the options
    assert len(CLEANED) == len(ran) + 1 and len({c["bucket"] for c in CLEANED}) == len(ran) + 1
    assert set(_BUCKETS) - before == set()  # every scratch bucket the suite filled is gone


def test_cleanup_hook_runs_once_on_the_config_options_and_says_what_stays() -> None:
    CLEANED.clear()
    for bucket, note in (("given", False), ("kept", True)):
        report = run_conformance(CleaningDictTier, {"bucket": bucket}, levels="core", rules=[2], limits=FAST, seed=6)
        assert not report.failed
        assert bucket not in _BUCKETS
        assert (any("one thing stays" in n for n in report.notes)) is note, report.notes
    assert CLEANED == [{"bucket": "given"}, {"bucket": "kept"}]
    report = run_conformance(CleaningDictTier, {"bucket": "mine"}, levels="core", rules=[2], limits=FAST, seed=6,
                             keep=True)
    assert _BUCKETS.get("mine") and len(CLEANED) == 2  # --keep: the hook is not called


def test_without_the_hook_keys_go_through_delete() -> None:
    report = run_conformance(DictAsyncTier, {"bucket": "by-delete"}, levels="core", rules=[2, 7], limits=FAST, seed=7)
    assert not report.failed and not report.notes
    assert _BUCKETS["by-delete"] == {}


# -- shared and bounded ---------------------------------------------------------------------


def test_shared_bounded_the_evicting_instance_reports_and_the_other_turns_miss() -> None:
    good = run_conformance("broken_tiers:BoundedDirTier", lambda scratch: {"root_dir": str(scratch)},
                           levels="shared,bounded", rules=[11], limits=FAST, seed=8)
    assert not good.failed, [r.why for r in good.results if r.status == "FAIL"]
    assert _check(good, "test_rule11_bounded_shared").status == "PASS"
    bad = run_conformance("broken_tiers:StickyHitDirTier", lambda scratch: {"root_dir": str(scratch)},
                          levels="shared,bounded", rules=[11], limits=FAST, seed=8)
    r = _check(bad, "test_rule11_bounded_shared")
    assert r.status == "FAIL" and "still answers HIT on the other instance after a load of it failed" in r.why, r.why
    # alone, each instance keeps rule 11: only two instances show it
    assert _check(bad, "test_rule11_bounded_capacity").status == "PASS"
