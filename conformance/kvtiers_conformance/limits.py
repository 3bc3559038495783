"""The numbers of the conformance suite: the rule bounds and the size of the test arena.

The defaults are DESIGN.md's, deliberately generous so a busy 2-core machine does not flake;
the arena is small so the suite is fast. Pass your own :class:`Limits` to
:func:`kvtiers_conformance.run_conformance` or set ``limits`` on a ``TierTests`` subclass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    """Bounds the rules are checked against and the shape of the test arena."""

    lookup_keys: int = 1000  #: rule 1: keys per timed lookup call
    lookup_ms: float = 50.0  #: rule 1: median lookup time bound
    repeats: int = 5  #: rule 1 and 8: timed calls; the median counts
    retry_s: float = 5.0  #: rule 1: RETRY must resolve within this
    finish_s: float = 30.0  #: rule 5: every accepted job reported within this
    poll_block_s: float = 1.0  #: rule 5: a get_finished_jobs call longer than this blocked
    submit_keys: int = 64  #: rule 8: keys of the timed submit
    submit_ms: float = 50.0  #: rule 8: median submit time bound
    jobs_in_flight: int = 64  #: rule 5: jobs submitted before the first poll
    big_job_keys: int = 512  #: rule 3: keys of the large job
    ownership_wait_s: float = 0.3  #: rule 6: how long poisoned slots are watched
    examples: int = 100  #: Hypothesis examples of the stateful test
    steps: int = 20  #: steps per stateful example
    shrink: bool = True  #: let Hypothesis shrink a failing stateful example (slower, clearer)
    slot_bytes: int = 4096  #: bytes per arena slot
    num_slots: int = 640  #: slots per instance arena (>= big_job_keys)
    bounded_slots: int = 16  #: rule 11: max_bytes = bounded_slots * slot_bytes
    crash_rounds: int = 3  #: rule 10: subprocesses killed mid-store
    crash_slot_bytes: int = 256 * 1024  #: rule 10: bigger slots widen the torn-write window
    async_op_timeout: float = 1.0  #: AsyncTier fault injection: op_timeout set on the instance
    close_grace_s: float = 2.0  #: rule 9: time allowed for a closed tier's threads to end
    check_s: float = 600.0  #: watchdog: a check still running after this FAILs (a hook blocked)

    def replace(self, **changes: object) -> Limits:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def with_overrides(self, changes: Mapping[str, Any], what: str = "--limits") -> Limits:
        """A copy with ``changes`` (field name to value, as from JSON) checked and applied.

        Raises :class:`ValueError` naming ``what`` and the field for an unknown name, a value
        of the wrong type, or a bound that is not positive.
        """
        fields = {f.name: f for f in dataclasses.fields(self)}
        checked: dict[str, object] = {}
        for name, value in changes.items():
            if name not in fields:
                raise ValueError(f"{what}: unknown limit {name!r} (known: {', '.join(fields)})")
            default = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
            if isinstance(default, bool):
                kind, ok = "true or false", isinstance(value, bool)
            elif isinstance(default, int):
                kind, ok = "a positive integer", number and isinstance(value, int)
            else:
                kind, ok = "a positive number", number
            if not ok:
                raise ValueError(f"{what}: {name} must be {kind}, got {value!r}")
            checked[name] = float(value) if isinstance(default, float) else value
        new = dataclasses.replace(self, **checked)
        if new.num_slots < new.big_job_keys:
            raise ValueError(f"{what}: num_slots ({new.num_slots}) must be at least big_job_keys ({new.big_job_keys})")
        return new

    def changed(self) -> dict[str, tuple[object, object]]:
        """The fields that differ from DESIGN.md's defaults: name to (value, default)."""
        return {f.name: (getattr(self, f.name), getattr(DEFAULT_LIMITS, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(DEFAULT_LIMITS, f.name)}


DEFAULT_LIMITS = Limits()
