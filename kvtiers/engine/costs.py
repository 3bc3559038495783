"""Load or recompute: what a load from each tier costs against the engine's prefill.

A prefix found only in a slow tier can take longer to load than to prefill again (a busy
object store, a throttled disk). :class:`LoadCosts` learns both costs while serving, with no
constants:

- per tier, the seconds of a load job of ``n`` chunks, fitted as ``latency + n * per_chunk``
  from the tier's finished load jobs (the manager feeds every successful one);
- the seconds of the engine's prefill of ``n`` tokens, fitted the same way from what the
  engine reports (:meth:`kvtiers.engine.manager.TieringManager.observe_prefill`).

Both fits weigh recent jobs more (exponential forgetting, :data:`ALPHA`). A lookup asks
:meth:`LoadCosts.cut` which of its tiers' chunks to load: for each tier, the chunks of the
prefix it alone serves are loaded unless the fitted load time exceeds the fitted recompute
time of their tokens by more than :data:`MARGIN`, once both fits have
:data:`MIN_SAMPLES` samples (before that, everything is loaded, as without the feature).
A tier that loses is answered as if its chunks were missing from the first of them: the
engine recomputes them. One decision in :data:`PROBE_EVERY` in a row that would leave a tier
out loads from it instead (a probe), so a tier that got faster is seen again. Each decision
is counted (``decisions``: ``(tier, "load" | "recompute")`` -> lookups), as
``kvtiers_load_decisions_total`` on /metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

__all__ = ["ALPHA", "MARGIN", "MIN_SAMPLES", "PROBE_EVERY", "CostFit", "LoadCosts"]

#: weight of the newest sample in each fit (the rest decays by ``1 - ALPHA``)
ALPHA = 0.1
#: a tier's load is skipped only when it is expected to take this many times the recompute
MARGIN = 1.25
#: samples each fit needs before it decides anything
MIN_SAMPLES = 8
#: a tier left out this many times in a row is loaded once more, so its fit keeps learning
#: (a tier that got faster is found again)
PROBE_EVERY = 32


class CostFit:
    """``seconds = latency + size * per_unit``, fitted by exponentially weighted least squares.

    With sizes that hardly vary, the fit is a plain ratio (no latency). Neither term is ever
    negative."""

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, size: float, seconds: float) -> None:
        """One observation: ``size`` units (> 0) took ``seconds`` (>= 0)."""
        if not size > 0 or not seconds >= 0:
            return
        keep = 1.0 - self.alpha
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + size
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + size * size
        self._xy = self._xy * keep + size * seconds
        self.samples += 1

    def terms(self) -> tuple[float, float]:
        """``(latency, per_unit)`` in seconds; ``(0, 0)`` before any sample."""
        if self._w <= 0 or self._x <= 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 1e-9 * mx * mx:
            slope = (self._xy / self._w - mx * my) / var
            latency = my - slope * mx
            if slope >= 0 and latency >= 0:
                return latency, slope
            if slope < 0:  # bigger jobs were faster: take the mean job time as a latency
                return my, 0.0
        return 0.0, self._y / self._x

    @property
    def mean_size(self) -> float:
        """The weighted mean size of the samples (0 before any)."""
        return self._x / self._w if self._w > 0 else 0.0

    def predict(self, size: float) -> float:
        """Expected seconds for ``size`` units."""
        latency, per_unit = self.terms()
        return latency + size * per_unit


class LoadCosts:
    """Per-tier load fits, the prefill fit, and the decisions made from them (see the module).

    ``enabled``: False turns the decisions off (everything found is loaded); the fits still
    learn, so :meth:`describe` shows what the decisions would be."""

    def __init__(self, *, enabled: bool = True, margin: float = MARGIN, min_samples: int = MIN_SAMPLES,
                 alpha: float = ALPHA, probe_every: int = PROBE_EVERY) -> None:
        self.enabled = enabled
        self.probe_every = probe_every
        self.margin = margin
        self.min_samples = min_samples
        self.alpha = alpha
        self.loads: dict[str, CostFit] = {}  # tier name -> seconds per load job of n chunks
        self.prefill = CostFit(alpha)  # seconds per prefill of n tokens
        self.decisions: Counter = Counter()  # (tier, "load" | "recompute") -> lookups
        self._skipped: Counter = Counter()  # tier -> "recompute" answers in a row

    def observe_load(self, tier: str, chunks: int, seconds: float) -> None:
        """A load job of ``chunks`` chunks from ``tier`` took ``seconds`` (submit to completion)."""
        fit = self.loads.get(tier)
        if fit is None:
            fit = self.loads[tier] = CostFit(self.alpha)
        fit.add(chunks, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed the KV of ``tokens`` prompt tokens in ``seconds``."""
        self.prefill.add(tokens, seconds)

    def decide(self, tier: str, chunks: int, tokens: int) -> str | None:
        """``"load"`` or ``"recompute"`` for ``chunks`` chunks (``tokens`` tokens) from ``tier``;
        None while either fit has fewer than ``min_samples`` samples."""
        fit = self.loads.get(tier)
        if fit is None or fit.samples < self.min_samples or self.prefill.samples < self.min_samples:
            return None
        if fit.predict(chunks) <= self.margin * self.prefill.predict(tokens):
            self._skipped[tier] = 0
            return "load"
        self._skipped[tier] += 1
        if self.probe_every and self._skipped[tier] % self.probe_every == 0:
            return "load"  # a probe: one load in probe_every, so the fit sees the tier as it is now
        return "recompute"

    def cut(self, sources: Sequence[str], tokens_per_chunk: int | None, host: str) -> int:
        """How many leading chunks of a lookup's prefix to offer: ``sources`` names where each
        comes from (``host``: the host cache, never cut). Counts each tier's decision."""
        if not self.enabled or not tokens_per_chunk:
            return len(sources)
        counts = Counter(s for s in sources if s != host)
        end = len(sources)
        for tier, n in counts.items():
            decision = self.decide(tier, n, n * tokens_per_chunk)
            if decision is None:
                continue
            self.decisions[(tier, decision)] += 1
            if decision == "recompute":
                end = min(end, sources.index(tier))
        return end

    def describe(self) -> dict[str, object]:
        """The fits and the decision counts, for logs and reports."""
        lat, per = self.prefill.terms()
        return {
            "enabled": self.enabled,
            "prefill": {"samples": self.prefill.samples, "latency_s": lat, "per_token_s": per},
            "tiers": {name: dict(zip(("latency_s", "per_chunk_s"), f.terms(), strict=True), samples=f.samples)
                      for name, f in self.loads.items()},
            "decisions": {f"{t}:{d}": n for (t, d), n in sorted(self.decisions.items())},
        }
