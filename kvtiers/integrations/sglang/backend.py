"""KvtiersStorage: any kvtiers tier as an SGLang HiCache storage backend (interface v1).

SGLang builds it through ``--hicache-storage-backend dynamic`` as
``KvtiersStorage(storage_config, kwargs)``, hands it the host pool with
``register_mem_pool_host`` and, with ``"interface_v1": 1`` in the extra config, calls:

- ``batch_exists(keys) -> int``: how many leading pages the tier holds (prefetch thread);
- ``batch_get_v1(keys, host_indices) -> list[bool]``: read pages into the host pool;
- ``batch_set_v1(keys, host_indices) -> list[bool]``: write pages from the host pool (backup thread).

The tier opens when the pool arrives, on an arena over the pool's own memory where the
layout allows (see :mod:`.pages`), in a namespace made of what SGLang knows (model, MLA,
host layout, page size, dtype, piece sizes, parallel ranks that shard the bytes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from ...errors import ConfigError
from ...registry import get_registry, open_tier
from ...types import Lookup, Namespace, TierContext
from ..blocking import BlockingTier
from ..keys import page_key
from .pages import PageLayout, copy_pieces, pool_arena, probe, staging_arena

log = logging.getLogger("kvtiers.integrations.sglang")

#: extra-config keys SGLang reads itself (not tier options)
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})


class KvtiersStorage(HiCacheStorage):
    """A kvtiers tier behind SGLang's ``HiCacheStorage`` interface v1.

    Extra config: ``tier`` (a registered name such as ``"fs"``, or ``"pkg.module:Class"``),
    ``namespace`` (extra namespace fields), ``zero_copy`` (null: where the layout allows;
    true: required; false: always stage), ``staging_pages`` (slots of the staging arena,
    default 64), ``lookup_wait_s`` (how long ``batch_exists`` asks again while the tier answers
    RETRY, default 0.5); every other key, except SGLang's own, is an option of the tier.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        for k in SGLANG_KEYS:
            extra.pop(k, None)
        self.tier_name = extra.pop("tier", None)
        if not isinstance(self.tier_name, str) or not self.tier_name:
            raise ConfigError("kvtiers HiCache backend: name the tier with \"tier\" in "
                              "--hicache-storage-backend-extra-config (e.g. \"fs\")")
        self.extra_namespace = extra.pop("namespace", None) or {}
        self.zero_copy = extra.pop("zero_copy", None)
        self.staging_pages = int(extra.pop("staging_pages", 64))
        self.lookup_wait_s = float(extra.pop("lookup_wait_s", 0.5))
        self.options = extra
        info = get_registry().tier_info(self.tier_name)  # unknown tier: an error now, not at the first page
        from ...options import check_options

        check_options(info.name, info.cls, self.options)
        self.storage_config = storage_config
        self.tier: BlockingTier | None = None
        self.layout: PageLayout | None = None
        self._staging_lock = threading.Lock()
        self.mem_pool_host = None

    # --- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tier on the host pool's pages (SGLang calls this right after construction)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.tier is not None:
            self.tier.close()
        self.layout = probe(mem_pool_host, self.zero_copy)
        if self.layout.zero_copy:
            arena = pool_arena(self.layout)
        else:
            arena = staging_arena(self.layout, self.staging_pages)
        self.namespace = Namespace(self.namespace_fields(mem_pool_host, self.layout))
        ctx = TierContext(arena, self.namespace)
        self.tier = BlockingTier(open_tier(self.tier_name, self.options, ctx))
        self.arena = arena
        log.info("SGLang HiCache backend: kvtiers tier %r, %s, namespace %s", self.tier_name,
                 "zero-copy" if self.layout.zero_copy else f"staged through {self.staging_pages} pages",
                 self.namespace.digest)

    def namespace_fields(self, pool: Any, layout: PageLayout) -> dict:
        """What changes a page's bytes, from SGLang's storage config and host pool."""
        c = self.storage_config
        fields: dict[str, Any] = {
            "engine": "sglang",
            "model": c.model_name,
            "mla": bool(c.is_mla_model),
            "layout": getattr(pool, "layout", None),
            "page_size": layout.page_size,
            "dtype": str(getattr(pool, "dtype", None)),
            "pieces": list(layout.pieces),
            "unit": "piece" if layout.zero_copy else "page",
        }
        if not c.is_mla_model:  # MLA KV is the same on every TP rank; MHA heads are split
            fields["tp"] = [c.tp_rank, c.tp_size]
        for name, rank, size in (("pp", c.pp_rank, c.pp_size), ("cp", c.attn_cp_rank, c.attn_cp_size),
                                 ("dcp", c.dcp_rank, c.dcp_size)):
            if size > 1:
                fields[name] = [rank, size]
        fields.update(self.extra_namespace)
        return fields

    def _ready(self) -> BlockingTier:
        if self.tier is None:
            raise RuntimeError("kvtiers HiCache backend: register_mem_pool_host was not called")
        return self.tier

    # --- interface v1 ------------------------------------------------------------------------
    def _keys(self, keys: list[str]) -> list[list[bytes]]:
        """The tier keys of each page: one per piece (zero-copy) or one for the page."""
        if self.layout.zero_copy:
            return [[page_key(h, j) for j in range(len(self.layout.pieces))] for h in keys]
        return [[page_key(h)] for h in keys]

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every piece the tier holds."""
        tier = self._ready()
        per_page = self._keys(keys)
        answers = iter(tier.lookup([k for ks in per_page for k in ks], self.lookup_wait_s))
        n = 0
        for ks in per_page:
            if not all([next(answers) is Lookup.HIT for _ in ks]):
                break
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._transfer("load", keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._transfer("store", keys, host_indices)

    def _transfer(self, kind: str, keys: list[str], host_indices: Any) -> list[bool]:
        tier, layout = self._ready(), self.layout
        if not keys:
            return []
        ps = layout.page_size
        if len(host_indices) != len(keys) * ps:
            raise ValueError(f"{len(keys)} pages need {len(keys) * ps} host indices, got {len(host_indices)}")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        m = len(layout.pieces)
        pages = [int(i) // ps for i in host_indices[::ps].tolist()]
        if layout.zero_copy:
            return self._zero_copy(tier, kind, keys, pages, ptrs, m)
        return self._staged(tier, kind, keys, ptrs, sizes, m)

    def _zero_copy(self, tier: BlockingTier, kind: str, keys: list[str], pages: list[int], ptrs: list[int],
                   m: int) -> list[bool]:
        layout = self.layout
        size = layout.pieces[0]
        slots, tkeys = [], []
        for i, (page, ks) in enumerate(zip(pages, self._keys(keys), strict=True)):
            page_slots = layout.slots(page)
            for j, s in enumerate(page_slots):  # the pool's own pointers must be these slots
                if ptrs[i * m + j] != layout.base + s * size:
                    log.error("kvtiers HiCache backend: page %d piece %d is not where the layout put it", page, j)
                    return [False] * len(keys)
            slots += page_slots
            tkeys += ks
        res = tier.run(kind, tkeys, slots)
        failed = set(res.failed_keys)
        if failed and res.error:
            log.info("kvtiers HiCache backend: %s of %d pages: %d pieces failed: %s", kind, len(keys), len(failed),
                     res.error)
        return [not failed.intersection(ks) for ks in self._keys(keys)]

    def _staged(self, tier: BlockingTier, kind: str, keys: list[str], ptrs: list[int], sizes: list[int],
                m: int) -> list[bool]:
        ok: list[bool] = []
        with self._staging_lock:  # one staging arena: one staged batch at a time
            n = len(self.arena)
            for start in range(0, len(keys), n):
                batch = keys[start:start + n]
                tkeys = [page_key(h) for h in batch]
                slots = list(range(len(batch)))
                if kind == "store":
                    for i in slots:
                        p = (start + i) * m
                        copy_pieces(ptrs[p:p + m], sizes[p:p + m], self.arena[i], to_slot=True)
                res = tier.run(kind, tkeys, slots)
                failed = set(res.failed_keys)
                for i, k in zip(slots, tkeys, strict=True):
                    good = k not in failed
                    if kind == "load" and good:
                        p = (start + i) * m
                        copy_pieces(ptrs[p:p + m], sizes[p:p + m], self.arena[i], to_slot=False)
                    ok.append(good)
        return ok

    # --- the legacy (non-v1) interface: not used with interface_v1 -----------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvtiers HiCache backend: set \"interface_v1\": 1 (zero-copy interface)")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvtiers HiCache backend: set \"interface_v1\": 1 (zero-copy interface)")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvtiers HiCache backend: set \"interface_v1\": 1 (zero-copy interface)")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvtiers HiCache backend: set \"interface_v1\": 1 (zero-copy interface)")

    # --- life cycle --------------------------------------------------------------------------
    def clear(self) -> None:
        """Not supported: a kvtiers tier removes keys only by its own eviction or its CLI's gc."""
        log.warning("kvtiers HiCache backend: clear() is not supported; use the tier's CLI (e.g. kvtiers fs gc)")

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
