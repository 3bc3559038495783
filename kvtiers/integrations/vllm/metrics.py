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
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

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
