"""kvtiers: a pluggable storage-tier SDK for LLM KV-cache offloading.

The tier contract (v1) lives in :mod:`kvtiers.hookspecs` and :mod:`kvtiers.types`.
Nothing here imports torch; only the engine side (:mod:`kvtiers.dma`, the tiering
manager) does.
"""

from .asynctier import AsyncTier
from .errors import ConfigError, TierError
from .hookspecs import hookimpl, hookspec
from .registry import TierHandle, TierInfo, get_registry, open_tier
from .types import Arena, Job, JobResult, Lookup, Namespace, TierContext, accept_job

__version__ = "0.1.0"

# The engine side, imported on first use: `import kvtiers` stays light (and torch-free).
_LAZY = {
    "TieringManager": "kvtiers.manager",
    "Request": "kvtiers.engine_types",
    "LookupResult": "kvtiers.engine_types",
    "TransferResult": "kvtiers.engine_types",
    "CacheEvent": "kvtiers.engine_types",
    "KVLayout": "kvtiers.layout",
    "KVGroup": "kvtiers.layout",
    "DmaEngine": "kvtiers.dma",
    "create_host_arena": "kvtiers.arena",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtiers' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "Arena",
    "AsyncTier",
    "ConfigError",
    "Job",
    "JobResult",
    "Lookup",
    "Namespace",
    "TierContext",
    "TierError",
    "TierHandle",
    "TierInfo",
    "accept_job",
    "get_registry",
    "hookimpl",
    "hookspec",
    "open_tier",
]
