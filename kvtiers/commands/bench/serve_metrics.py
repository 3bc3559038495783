"""A server's Prometheus ``/metrics``: scraped, differenced, and summed up for ``kvtiers bench serve``.

``parse`` reads the text format into ``{"name{label=value,...}": value}`` (the ``engine`` and
``model_name`` labels left out, as every series of one server carries the same); ``delta`` is
what a cell added between two scrapes; ``summarize`` picks out what the table prints: prompt
tokens by source, per-tier chunk hits and bytes (vLLM's tiering counters and kvtiers' own
``kvtiers_tier_*`` series where the server exports them), promotion allocation failures and
vLLM's lookup waits.
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

__all__ = ["delta", "parse", "scrape", "summarize"]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_DROP = ("engine", "model_name")


def parse(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``{series: value}``; ``_created`` series and comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or m.group(1).endswith("_created"):
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = [(k, v) for k, v in _LABEL.findall(m.group(3) or "") if k not in _DROP]
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels)) + "}" if labels else "")
        out[key] = out.get(key, 0.0) + value
    return out


def scrape(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """``GET base_url/metrics``, parsed."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return parse(r.read().decode("utf-8", "replace"))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two scrapes (series absent before count from 0); unchanged left out."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _split(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    labels = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p) if rest else {}
    return name, labels


def _tier_name(label: str) -> str:
    """vLLM's ``tier`` label (``1:kvtiers_fs``) as the tier's type (``kvtiers_fs``)."""
    return label.split(":", 1)[1] if ":" in label else label


def summarize(d: dict[str, float], gauges: dict[str, float] | None = None) -> dict[str, Any]:
    """The table's figures from one cell's :func:`delta`.

    ``prompt_tokens``: by vLLM's source (``local_compute``, ``local_cache_hit``,
    ``external_kv_transfer``); ``cached_by_source``: the cached ones by the cache that supplied
    them (``device``, ``host``, ``disk``, ``p2p``, ...); ``tiers``: per secondary tier, chunk
    queries and hits, bytes read and written (vLLM's tiering counters), with kvtiers' own
    ``kvtiers_tier_*`` counters under ``kvtiers`` where exported; ``promotion_alloc_failures``;
    ``lookup_async_delay_s`` / ``lookup_async_waits``: vLLM's time spent waiting on lookups.
    ``gauges`` (the scrape after the cell): each tier's ``reuse_ceiling`` by window, the hit rate
    an unbounded cache would reach (``kvtiers_reuse_ceiling``, docs/observability.md).
    """
    s: dict[str, Any] = {"prompt_tokens": {}, "cached_by_source": {}, "tiers": {}, "promotion_alloc_failures": 0.0,
                         "lookup_async_delay_s": 0.0, "lookup_async_waits": 0.0}
    tier_fields = {"chunk_queries": "queries", "chunk_hits": "hits", "read_bytes": "read_bytes",
                   "write_bytes": "write_bytes"}
    for key, v in d.items():
        name, labels = _split(key)
        base = name.removesuffix("_total")
        if base == "vllm:prompt_tokens_by_source":
            src = labels.get("source", "?")
            s["prompt_tokens"][src] = s["prompt_tokens"].get(src, 0.0) + v
        elif base == "vllm:prompt_tokens_cached_by_source":
            src = labels.get("source", "?")
            s["cached_by_source"][src] = s["cached_by_source"].get(src, 0.0) + v
        elif base == "vllm:kv_offload_tiering_promotion_allocation_failures":
            s["promotion_alloc_failures"] += v
        elif base == "vllm:kv_offload_tiering_lookup_async_delay_seconds_sum":
            s["lookup_async_delay_s"] += v
        elif base == "vllm:kv_offload_tiering_lookup_async_delay_seconds_count":
            s["lookup_async_waits"] += v
        elif base.startswith("vllm:kv_offload_tiering_") and "tier" in labels:
            field = tier_fields.get(base.removeprefix("vllm:kv_offload_tiering_"))
            if field:
                t = s["tiers"].setdefault(_tier_name(labels["tier"]), {})
                t[field] = t.get(field, 0.0) + v
        elif base.startswith("kvtiers_tier_") and name.endswith("_total"):  # counters; gauges say nothing here
            tier = labels.get("tier") or labels.get("tier_type") or "?"
            t = s["tiers"].setdefault(_tier_name(tier), {}).setdefault("kvtiers", {})
            field = base.removeprefix("kvtiers_tier_")
            t[field] = t.get(field, 0.0) + v
    for key, v in (gauges or {}).items():
        name, labels = _split(key)
        if name == "kvtiers_reuse_ceiling" and "window" in labels:
            t = s["tiers"].setdefault(_tier_name(labels.get("tier", "?")), {})
            t.setdefault("reuse_ceiling", {})[labels["window"]] = v
    return s
