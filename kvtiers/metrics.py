"""Prometheus metrics for every tier, the host cache and the DMA engine.

Implemented once, around every tier: :class:`TierObserver` is a pluggy wrapper plugin
registered on each tier's :class:`~kvtiers.TierHandle`, so it sees every hook call of any
tier, third-party tiers included, without the tier doing anything. It keeps plain
counters (always, for summaries such as the demo's) and, where ``prometheus_client`` is
installed (the ``observe`` extra), exports them. A tier can add its own counters, gauges
and histograms with :func:`tier_metrics`; they carry the same ``tier`` label and are
exposed with the rest.

Series (all names ``kvtiers_...``; the mapping onto vLLM's ``vllm:kv_offload_tiering_*``
is in docs/observability.md): per tier, chunk queries / hits / misses / retries, lookup
latency, bytes and seconds read and written, job failures by kind and reason, jobs in
flight, backlog, evictions by reason; for the host cache, slots, used and pinned slots,
evictions and allocation failures; for the DMA engine, bytes and seconds per direction.

Multiprocess: with ``PROMETHEUS_MULTIPROC_DIR`` set (before ``prometheus_client`` is
imported), every worker process writes its values there and :func:`serve_metrics` serves
their sum (gauges: the sum over live processes). No torch here.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError
from .hookspecs import hookimpl
from .types import Lookup

__all__ = [
    "ManagerMetrics", "MetricsConfig", "MetricsServer", "TierMetrics", "TierObserver", "TierStats",
    "attach_metrics", "have_prometheus", "parse_metrics", "serve_metrics", "tier_metrics",
]

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def have_prometheus() -> bool:
    """Whether ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


# -- config -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetricsConfig:
    """The ``metrics`` block of a config: ``enable`` (default true when the block is
    given), ``port`` (serve ``/metrics`` on it while the manager runs; 0: any free port;
    null: only register into the process's registry, e.g. the engine's own ``/metrics``),
    ``addr`` (the address to listen on), ``interval`` (seconds between refreshes of the
    host and DMA series)."""

    enable: bool = True
    port: int | None = None
    addr: str = "0.0.0.0"
    interval: float = 0.5


def parse_metrics(obj: Mapping[str, Any] | MetricsConfig | None) -> MetricsConfig | None:
    """Check a ``metrics`` config block; ``None`` when absent or disabled."""
    if obj is None or isinstance(obj, MetricsConfig):
        return obj if obj is None or obj.enable else None
    if not isinstance(obj, Mapping):
        raise ConfigError(f"config: 'metrics' expects an object, got {type(obj).__name__}")
    known = {f.name for f in fields(MetricsConfig)}
    checks = {
        "enable": (lambda v: isinstance(v, bool), "true or false"),
        "port": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 65536),
                 "a port number (0-65535) or null"),
        "addr": (lambda v: isinstance(v, str) and v != "", "an address to listen on"),
        "interval": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "a number >= 0"),
    }
    for key, value in obj.items():
        if key not in known:
            raise ConfigError(f"config: metrics: unknown key {key!r} (known: {', '.join(sorted(known))})")
        ok, what = checks[key]
        if not ok(value):
            raise ConfigError(f"config: metrics.{key} expects {what}, got {type(value).__name__} {value!r}")
    cfg = MetricsConfig(**obj)
    return cfg if cfg.enable else None


# -- the Prometheus families, once per registry --------------------------------------------

_families: dict[int, _Families] = {}
_families_lock = threading.Lock()


