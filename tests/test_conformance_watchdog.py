"""A tier whose hook never returns must not hang the suite: the watchdog FAILs the check
and the run goes on; the CLI then exits without waiting for the stuck thread."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
import time

from kvtiers_conformance import DEFAULT_LIMITS, run_conformance
from tier_helpers import InlineMemoryTier

from kvtiers import Job, hookimpl

TESTS = pathlib.Path(__file__).parent


class HangingLoadTier(InlineMemoryTier):
    """Rule 8 broken in the worst way: a load of a key never stored blocks forever."""

    never = threading.Event()

    @hookimpl
    def submit_load(self, job: Job) -> None:
        if any(k not in self._data for k in job.keys):
            self.never.wait()
        super().submit_load(job)


def test_a_hung_hook_fails_its_check_and_the_run_goes_on() -> None:
    limits = DEFAULT_LIMITS.replace(check_s=3.0, examples=5)
    t0 = time.monotonic()
    report = run_conformance(HangingLoadTier, {}, levels="core", rules=[4, 7], limits=limits, seed=1)
    took = time.monotonic() - t0
    assert report.status(4) == "FAIL"
    hung = [r for r in report.results if r.status == "FAIL" and "did not finish within 3 s" in r.why]
    assert hung, [(r.check.test_name, r.why) for r in report.results]
    assert report.status(7) == "PASS"  # later checks still ran and passed
    assert took < 120, f"the run took {took:.0f} s"


def test_cli_exits_1_instead_of_hanging() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", "import sys; from kvtiers.commands.cli import main; sys.exit(main())", "conformance",
           "test_conformance_watchdog:HangingLoadTier", "--config", "{}", "--level", "core",
           "--examples", "5", "--check-timeout", "2", "--seed", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "rule 4 failure-is-a-result [core]: FAIL" in p.stdout, p.stdout
    assert "did not finish within 2 s" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("summary: FAILED")
