"""KvtiersTier: a kvtiers tier as a vLLM secondary tier (``SecondaryTierManager``).

vLLM's tiering manager keeps chunks in its CPU primary tier (a shared-memory region of
``num_chunks`` rows) and cascades every stored chunk to each secondary tier; a secondary hit
is promoted back into a primary row. The adapter hands the kvtiers tier that region as its
arena (row ``c`` is slot ``c``, zero-copy) and maps one call to one call:

==========================  ============================================================
vLLM                        kvtiers
==========================  ============================================================
``lookup(key, ctx)``        ``lookup([key])``: HIT, MISS, RETRY as they are (vLLM turns a
                            HIT into its own HIT_PENDING while it promotes); a RETRY is
                            asked again for at most ``retry_wait_ms`` per step
``submit_store(job)``       ``submit_store(Job(job_id, keys, chunk_ids))``
``submit_load(job)``        ``submit_load(Job(job_id, keys, chunk_ids))``
``get_finished_jobs()``     ``get_finished_jobs()``; a load with some failed keys reports
                            the others as ``successful_keys``
``drain_jobs()``            polls ``get_finished_jobs`` until every accepted job is back
``touch(keys, ctx)``        ``touch(keys)`` (vLLM 0.32 and 0.33 define it; none calls it)
``shutdown()``              ``close()``
``take_events()``           keys stored, and keys the tier removed (``ctx.removed``)
``get_stats()``             removed / failed chunks and backlog, and the kvtiers_tier_*
                            series (see ``metrics.py``)
==========================  ============================================================

Recency: vLLM 0.34 has no ``touch`` any more (and no scheduler of 0.32 or 0.33 called it),
so the adapter refreshes a key's recency in the kvtiers tier itself (``touch``) each time the
tier serves it: a lookup that answers HIT (vLLM asks a secondary tier only for what its
primary tier lacks, and promotes every HIT) and, under ``KvtiersOffloadingSpec``, each load
vLLM makes from its primary tier (:meth:`KvtiersTier.refresh`), so a chunk used often from the
host arena is not the first a bounded tier evicts (docs/vllm.md, "Recency").

A key whose load failed answers MISS until it is stored again, so a tier that keeps
answering HIT for a chunk it cannot read does not make vLLM promote it forever.

A tier whose ``get_finished_jobs`` raises (rule 4 says it never does) on every poll for
:data:`POLL_GIVE_UP_S` would leave vLLM waiting for its jobs forever. The adapter then gives
the tier up: it closes it (rule 9: every accepted job finished or failed, no thread left that
could still touch a slot), reports each job the tier did not report as failed, and from then
on answers MISS and fails every job at once, so vLLM recomputes instead of hanging.

A RETRY defers the request a whole engine step (vLLM asks again only in its next schedule),
while a tier resolves most of them in well under a millisecond (the fs tier's ``stat`` probe
of a key it does not know, which is every key of a new prompt). So the adapter asks a key
that answered RETRY again, every 0.2 ms, until it resolves or ``retry_wait_ms`` of this
step's scheduler time is spent (default :data:`DEFAULT_RETRY_WAIT_MS`, 0: pass RETRY as is; it blocks
the scheduler, see :mod:`.promotion_wait` for why the waits are off by default).
The tier's own lookup stays non-blocking (rule 1); only this adapter waits.

Load or recompute (kvtiers.engine.costs): a HIT that would load slower than vLLM recomputes
its tokens answers MISS. The decision is one per request, tier and scheduler step (kept in the
request's ``ReqContext``), so the chunks a request promotes in one step are one job or none; a
request deferred to a later step is decided again. The tier's loads in flight, for a request,
are the other requests' promotions not yet finished and the other requests granted a load in
this step (vLLM submits a step's promotions at its end).

Tenants: a request's ``cache_salt`` is its tenant (:mod:`.tenant` carries it in the
``ReqContext``). Each lookup, store and promotion is made as that tenant's (or no tenant's)
(:func:`kvtiers.encryption.tenants.as_tenant`), so an encrypted tier seals and opens the
job's keys with that tenant's key (docs/security.md#tenants); other tiers ignore it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...commands.bench.slowtier import parse_slow_loads
from ...encryption.tenants import as_tenant
from ...engine.admission import Admission
from ...engine.costs import LoadCosts
from ...engine.reuse import ReuseEstimator
from ...errors import ConfigError
from ...metrics import TierObserver
from ...registry import TierHandle, open_tier
from ...types import PAGE, Arena, Job, Lookup, Namespace, TierContext
from ...types import JobResult as TierResult
from ..keys import tier_key
from .compat import EVENT_REQ_CONTEXT, HAS_CONFIG_INFO, ConfigInfoMapping
from .metrics import TierSeries, TierStats, metric_definitions, tier_series_definitions
from .namespace import namespace_fields
from .pins import RequestPins
from .step_costs import install as install_step_costs
from .tenant import install as install_tenants
from .tenant import tenant_of

log = logging.getLogger("kvtiers.integrations.vllm")

_ANSWER = {Lookup.HIT: LookupResult.HIT, Lookup.MISS: LookupResult.MISS, Lookup.RETRY: LookupResult.RETRY}
_DRAIN_WARN_S = 10.0
#: seconds of polls that all raised before the adapter gives the tier up (see the module)
POLL_GIVE_UP_S = 10.0
#: scheduler milliseconds per step the adapter spends asking RETRY keys again, by default
DEFAULT_RETRY_WAIT_MS = 0.0
_RETRY_POLL_S = 0.0002
#: vLLM medium of a kvtiers tier, for vLLM's load filters and cache-hit sources; others are STORAGE
MEDIUM = {"memory": Medium.CPU, "p2p": Medium.CPU}


class _Offered(dict):
    """The keys a request has offered (in its ``ReqContext``), per kvtiers tier and count: for
    the reuse ceiling a promotion that failed and the store of the chunk vLLM then recomputed
    are one offer, as a load from the primary tier and a store of the same chunk are; for
    ``min_offers`` (which counts stores only) two stores of a chunk by one request are one."""


class _Decisions(dict):
    """A request's load-or-recompute decisions (in its ``ReqContext``): per kvtiers tier, the
    scheduler step it was made in and the decision."""


@dataclass
class _Pending:
    job: TransferJob
    keys: tuple[bytes, ...]  # the tier's keys, in the job's order
    t0: float = 0.0  # submitted (perf_counter)
    declined: frozenset[bytes] = frozenset()  # keys of a store not sent ("admit": kept back, or held already)


def _tokens_per_chunk(spec: Any) -> int | None:
    """Tokens per chunk of vLLM's offloading spec (blocks per chunk x tokens per block), or None."""
    try:
        return int(spec.blocks_per_chunk) * max(int(t) for t in spec.tokens_per_block)
    except (AttributeError, TypeError, ValueError):
        return None