class _Families:
    """Every kvtiers metric family in one registry, plus the tiers' own."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter as C
        from prometheus_client import Gauge as G
        from prometheus_client import Histogram as H

        self.registry = registry
        r = {"registry": registry}
        live = {"registry": registry, "multiprocess_mode": "livesum"}
        t = ["tier"]
        self.queries = C("kvtiers_tier_chunk_queries", "Chunk keys a tier was asked about (lookup).", t, **r)
        self.hits = C("kvtiers_tier_chunk_hits", "Chunk keys a tier answered HIT.", t, **r)
        self.misses = C("kvtiers_tier_chunk_misses", "Chunk keys a tier answered MISS.", t, **r)
        self.retries = C("kvtiers_tier_chunk_retries", "Chunk keys a tier answered RETRY.", t, **r)
        self.lookup_seconds = H("kvtiers_tier_lookup_duration_seconds", "Time of one lookup call on the engine thread.",
                                t, buckets=LATENCY_BUCKETS, **r)
        self.read_bytes = C("kvtiers_tier_read_bytes", "Bytes loaded from a tier into the host arena.", t, **r)
        self.read_seconds = C("kvtiers_tier_read_seconds", "Seconds of load jobs (submit to completion).", t, **r)
        self.write_bytes = C("kvtiers_tier_write_bytes", "Bytes stored from the host arena into a tier.", t, **r)
        self.write_seconds = C("kvtiers_tier_write_seconds", "Seconds of store jobs (submit to completion).", t, **r)
        self.job_failures = C("kvtiers_tier_job_failures", "Jobs with at least one failed key, or whose submit raised.",
                              ["tier", "kind", "reason"], **r)
        self.in_flight = G("kvtiers_tier_jobs_in_flight", "Jobs submitted to a tier and not reported yet.",
                           ["tier", "kind"], **live)
        self.backlog = G("kvtiers_tier_backlog", "Accepted jobs not reported yet, as the tier says (backlog hook).",
                         t, **live)
        self.evictions = C("kvtiers_tier_evictions", "Chunks a tier removed on its own (ctx.removed), by reason.",
                           ["tier", "reason"], **r)
        self.host_slots = G("kvtiers_host_slots", "Slots of the host arena.", **live)
        self.host_used = G("kvtiers_host_used_slots", "Slots of the host arena holding a chunk.", **live)
        self.host_pinned = G("kvtiers_host_pinned_slots", "Slots pinned by a transfer or a request.", **live)
        self.host_evictions = C("kvtiers_host_evictions", "Chunks evicted from the host arena.", **r)
        self.host_alloc_failures = C("kvtiers_host_allocation_failures",
                                     "Chunks not stored or promoted: every slot of the arena was pinned.", **r)
        self.dma_bytes = C("kvtiers_dma_bytes", "Bytes copied by the DMA engine.", ["direction"], **r)
        self.dma_seconds = C("kvtiers_dma_seconds", "Seconds a device copy was in flight.", ["direction"], **r)
        self.loaded = C("kvtiers_loaded_chunks", "Chunks loaded to the device, by where they came from.",
                        ["source"], **r)
        self.service_errors = C("kvtiers_service_errors", "Calls into a plugin's service (a config block) that "
                                "raised, by phase (poll: the service was closed and dropped; close).",
                                ["service", "phase"], **r)
        self.admission = C("kvtiers_tier_admission_chunks", "Chunks a tier's \"admit\" option sent down (admitted), "
                           "kept back for fewer offers than min_offers (declined) or held for write-back (deferred).",
                           ["tier", "decision"], **r)
        self.reuse_ceiling = G("kvtiers_reuse_ceiling", "Share of chunk offers that repeat an earlier one within the "
                               "window: the hit rate an unbounded cache would reach (HyperLogLog estimate).",
                               ["window"], registry=registry, multiprocess_mode="livemax")
        self.pin_events = C("kvtiers_pin_chunks", "Chunk keys of lifetime pins (docs/pins.md), by medium (host or "
                            "a tier) and event: pinned, refused, unpinned, expired (host only).",
                            ["medium", "event"], **r)
        self.pinned = G("kvtiers_host_lifetime_pinned_chunks", "Chunk keys a lifetime pin holds in the host cache.",
                        **live)
        self.load_decisions = C("kvtiers_load_decisions", "Lookups whose chunks from a tier were loaded, or left to "
                                "the engine to recompute because the load was expected to take longer "
                                "(recompute_when_faster).", ["tier", "decision"], **r)


def _one_per_registry(store: dict[int, Any], make: Callable[[Any], Any], registry: Any) -> Any:
    """``store``'s entry for ``registry`` (default: prometheus_client's), made by ``make`` on
    first use; ``None`` without prometheus_client."""
    if not have_prometheus():
        return None
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    with _families_lock:
        fam = store.get(id(registry))
        if fam is None:
            fam = store[id(registry)] = make(registry)
        return fam


def _families_for(registry: Any = None) -> _Families | None:
    """The families in ``registry`` (default: prometheus_client's), or ``None`` without it."""
    return _one_per_registry(_families, _Families, registry)


class _CustomFamilies:
    """The tiers' own families (:func:`tier_metrics`) in one registry. Kept apart from
    :class:`_Families`: a tier's first metric must not register kvtiers' own families, which a
    host may already hold under the same names (vLLM declares the kvtiers_tier_* series in its
    own registry, and with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` that is this process's)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.families: dict[str, tuple[str, Any, tuple[str, ...]]] = {}  # name -> (kind, family, labelnames)
        self.lock = threading.Lock()


_customs: dict[int, _CustomFamilies] = {}


def _customs_for(registry: Any) -> _CustomFamilies | None:
    """The tiers' own families in ``registry`` (default: prometheus_client's), ``None`` without it."""
    return _one_per_registry(_customs, _CustomFamilies, registry)


# -- around every tier ----------------------------------------------------------------------

@dataclass
class TierStats:
    """Plain counters of one tier (kept with or without prometheus_client)."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    retries: int = 0
    lookup_seconds: float = 0.0
    read_bytes: int = 0
    read_seconds: float = 0.0
    write_bytes: int = 0
    write_seconds: float = 0.0
    failures: Counter = field(default_factory=Counter)  # (kind, reason) -> jobs
    in_flight: Counter = field(default_factory=Counter)  # kind -> jobs
    evictions: Counter = field(default_factory=Counter)  # reason -> chunks

    @property
    def hit_rate(self) -> float:
        """Hits per chunk queried (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


def _reason(res: Any) -> str:
    """A bounded label value for why a job failed: the exception type a tier put at the
    front of ``error`` (``"TimeoutError: ..."``), ``"error"`` for other text, or
    ``"failed_keys"`` when only keys were listed."""
    err = getattr(res, "error", None)
    if not err:
        return "failed_keys"
    head = str(err).split(":", 1)[0].strip()
    return head if _NAME.match(head) and len(head) <= 40 else "error"


class TierObserver:
    """Pluggy wrapper plugin around one tier's hooks: counts into :class:`TierStats` and
    the Prometheus families (label ``tier=name``). Never changes a result or an
    exception; its own faults are swallowed."""

    def __init__(self, name: str, families: _Families | None) -> None:
        self.name = name
        self.stats = TierStats()
        self._fam = families
        self._jobs: dict[int, tuple[str, float]] = {}  # job id -> (kind, submit time)
        self._lock = threading.Lock()
        if families is not None:  # every series exists from the start, at 0
            for f in (families.queries, families.hits, families.misses, families.retries, families.read_bytes,
                      families.read_seconds, families.write_bytes, families.write_seconds, families.backlog):
                f.labels(tier=name)
            families.lookup_seconds.labels(tier=name)
            for kind in ("store", "load"):
                families.in_flight.labels(tier=name, kind=kind)

    @hookimpl(wrapper=True)
    def lookup(self, keys: Sequence[bytes]) -> Any:
        t0 = time.perf_counter()
        answers = yield
        try:
            dt = time.perf_counter() - t0
            n = len(keys)
            hits = misses = retries = 0
            for a in answers or ():
                if a is Lookup.HIT:
                    hits += 1
                elif a is Lookup.RETRY:
                    retries += 1
                else:
                    misses += 1
            s = self.stats
            s.queries += n
            s.hits += hits
            s.misses += misses
            s.retries += retries
            s.lookup_seconds += dt
            f = self._fam
            if f is not None:
                f.queries.labels(tier=self.name).inc(n)
                if hits:
                    f.hits.labels(tier=self.name).inc(hits)
                if misses:
                    f.misses.labels(tier=self.name).inc(misses)
                if retries:
                    f.retries.labels(tier=self.name).inc(retries)
                f.lookup_seconds.labels(tier=self.name).observe(dt)
        except Exception:
            pass
        return answers

    def _submitted(self, kind: str, job: Any) -> Any:
        try:
            result = yield
        except BaseException:
            self._failed(kind, "submit")
            raise
        try:
            self._jobs[job.job_id] = (kind, time.perf_counter())
            self.stats.in_flight[kind] += 1
            if self._fam is not None:
                self._fam.in_flight.labels(tier=self.name, kind=kind).inc()
        except Exception:
            pass
        return result

    @hookimpl(wrapper=True)
    def submit_store(self, job: Any) -> Any:
        return (yield from self._submitted("store", job))

    @hookimpl(wrapper=True)
    def submit_load(self, job: Any) -> Any:
        return (yield from self._submitted("load", job))

    @hookimpl(wrapper=True)
    def get_finished_jobs(self) -> Any:
        results = yield
        try:
            now = time.perf_counter()
            for res in results or ():
                entry = self._jobs.pop(getattr(res, "job_id", None), None)
                if entry is None:
                    continue
                kind, t0 = entry
                self.stats.in_flight[kind] -= 1
                seconds = res.seconds if 0 < res.seconds <= now - t0 + 1e-3 else now - t0
                self._moved(kind, res.nbytes, seconds)
                if res.failed_keys:
                    self._failed(kind, _reason(res))
        except Exception:
            pass
        return results

    def removed(self, keys: Sequence[bytes], reason: str) -> None:
        """The tier context's removed-listener (any thread)."""
        reason = reason if isinstance(reason, str) and _NAME.match(reason) and len(reason) <= 40 else "other"
        with self._lock:
            self.stats.evictions[reason] += len(keys)
        if self._fam is not None:
            self._fam.evictions.labels(tier=self.name, reason=reason).inc(len(keys))

    def _moved(self, kind: str, nbytes: int, seconds: float) -> None:
        s, f = self.stats, self._fam
        if kind == "load":
            s.read_bytes += nbytes
            s.read_seconds += seconds
        else:
            s.write_bytes += nbytes
            s.write_seconds += seconds
        if f is not None:
            f.in_flight.labels(tier=self.name, kind=kind).dec()
            (f.read_bytes if kind == "load" else f.write_bytes).labels(tier=self.name).inc(nbytes)
            (f.read_seconds if kind == "load" else f.write_seconds).labels(tier=self.name).inc(seconds)

    def _failed(self, kind: str, reason: str) -> None:
        self.stats.failures[kind, reason] += 1
        if self._fam is not None:
            self._fam.job_failures.labels(tier=self.name, kind=kind, reason=reason).inc()

    def backlog(self, value: int) -> None:
        if self._fam is not None:
            self._fam.backlog.labels(tier=self.name).set(value)


