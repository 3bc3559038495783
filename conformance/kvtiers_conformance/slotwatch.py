"""Watching the slots of reported jobs for late writes (rule 6).

A :class:`SlotWatch` submits jobs on slots it keeps for itself, has the harness poison each
job's slots the moment its result is accepted (after a load's bytes were verified), and
then checks that nothing writes them again: a tier that reported a job (done, failed, timed
out, cancelled on close) no longer owns its slots. A store that keeps reading its slot
after reporting shows up later: its key then loads the poison, which the harness fails as
wrong bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from .harness import Instance, fail, poison


class SlotWatch:
    """The slots of jobs submitted through it, poisoned once reported and watched."""

    def __init__(self, t: Instance) -> None:
        self.t = t
        self.slots: dict[int, tuple[str, int, str]] = {}  #: slot -> (kind, job id, note)

    def submit(self, kind: str, keys: Sequence[bytes], *, absent: Iterable[bytes] = (),
               absent_what: str = "never-stored", note: str = "") -> int:
        """Submit a store or load on slots of its own (kept until :meth:`release`);
        ``note`` says how the job ran, in a failure message."""
        t = self.t
        slots = t.alloc(len(keys))
        jid = t.submit(kind, keys, slots, absent=absent, absent_what=absent_what)
        t.poison_on_report.add(jid)
        for s in slots:
            self.slots[s] = (kind, jid, note)
        return jid

    def check(self) -> None:
        """Fail if a slot of a reported job no longer holds the poison."""
        t = self.t
        pat = poison(t.slot_bytes)
        for s, (kind, jid, note) in self.slots.items():
            r = t.results.get(jid)
            if r is not None and t.arena[s] != pat:
                how = f"reported failed ({r.error})" if r.failed_keys else "reported"
                fail(f"rule 6: slot {s} of {kind} job {jid}{' (' + note + ')' if note else ''} was written "
                     f"after the job was {how}: a tier never touches a slot once its job is reported")

    def watch(self, seconds: float) -> None:
        """Check for ``seconds``, polling the tier meanwhile (a late result fails too)."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            if time.monotonic() > deadline:
                return
            self.t.poll()
            time.sleep(0.01)

    def release(self) -> None:
        """Give the slots back to the instance."""
        self.t.release(self.slots)
        self.slots.clear()
