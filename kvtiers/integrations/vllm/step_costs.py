"""The engine's prefill cost under vLLM, measured from the scheduler's steps.

Load or recompute (``recompute_when_faster``, kvtiers/engine/costs.py) needs what the engine's
prefill of ``n`` tokens costs. vLLM's scheduler-side connector sees no model timing, but it
sees every step: :func:`install` wraps, once per process, the offloading connector's
``build_connector_meta`` (called once per scheduler step with the step's
``SchedulerOutput``), and the time from one step's call to the next is that step's engine
time, for its ``total_num_scheduled_tokens``. Each step is one sample of the prefill fit
shared by the manager's kvtiers secondary tiers (``seconds = latency + tokens x per_token``:
the per-token term is what one more token costs in a step, decode tokens included).

A gap between steps longer than :data:`IDLE_FACTOR` times the fitted time of the step, once
the fit has its samples, is an idle engine (no request to schedule), not a step: skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...engine.costs import CostFit

log = logging.getLogger("kvtiers.integrations.vllm")

_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
#: a gap this many times the fitted step time is idleness, not a step
IDLE_FACTOR = 10.0
#: the connector scheduler's attribute holding its :class:`StepMeter`
METER_ATTR = "_kvtiers_step_meter"

_lock = threading.Lock()
_installed = False


class StepMeter:
    """Step times of one scheduler, fed to the prefill fit of its kvtiers tiers."""

    def __init__(self, tiers: list[Any], min_samples: int) -> None:
        self.prefill = CostFit()
        self.min_samples = min_samples
        self.skipped = 0  # gaps taken for idleness
        for t in tiers:  # one fit for all: the engine is the same
            t.costs.prefill = self.prefill
        self._last: tuple[float, int] | None = None

    def step(self, tokens: int, now: float | None = None) -> None:
        """A step scheduling ``tokens`` tokens starts (at ``now``); the previous one ended."""
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (now, int(tokens))
        if last is None or last[1] <= 0:
            return
        seconds = now - last[0]
        fit = self.prefill
        if fit.samples >= self.min_samples and seconds > IDLE_FACTOR * max(fit.predict(last[1]), 1e-4):
            self.skipped += 1
            return
        fit.add(last[1], seconds)


def meter_for(scheduler: Any) -> StepMeter | None:
    """The scheduler's meter, made on first use; None when its manager has no kvtiers tier
    that decides (``recompute_when_faster`` off, or no tokens per chunk)."""
    meter = getattr(scheduler, METER_ATTR, False)
    if meter is not False:
        return meter
    # a kvtiers tier is known by its load-cost model (no import of .tier: it imports this module)
    tiers = [t for t in getattr(getattr(scheduler, "manager", None), "secondary_tiers", ()) or ()
             if getattr(getattr(t, "costs", None), "enabled", False) and getattr(t, "tokens_per_chunk", None)]
    meter = StepMeter(tiers, min(t.costs.min_samples for t in tiers)) if tiers else None
    setattr(scheduler, METER_ATTR, meter)
    return meter


def install() -> bool:
    """Wrap vLLM's offloading connector scheduler's ``build_connector_meta`` (once per
    process); False where this vLLM has no such method (nothing is measured then)."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            import importlib

            cls = importlib.import_module(_SCHEDULER).OffloadingConnectorScheduler
            orig = cls.build_connector_meta
        except (ImportError, AttributeError) as e:
            log.info("kvtiers: no offloading connector scheduler to time steps (%s): recompute_when_faster "
                     "does not decide under this vLLM", e)
            return False

        def build_connector_meta(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                meter = meter_for(self)
                if meter is not None:
                    meter.step(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
            except Exception as e:  # measuring must never stop a step
                log.debug("kvtiers: step timing failed: %s", e)
            return orig(self, scheduler_output, *args, **kwargs)

        build_connector_meta.__wrapped__ = orig  # type: ignore[attr-defined]
        cls.build_connector_meta = build_connector_meta
        _installed = True
        return True