# -- a tier's own metrics ---------------------------------------------------------------------

_tier_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TierContext -> tier name
_tier_registries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TierContext -> its manager's registry
UNATTACHED = "unattached"


@dataclass(frozen=True)
class _Spec:
    kind: str  # "counter" | "gauge" | "histogram"
    name: str
    documentation: str
    labelnames: tuple[str, ...]
    buckets: tuple[float, ...] = LATENCY_BUCKETS


def _custom_family(spec: _Spec, registry: Any) -> Any:
    """The family of ``spec`` in ``registry`` (created on first use), or ``None`` without
    prometheus_client. The same name with another kind or labels is a ``ValueError``."""
    fam = _customs_for(registry)
    if fam is None:
        return None
    with fam.lock:
        known = fam.families.get(spec.name)
        if known is not None:
            if known[0] != spec.kind or known[2] != spec.labelnames:
                raise ValueError(f"metric {spec.name!r} exists as a {known[0]} with labels {list(known[2])}")
            return known[1]
        import prometheus_client as pc

        args = (spec.name, spec.documentation, ["tier", *spec.labelnames])
        if spec.kind == "counter":
            family = pc.Counter(*args, registry=fam.registry)
        elif spec.kind == "gauge":
            family = pc.Gauge(*args, registry=fam.registry, multiprocess_mode="livesum")
        else:
            family = pc.Histogram(*args, registry=fam.registry, buckets=spec.buckets)
        fam.families[spec.name] = (spec.kind, family, spec.labelnames)
        return family


