"""What a kvtiers tier adds to vLLM's offloading metrics.

vLLM's tiering manager already counts, per tier, the bytes and seconds of every job, lookup
queries and hits, and failed jobs, from what the adapter reports. These are the facts only
the tier knows: keys it removed on its own (eviction, gc, corruption), keys that failed
inside jobs, and its backlog. Each series carries the label ``kvtiers_tier`` (vLLM's tier
type, e.g. ``kvtiers_fs``).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from ...metrics import LATENCY_BUCKETS

REMOVED = "vllm:kv_offload_kvtiers_removed_chunks"
FAILED = "vllm:kv_offload_kvtiers_failed_chunks"
BACKLOG = "vllm:kv_offload_kvtiers_backlog_jobs"
LABEL = "kvtiers_tier"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The Prometheus definitions vLLM registers for a kvtiers secondary tier."""
    return {
        REMOVED: OffloadingCounterMetadata(
            documentation="Chunks a kvtiers tier removed on its own (evicted, gc, corrupt), by tier and reason.",
            labelnames=(LABEL, "reason"),
        ),
        FAILED: OffloadingCounterMetadata(
            documentation="Chunks that failed inside kvtiers tier jobs, by tier and direction (load, store).",
            labelnames=(LABEL, "op"),
        ),
        BACKLOG: OffloadingGaugeMetadata(
            documentation="Jobs a kvtiers tier has accepted and not yet reported.",
            labelnames=(LABEL,),
        ),
    }


class TierStats:
    """Counters collected between two ``get_stats`` calls; ``removed`` is safe from any thread."""

    def __init__(self, tier_type: str) -> None:
        self.tier_type = tier_type
        self._lock = threading.Lock()
        self._removed: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()

    def removed(self, n: int, reason: str) -> None:
        with self._lock:
            self._removed[reason] += n

    def failed(self, n: int, op: str) -> None:
        if n:
            with self._lock:
                self._failed[op] += n

    def take(self, backlog: int) -> Any:
        """An ``OffloadingConnectorStats`` with what happened since the last call."""
        with self._lock:
            removed, self._removed = self._removed, Counter()
            failed, self._failed = self._failed, Counter()
        stats = OffloadingConnectorStats()
        for reason, n in sorted(removed.items()):
            stats.increase_counter(REMOVED, n, labelvalues=(self.tier_type, reason))
        for op, n in sorted(failed.items()):
            stats.increase_counter(FAILED, n, labelvalues=(self.tier_type, op))
        stats.set_gauge(BACKLOG, backlog, labelvalues=(self.tier_type,))
        return stats


# --- kvtiers' own series (docs/observability.md), through vLLM's offloading stats ----------------
#
# Under vLLM the tiers run in the engine process, and vLLM's /metrics is served by the API
# server process from its own registry: series a tier registers with prometheus_client in the
# engine process never reach it. vLLM's offloading stats do: definitions declared by the spec
# and tier classes (build_metric_definitions) become Prometheus families in the API server,
# and the values travel with each step's KV connector stats. So the kvtiers_tier_* and
# kvtiers_host_* series are declared and reported that way, under the names
# docs/observability.md gives (a counter ``x`` is exposed as ``x_total``).

TIER_LABEL = "tier"
_TIER_COUNTERS = {
    "kvtiers_tier_chunk_queries": ("queries", "Chunk keys a tier was asked about (lookup)."),
    "kvtiers_tier_chunk_hits": ("hits", "Chunk keys a tier answered HIT."),
    "kvtiers_tier_chunk_misses": ("misses", "Chunk keys a tier answered MISS."),
    "kvtiers_tier_chunk_retries": ("retries", "Chunk keys a tier answered RETRY."),
    "kvtiers_tier_read_bytes": ("read_bytes", "Bytes loaded from a tier into the host arena."),
    "kvtiers_tier_read_seconds": ("read_seconds", "Seconds of load jobs (submit to completion)."),
    "kvtiers_tier_write_bytes": ("write_bytes", "Bytes stored from the host arena into a tier."),
    "kvtiers_tier_write_seconds": ("write_seconds", "Seconds of store jobs (submit to completion)."),
}
LOOKUP_SECONDS = "kvtiers_tier_lookup_duration_seconds"
JOB_FAILURES = "kvtiers_tier_job_failures"
IN_FLIGHT = "kvtiers_tier_jobs_in_flight"
TIER_BACKLOG = "kvtiers_tier_backlog"
EVICTIONS = "kvtiers_tier_evictions"
REUSE_CEILING = "kvtiers_reuse_ceiling"
LOAD_DECISIONS = "kvtiers_load_decisions"
PIN_EVENTS = "kvtiers_pin_chunks"
ADMISSION = "kvtiers_tier_admission_chunks"
HOST_SLOTS = "kvtiers_host_slots"
HOST_USED = "kvtiers_host_used_slots"
HOST_PINNED = "kvtiers_host_pinned_slots"
HOST_LOADS = "vllm:kv_offload_kvtiers_loads"


