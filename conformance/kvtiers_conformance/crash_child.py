"""The subprocess of the crash test (rule 10): stores chunks until it is killed.

Run as ``python -m kvtiers_conformance.crash_child SPEC_JSON``; SPEC holds ``type``,
``config``, ``slot_bytes``, ``namespace`` (fields) and ``prefix`` (hex). It prints
``submitted N`` before each store job and ``done N`` after its result, flushing each line,
so the parent knows which keys may exist when it sends SIGKILL.
"""

from __future__ import annotations

import json
import sys

from kvtiers import Arena, Job, Namespace, TierContext, open_tier

from .harness import content

BATCH = 8


def crash_key(prefix: bytes, i: int) -> bytes:
    """The i-th key the child stores."""
    return prefix + i.to_bytes(4, "big")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    slot_bytes = int(spec["slot_bytes"])
    prefix = bytes.fromhex(spec["prefix"])
    arena = Arena.allocate(BATCH, slot_bytes)
    ctx = TierContext(arena, Namespace(spec["namespace"]))
    tier = open_tier(spec["type"], spec["config"], ctx)
    n = 0
    job_id = 0
    while True:
        keys = [crash_key(prefix, n + j) for j in range(BATCH)]
        for j, k in enumerate(keys):
            arena[j][:] = content(k, slot_bytes)
        job_id += 1
        n += BATCH
        print(f"submitted {n}", flush=True)
        tier.submit_store(Job(job_id, tuple(keys), tuple(range(BATCH))))
        done = False
        while not done:
            done = any(r.job_id == job_id for r in tier.get_finished_jobs())
        print(f"done {n}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
