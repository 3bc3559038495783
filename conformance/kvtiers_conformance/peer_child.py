"""The second instance of the ``shared`` level, in a process of its own.

Tiers often share one handle per process (an LMDB environment, an SQLite connection, a
client pool); engines run one instance per worker process. So the ``shared`` checks open the
second instance here, through :class:`~kvtiers_conformance.peer.RemoteInstance`.

Run as ``python -m kvtiers_conformance.peer_child SPEC_JSON``; SPEC holds ``type``,
``config``, ``levels``, ``limits`` (the fields of :class:`~.limits.Limits`), ``seed``,
``slot_bytes``, ``num_slots`` and ``max_bytes``. The child opens one :class:`~.harness.Instance` (its own
arena, the same namespace as the parent's instances), answers ``{"ok": true}``, then serves
one JSON request per stdin line with one JSON reply per line: ``{"ok": true, "value": ...}``,
``{"fail": message}`` (a rule broken here) or ``{"error": traceback}``. Keys travel as hex.
The replies use a copy of the original stdout; the tier's own prints go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from .harness import ConformanceFailure, Harness, Instance
from .limits import Limits


def handle(t: Instance, req: dict[str, Any]) -> Any:
    """Run one request on instance ``t``; return its value."""
    op = req["op"]
    keys = [bytes.fromhex(k) for k in req.get("keys", ())]
    if op == "store":
        t.store(keys)
    elif op == "submit_stores":
        return [t.submit("store", [bytes.fromhex(k) for k in job]) for job in req["jobs"]]
    elif op == "wait":
        results = t.wait(req["ids"])
        return {str(i): [[k.hex() for k in r.failed_keys], r.error] for i, r in results.items()}
    elif op == "wait_hit":
        t.wait_hit(keys)
    elif op == "load_all":
        t.load_all(keys, why=req["why"])
    elif op == "resolve":
        return [a.name for a in t.resolve(keys)]
    elif op == "load":
        return [k.hex() for k in t.load(keys).failed_keys]
    elif op == "removed":
        return sorted(k.hex() for k in t.removed_keys())
    elif op == "close":
        t.close()
    else:
        raise ValueError(f"unknown request {op!r}")
    return None


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints of the tier (Python or C) go to stderr, never into the replies
    sys.stdout = sys.stderr

    def reply(**fields: Any) -> None:
        proto.write(json.dumps(fields) + "\n")
        proto.flush()

    try:
        h = Harness(spec["type"], spec["config"], levels=spec["levels"], limits=Limits(**spec["limits"]),
                    seed=spec["seed"])
        t = h.open(slot_bytes=spec["slot_bytes"], num_slots=spec["num_slots"], max_bytes=spec.get("max_bytes"))
    except ConformanceFailure as e:
        reply(fail=str(e))
        return 0
    except Exception:
        reply(error=traceback.format_exc())
        return 1
    reply(ok=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply(ok=True, value=handle(t, req))
        except ConformanceFailure as e:
            reply(fail=str(e))
        except Exception:
            reply(error=traceback.format_exc())
        if req["op"] == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
