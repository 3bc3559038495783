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
:data:`MIN_SAMPLES` samples (before that, everything is loaded, as without the feature, but
for the two rules on first loads below).
A tier that loses is answered as if its chunks were missing from the first of them: the
engine recomputes them. One decision in :data:`PROBE_EVERY` in a row that would leave a tier
out loads from it instead (a probe, when none of the tier's loads is in flight), so a tier
that got faster is seen again.

Learning costs loads, and a tier's first loads are the ones nothing is known of. So:

- until a tier's first load is timed, it has one load at a time: a lookup while that load is
  in flight (``loading``) recomputes instead of waiting for a tier that may take any time;
- before the fit has its samples, a tier whose every timed load took more than
  :data:`DECISIVE` times the recompute of its tokens, divided by the number of those loads
  (but never below :data:`MARGIN`), loses at once: one load over 4x, two each over 2x, three
  over 1.33x, four or more over 1.25x (the probes correct loads that were slow by accident).
  Evidence that agrees shortens the learning: with a fixed factor, a tier between 1.25x and 4x
  took 8 slow loads to be known, and a prefill fit moving around 4x (a busy engine) flipped
  its decisions back and forth.

So a tier slower than recompute costs one load's wait on one request, not a wait on every
request in flight while its fit learns. Each decision is counted (``decisions``: ``(tier,
"load" | "recompute")`` -> lookups; under vLLM, one per request, tier and step), as
``kvtiers_load_decisions_total`` on /metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

__all__ = ["ALPHA", "DECISIVE", "MARGIN", "MIN_SAMPLES", "PROBE_EVERY", "CostFit", "LoadCosts"]

#: weight of the newest sample in each fit (the rest decays by ``1 - ALPHA``)
ALPHA = 0.1
#: a tier's load is skipped only when it is expected to take this many times the recompute
MARGIN = 1.25
#: samples each fit needs before it decides from its prediction
MIN_SAMPLES = 8
#: before its fit has its samples, a tier whose every load took this many times the recompute of
#: its tokens (or more), divided by the number of its timed loads (never below MARGIN), loses
DECISIVE = 4.0
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
        self.fastest = float("inf")  # the least seconds per unit of any sample
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
        self.fastest = min(self.fastest, seconds / size)

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

    def decide(self, tier: str, chunks: int, tokens: int, loading: int = 0) -> str | None:
        """``"load"`` or ``"recompute"`` for ``chunks`` chunks (``tokens`` tokens) from ``tier``;
        None (load, undecided) while the fits have too few samples (see the module).
        ``loading``: the tier's loads in flight now, other than this lookup's."""
        fit = self.loads.get(tier)
        if fit is None or fit.samples == 0:
            return "recompute" if loading else None  # one load at a time finds out what one costs
        if self.prefill.samples < self.min_samples:
            return None
        recompute = self.prefill.predict(tokens)
        if fit.samples >= self.min_samples:
            loses = fit.predict(chunks) > self.margin * recompute
        elif fit.fastest * chunks > max(self.margin, DECISIVE / fit.samples) * recompute:
            loses = True
        else:
            return None
        if not loses:
            self._skipped[tier] = 0
            return "load"
        self._skipped[tier] += 1
        if self.probe_every and self._skipped[tier] >= self.probe_every and not loading:
            self._skipped[tier] = 0
            return "load"  # a probe, so the fit sees the tier as it is now
        return "recompute"

    def cut(self, sources: Sequence[str], tokens_per_chunk: int | None, host: str,
            loading: Mapping[str, int] | None = None) -> int:
        """How many leading chunks of a lookup's prefix to offer: ``sources`` names where each
        comes from (``host``: the host cache, never cut); ``loading``: each tier's loads in
        flight. Counts each tier's decision."""
        if not self.enabled or not tokens_per_chunk:
            return len(sources)
        counts = Counter(s for s in sources if s != host)
        end = len(sources)
        for tier, n in counts.items():
            decision = self.decide(tier, n, n * tokens_per_chunk, (loading or {}).get(tier, 0))
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
