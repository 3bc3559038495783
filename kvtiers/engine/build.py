"""Building a :class:`~kvtiers.engine.manager.TieringManager` from a config: the chunk
geometry (blocks per chunk, tokens per chunk, chunk and slot bytes), the arena size and the
namespace, then the host arena, the DMA engine, the manager and its tiers. On any failure
what was built is closed again.

The manager's module calls this one (``TieringManager.from_config``), never the other way:
the manager class comes in as an argument, and this module knows it only as
:class:`BuiltManager`, what building needs of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from ..types import Namespace

__all__ = ["BuiltManager", "build_from_config"]


class BuiltManager(Protocol):
    """What building needs of the manager class it is given."""

    services: dict[str, Any]

    def add_tier(self, tier: Any, options: Mapping[str, Any] | None = None, *, name: str | None = None) -> Any: ...

    def close(self, timeout: float = 30.0) -> None: ...


M = TypeVar("M", bound=BuiltManager)


def build_from_config(
    cls: Callable[..., M],
    config: Any,
    kv_caches: Any,
    *,
    layout: Any,
    namespace_fields: Mapping[str, Any] | None,
    tokens_per_block: int | None,
    num_workers: int,
    pin: bool | None,
    tier_job_timeout: float,
    dma: Any = None,
) -> M:
    """What :meth:`TieringManager.from_config <kvtiers.engine.manager.TieringManager.from_config>`
    does (see there), for the manager class ``cls``."""
    from ..config import Config, load_config
    from ..errors import ConfigError
    from .arena import arena_size, create_host_arena, slot_bytes_for
    from .dma import DmaEngine
    from .layout import KVLayout

    cfg = config if isinstance(config, Config) else load_config(config)
    from ..metrics import parse_metrics
    from .kvevents import parse_kv_events

    kv_events, metrics = parse_kv_events(cfg.kv_events), parse_metrics(cfg.metrics)  # errors before building
    if kv_caches is None and (layout is None or dma is None):
        raise ValueError("from_config: kv_caches may be None only with both layout= and dma= (a DMA engine factory)")
    layout = layout if layout is not None else KVLayout.from_tensors(kv_caches)
    if tokens_per_block:
        layout.check_tokens_per_block(tokens_per_block)
    bpc = cfg.blocks_per_chunk
    tokens_per_chunk = None
    if cfg.block_size is not None:  # vLLM: tokens per offloaded block
        if not tokens_per_block:
            raise ConfigError("config: 'block_size' needs the engine's tokens_per_block to derive blocks_per_chunk")
        if cfg.block_size % tokens_per_block:
            raise ConfigError(
                f"config: 'block_size' {cfg.block_size} is not a multiple of the engine's block size "
                f"{tokens_per_block} tokens"
            )
        bpc = cfg.block_size // tokens_per_block
    if tokens_per_block:
        tokens_per_chunk = tokens_per_block * bpc
    chunk_bytes = layout.chunk_bytes(bpc)
    slot_bytes = slot_bytes_for(chunk_bytes)
    device_chunks = _device_blocks(kv_caches) // bpc if kv_caches is not None else None
    try:
        num_slots = arena_size(
            cfg.host_bytes, slot_bytes, host_blocks_factor=cfg.host_blocks_factor,
            device_chunk_capacity=device_chunks, num_workers=num_workers,
        )
    except ConfigError as e:  # say how the slot size was computed
        raise ConfigError(f"{e}; a slot is one chunk padded to a multiple of 4096 bytes: {slot_bytes} bytes, "
                          f"from blocks_per_chunk={bpc} and the KV layout: {layout.explain_chunk_bytes(bpc)}") from None
    fields = {**cfg.namespace, **dict(namespace_fields or {})}
    fields.update(layout=layout.describe(), blocks_per_chunk=bpc, chunk_bytes=chunk_bytes)
    namespace = Namespace(fields)
    host = create_host_arena(
        num_slots, slot_bytes, pin=pin, shared_memory=cfg.shared_memory, elastic=cfg.elastic,
        elastic_reserve_bytes=cfg.elastic_reserve_bytes,
    )
    mgr = None
    try:
        dma = DmaEngine(layout, kv_caches, host, bpc) if dma is None else dma(layout, host, bpc)
        mgr = cls(
            arena=host.arena, dma=dma, blocks_per_chunk=bpc, chunk_bytes=chunk_bytes,
            tokens_per_chunk=tokens_per_chunk, eviction_policy=cfg.eviction_policy,
            store_threshold=cfg.store_threshold, offload_prompt_only=cfg.offload_prompt_only,
            max_offload_tokens=cfg.max_offload_tokens, namespace=namespace, host=host,
            tier_job_timeout=tier_job_timeout, layout=layout, pins=cfg.pins,
            recompute_when_faster=cfg.recompute_when_faster,
        )
        for t in cfg.tiers:
            mgr.add_tier(t.type, t.options, name=t.name)
        if metrics is not None:
            from ..metrics import attach_metrics

            attach_metrics(mgr, metrics)
        if kv_events is not None:
            from .kvevents import attach_kv_events

            attach_kv_events(mgr, kv_events)
        for key, block in cfg.blocks.items():  # plugin features, e.g. kvtiers_p2p's "serve" (docs/p2p.md)
            if block is not None:
                from ..registry import get_registry

                mgr.services[key] = get_registry().manager_blocks()[key](mgr, block)
    except BaseException:
        if mgr is not None:
            mgr.close(timeout=5.0)
        else:
            host.close()
        raise
    return mgr


def _device_blocks(kv_caches: Any) -> int:
    """The number of device blocks: dim 0 of the first KV tensor."""
    obj = kv_caches
    while not hasattr(obj, "shape"):
        if isinstance(obj, Mapping):
            obj = next(iter(obj.values()))
        else:
            obj = next(iter(obj))
    return int(obj.shape[0])
