"""The JSON configuration shared by the engine side and the CLI.

One object::

    {"host_bytes": N, "blocks_per_chunk": N, "eviction_policy": "lru",
     "tiers": [{"type": "fs", "root_dir": "/mnt/kv"}, ...]}

vLLM's ``kv_connector_extra_config`` (or the whole ``--kv-transfer-config`` object holding
it) is accepted too: its names are translated, keys with no meaning here are accepted and
named in one log line, anything else unknown is a :class:`ConfigError`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

log = logging.getLogger("kvtiers")

# vLLM names -> ours (top level)
VLLM_ALIASES = {"cpu_bytes_to_use": "host_bytes", "secondary_tiers": "tiers"}
# vLLM keys that mean nothing here: accepted and named once in the log
VLLM_IGNORED = frozenset({
    "spec_name", "spec_module_path", "enable_kv_events", "self_describing_kv_events",
    "max_tracker_size", "kv_connector", "kv_role", "kv_connector_module_path",
    "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "engine_id",
    "kv_ip", "kv_port", "kv_load_failure_policy",
})
# vLLM names inside a tier entry -> ours
VLLM_TIER_ALIASES = {"endpoint_override": "endpoint_url"}
VLLM_TIER_IGNORED = frozenset({"enable_kv_events"})
EVICTION_POLICIES_BUILTIN = ("lru", "arc")
# config blocks of first-party plugins: named in the error when the plugin is not installed
FIRST_PARTY_BLOCKS = {"serve": "p2p"}


@dataclass(frozen=True)
class TierConfig:
    """One secondary tier: its ``type`` (registered name or ``pkg.module:Class``), options,
    and an optional ``name`` (the tier's medium in KV events and lookups; default: the type)."""

    type: str
    options: dict[str, Any] = field(default_factory=dict)
    name: str | None = None


@dataclass(frozen=True)
class Config:
    """A parsed, checked kvtiers configuration. See docs/configuration.md."""

    host_bytes: int | None = None
    host_blocks_factor: float | None = None
    blocks_per_chunk: int = 1
    block_size: int | None = None
    eviction_policy: str = "lru"
    store_threshold: int = 1
    offload_prompt_only: bool = True
    max_offload_tokens: int | None = None
    namespace: dict[str, Any] = field(default_factory=dict)
    shared_memory: str | None = None
    elastic: bool = False
    elastic_reserve_bytes: int = 1 << 30
    tiers: tuple[TierConfig, ...] = ()
    ignored: tuple[str, ...] = ()
    kv_events: dict[str, Any] | None = None  # checked by kvtiers.engine.kvevents (docs/observability.md)
    metrics: dict[str, Any] | None = None  # checked by kvtiers.metrics
    pins: dict[str, Any] | None = None  # lifetime pins' max_ttl, max_share: checked by kvtiers.engine.pins
    recompute_when_faster: bool = True  # skip a tier's load that would take longer than the prefill (engine/costs.py)
    # blocks a plugin registered (register_manager_blocks), e.g. "serve" (kvtiers_p2p, docs/p2p.md):
    # name -> its object (or null), checked by the plugin when the manager is built
    blocks: dict[str, Any] = field(default_factory=dict)

    @property
    def tier_entries(self) -> list[dict[str, Any]]:
        return [{"type": t.type, **({"name": t.name} if t.name else {}), **t.options} for t in self.tiers]


def _expect(key: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"config: {key!r} expects {what}, got {type(value).__name__} {value!r}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS: dict[str, tuple[Any, str]] = {
    "host_bytes": (lambda v: v is None or (_int(v) and v > 0), "a positive int (bytes)"),
    "host_blocks_factor": (lambda v: v is None or (_num(v) and v > 0), "a positive number"),
    "blocks_per_chunk": (lambda v: _int(v) and v > 0, "a positive int"),
    "block_size": (lambda v: v is None or (_int(v) and v > 0), "a positive int (tokens)"),
    "eviction_policy": (lambda v: isinstance(v, str) and v != "", "a policy name (lru, arc, or a registered one)"),
    "store_threshold": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "offload_prompt_only": (lambda v: isinstance(v, bool), "true or false"),
    "max_offload_tokens": (lambda v: v is None or (_int(v) and v >= 0), "an int >= 0 or null"),
    "namespace": (lambda v: isinstance(v, dict), "an object"),
    "shared_memory": (lambda v: v is None or (isinstance(v, str) and v != ""), "a shared-memory name or null"),
    "elastic": (lambda v: isinstance(v, bool), "true or false"),
    "elastic_reserve_bytes": (lambda v: _int(v) and v >= 0, "an int >= 0 (bytes)"),
    "tiers": (lambda v: isinstance(v, list), "a list of tier objects"),
    "kv_events": (lambda v: v is None or isinstance(v, dict), "an object (KV event publishing) or null"),
    "metrics": (lambda v: v is None or isinstance(v, dict), "an object (Prometheus metrics) or null"),
    "pins": (lambda v: v is None or isinstance(v, dict), "an object (max_ttl, max_share: docs/pins.md) or null"),
    "recompute_when_faster": (lambda v: isinstance(v, bool), "true or false"),
}


def _tier(i: int, entry: Any) -> TierConfig:
    return parse_tier_entry(entry, f"tiers[{i}]")


def parse_tier_entry(entry: Any, where: str, what: str = "config") -> TierConfig:
    """Check one tier entry (ours or vLLM's: ``module_path``/``class_name``, aliased option
    names) and split it into type, options and display name; a :class:`ConfigError` starting
    ``"{what}: {where}"`` names what is wrong. Options are checked against the tier's
    signature later, when it is opened."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{what}: {where} expects an object with a 'type', got {type(entry).__name__}")
    entry = dict(entry)
    if "module_path" in entry:  # vLLM: load an external tier class from a module
        mod = entry.pop("module_path")
        cls = entry.pop("class_name", None) or entry.pop("type", None)
        if not isinstance(mod, str) or not isinstance(cls, str):
            raise ConfigError(f"{what}: {where}: 'module_path' needs a 'class_name' (or 'type') naming the class")
        entry["type"] = f"{mod}:{cls}"
    t = entry.pop("type", None)
    if not isinstance(t, str) or not t:
        raise ConfigError(f"{what}: {where} needs a 'type' (a registered tier name or 'pkg.module:Class')")
    for old, new in VLLM_TIER_ALIASES.items():
        if old in entry:
            if new in entry:
                raise ConfigError(f"{what}: {where}: both {old!r} and its alias target {new!r} given")
            entry[new] = entry.pop(old)
    for k in VLLM_TIER_IGNORED & entry.keys():
        entry.pop(k)
        log.info("kvtiers config: %s: vLLM key %r has no meaning here; ignored", where, k)
    name = entry.pop("name", None)
    if name is not None and (not isinstance(name, str) or not name or name == "host"):
        raise ConfigError(f"{what}: {where}: 'name' expects a non-empty string other than 'host', got {name!r}")
    return TierConfig(t, entry, name)


def parse_config(obj: Mapping[str, Any]) -> Config:
    """Check and translate a config object (ours or vLLM's); raise :class:`ConfigError`."""
    if not isinstance(obj, Mapping):
        raise ConfigError(f"config: expected a JSON object, got {type(obj).__name__}")
    obj = dict(obj)
    if "kv_connector_extra_config" in obj:  # the whole --kv-transfer-config object
        extra = obj.pop("kv_connector_extra_config")
        if not isinstance(extra, dict):
            raise ConfigError("config: 'kv_connector_extra_config' expects an object")
        outer_unknown = set(obj) - VLLM_IGNORED
        if outer_unknown:
            raise ConfigError(f"config: unknown key {sorted(outer_unknown)[0]!r} beside 'kv_connector_extra_config'")
        obj = extra
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # our name -> the key the config used for it
    ignored: list[str] = []
    blocks: dict[str, Any] = {}
    for key, value in obj.items():
        name = VLLM_ALIASES.get(key, key)
        if name in values:
            a, b = sorted((given_as[name], key))
            raise ConfigError(f"config: both {a!r} and {b!r} given; use one")
        given_as[name] = key
        if key in VLLM_IGNORED:
            ignored.append(key)
            continue
        if name not in _CHECKS:
            registered = _plugin_blocks()
            if name in registered:
                _expect(key, value, value is None or isinstance(value, dict),
                        f"an object (the {registered[name]} plugin's block) or null")
                blocks[name] = value
                continue
            if name in FIRST_PARTY_BLOCKS:
                extra = FIRST_PARTY_BLOCKS[name]
                raise ConfigError(f"config: {key!r} needs the {extra} tier plugin: pip install 'kvtiers[{extra}]'")
            known = ", ".join(sorted(set(_CHECKS) | set(VLLM_ALIASES) | set(registered)))
            raise ConfigError(f"config: unknown key {key!r} (known: {known})")
        check, what = _CHECKS[name]
        _expect(key, value, check(value), what)
        values[name] = value
    if ignored:
        log.info("kvtiers config: vLLM keys with no meaning here, ignored: %s", ", ".join(sorted(ignored)))
    if values.get("host_bytes") is None and values.get("host_blocks_factor") is None:
        raise ConfigError("config: give 'host_bytes' (alias 'cpu_bytes_to_use') or 'host_blocks_factor'")
    if values.get("host_bytes") is not None and values.get("host_blocks_factor") is not None:
        raise ConfigError("config: give either 'host_bytes' or 'host_blocks_factor', not both")
    if "block_size" in values and "blocks_per_chunk" in values:
        raise ConfigError("config: 'block_size' and 'blocks_per_chunk' are exclusive (as in vLLM); give one")
    tiers = tuple(_tier(i, e) for i, e in enumerate(values.pop("tiers", [])))
    names = [t.name for t in tiers if t.name]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"config: tier name {dup!r} is used twice")
    return Config(**values, tiers=tiers, ignored=tuple(sorted(ignored)), blocks=blocks)


def _plugin_blocks() -> dict[str, str]:
    """Config blocks registered by installed plugins: name -> the plugin that offers it."""
    from .registry import get_registry

    return {name: plugin for name, (plugin, _attach) in get_registry().blocks.items()}


def load_config(src: str | os.PathLike | Mapping[str, Any]) -> Config:
    """Parse a config given as a mapping, a JSON string, or the path of a JSON file."""
    if isinstance(src, Mapping):
        return parse_config(src)
    text = str(src)
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"config: cannot read {src!r}: {e.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config: not valid JSON: {e}") from None
    return parse_config(obj)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """``1048576``, ``512K``, ``4MiB``, ``8GiB``, ``1.5G`` -> bytes (binary units); an int is
    taken as it is. ``ValueError`` naming the text otherwise (the commands' ``SIZE`` options)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512K, 4MiB, 8GiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_json_option(text: str | None, path: str | None, what: str = "--config") -> dict[str, Any]:
    """For CLI commands: a JSON object from ``--config`` text or ``--config-file``."""
    if text and path:
        raise ConfigError(f"{what}: give --config or --config-file, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{what}: cannot read {path!r}: {e.strerror}") from None
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj
