"""``kvtiers bench serve --variant NAME=CONFIG:JSON``: a named copy of a configuration with
other spec options, measured in the same interleaved run as the configuration itself.

The JSON object's keys are merged into the copy's ``kv_connector_extra_config`` (e.g.
``kvtiers_promotion_wait_ms``, read by ``KvtiersOffloadingSpec``); ``retry_wait_ms``, an
option of kvtiers' vLLM tier adapter that exists only in a ``secondary_tiers`` entry, goes
into the copy's tier entry, and so does every key of a ``"tier"`` object::

    --configs fs,fs-nowait --variant 'fs-nowait=fs:{"kvtiers_promotion_wait_ms": 0, "retry_wait_ms": 0}'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .serve_run import BUILTIN, Config

__all__ = ["TIER_KEYS", "describe", "parse_variant", "with_variants"]

#: keys of the secondary tier entry (kvtiers' adapter) accepted at the top level of a variant
TIER_KEYS = ("retry_wait_ms",)


def parse_variant(text: str) -> Config:
    """``NAME=CONFIG:JSON`` as a :class:`Config` copying ``CONFIG``; ``ValueError`` (one line) if not."""
    name, eq, rest = text.partition("=")
    base, colon, js = rest.partition(":")
    name, base = name.strip(), base.strip()
    if not eq or not colon or not name or not base:
        raise ValueError(f"{text!r} is not NAME=CONFIG:JSON (e.g. 'fs-nowait=fs:{{\"kvtiers_promotion_wait_ms\": 0}}')")
    try:
        keys = json.loads(js)
    except json.JSONDecodeError as e:
        raise ValueError(f"variant {name!r}: {js!r} is not JSON ({e.msg})") from None
    if not isinstance(keys, dict):
        raise ValueError(f"variant {name!r}: {js!r} is not a JSON object of kv_connector_extra_config keys")
    if name in BUILTIN or name == base:
        raise ValueError(f"variant {name!r}: the name of a built-in configuration; name the copy otherwise")
    if base == "none":
        raise ValueError(f"variant {name!r}: 'none' does not offload, it has no kv_connector_extra_config")
    tier = keys.pop("tier", {})
    if not isinstance(tier, dict):
        raise ValueError(f"variant {name!r}: \"tier\" must be a JSON object of secondary tier entry keys")
    tier = {**{k: keys.pop(k) for k in TIER_KEYS if k in keys}, **tier}
    if tier and base == "host":
        raise ValueError(f"variant {name!r}: 'host' has no secondary tier for {', '.join(sorted(tier))}")
    if tier and base == "vllm-fs" and set(tier) & set(TIER_KEYS):
        raise ValueError(f"variant {name!r}: {', '.join(sorted(set(tier) & set(TIER_KEYS)))} is an option of "
                         f"kvtiers' tiers, not of vLLM's fs tier (vllm-fs)")
    if "secondary_tiers" in keys:
        raise ValueError(f"variant {name!r}: secondary_tiers is the configuration's own; copy another configuration")
    return Config(name, None if base == "host" else base, spec_extra=keys, tier_keys=tier, base=base)


def with_variants(configs: list[Config], variants: Sequence[Config]) -> list[Config]:
    """``configs`` with each variant in its place where ``configs`` names it, else appended;
    ``ValueError`` if a variant is named twice."""
    by_name: dict[str, Config] = {}
    for v in variants:
        if v.name in by_name:
            raise ValueError(f"variant {v.name!r} defined twice")
        by_name[v.name] = v
    out = [by_name.pop(c.name, c) for c in configs]
    return out + [v for v in variants if v.name in by_name]


def describe(cfg: Config) -> dict[str, Any] | None:
    """A variant's copy and keys, for the report (None for a plain configuration)."""
    if cfg.base is None:
        return None
    return {"base": cfg.base, "kv_connector_extra_config": cfg.spec_extra, "tier": cfg.tier_keys}
