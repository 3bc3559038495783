"""The engine side of kvtiers: what an inference-engine integrator wires in once.

- :mod:`.arena`: the host arena (page-aligned, pinned with an accelerator, shared or elastic);
- :mod:`.layout`: KV layouts (flat, MLA, several groups) and a chunk's place in a slot;
- :mod:`.dma`: the DMA engine between device KV tensors and arena slots;
- :mod:`.hostcache`, :mod:`.policies`: key -> slot, pins, LRU / ARC / plugin eviction;
- :mod:`.manager`: :class:`TieringManager`, composed of :mod:`.loads` (lookups, load waves,
  promotion), :mod:`.stores` (device -> arena copies and the store cascade),
  :mod:`.transfers` (transfer ids and results), :mod:`.tiers` (the tier stack, its jobs and
  timeouts), :mod:`.events` (cache events) and :mod:`.build` (``from_config``);
  :mod:`.types` holds the values the engine sees (``Request``, ``LookupResult``, ...);
- :mod:`.weights`: model weights through the tiers (sleep, wake, publish and fork), with
  :mod:`.weights_chunks` (tensor table, chunks, manifest, copier) and :mod:`.weights_memory`.

This package is the only place kvtiers imports torch; the tier contract and SDK one level up
never do. Names are imported on first use, so ``import kvtiers.engine`` costs nothing until
one of them is touched.
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
    "ModelWeights": "kvtiers.engine.weights",
    "WeightsIdentity": "kvtiers.engine.weights",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtiers.engine' has no attribute {name!r}")


__all__ = list(_LAZY)