class _Bound:
    """One of a tier's own metrics. The ``tier`` label and the registry are those of the
    manager the tier is attached to, looked up at each call (a tier makes its metrics in
    ``__init__``, before the manager names it). Without prometheus_client calls do nothing."""

    def __init__(self, spec: _Spec, ctx: Any, labels: Mapping[str, str] | None = None) -> None:
        self._spec = spec
        self._ctx = ctx
        self._labels = dict(labels or {})

    def labels(self, *values: str, **labels: str) -> _Bound:
        """The series with these extra labels (as prometheus_client's ``labels``)."""
        if values:
            labels = {**dict(zip(self._spec.labelnames, values, strict=True)), **labels}
        return _Bound(self._spec, self._ctx, {**self._labels, **labels})

    def _child(self) -> Any:
        family = _custom_family(self._spec, _tier_registries.get(self._ctx))
        if family is None:
            return None
        return family.labels(tier=_tier_names.get(self._ctx, UNATTACHED), **self._labels)

    def inc(self, amount: float = 1) -> None:
        c = self._child()
        if c is not None:
            c.inc(amount)

    def dec(self, amount: float = 1) -> None:
        c = self._child()
        if c is not None:
            c.dec(amount)

    def set(self, value: float) -> None:
        c = self._child()
        if c is not None:
            c.set(value)

    def observe(self, value: float) -> None:
        c = self._child()
        if c is not None:
            c.observe(value)


