"""What a tool shows of a manager's KV events and metrics: the demo's summary lines and
JSON fields, and the config blocks its ``--events`` / ``--metrics-port`` options stand for.
No torch here."""

from __future__ import annotations

from typing import Any

from ..requires import require

__all__ = ["observe_config", "observe_lines", "observe_summary", "require_metrics_server"]


def observe_config(events: str | None, events_replay: str | None, linger: float) -> dict[str, Any]:
    """Config blocks for a tool: metrics always (plain counters, exported where
    prometheus_client is installed), KV events when ``events`` names an endpoint."""
    out: dict[str, Any] = {"metrics": {}}
    if events:
        require("KV events (--events)", "zmq", "msgspec", extra="observe")
        out["kv_events"] = {"endpoint": events, "replay_endpoint": events_replay,
                            "linger": linger if events_replay else 0.0}
    return out


def require_metrics_server() -> None:
    """Raise a one-line error unless prometheus_client can serve /metrics."""
    require("Prometheus metrics (--metrics-port)", "prometheus_client", extra="observe")


def observe_summary(mgr: Any) -> dict[str, Any]:
    """JSON fields: per-tier lookups and hit rates, the cache events the manager delivered
    (chunk keys per kind and medium), and what the KV event publisher sent."""
    out: dict[str, Any] = {}
    mm = getattr(mgr, "metrics", None)
    if mm is not None:
        out["tier_lookups"] = mm.tier_summary()
    cache_events: dict[str, dict[str, int]] = {}
    for (kind, medium), n in sorted(mgr.stats.events.items()):
        cache_events.setdefault(kind, {})[medium] = n
    out["cache_events"] = cache_events
    bridge = getattr(mgr, "kv_events", None)
    if bridge is not None and bridge.publisher is not None:
        pub = bridge.publisher
        out["kv_events"] = {
            "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "batches": pub.published,
            "dropped": pub.dropped, "events": dict(pub.events),
            "blocks": [{"type": t, "medium": m, "ownership": o, "blocks": n} for (t, m, o), n in bridge.blocks.items()],
        }
    return out


def observe_lines(mgr: Any) -> list[str]:
    """Summary lines: per-tier hit rates, and KV events published by kind."""
    lines: list[str] = []
    mm = getattr(mgr, "metrics", None)
    if mm is not None and mm.tiers:
        lines += ["", f"{'tier lookups':<22}{'chunks':>8}{'hits':>8}{'hit rate':>10}"]
        for name, s in mm.tier_summary().items():
            lines.append(f"  {name:<20}{s['queries']:>8}{s['hits']:>8}{100.0 * s['hit_rate']:>9.1f}%")
    bridge = getattr(mgr, "kv_events", None)
    if bridge is not None and bridge.publisher is not None:
        pub = bridge.publisher
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(pub.events.items())) or "none"
        lines += ["", f"KV events published on {pub.endpoint}: {pub.published} batches; {kinds}"
                      + (f"; {pub.dropped} batches dropped" if pub.dropped else "")]
    return lines
