"""The configuration of the ``kvtiers`` load format (``--model-loader-extra-config``), checked.

One JSON object::

    {"mode": "publish" | "fork", "name": "my-model", "revision": "v1",
     "tiers": [{"type": "fs", "root_dir": "/mnt/weights"}, ...],
     "chunk_bytes": 4194304, "host_bytes": 67108864, "timeout": 600}

``mode``, ``name`` and ``tiers`` are required; ``revision`` (default: vLLM's ``--revision``, or
none), ``chunk_bytes``, ``host_bytes`` (the staging arena each rank streams chunks through) and
``timeout`` (seconds one step may take) are optional. A tier entry is a kvtiers tier entry, as in
``tiers`` of a kvtiers config; the ``kvtiers_<name>`` types of a ``kv_transfer_config``
(``kvtiers_fs``) are accepted too, so one list serves both. Anything wrong is a ``ValueError``
of one line naming the key. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...engine.weights import DEFAULT_CHUNK_BYTES
from ...errors import ConfigError
from ...types import PAGE

__all__ = ["KEYS", "LOAD_FORMAT", "LoaderConfig", "parse_loader_config"]

LOAD_FORMAT = "kvtiers"
#: every key the load format reads, with what it expects
KEYS = {"mode": "'publish' or 'fork'", "name": "a non-empty string (the model's name in the tiers)",
        "revision": "a non-empty string or null", "tiers": "a non-empty list of tier objects",
        "chunk_bytes": f"a positive multiple of {PAGE} (bytes)", "host_bytes": "a positive int (bytes)",
        "timeout": "a positive number (seconds)"}
_WHAT = "kvtiers load format: --model-loader-extra-config"
_VLLM_PREFIX = "kvtiers_"


@dataclass(frozen=True)
class LoaderConfig:
    """A checked ``kvtiers`` load format configuration (see the module docstring)."""

    mode: str
    name: str
    revision: str | None
    tiers: tuple[dict[str, Any], ...]
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    host_bytes: int = 64 << 20
    timeout: float = 600.0
    revision_given: bool = False

    def weights_config(self) -> dict[str, Any]:
        """The kvtiers config of the :class:`~kvtiers.engine.weights.ModelWeights` that move the
        weights: the tiers, and an arena of ``host_bytes`` (at least two chunks)."""
        return {"host_bytes": max(self.host_bytes, 2 * self.chunk_bytes), "tiers": [dict(t) for t in self.tiers]}


def _fail(key: str, value: Any) -> ValueError:
    return ValueError(f"{_WHAT}: {key!r} expects {KEYS[key]}, got {type(value).__name__} {value!r}")


def _tier_entry(i: int, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, Mapping):
        raise ValueError(f"{_WHAT}: 'tiers'[{i}] expects a tier object with a 'type', got {type(entry).__name__}")
    out = dict(entry)
    t = out.get("type")
    if isinstance(t, str) and t.startswith(_VLLM_PREFIX) and len(t) > len(_VLLM_PREFIX) and "module_path" not in out:
        out["type"] = t[len(_VLLM_PREFIX):]  # kvtiers_fs (a kv_transfer_config entry) is the fs tier
    return out


def parse_loader_config(extra: Any) -> LoaderConfig:
    """Check ``extra`` (vLLM's ``model_loader_extra_config``: a mapping) and return it as a
    :class:`LoaderConfig`; the tier entries are checked as a kvtiers config checks them."""
    if not isinstance(extra, Mapping):
        raise ValueError(f"{_WHAT} expects a JSON object, got {type(extra).__name__}")
    unknown = sorted(set(extra) - set(KEYS), key=str)
    if unknown:
        raise ValueError(f"{_WHAT}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    for key in ("mode", "name", "tiers"):
        if key not in extra:
            raise ValueError(f"{_WHAT}: {key!r} is missing; it expects {KEYS[key]}")
    mode, name, tiers = extra["mode"], extra["name"], extra["tiers"]
    if mode not in ("publish", "fork"):
        raise _fail("mode", mode)
    if not isinstance(name, str) or not name.strip():
        raise _fail("name", name)
    revision = extra.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise _fail("revision", revision)
    if not isinstance(tiers, list) or not tiers:
        raise _fail("tiers", tiers)
    entries = tuple(_tier_entry(i, e) for i, e in enumerate(tiers))
    chunk = extra.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0 or chunk % PAGE:
        raise _fail("chunk_bytes", chunk)
    host = extra.get("host_bytes", 64 << 20)
    if not isinstance(host, int) or isinstance(host, bool) or host <= 0:
        raise _fail("host_bytes", host)
    timeout = extra.get("timeout", 600.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise _fail("timeout", timeout)
    cfg = LoaderConfig(mode, name, revision, entries, chunk, host, float(timeout), "revision" in extra)
    from ...config import load_config

    try:
        load_config(cfg.weights_config())
    except ConfigError as e:  # e.g. a tier entry without a type: "config: tiers[0] needs a 'type' ..."
        raise ValueError(f"{_WHAT}: 'tiers': {str(e).removeprefix('config: ')}") from None
    return cfg