class TierMetrics:
    """What :func:`tier_metrics` returns: makes a tier's own metrics, labelled with the
    tier's name (``tier``) plus ``labelnames``. Instances of a tier share a family by
    name; the same name with another kind or labels is a ``ValueError`` when first used."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> _Bound:
        """A counter (exposed as ``<name>_total``): ``.inc(n)``, ``.labels(...)``."""
        return self._make("counter", name, documentation, labelnames)

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> _Bound:
        """A gauge (summed over live processes in multiprocess mode): ``.set(v)``, ``.inc()``, ``.dec()``."""
        return self._make("gauge", name, documentation, labelnames)

    def histogram(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> _Bound:
        """A histogram: ``.observe(v)``."""
        return self._make("histogram", name, documentation, labelnames, tuple(buckets))

    def _make(self, kind: str, name: str, documentation: str, labelnames: Sequence[str],
              buckets: tuple[float, ...] = LATENCY_BUCKETS) -> _Bound:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"metric name {name!r}: letters, digits and underscores, not starting with a digit")
        labels = tuple(labelnames)
        if "tier" in labels:
            raise ValueError(f"metric {name!r}: the 'tier' label is added for you")
        return _Bound(_Spec(kind, name, documentation, labels, buckets), self._ctx)


def tier_metrics(ctx: Any) -> TierMetrics:
    """The documented call for a tier's own metrics: ``m = kvtiers.metrics.tier_metrics(ctx)``
    in ``__init__``, then ``self.compactions = m.counter("mytier_compactions", "...")`` and
    ``self.compactions.inc()`` when it happens. Each series carries ``tier=<the tier's
    name in the manager>`` and lands in the manager's registry. Does nothing where
    prometheus_client is absent."""
    return TierMetrics(ctx)


# -- the manager's host cache, DMA engine and tiers ------------------------------------------

class ManagerMetrics:
    """Metrics of one :class:`~kvtiers.engine.manager.TieringManager`: a
    :class:`TierObserver` on each tier (tiers added later are picked up), and the host
    cache and DMA series refreshed from ``mgr.cache`` and ``mgr.stats`` at most every
    ``interval`` seconds, on the engine thread, at the end of a manager call."""

    def __init__(self, mgr: Any, *, interval: float = 0.5, registry: Any = None) -> None:
        self.mgr = mgr
        self.interval = interval
        self.tiers: dict[str, TierObserver] = {}
        self.server: MetricsServer | None = None  # serving /metrics when the config gave a port
        self.registry = registry
        self._fam = _families_for(registry)
        self._last = 0.0
        self._seen: Counter = Counter()  # cumulative values already exported (for deltas)
        self._observe_new_tiers()
        if self._fam is not None:
            self._fam.host_slots.set(len(mgr.arena))

    def tier_summary(self) -> dict[str, dict[str, Any]]:
        """Per tier: queries, hits, misses, retries, hit rate, bytes read and written."""
        admission = {t.name: t.admission.describe() for t in self.mgr.tiers if getattr(t, "admission", None)}
        return {name: {"queries": o.stats.queries, "hits": o.stats.hits, "misses": o.stats.misses,
                       "retries": o.stats.retries, "hit_rate": o.stats.hit_rate,
                       "read_bytes": o.stats.read_bytes, "write_bytes": o.stats.write_bytes,
                       "evictions": dict(o.stats.evictions), "job_failures": sum(o.stats.failures.values()),
                       **({"admission": admission[name]} if name in admission else {})}
                for name, o in self.tiers.items()}

    def reuse_ceiling(self) -> dict[str, float | None]:
        """The reuse ceiling per window (``15m``, ``1h``, ``1d``): beside each tier's hit rate."""
        reuse = getattr(self.mgr, "reuse", None)
        return reuse.summary() if reuse is not None else {}

    def tick(self, force: bool = False) -> None:
        """The manager's flush hook: refresh the host and DMA series when due."""
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        self._observe_new_tiers()
        f = self._fam
        if f is None:
            return
        mgr = self.mgr
        cache, stats = mgr.cache, mgr.stats
        f.host_used.set(len(cache))
        f.host_pinned.set(cache.pinned_slots())
        self._delta(f.host_evictions, "host_evictions", cache.evictions)
        self._delta(f.host_alloc_failures, "host_full", stats.host_full)
        for path, direction in (("device->host", "device_to_host"), ("host->device", "host_to_device")):
            ps = stats.paths.get(path)
            if ps is not None:
                self._delta(f.dma_bytes.labels(direction=direction), f"b{path}", ps.nbytes)
                self._delta(f.dma_seconds.labels(direction=direction), f"s{path}", ps.seconds)
        for source, n in list(stats.hits.items()):
            self._delta(f.loaded.labels(source=source), f"hit:{source}", n)
        for (service, phase), n in list(getattr(mgr, "service_errors", {}).items()):
            self._delta(f.service_errors.labels(service=service, phase=phase), f"service:{service}:{phase}", n)
        for t in mgr.tiers:
            obs = self.tiers.get(t.name)
            if obs is not None:
                try:
                    obs.backlog(int(t.handle.backlog()))
                except Exception:
                    pass
            adm = getattr(t, "admission", None)  # its "admit" option (kvtiers.engine.admission)
            if adm is not None:
                for decision in ("admitted", "declined", "deferred"):
                    self._delta(f.admission.labels(tier=t.name, decision=decision), f"admit:{t.name}:{decision}",
                                getattr(adm, decision))
        pins = getattr(mgr, "pins", None)  # lifetime pins (kvtiers.engine.pins)
        if pins is not None:
            pins.expire()
            f.pinned.set(len(pins))
            for event in ("pinned", "refused", "unpinned", "expired"):
                self._delta(f.pin_events.labels(medium="host", event=event), f"pin:host:{event}", getattr(pins, event))
            for (medium, event), n in list(pins.tier_counts.items()):
                self._delta(f.pin_events.labels(medium=medium, event=event), f"pin:{medium}:{event}", n)
        costs = getattr(mgr, "costs", None)  # load or recompute (kvtiers.engine.costs)
        if costs is not None:
            for (tier, decision), n in list(costs.decisions.items()):
                self._delta(f.load_decisions.labels(tier=tier, decision=decision), f"cost:{tier}:{decision}", n)
        reuse = getattr(mgr, "reuse", None)  # the reuse ceiling (kvtiers.engine.reuse)
        if reuse is not None:
            for window, value in reuse.summary().items():
                if value is not None:
                    f.reuse_ceiling.labels(window=window).set(value)

    def _delta(self, counter: Any, key: str, value: float) -> None:
        d = value - self._seen[key]
        if d > 0:
            counter.inc(d)
            self._seen[key] = value

    def _observe_new_tiers(self) -> None:
        for t in self.mgr.tiers:
            if t.name in self.tiers:
                continue
            obs = TierObserver(t.name, self._fam)
            t.handle.add_wrapper(obs, name="kvtiers-metrics")
            t.handle.ctx.add_removed_listener(obs.removed)
            _tier_names[t.handle.ctx] = t.name
            _tier_registries[t.handle.ctx] = self.registry
            self.tiers[t.name] = obs