def tier_series_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The kvtiers_tier_* families, label ``tier`` (the vLLM tier type, e.g. ``kvtiers_fs``)."""
    defs: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
        for name, (_, doc) in _TIER_COUNTERS.items()
    }
    defs[LOOKUP_SECONDS] = OffloadingHistogramMetadata(documentation="Time of one lookup call on the engine thread.",
                                                       labelnames=(TIER_LABEL,), buckets=LATENCY_BUCKETS)
    defs[JOB_FAILURES] = OffloadingCounterMetadata(
        documentation="Jobs with at least one failed key, or whose submit raised.",
        labelnames=(TIER_LABEL, "kind", "reason"))
    defs[IN_FLIGHT] = OffloadingGaugeMetadata(documentation="Jobs submitted to a tier and not reported yet.",
                                              labelnames=(TIER_LABEL, "kind"))
    defs[TIER_BACKLOG] = OffloadingGaugeMetadata(
        documentation="Accepted jobs not reported yet, as the tier says (backlog hook).", labelnames=(TIER_LABEL,))
    defs[EVICTIONS] = OffloadingCounterMetadata(
        documentation="Chunks a tier removed on its own (ctx.removed), by reason.", labelnames=(TIER_LABEL, "reason"))
    defs[REUSE_CEILING] = OffloadingGaugeMetadata(  # kvtiers.engine.reuse
        documentation="Share of chunk offers that repeat an earlier one within the window: the hit rate an "
                      "unbounded cache would reach (HyperLogLog estimate).", labelnames=(TIER_LABEL, "window"))
    defs[LOAD_DECISIONS] = OffloadingCounterMetadata(  # kvtiers.engine.costs
        documentation="Chunk lookups a tier answered HIT (load) or MISS because the load was expected to take "
                      "longer than recomputing (recompute), recompute_when_faster.",
        labelnames=(TIER_LABEL, "decision"))
    defs[PIN_EVENTS] = OffloadingCounterMetadata(  # kvtiers.integrations.vllm.pins
        documentation="Chunk keys of requests' kvtiers_pin fields, by event: pinned or refused by the tier, "
                      "bad_field (requests whose field was not understood; one each).",
        labelnames=(TIER_LABEL, "event"))
    defs[ADMISSION] = OffloadingCounterMetadata(  # kvtiers.engine.admission, the "admit" option
        documentation="Chunks of vLLM's stores a tier's \"admit\" option sent down (admitted) or kept back "
                      "(declined: offered fewer than min_offers times).",
        labelnames=(TIER_LABEL, "decision"))
    return defs


def host_series_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The kvtiers_host_* gauges: vLLM's CPU primary tier is the host arena."""
    return {
        HOST_SLOTS: OffloadingGaugeMetadata(documentation="Slots of the host arena (vLLM's CPU primary tier rows)."),
        HOST_USED: OffloadingGaugeMetadata(documentation="Slots of the host arena holding a chunk."),
        HOST_PINNED: OffloadingGaugeMetadata(documentation="Slots pinned by a transfer or a request."),
        HOST_LOADS: OffloadingCounterMetadata(
            documentation="Load jobs from the host arena into the device cache, by mode: sync (within the step "
                          "that schedules the request, kvtiers_sync_load) or async (one step later, vLLM's way).",
            labelnames=("mode",)),
    }


class TierSeries:
    """What a kvtiers tier did since the last :meth:`take`, as kvtiers_tier_* stats.

    ``observer`` is the :class:`kvtiers.metrics.TierObserver` wrapped around the tier's hooks
    (the same counting as in kvtiers' own manager); lookup times are the adapter's samples.
    """

    def __init__(self, label: str, observer: Any) -> None:
        self.label = label
        self.observer = observer
        self._lookups: list[float] = []
        self._last: dict[str, Any] = {}
        self._first = True

    def lookup_took(self, seconds: float) -> None:
        self._lookups.append(seconds)

    def _delta(self, key: str, now: Any) -> Any:
        before = self._last.get(key)
        if isinstance(now, Counter):
            with self.observer._lock:  # evictions grow on the tier's threads
                now = now.copy()
            self._last[key] = now
            return {k: v - (before or Counter())[k] for k, v in now.items()}
        self._last[key] = now
        return now - (before or 0)

    def take(self, stats: Any) -> None:
        """Add the increments since the last call to ``stats`` (an ``OffloadingConnectorStats``)."""
        s = self.observer.stats
        lab = (self.label,)
        for name, (attr, _) in _TIER_COUNTERS.items():
            d = self._delta(attr, getattr(s, attr))
            if d or self._first:
                stats.increase_counter(name, d, labelvalues=lab)
        for (kind, reason), n in self._delta("failures", s.failures).items():
            if n:
                stats.increase_counter(JOB_FAILURES, n, labelvalues=(self.label, kind, reason))
        for reason, n in self._delta("evictions", s.evictions).items():
            if n:
                stats.increase_counter(EVICTIONS, n, labelvalues=(self.label, reason))
        for kind in ("store", "load"):
            stats.set_gauge(IN_FLIGHT, s.in_flight[kind], labelvalues=(self.label, kind))
        samples, self._lookups = self._lookups, []
        for dt in samples:
            stats.observe_histogram(LOOKUP_SECONDS, dt, labelvalues=lab)
        self._first = False

    def backlog(self, stats: Any, backlog: int) -> None:
        stats.set_gauge(TIER_BACKLOG, backlog, labelvalues=(self.label,))

    def reuse(self, stats: Any, ceilings: dict[str, float | None]) -> None:
        """The reuse ceiling per window (kvtiers.engine.reuse), once there were offers."""
        for window, value in ceilings.items():
            if value is not None:
                stats.set_gauge(REUSE_CEILING, value, labelvalues=(self.label, window))

    def decisions(self, stats: Any, decisions: Counter) -> None:
        """Load-or-recompute decisions since the last call (kvtiers.engine.costs)."""
        for (_, decision), n in self._delta("decisions", Counter(decisions)).items():
            if n:
                stats.increase_counter(LOAD_DECISIONS, n, labelvalues=(self.label, decision))

    def admission(self, stats: Any, counts: dict[str, int]) -> None:
        """The ``"admit"`` option's decisions since the last call (``{"admitted": n, "declined": n}``)."""
        for decision, n in self._delta("admission", Counter(counts)).items():
            if n:
                stats.increase_counter(ADMISSION, n, labelvalues=(self.label, decision))

    def pins(self, stats: Any, counts: Counter) -> None:
        """Requests' pins since the last call (kvtiers.integrations.vllm.pins, ``RequestPins.counts``)."""
        for event, n in self._delta("pins", Counter(counts)).items():
            if n:
                stats.increase_counter(PIN_EVENTS, n, labelvalues=(self.label, event))


def host_stats(primary: Any, loads: Counter[str] | None = None) -> Any:
    """The kvtiers_host_* gauges of vLLM's CPU primary tier (its chunk pool's counts), and the
    load jobs by mode since the last call (``loads``: ``{"sync": n, "async": n}``) if counted."""
    stats = OffloadingConnectorStats()
    for mode, n in sorted((loads or {}).items()):
        if n:
            stats.increase_counter(HOST_LOADS, n, labelvalues=(mode,))
    slots = int(getattr(primary, "_num_chunks", 0))
    used = int(getattr(primary, "_num_allocated_chunks", 0)) - len(getattr(primary, "_free_list", ()))
    pinned = used - int(getattr(primary, "_num_evictable_cache_chunks", 0))
    stats.set_gauge(HOST_SLOTS, slots)
    stats.set_gauge(HOST_USED, max(used, 0))
    stats.set_gauge(HOST_PINNED, max(pinned, 0))
    return stats
