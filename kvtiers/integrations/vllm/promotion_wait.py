"""Promotions finished in the scheduler step that finds them (``kvtiers_promotion_wait_ms``).

vLLM's tiering manager answers a chunk found in a secondary tier with ``HIT_PENDING``: it
reserves a primary row, submits the load at the end of the step (``on_schedule_end``) and
polls it at the next step's first lookup. vLLM's scheduler defers a request with any
``HIT_PENDING`` chunk, so every request whose prefix comes from a tier waits one whole engine
step (a forward pass of everything running: 0.1-1 s on a busy CPU server) for a load that
takes a few milliseconds. That wait is vLLM's ``lookup_async_delay``.

:func:`install` wraps the manager's ``lookup``: when a lookup has just started a promotion
for a request, it also starts the promotions of the request's following chunks (the keys
vLLM's scheduler recorded for the request, in order, up to the first one that is not a hit),
submits them at once as the step's promotions, and waits for them, at most the step's budget
in all; the lookup then answers ``HIT`` and the request is scheduled in this step. A load not
done within the budget, or a failed key, is what vLLM would have seen anyway (``HIT_PENDING``,
then the next step's poll; a failed key is a ``MISS``).

vLLM's scheduler pins a request's HIT chunks (``prepare_load``) only after its scan, and a
promotion's row may be taken by evicting an unpinned chunk, even one this scan already
answered HIT. vLLM never loads such a scan, because a promotion always defers it. So here a
request is waited for at most once per step (a later promotion of it in the step is deferred,
as in vLLM), and after the wait every chunk the scan answered before must still be in the
primary tier; if a promotion evicted one, the answer stays ``HIT_PENDING`` (deferred). The budget (milliseconds of
scheduler time per step, default :data:`DEFAULT_WAIT_MS`) is ``kvtiers_promotion_wait_ms`` in
``kv_connector_extra_config``; 0 (the default) turns the wait off.

Off by default because the wait blocks the scheduler, so every running request waits with
it: on a real ``vllm serve`` under load (24 prefixes, C=4) the waits took vLLM's
``lookup_async_delay`` from 3.2 s to 0 but served fewer requests per second (6.79 against
7.39 on a quiet machine, 5.12 against 8.49 on a busy one) with a longer TTFT. It helps where
steps are long and requests few (docs/vllm.md, "Lookups that wait").
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext

from .compat import missing

log = logging.getLogger("kvtiers.integrations.vllm")

#: scheduler milliseconds per step spent waiting for promotions, by default
DEFAULT_WAIT_MS = 0.0
_POLL_S = 0.0002


class PromotionWait:
    """The wrapper of one tiering manager's ``lookup`` and ``on_schedule_end`` (see the module)."""

    def __init__(self, manager: Any, budget_ms: float) -> None:
        if budget_ms < 0:
            raise ValueError(f"kvtiers_promotion_wait_ms must be >= 0, got {budget_ms}")
        self.manager = manager
        self.budget_s = budget_ms / 1000.0
        self.spent_s = 0.0  # this step's
        self.waits = 0  # waits started
        self._asked: dict[str, list[OffloadKey]] = {}  # this step: req_id -> keys looked up, in order
        self._waited: set[str] = set()  # this step: requests waited for
        self.done_in_step = 0  # waits whose promotions all finished within the budget
        #: HIT_PENDING answers left as they are, by why: "budget" (this step's spent), "again" (the
        #: request was waited for this step), "other" (not this request's promotion: a store in
        #: flight, another request's), "evicted" (a promotion evicted a chunk the scan answered HIT),
        #: "late" (the loads outlasted the budget)
        self.deferred = {"budget": 0, "again": 0, "other": 0, "evicted": 0, "late": 0}
        self._lookup = manager.lookup
        self._on_schedule_end = manager.on_schedule_end
        manager.lookup = self.lookup
        manager.on_schedule_end = self.on_schedule_end

    def on_schedule_end(self, context: Any) -> None:
        """vLLM's end of step; a new step has a new budget."""
        self.spent_s = 0.0
        self._asked.clear()
        self._waited.clear()
        self._on_schedule_end(context)

    def lookup(self, key: OffloadKey, req_context: ReqContext, **kw: Any) -> LookupResult:
        """vLLM's lookup; a promotion it starts is finished before it answers, within the budget."""
        if kw:  # a peer's lookup through serve_external_requests: as vLLM does it
            return self._lookup(key, req_context, **kw)
        req_id = req_context.req_id
        asked = self._asked.setdefault(req_id, [])
        res = self._lookup(key, req_context)
        why = None
        if res is not LookupResult.HIT_PENDING:
            pass
        elif req_id in self._waited:
            why = "again"
        elif self.spent_s >= self.budget_s:
            why = "budget"
        elif not self._queued(req_id):
            why = "other"  # pending for another reason: a store in flight, another request's promotion
        if res is not LookupResult.HIT_PENDING or why is not None:
            if why is not None:
                self.deferred[why] += 1
            asked.append(key)
            return res
        self._waited.add(req_id)
        t0 = time.perf_counter()
        try:
            self._queue_following(key, req_context)
            if self._wait(req_id, t0 + self.budget_s - self.spent_s):
                self.done_in_step += 1
            res = self._lookup(key, req_context)
            primary = self.manager.primary_tier
            if res is LookupResult.HIT and any(primary.lookup(k, req_context) is not LookupResult.HIT for k in asked):
                res = LookupResult.HIT_PENDING  # a promotion evicted a chunk this scan answered HIT: defer
                self.deferred["evicted"] += 1
            elif res is LookupResult.HIT_PENDING:
                self.deferred["late"] += 1
        except Exception as e:  # never worse than vLLM's own path
            log.warning("kvtiers: waiting for a promotion failed (%s: %s); vLLM polls it next step",
                        type(e).__name__, e)
            res = LookupResult.HIT_PENDING
        finally:
            self.waits += 1
            self.spent_s += time.perf_counter() - t0
        asked.append(key)
        return res

    def _queued(self, req_id: str) -> bool:
        pending = getattr(self.manager, "_pending_load_submissions", None) or {}
        return any(req_id in by_req for by_req in pending.values())

    def _queue_following(self, key: OffloadKey, req_context: ReqContext) -> None:
        """Look up the request's chunks after ``key`` (their promotions queue up) to the first
        that is neither a hit nor a pending hit: the scheduler asks them next anyway."""
        positions = getattr(req_context, "_offload_key_positions", None)
        if not positions or key not in positions:
            return
        keys = list(positions)
        last = positions[key]
        for k in keys[keys.index(key) + 1:]:
            pos = positions[k]
            if pos <= last:  # the next KV group's keys start over
                return
            last = pos
            if self._lookup(k, req_context) not in (LookupResult.HIT, LookupResult.HIT_PENDING):
                return

    def _wait(self, req_id: str, deadline: float) -> bool:
        """Submit the step's queued promotions now; poll until this request's are done or the
        deadline passes. True if they are done."""
        m = self.manager
        m._flush_pending_promotions()
        mine = [j for j, meta in m._jobs.items()
                if meta.transfer_job.is_promotion and meta.transfer_job.req_context.req_id == req_id]
        while True:
            m._process_finished_jobs()
            if not any(j in m._jobs for j in mine):
                return True
            if time.perf_counter() >= deadline:
                return False
            time.sleep(_POLL_S)


def install(manager: Any, extra_config: dict[str, Any]) -> PromotionWait | None:
    """Wrap ``manager`` (vLLM's tiering manager) unless it has no secondary tier or the budget is 0."""
    budget = extra_config.get("kvtiers_promotion_wait_ms", DEFAULT_WAIT_MS)
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise ValueError(f"kvtiers_promotion_wait_ms must be a number of milliseconds, got {budget!r}")
    if not budget or not getattr(manager, "secondary_tiers", None):
        return None
    lacks = missing(manager, ("_pending_load_submissions", "_flush_pending_promotions", "_jobs",
                              "_process_finished_jobs", "primary_tier"))
    if lacks:
        log.warning("kvtiers: this vLLM's tiering manager (%s) has no %s: kvtiers_promotion_wait_ms is off",
                    type(manager).__name__, ", ".join(lacks))
        return None
    return PromotionWait(manager, float(budget))
