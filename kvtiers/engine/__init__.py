"""The engine side of kvtiers: what an inference-engine integrator wires in once.

The host arena (:mod:`.arena`), KV layouts (:mod:`.layout`), the device DMA engine
(:mod:`.dma`), the host cache and its eviction policies (:mod:`.hostcache`,
:mod:`.policies`), the tiering manager and its value types (:mod:`.manager`, :mod:`.types`),
the demo and the arena bench. This package is the only place kvtiers imports torch; the tier
contract and SDK one level up never do. Names are imported on first use, so
``import kvtiers.engine`` costs nothing until one of them is touched.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "TieringManager": "kvtiers.engine.manager",
    "Request": "kvtiers.engine.types",
    "LookupResult": "kvtiers.engine.types",
    "TransferResult": "kvtiers.engine.types",
    "CacheEvent": "kvtiers.engine.types",
    "KVLayout": "kvtiers.engine.layout",
    "KVGroup": "kvtiers.engine.layout",
    "DmaEngine": "kvtiers.engine.dma",
    "HostArena": "kvtiers.engine.arena",
    "create_host_arena": "kvtiers.engine.arena",
    "arena_size": "kvtiers.engine.arena",
    "slot_bytes_for": "kvtiers.engine.arena",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtiers.engine' has no attribute {name!r}")


__all__ = list(_LAZY)