def attach_metrics(mgr: Any, config: Mapping[str, Any] | MetricsConfig | None = None, *,
                   registry: Any = None) -> ManagerMetrics | None:
    """Observe ``mgr``'s tiers, host cache and DMA engine (``config``: a ``metrics``
    block; default: enabled, no port). With a ``port``, ``/metrics`` is served until the
    manager closes. ``registry``: the engine's prometheus_client registry (default: the
    process's). Sets and returns ``mgr.metrics``; ``None`` when the block disables it."""
    cfg = parse_metrics(config if config is not None else {})
    if cfg is None:
        return None
    mm = ManagerMetrics(mgr, interval=cfg.interval, registry=registry)
    events = mgr._events  # the manager's event bus (kvtiers.engine.events)
    events.add_flush_hook(mm.tick)
    if cfg.port is not None:
        server = serve_metrics(cfg.port, cfg.addr, registry=registry)
        mm.server = server
        events.add_closer(server.close)
    events.add_closer(lambda: mm.tick(force=True))  # closers run last-added first: before the server stops
    mgr.metrics = mm
    return mm


# -- serving ---------------------------------------------------------------------------------

class MetricsServer:
    """A running ``/metrics`` HTTP server: ``port`` (the bound one), :meth:`close`."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = httpd.server_port

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None


def serve_metrics(port: int = 0, addr: str = "0.0.0.0", *, registry: Any = None) -> MetricsServer:
    """Serve ``/metrics`` of ``registry`` (default: the process's) on ``addr:port`` in a
    daemon thread (port 0: any free port, see ``.port``). With ``PROMETHEUS_MULTIPROC_DIR``
    set, serves the sum over every process writing there instead."""
    import prometheus_client as pc

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = pc.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    httpd, thread = pc.start_http_server(port, addr, registry=registry if registry is not None else pc.REGISTRY)
    return MetricsServer(httpd, thread)
