"""kvtiers: a pluggable storage-tier SDK for LLM KV-cache offloading.

The tier contract (v1) lives in :mod:`kvtiers.hookspecs` and :mod:`kvtiers.types`.
Nothing here imports torch; only the engine side, :mod:`kvtiers.engine` (host arena,
DMA engine, tiering manager), does.
"""

from .asynctier import AsyncTier
from .errors import ConfigError, TierError
from .hookspecs import hookimpl, hookspec
from .registry import TierHandle, TierInfo, get_registry, open_tier
from .types import Arena, Baseline, Job, JobResult, Lookup, Namespace, TierContext, accept_job, prefix_chunk_keys

__version__ = "0.1.0"

# The engine side (kvtiers.engine), imported on first use: `import kvtiers` stays light and torch-free.
_ENGINE_NAMES = (
    "TieringManager", "Request", "LookupResult", "TransferResult", "CacheEvent",
    "KVLayout", "KVGroup", "DmaEngine", "create_host_arena",
)


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvtiers' has no attribute {name!r}")


__all__ = [
    *_ENGINE_NAMES,
    "Arena",
    "AsyncTier",
    "Baseline",
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
    "prefix_chunk_keys",
]