def primary_arena(primary_kv_view: memoryview) -> tuple[Arena, memoryview]:
    """The primary tier's ``num_chunks x row_stride`` memoryview as a kvtiers arena.

    ``view[c]`` of a 2-D memoryview raises NotImplementedError, so the arena is built over
    the flat byte view, with the row stride as its slot size. Returns the arena and the flat
    view (released on shutdown).
    """
    mv = primary_kv_view
    if mv.ndim != 2 or mv.strides is None or not mv.c_contiguous:
        raise ConfigError(f"primary_kv_view must be a C-contiguous 2-D memoryview, got shape {mv.shape}")
    stride = mv.strides[0]
    if stride % PAGE:
        raise ConfigError(f"primary KV rows are {stride} bytes, not a multiple of {PAGE}: a kvtiers arena needs "
                          f"page-aligned slots")
    flat = mv.cast("B")
    return Arena(flat, stride, owner=mv), flat


class KvtiersTier(SecondaryTierManager):
    """Any kvtiers tier as a vLLM secondary tier.

    Configured in ``kv_connector_extra_config["secondary_tiers"]`` as
    ``{"type": "kvtiers_<name>", <the tier's options>}`` for a registered kvtiers tier
    (``kvtiers_fs``, ``kvtiers_memory``, ``kvtiers_obj``, a third-party one), or
    ``{"type": "kvtiers", "tier": "<name or pkg.module:Class>", ...}``; add
    ``"module_path": "kvtiers.integrations.vllm"`` where kvtiers' vLLM plugin is not loaded.
    Options of the adapter itself: ``tier``, ``namespace`` (extra namespace fields),
    ``enable_kv_events`` and ``locality`` (as vLLM's fs tier), ``retry_wait_ms`` (see the
    module), ``slow_loads`` (fault injection for benches: ``{"delay_ms", "per_chunk_ms"}``, each
    load job held back that long, kvtiers/commands/bench/slowtier.py), ``admit`` (``{"min_offers": N}``:
    chunks of vLLM's stores offered fewer than N times are kept back, docs/admission.md#under-vllm).
    Every other key is an option of the kvtiers tier, checked against its signature before it opens.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE
    #: the kvtiers tier of a generated ``kvtiers_<name>`` class; None: the ``tier`` option names it
    kvtiers_tier: ClassVar[str | None] = None

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        tier: str | None = None,
        namespace: dict | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        retry_wait_ms: float = DEFAULT_RETRY_WAIT_MS,
        slow_loads: dict | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        name = self._tier_name(tier_type, tier)
        self.admission = self._admission(tier_type, options.pop("admit", None))
        if type(self).kvtiers_tier is None and name in MEDIUM:  # the generic class: medium from the tier
            self.medium = MEDIUM[name]
            self.cache_hit_source = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}[self.medium]
        self.locality = Locality(locality) if locality is not None else None
        if isinstance(retry_wait_ms, bool) or not isinstance(retry_wait_ms, int | float) or retry_wait_ms < 0:
            raise ConfigError(f"secondary tier {tier_type!r}: 'retry_wait_ms' must be a number >= 0, "
                              f"got {retry_wait_ms!r}")
        self.retry_wait_s = retry_wait_ms / 1000.0
        try:
            slow = parse_slow_loads(slow_loads)
        except ValueError as e:
            raise ConfigError(f"secondary tier {tier_type!r}: {e}") from None
        extra = getattr(offloading_spec, "extra_config", None) or {}
        enabled = extra.get("recompute_when_faster", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"'recompute_when_faster' must be true or false, got {enabled!r}")
        self._retry_spent_s = 0.0  # this step's
        self._granted: set[str] = set()  # requests decided to load in this step (promotions not submitted yet)
        self._step = 0  # scheduler steps ended (on_schedule_end)
        if namespace is not None and not isinstance(namespace, dict):
            raise ConfigError(f"secondary tier {tier_type!r}: 'namespace' must be an object of extra fields")
        self.arena, self._flat = primary_arena(primary_kv_view)
        self.namespace = Namespace(namespace_fields(offloading_spec, self.arena.slot_bytes, namespace))
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False))
        if enable_kv_events and not events_on:
            log.warning("secondary tier %r: enable_kv_events is set but vLLM's KV cache events are off", tier_type)
        self._events: deque[OffloadingEvent] | None = deque() if enable_kv_events and events_on else None
        self._stats = TierStats(tier_type)
        self._jobs: dict[int, _Pending] = {}
        self._stash: list[TierResult] = []  # results drain_jobs collected for the next get_finished_jobs
        self._failed_loads: set[bytes] = set()  # answer MISS until stored again
        self._long: dict[bytes, OffloadKey] = {}  # tier key -> vLLM key, only for keys longer than 64 bytes
        self._lock = threading.Lock()  # _long, read by removals from the tier's threads
        self._closed = False
        self._given_up: str | None = None  # why the tier was closed while serving (see the module)
        self._poll_failing_since: float | None = None  # monotonic time of the first poll of a run that raised
        ctx = TierContext(self.arena, self.namespace, removed=self._on_removed)
        try:
            self.handle: TierHandle = open_tier(name, options, ctx)
        except BaseException:  # let go of vLLM's region, so its clean-up can unmap it
            self.arena.buffer.release()
            self._flat.release()
            raise
        self.kvtiers_name = name
        install_tenants()  # requests' cache_salt reaches lookup and jobs as their tenant
        # kvtiers' own counting around the tier's hooks, reported as kvtiers_tier_* through get_stats
        observer = TierObserver(tier_type, None)
        self.handle.add_wrapper(observer, name="kvtiers-metrics")
        ctx.add_removed_listener(observer.removed)
        if slow is not None:
            self.handle.add_wrapper(slow, name="kvtiers-slow-loads")
        self._series = TierSeries(tier_type, observer)
        #: told the vLLM keys of each promotion (the primary tier's kvtiers_bip policy, set by the spec)
        self.on_promotion: Callable[[Sequence[OffloadKey]], None] | None = None
        self.pins = RequestPins(name)  # requests' kv_transfer_params.kvtiers_pin (docs/pins.md#from-vllm)
        self.reuse = ReuseEstimator()  # the reuse ceiling of the keys vLLM stores and loads (docs/observability.md)
        # load or recompute (kvtiers.engine.costs): this tier's promotions timed here, the engine's steps
        # by .step_costs; a HIT whose load would take longer than its prefill answers MISS
        self.costs = LoadCosts(enabled=enabled)
        self.tokens_per_chunk = _tokens_per_chunk(offloading_spec)
        if enabled and self.tokens_per_chunk:
            install_step_costs()
        log.info("vLLM secondary tier %r: kvtiers tier %r, namespace %s, %d chunks of %d bytes",
                 tier_type, name, self.namespace.digest, len(self.arena), self.arena.slot_bytes)
        if not HAS_CONFIG_INFO:
            log.info("vLLM secondary tier %r: this vLLM has no config_info hooks; kvtiers_tier and "
                     "kvtiers_namespace are not added to vllm:kv_offload_config_info", tier_type)

    @staticmethod
    def _admission(tier_type: str, option: Any) -> Admission | None:
        """The ``"admit"`` option under vLLM's cascade (docs/admission.md#under-vllm): ``min_offers``
        only; write-back needs the primary tier's evictions, which vLLM does not report."""
        adm = Admission.from_option(tier_type, option)
        if adm is not None and adm.write_back:
            raise ConfigError(f"secondary tier {tier_type!r}: option 'admit': 'when': 'evicted' is not applied "
                              "under vLLM's tiering (vLLM does not report its primary tier's evictions); "
                              "use 'min_offers' or the default 'when': 'stored'")
        return adm if adm is not None and adm.counter is not None else None

    def _tier_name(self, tier_type: str, tier: str | None) -> str:
        fixed = type(self).kvtiers_tier
        if fixed is not None and tier is not None and tier != fixed:
            raise ConfigError(f"secondary tier {tier_type!r} is the kvtiers tier {fixed!r}; "
                              f"drop 'tier': {tier!r} or use type 'kvtiers'")
        name = tier if tier is not None else fixed
        if not name:
            raise ConfigError(f"secondary tier {tier_type!r}: name the kvtiers tier with 'tier' "
                              f"(a registered name such as 'fs', or 'pkg.module:Class'), or use type 'kvtiers_<name>'")
        return name

    # --- keys --------------------------------------------------------------------------------
    def _key(self, key: OffloadKey) -> bytes:
        k = tier_key(key)
        if len(key) != len(k) and self._events is not None:
            with self._lock:
                self._long[k] = key
        return k

    def _engine_key(self, k: bytes) -> OffloadKey:
        with self._lock:
            return self._long.get(k, OffloadKey(k))

    # --- lookup ------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        k = self._key(key)
        if k in self._failed_loads or self._given_up is not None:
            return LookupResult.MISS
        tenant = tenant_of(req_context)
        t0 = time.perf_counter()
        try:
            with as_tenant(self.handle, tenant):
                (answer,) = self.handle.lookup([k])
        except Exception as e:  # rule 4 says a tier never raises here; if one does, it is a miss
            log.warning("kvtiers tier %r: lookup raised %s: %s", self.kvtiers_name, type(e).__name__, e)
            return LookupResult.MISS
        finally:
            t1 = time.perf_counter()
            self._series.lookup_took(t1 - t0)
        if answer is Lookup.RETRY and self._retry_spent_s < self.retry_wait_s:
            answer = self._settle(k, t1, tenant)
        if answer is Lookup.HIT and self._recompute_faster(req_context):
            return LookupResult.MISS  # its load would take longer than its prefill: vLLM recomputes it
        if answer is Lookup.HIT:  # served: recently used (see the module, "Recency")
            self._touch([k], tenant)
            self.pins.note([k], req_context)
        return _ANSWER[answer]

    def _recompute_faster(self, req_context: ReqContext) -> bool:
        """Whether this request recomputes what this tier holds rather than load it
        (kvtiers.engine.costs), for a promotion of this tier's usual size. Decided (and counted)
        at the request's first HIT here in a scheduler step, and kept for its other chunks of
        that step: they are promoted in one job or not at all. A request deferred to the next
        step is decided again there (a probe, or a load begun while the tier was unknown, does
        not go on chunk after chunk once the tier is known to lose)."""
        costs, tpc = self.costs, self.tokens_per_chunk
        if not costs.enabled or not tpc:
            return False
        get = getattr(req_context, "get_state", None)
        made = get(_Decisions) if get is not None else None
        if made is not None and made.get(id(self), (None,))[0] == self._step:
            return made[id(self)][1] == "recompute"
        fit = costs.loads.get(self.tier_type)
        n = max(1, round(fit.mean_size)) if fit is not None else 1
        req = getattr(req_context, "req_id", None)
        # the tier's loads in flight for other requests: promotions submitted, and granted in this step
        loading = sum(1 for p in list(self._jobs.values())
                      if p.job.is_promotion and getattr(p.job.req_context, "req_id", None) != req)
        loading += len(self._granted - {req})
        decision = costs.decide(self.tier_type, n, n * tpc, loading)
        if decision is not None:
            costs.decisions[(self.tier_type, decision)] += 1
        if decision != "recompute" and req is not None:
            self._granted.add(req)
        if get is not None:
            if made is None:
                made = _Decisions()
                req_context.set_state(made)
            made[id(self)] = (self._step, decision)
        return decision == "recompute"

    def _settle(self, k: bytes, t0: float, tenant: str | None) -> Lookup:
        """Ask ``k`` (``tenant``'s) again until it is not RETRY or this step's ``retry_wait_ms``
        is spent."""
        deadline = t0 + self.retry_wait_s - self._retry_spent_s
        answer = Lookup.RETRY
        try:
            while answer is Lookup.RETRY and time.perf_counter() < deadline:
                time.sleep(_RETRY_POLL_S)
                t1 = time.perf_counter()
                try:
                    with as_tenant(self.handle, tenant):
                        (answer,) = self.handle.lookup([k])
                finally:  # each of the tier's lookups is one in kvtiers_tier_lookup_duration_seconds
                    self._series.lookup_took(time.perf_counter() - t1)
        except Exception as e:
            log.warning("kvtiers tier %r: lookup raised %s: %s", self.kvtiers_name, type(e).__name__, e)
            answer = Lookup.MISS
        finally:
            self._retry_spent_s += time.perf_counter() - t0
        return answer

    def on_schedule_end(self, context: Any) -> None:
        """vLLM's end of a scheduler step: the next step has a new ``retry_wait_ms`` and makes
        its own load-or-recompute decisions (this step's promotions are submitted by now)."""
        self._retry_spent_s = 0.0
        self._granted.clear()  # their promotions were submitted before this call (vLLM flushes them first)
        self._step += 1
        super().on_schedule_end(context)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """vLLM 0.32 and 0.33's hook (none of their schedulers calls it; 0.34 has none)."""
        self.refresh(keys, req_context)

    def refresh(self, keys: Iterable[OffloadKey], req_context: ReqContext | None) -> None:
        """Mark ``keys`` (vLLM's) recently used in the kvtiers tier, as the request's tenant."""
        tier_keys = [self._key(k) for k in keys]
        self.reuse.offer(self._first_offers(tuple(tier_keys), req_context, "reuse"))  # a load from the primary tier
        self._touch(tier_keys, tenant_of(req_context))

    def _touch(self, keys: list[bytes], tenant: str | None) -> None:
        if not keys or self.handle.closed:  # shut down or given up
            return
        try:
            with as_tenant(self.handle, tenant):
                self.handle.touch(keys)
        except Exception as e:  # recency is a hint: never fail the engine's call for it
            log.debug("kvtiers tier %r: touch raised %s", self.kvtiers_name, e)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """With ``"admit"``, vLLM's request-level policy: every request offers this tier all its
        chunks, those its primary tier holds already included, so a chunk's offers are the
        requests that used it and one that meets ``min_offers`` goes down from the primary tier
        then (docs/admission.md#under-vllm)."""
        if self.admission is not None:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    # --- jobs --------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.handle.submit_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.handle.submit_load)

    def _submit(self, tj: TransferJob, submit: Any) -> None:
        keys = tuple(self._key(k) for k in tj.keys)
        self.reuse.offer(self._first_offers(keys, tj.req_context, "reuse"))  # a store or a promotion, once a request
        if tj.is_promotion and self.on_promotion is not None:
            self.on_promotion(tj.keys)
        chunks = tuple(int(c) for c in tj.chunk_ids)
        sent, declined = keys, frozenset[bytes]()
        if self.admission is not None and not tj.is_promotion:
            declined = self._hold_back(keys, tenant_of(tj.req_context),
                                       self._first_offers(keys, tj.req_context, "admit"))
            if declined:
                keep = [i for i, k in enumerate(keys) if k not in declined]
                sent, chunks = tuple(keys[i] for i in keep), tuple(chunks[i] for i in keep)
        self._jobs[tj.job_id] = _Pending(tj, keys, time.perf_counter(), declined)
        if declined and not chunks:  # nothing admitted: done, nothing failed
            self._stash.append(TierResult(tj.job_id, ()))
            return
        try:
            if self._closed:
                raise RuntimeError("tier is shut down")
            if self._given_up is not None:
                raise RuntimeError(f"tier was given up: {self._given_up}")
            with as_tenant(self.handle, tenant_of(tj.req_context)):  # the job's tenant, passed with it
                submit(Job(tj.job_id, sent, chunks))
        except Exception as e:  # the tier did not accept the job: report it failed, as vLLM expects a result
            log.warning("kvtiers tier %r: job %d not accepted: %s: %s", self.kvtiers_name, tj.job_id,
                        type(e).__name__, e)
            self._stash.append(TierResult(tj.job_id, keys, error=f"{type(e).__name__}: {e}"))

    def _first_offers(self, keys: tuple[bytes, ...], req_context: ReqContext | None, count: str) -> tuple[bytes, ...]:
        """Those of ``keys`` the request has not offered this tier before for ``count``
        (``"reuse"``, ``"admit"``; all of them for a context without per-request state);
        marks them offered."""
        get = getattr(req_context, "get_state", None)
        if get is None:
            return keys
        offered = get(_Offered)
        if offered is None:
            offered = _Offered()
            req_context.set_state(offered)
        seen = offered.setdefault((id(self), count), set())
        first = tuple(k for k in keys if k not in seen)
        seen.update(first)
        return first

    def _hold_back(self, keys: tuple[bytes, ...], tenant: str | None, first: tuple[bytes, ...]) -> frozenset[bytes]:
        """The keys of a store not to send: those offered fewer than ``min_offers`` times (this
        offer counted if it is the request's ``first`` of the key; kvtiers.engine.admission:
        never too few) and those the tier holds already (the request-level policy offers a
        request's stored chunks again)."""
        adm = self.admission
        assert adm is not None and adm.counter is not None
        new = set(first)
        # add() returns the key's new estimate: one hash per key, not a second for admits()
        declined = {k for k in keys
                    if (adm.counter.add(k) if k in new else adm.counter.estimate(k)) < adm.min_offers}
        adm.declined += len(declined)
        wanted = [k for k in keys if k not in declined]
        if wanted:
            try:
                with as_tenant(self.handle, tenant):
                    answers = self.handle.lookup(wanted)
            except Exception:  # rule 4 says it does not raise; if it does, send them all
                answers = [Lookup.MISS] * len(wanted)
            present = {k for k, a in zip(wanted, answers, strict=True) if a is Lookup.HIT}
            adm.admitted += len(wanted) - len(present)
            declined |= present
        return frozenset(declined)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        polled = self._poll() if not self._closed else []  # before taking the stash: _give_up reads it
        results, self._stash = self._stash + polled, []
        out = [r for r in (self._finish(res) for res in results) if r is not None]
        if not self.handle.closed:
            self.pins.flush(self.handle)
        return out

    def _poll(self) -> list[TierResult]:
        if self._given_up is not None:
            return []
        try:
            results = self.handle.get_finished_jobs()
        except Exception as e:
            now = time.monotonic()
            if self._poll_failing_since is None:
                self._poll_failing_since = now
                log.warning("kvtiers tier %r: get_finished_jobs raised %s: %s", self.kvtiers_name,
                            type(e).__name__, e)
            elif now - self._poll_failing_since >= POLL_GIVE_UP_S:
                return self._give_up(f"get_finished_jobs raised on every poll for {POLL_GIVE_UP_S:g} s, "
                                     f"last {type(e).__name__}: {e}")
            return []
        self._poll_failing_since = None
        return results

    def _give_up(self, why: str) -> list[TierResult]:
        """Close the tier while serving; return a result for every job it has not reported:
        its own, from the one poll after close (rule 9), else failed."""
        self._given_up = why
        log.error("kvtiers tier %r given up: %s; its %d pending job(s) fail and it answers MISS from now on",
                  self.kvtiers_name, why, len(self._jobs))
        results: list[TierResult] = []
        try:
            self.handle.close()  # rule 9: its accepted jobs finished or failed, its threads gone
        except Exception as e:
            log.error("kvtiers tier %r: close raised %s: %s", self.kvtiers_name, type(e).__name__, e)
        try:
            results = list(self.handle.get_finished_jobs())
        except Exception:  # as it did before: every job it did not report fails below
            pass
        known = {r.job_id for r in results} | {r.job_id for r in self._stash}
        results += [TierResult(job_id, p.keys, error=f"tier given up: {why}")
                    for job_id, p in self._jobs.items() if job_id not in known]
        return results

    def _finish(self, res: TierResult) -> JobResult | None:
        pending = self._jobs.pop(res.job_id, None)
        if pending is None:
            log.warning("kvtiers tier %r reported job %d, which it was never given", self.kvtiers_name, res.job_id)
            return None
        tj, keys = pending.job, pending.keys
        failed = set(res.failed_keys) & set(keys)
        if res.failed_keys and not failed:  # failed keys the job never had: the whole job is suspect
            failed = set(keys) - pending.declined
        self._stats.failed(len(failed), "load" if tj.is_promotion else "store")
        if res.error and failed:
            log.info("kvtiers tier %r: job %d: %d of %d keys failed: %s", self.kvtiers_name, tj.job_id,
                     len(failed), len(keys), res.error)
        successful = None
        if tj.is_promotion:
            self._failed_loads.update(failed)
            if len(failed) < len(keys):  # what a load of this size takes (kvtiers.engine.costs)
                took = time.perf_counter() - pending.t0
                seconds = res.seconds if 0 < res.seconds <= took + 1e-3 else took
                self.costs.observe_load(self.tier_type, len(keys) - len(failed), seconds)
            if failed and len(failed) < len(keys):
                successful = tuple(ek for ek, k in zip(tj.keys, keys, strict=True) if k not in failed)
        else:
            gone = failed | pending.declined  # not sent ("admit"): not stored now, not failed
            stored = [ek for ek, k in zip(tj.keys, keys, strict=True) if k not in gone]
            self._failed_loads.difference_update(k for k in keys if k not in gone)
            self.pins.note([k for k in keys if k not in gone], tj.req_context)
            if self._events is not None and stored:
                ctx = {"req_context": tj.req_context} if EVENT_REQ_CONTEXT else {}  # vLLM 0.34
                self._events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                    locality=self.locality, **ctx))
        return JobResult(
            job_id=tj.job_id,
            success=not failed,
            successful_keys=successful,
            transfer_time=res.seconds or None,
            transfer_bytes=res.nbytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        """Block until the tier has reported every accepted job (rule 5: within 30 s)."""
        waiting = {j for j in self._jobs if j not in {r.job_id for r in self._stash}}
        start = warned = time.monotonic()
        while waiting and not self._closed:
            for res in self._poll():
                self._stash.append(res)
                waiting.discard(res.job_id)
            if waiting:
                time.sleep(0.002)
                if time.monotonic() - warned > _DRAIN_WARN_S:
                    warned = time.monotonic()
                    log.warning("kvtiers tier %r: still waiting for %d job(s) after %.0f s", self.kvtiers_name,
                                len(waiting), warned - start)

    # --- removals, events, stats -------------------------------------------------------------
    def _on_removed(self, keys: Sequence[bytes], reason: str) -> None:
        """``ctx.removed``: keys the tier dropped on its own; called from any thread."""
        self._stats.removed(len(keys), reason)
        if self._events is not None:
            self._events.append(OffloadingEvent(keys=[self._engine_key(k) for k in keys], medium=self.medium,
                                                removed=True, locality=self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {**metric_definitions(), **tier_series_definitions()}

    def get_stats(self) -> Any:
        try:
            backlog = 0 if self.handle.closed else self.handle.backlog()
        except Exception:
            backlog = len(self._jobs)
        stats = self._stats.take(backlog)
        self._series.take(stats)
        self._series.backlog(stats, backlog)
        self._series.reuse(stats, self.reuse.summary())
        self._series.decisions(stats, self.costs.decisions)
        self._series.pins(stats, self.pins.counts)
        if self.admission is not None:
            self._series.admission(stats, {"admitted": self.admission.admitted, "declined": self.admission.declined})
        return stats

    # vLLM 0.33's info-metric hooks; vLLM 0.32 has none and never calls them (see compat.py)
    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvtiers_tier", "kvtiers_namespace")

    def config_info(self) -> ConfigInfoMapping:
        return {"kvtiers_tier": self.kvtiers_name, "kvtiers_namespace": self.namespace.digest}

    # --- life cycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the tier (it finishes or fails every accepted job first) and let go of the
        primary region, so vLLM can unmap it."""
        if self._closed:
            return
        try:
            self.handle.close()
            self._stash.extend(self._poll())
        finally:
            self._closed = True
            self.arena.buffer.release()
            self._flat.release()
