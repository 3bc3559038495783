"""A Hypothesis state machine: random store / load / lookup / reopen sequences checked
against a reference model (the set of stored keys; a key's bytes are a function of it).

``reopen`` (close, then a new instance on the same backend) runs only when ``durable`` is
being checked. The run is seeded by the harness seed (``--seed``), and draws
``Limits.examples`` examples of up to ``Limits.steps`` steps.
"""

from __future__ import annotations

import os

from kvtiers import Lookup

from ..harness import ConformanceFailure, Harness, Instance, NotCertified, fail, qkey
from ..rules import check

try:
    import hypothesis
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
except ImportError:  # the stateful check is skipped, the rest of the suite runs
    hypothesis = None  # type: ignore[assignment]

#: key suffixes the machine draws from: plain, hostile, and near-aliases of each other
SUFFIXES: list[bytes] = [b"a", b"b", b"a/b", b"ab", b"a\x00b", b"..", b"../x", b"\xff" * 8, b"x" * 60, b"x" * 59,
            b"\x00", b"/", b"k1", b"k2", b"k3", b"K1"]


def machine_for(h: Harness) -> type:
    """The state machine class bound to harness ``h``."""
    durable = "durable" in h.levels
    key_sets = st.lists(st.integers(0, len(SUFFIXES) - 1), max_size=6, unique=True)

    class TierMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.salt = os.urandom(4)
            self.t: Instance = h.open(num_slots=64)
            self.model: set[bytes] = set()

        def keys(self, idx: list[int]) -> list[bytes]:
            return [(self.salt + SUFFIXES[i])[:64] for i in idx]

        @rule(idx=key_sets)
        def store(self, idx: list[int]) -> None:
            keys = self.keys(idx)
            self.t.store(keys)
            self.model.update(keys)

        @rule(idx=key_sets)
        def load(self, idx: list[int]) -> None:
            keys = self.keys(idx)
            jid = self.t.submit("load", keys, absent=[k for k in keys if k not in self.model])
            r = self.t.wait([jid])[jid]  # good keys are byte-checked by the harness
            for k in keys:
                if k in self.model and k in r.failed_keys:
                    fail(f"rule 2: load of stored key {qkey(k)} failed: {r.error}")
                if k not in self.model and k not in r.failed_keys:
                    fail(f"rule 4: load of never-stored key {qkey(k)} reported success")

        @rule(idx=key_sets)
        def lookup(self, idx: list[int]) -> None:
            keys = self.keys(idx)
            for k, a in zip(keys, self.t.resolve(keys), strict=True):
                want = Lookup.HIT if k in self.model else Lookup.MISS
                if a is not want:
                    fail(f"rule 2: key {qkey(k)} answers {a.name}, the model says {want.name}")

        @rule(store=key_sets, load=key_sets)
        def overlap(self, store: list[int], load: list[int]) -> None:
            """A store and a load of already-stored keys in flight together."""
            stored = [k for k in self.keys(load) if k in self.model]
            ids = [self.t.submit("store", self.keys(store)), self.t.submit("load", stored)]
            for r in self.t.wait(ids).values():
                if not r.ok:
                    fail(f"a store, or a load of stored keys, failed: {r.error}")
            self.model.update(self.keys(store))

        @precondition(lambda self: durable)
        @rule()
        def reopen(self) -> None:
            self.close()
            self.t = h.open(num_slots=64)

        def close(self) -> None:
            self.t.close()
            h.instances.remove(self.t)  # keep memory flat over many examples

        def teardown(self) -> None:
            self.close()

    return TierMachine


@check(3, "stateful")
def stateful(h: Harness) -> None:
    """Random store/load/lookup(/reopen) sequences agree with a reference model."""
    if hypothesis is None:
        raise NotCertified("hypothesis is not installed (pip install hypothesis)")
    lim = h.limits
    machine = hypothesis.seed(h.seed)(machine_for(h))
    lines: list[str] = []
    with hypothesis.reporting.with_reporter(lines.append):
        try:
            run_state_machine_as_test(machine, settings=settings(
                max_examples=lim.examples, stateful_step_count=lim.steps, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=False,
                phases=[p for p in hypothesis.Phase if lim.shrink or p is not hypothesis.Phase.shrink],
            ))
        except ConformanceFailure as e:
            text = "\n".join(lines + list(getattr(e, "__notes__", ()))).split("Explanation:")[0]
            steps = "; ".join(x.strip() for x in text.splitlines() if x.strip().startswith("state."))
            raise ConformanceFailure(f"{e} [stateful steps: {steps[:400]}]") from None
        finally:
            for inst in h.instances:  # examples that failed mid-way leave instances open
                if not inst.closed:
                    try:
                        inst.close()
                    except ConformanceFailure:
                        pass
