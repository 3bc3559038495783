"""The sqlite example's bound (``max_bytes``) and pins (rule 13): the suite's rule 11 and 13
pass on it, a broken pin hook fails rule 13, and the pins themselves (refusals with a reason,
expiry, unpin, bad options) checked directly on a real database file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvtiers_conformance import Limits, run_conformance
from kvtiers_sqlite import SqliteTier

from kvtiers import Arena, ConfigError, Job, Lookup, Namespace, TierContext, TierError, hookimpl, open_tier

SLOT = 4096
FAST = Limits(finish_s=5.0, retry_s=3.0, examples=10, crash_rounds=1, shrink=False)


class ForgetfulPins(SqliteTier):
    """Accepts every pin of a key it knows and protects none (what rule 13 must catch)."""

    @hookimpl
    def pin(self, keys, seconds):
        return None if len(self.known_stored(keys)) == len(keys) else "not stored here"


def bounded_rules(cls) -> dict[tuple[int, str], str]:
    report = run_conformance(cls, lambda scratch: {"path": str(scratch / "kv.sqlite3")}, levels={"bounded", "shared"},
                             rules={11, 13}, limits=FAST, seed=13)
    return {(r.rule, r.level): r.line() for r in report.rules()}


def test_the_suite_certifies_the_bound_and_the_pins():
    lines = bounded_rules(SqliteTier)
    assert lines[13, "bounded"].startswith("rule 13 ") and ": PASS" in lines[13, "bounded"], lines
    assert ": PASS" in lines[11, "bounded"], lines


def test_a_pin_hook_that_protects_nothing_fails_rule_13():
    line = run_conformance(ForgetfulPins, lambda scratch: {"path": str(scratch / "kv.sqlite3")}, levels={"bounded"},
                           rules={13}, limits=FAST, seed=13).rules()
    (line,) = [r for r in line if r.rule == 13]
    assert line.status == "FAIL", line.line()
    assert "pinned key(s) were evicted before their time" in line.line()


class Removed(list):
    def __call__(self, keys, reason) -> None:
        self.extend(keys)


def open_bounded(path: Path, chunks: int, removed: Removed | None = None):
    ctx = TierContext(Arena.allocate(8, SLOT), Namespace({"model": "m"}), removed=removed)
    return open_tier("sqlite", {"path": str(path), "max_bytes": chunks * SLOT}, ctx)


def store(h, keys: list[bytes], job_id: int) -> None:
    for i, k in enumerate(keys):
        h.ctx.arena[i][:] = k.ljust(SLOT, b".")
    h.submit_store(Job(job_id, tuple(keys), tuple(range(len(keys)))))
    deadline = time.monotonic() + 20
    while not (done := h.get_finished_jobs()):
        assert time.monotonic() < deadline, f"store {job_id} not reported"
        time.sleep(0.002)
    assert done[0].ok, done[0].error


def settled(h, keys: list[bytes]) -> list[Lookup]:
    deadline = time.monotonic() + 20
    while Lookup.RETRY in (answers := h.lookup(keys)):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return answers


def test_oldest_unpinned_rows_go_first_and_are_reported(tmp_path):
    removed = Removed()
    h = open_bounded(tmp_path / "kv.sqlite3", 4, removed)
    try:
        store(h, [b"a", b"b"], 1)
        assert h.pin([b"a"], None) is None
        store(h, [b"c", b"d", b"e"], 2)  # five chunks into four: b, the oldest unpinned, goes
        assert removed == [b"b"]
        assert settled(h, [b"a", b"b", b"c", b"d", b"e"]) == [Lookup.HIT, Lookup.MISS] + [Lookup.HIT] * 3
        h.unpin([b"a"])
        store(h, [b"f"], 3)
        assert removed == [b"b", b"a"]
    finally:
        h.close()


def test_pins_are_refused_with_the_reason(tmp_path):
    h = open_bounded(tmp_path / "kv.sqlite3", 4)
    try:
        store(h, [b"a", b"b", b"c"], 1)
        why = h.pin([b"a", b"never"], 60)
        assert why == "sqlite tier: 1 of 2 key(s) not stored here (first 6e65766572)", why
        assert h.pin([b"a", b"b"], 60) is None  # half of four chunks
        why = h.pin([b"c"], 60)
        assert why == f"sqlite tier: pinning 1 chunk(s) would pin {3 * SLOT} bytes, past half of max_bytes={4 * SLOT}"
        store(h, [b"d", b"e", b"f"], 2)  # nothing refused is pinned: c goes, a and b stay
        assert settled(h, [b"a", b"b", b"c"]) == [Lookup.HIT, Lookup.HIT, Lookup.MISS]
    finally:
        h.close()


def test_a_pin_ends_at_its_time(tmp_path):
    removed = Removed()
    h = open_bounded(tmp_path / "kv.sqlite3", 2, removed)
    try:
        store(h, [b"a"], 1)
        assert h.pin([b"a"], 0.05) is None
        time.sleep(0.3)  # well past the pin's end
        store(h, [b"b", b"c"], 2)
        assert removed == [b"a"]
    finally:
        h.close()


@pytest.mark.parametrize(("bad", "why"), [(-1, "max_bytes must be >= 0, got -1"),
                                          (1.5, "option 'max_bytes' expects int | None, got float 1.5"),
                                          ("4096", "option 'max_bytes' expects int | None, got str '4096'")])
def test_a_bad_max_bytes_is_one_line_at_open(tmp_path, bad, why):
    with pytest.raises((ConfigError, TierError)) as e:
        open_tier("sqlite", {"path": str(tmp_path / "kv.sqlite3"), "max_bytes": bad},
                  TierContext(Arena.allocate(2, SLOT), Namespace({"model": "m"})))
    assert why in str(e.value) and "\n" not in str(e.value), e.value
