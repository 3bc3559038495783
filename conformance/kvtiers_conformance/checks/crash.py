"""Rule 10 (durable): a store killed with SIGKILL never leaves a key that answers HIT and
then loads wrong bytes."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time

from kvtiers import Lookup

from ..crash_child import BATCH, crash_key
from ..harness import ConformanceFailure, Harness, child_env, fail, type_path
from ..rules import check


def _run_and_kill(h: Harness, prefix: bytes, delay: float) -> int:
    """Start a storing child, SIGKILL it ``delay`` s after its first finished job; return
    how many keys it may have submitted."""
    spec = {
        "type": type_path(h.tier_type),
        "config": h.config,
        "slot_bytes": h.limits.crash_slot_bytes,
        "namespace": h.namespace(h.limits.crash_slot_bytes).fields,
        "prefix": prefix.hex(),
    }
    if isinstance(h.tier_type, type) and h.tier_type.__module__ == "__main__":
        fail("rule 10: the tier class lives in __main__; a subprocess cannot import it (pass 'pkg.mod:Class')")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtiers_conformance.crash_child", json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), text=True,
    )
    submitted = 0
    try:
        deadline = time.monotonic() + h.limits.finish_s
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
            if not line:
                proc.kill()
                _, err = proc.communicate()
                fail("rule 10: the storing subprocess did not finish a store job "
                     f"within {h.limits.finish_s:g} s: {err.strip()[-300:]}")
            word, _, num = line.partition(" ")
            if word == "submitted":
                submitted = int(num)
            elif word == "done":
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
        for line in rest.splitlines():
            word, _, num = line.partition(" ")
            if word == "submitted":
                submitted = int(num)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return submitted


@check(10, "crash_safety", "durable")
def crash_safety(h: Harness) -> None:
    """Subprocesses storing 256 KiB chunks are SIGKILLed mid-store; every key a new instance
    then calls HIT must load the exact bytes (or fail), never wrong ones."""
    lim = h.limits
    for rnd in range(lim.crash_rounds):
        prefix = h.key(b"K")[:-4] + bytes([rnd])
        submitted = _run_and_kill(h, prefix, delay=h.rng.uniform(0.0, 0.05))
        keys = [crash_key(prefix, i) for i in range(submitted + BATCH)]
        h.stored.setdefault(lim.crash_slot_bytes, set()).update(keys)
        t = h.open(slot_bytes=lim.crash_slot_bytes, num_slots=2 * BATCH)
        answers = t.resolve(keys)
        hits = [k for k, a in zip(keys, answers, strict=True) if a is Lookup.HIT]
        try:
            for i in range(0, len(hits), BATCH):
                t.load(hits[i:i + BATCH])  # the harness compares every byte of good keys
        except ConformanceFailure as e:
            fail(f"rule 10: after a storing process was killed with SIGKILL: {str(e).removeprefix('rule 3: ')}")
        t.close()
