"""Where the suite's time goes, when ``$KVTIERS_TEST_TIMELINE`` names a file: one line per event,
``<unix time> <process> <event> <what>``, appended by every pytest worker (each test's start and
end) and by :func:`vllm_engines.engine` (each engine's start and end, waiting for a place
included in neither; the serving soak, the long-prompt bench and the LMCache engines start
their processes otherwise and are not recorded). A child pytest inherits the variable (e.g.
``test_vllm_releases``'s) and records under its parent's worker name, with its own pid.
``--durations`` gives each test's time; this gives when, beside what (docs/development.md)."""

from __future__ import annotations

import os
import time

PATH = os.environ.get("KVTIERS_TEST_TIMELINE")


def mark(event: str, what: str) -> None:
    """Append one event (nothing when ``$KVTIERS_TEST_TIMELINE`` is not set)."""
    if not PATH:
        return
    who = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(PATH, "a") as f:  # one short write per line: lines of several processes do not mix
        f.write(f"{time.time():.3f} {who}:{os.getpid()} {event} {what}\n")
