"""kvtiers: a pluggable storage-tier SDK for LLM KV-cache offloading.

The tier contract (v1) lives in :mod:`kvtiers.hookspecs` and :mod:`kvtiers.types`.
Nothing here imports torch; only the engine side (:mod:`kvtiers.dma`, the tiering
manager) does.
"""

from .asynctier import AsyncTier
from .errors import ConfigError, TierError
from .hookspecs import hookimpl, hookspec
from .registry import TierHandle, TierInfo, get_registry, open_tier
from .types import Arena, Job, JobResult, Lookup, Namespace, TierContext

__version__ = "0.1.0"

__all__ = [
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
    "get_registry",
    "hookimpl",
    "hookspec",
    "open_tier",
]
