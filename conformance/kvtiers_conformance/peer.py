"""A tier instance in another process, driven from the parent's check (level ``shared``).

:class:`RemoteInstance` (``RemoteInstance(h)`` in a check) starts
:mod:`~kvtiers_conformance.peer_child` and offers the :class:`~.harness.Instance` calls the shared
checks need. A rule the child finds broken is
raised here as :class:`~.harness.ConformanceFailure`, marked as seen in the second process.
"""

from __future__ import annotations

import dataclasses
import json
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .harness import ConformanceFailure, child_env, fail, type_path

if TYPE_CHECKING:
    from .harness import Harness

#: seconds the child may take to import kvtiers and open the tier, on top of the limits
START_S = 60.0


class RemoteInstance:
    """One tier instance in a child process; see the module docstring."""

    def __init__(self, h: Harness, *, slot_bytes: int | None = None, num_slots: int = 64,
                 max_bytes: int | None = None) -> None:
        if isinstance(h.tier_type, type) and h.tier_type.__module__ == "__main__":
            fail("shared: the tier class lives in __main__; the second process cannot import it "
                 "(pass 'pkg.mod:Class')")
        self.h = h
        self.slot_bytes = slot_bytes or h.limits.slot_bytes
        self.closed = False
        spec = {
            "type": type_path(h.tier_type), "config": h.config, "levels": sorted(h.levels),
            "limits": dataclasses.asdict(h.limits), "seed": h.seed, "slot_bytes": self.slot_bytes,
            "num_slots": num_slots, "max_bytes": max_bytes,
        }
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtiers_conformance.peer_child", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=child_env(), text=True,
        )
        self._reply(START_S + h.limits.finish_s, "start")
        h.instances.append(self)  # type: ignore[arg-type]  # the harness's close_all closes it too

    # -- protocol ---------------------------------------------------------------------------
    def _stderr_tail(self) -> str:
        self._err.seek(0)
        return " ".join(self._err.read().split())[-300:]

    def _reply(self, timeout: float, what: str) -> Any:
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else ""  # type: ignore[union-attr]
        if not line:
            self._kill()
            fail(f"the second process (another instance of the tier) gave no answer to {what} "
                 f"within {timeout:g} s: {self._stderr_tail() or 'no output'}")
        msg = json.loads(line)
        if "fail" in msg:
            raise ConformanceFailure(f"{msg['fail']} (in the second process)")
        if "error" in msg:
            fail(f"the second process failed on {what}: {' '.join(msg['error'].split())[-400:]}")
        return msg.get("value")

    def call(self, op: str, keys: Sequence[bytes] = (), **fields: Any) -> Any:
        """Send one request; return its value (a broken rule raises ConformanceFailure)."""
        if self.closed:
            raise RuntimeError("conformance harness: remote instance used after close")
        req = {"op": op, "keys": [k.hex() for k in keys], **fields}
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._reply(2 * self.h.limits.finish_s + self.h.limits.retry_s, op)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()  # type: ignore[union-attr]
            except OSError:  # a broken pipe to a child that died
                pass
        self.closed = True

    # -- the Instance calls the shared checks use -------------------------------------------
    def store(self, keys: Sequence[bytes]) -> None:
        self.h.stored.setdefault(self.slot_bytes, set()).update(keys)
        self.call("store", keys)

    def submit_stores(self, jobs: Sequence[Sequence[bytes]]) -> list[int]:
        """Submit store jobs without waiting; return their ids (for :meth:`wait`)."""
        for keys in jobs:
            self.h.stored.setdefault(self.slot_bytes, set()).update(keys)
        return self.call("submit_stores", jobs=[[k.hex() for k in job] for job in jobs])

    def wait(self, ids: Sequence[int]) -> dict[int, tuple[tuple[bytes, ...], str | None]]:
        """``job id -> (failed keys, error)`` once every job in ``ids`` is reported."""
        got = self.call("wait", ids=list(ids))
        return {int(i): (tuple(bytes.fromhex(k) for k in failed), error) for i, (failed, error) in got.items()}

    def wait_hit(self, keys: Sequence[bytes]) -> None:
        self.call("wait_hit", keys)

    def load_all(self, keys: Sequence[bytes], why: str = "rule 2") -> None:
        self.call("load_all", keys, why=why)

    def resolve(self, keys: Sequence[bytes]) -> list[str]:
        return self.call("resolve", keys)

    def load(self, keys: Sequence[bytes]) -> list[bytes]:
        """Load ``keys`` in one job (good keys verified there); return the failed ones."""
        return [bytes.fromhex(k) for k in self.call("load", keys)]

    def removed_keys(self) -> set[bytes]:
        """The keys the remote instance reported through its ``ctx.removed``."""
        return {bytes.fromhex(k) for k in self.call("removed")}

    def close(self) -> None:
        """Close the remote tier (the child checks rule 9's hand-over) and end the process."""
        if self.closed:
            self._err.close()
            return
        try:
            self.call("close")
        finally:
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            self._kill()
            self._err.close()
