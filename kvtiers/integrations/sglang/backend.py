"""KvtiersStorage: any kvtiers tier as an SGLang HiCache storage backend (interfaces v1 and v2).

SGLang builds it through ``--hicache-storage-backend dynamic`` as
``KvtiersStorage(storage_config, kwargs)``, hands it the host pool with
``register_mem_pool_host`` and, with ``"interface_v1": 1`` in the extra config, calls:

- ``batch_exists(keys) -> int``: how many leading pages the tier holds (prefetch thread);
- ``batch_get_v1(keys, host_indices) -> list[bool]``: read pages into the host pool;
- ``batch_set_v1(keys, host_indices) -> list[bool]``: write pages from the host pool (backup thread).

Interface v2 (SGLang 0.5.23; hybrid models' side pools): ``register_mem_host_pool_v2(pool,
name)`` opens a tier instance per host pool (the KV pool, a Mamba state pool, a sliding-window
pool, an indexer pool, ...), each in a namespace of its own (``pool``: the name; the KV pool
keeps v1's namespace, so a cache written through either interface is found by the other);
``on_host_pools_registered()`` logs the set; ``batch_exists_v2`` applies SGLang's hit policies
(``PoolHitPolicy``) to the side pools; ``batch_get_v2`` / ``batch_set_v2`` move each
``PoolTransfer``'s pages between its host pool and its tier.

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
        if "admit" in extra:  # the manager's cascade applies it (docs/admission.md); this opens the tier itself
            raise ConfigError(f"kvtiers HiCache backend: tier {self.tier_name!r}: option 'admit' is not applied "
                              "under SGLang (it opens the tier itself, with no kvtiers cascade); remove it")
        info = get_registry().tier_info(self.tier_name)  # unknown tier: an error now, not at the first page
        from ...options import check_options

        check_options(info.name, info.cls, self.options)
        self.storage_config = storage_config
        self.tier: BlockingTier | None = None  # the KV pool's (interface v1)
        self.layout: PageLayout | None = None
        self._pools: dict[str, _Pool] = {}  # by SGLang's pool name ("kv", "mamba", "swa", ...)
        self.mem_pool_host = None

    # --- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tier on the host pool's pages (SGLang calls this right after construction)."""
        super().register_mem_pool_host(mem_pool_host)
        old = self._pools.pop(KV, None)
        if old is not None:
            old.close()
        kv = self._open_pool(mem_pool_host, KV)
        self._pools[KV] = kv
        self.layout, self.arena, self.namespace, self.tier = kv.layout, kv.arena, kv.namespace, kv.tier

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Interface v2: a host pool of its own name (the KV pool, a hybrid model's side pool:
        Mamba state, sliding window, indexer, ...), each on a tier instance in a namespace of
        its own (the pool's name in it)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        kv = self._pools.get(KV)
        if name == KV and kv is not None and kv.pool is host_pool:
            return  # the anchor pool, registered again by name
        old = self._pools.pop(name, None)
        if old is not None:
            old.close()
        self._pools[name] = self._open_pool(host_pool, name)
        if name == KV:
            kv = self._pools[KV]
            self.layout, self.arena, self.namespace, self.tier = kv.layout, kv.arena, kv.namespace, kv.tier

    def on_host_pools_registered(self) -> None:
        """Interface v2: every host pool of the attach is registered (logged once)."""
        log.info("SGLang HiCache backend: kvtiers tier %r for the host pools %s", self.tier_name,
                 ", ".join(sorted(self._pools)))

    def _open_pool(self, pool: Any, name: str) -> _Pool:
        layout = probe(pool, self.zero_copy)
        arena = pool_arena(layout) if layout.zero_copy else staging_arena(layout, self.staging_pages)
        fields = self.namespace_fields(pool, layout)
        if name != KV:  # the KV pool keeps interface v1's namespace: caches written by v1 are found
            fields["pool"] = name
        namespace = Namespace(fields)
        tier = BlockingTier(open_tier(self.tier_name, self.options, TierContext(arena, namespace)))
        log.info("SGLang HiCache backend: pool %r on kvtiers tier %r, %s, namespace %s", name, self.tier_name,
                 "zero-copy" if layout.zero_copy else f"staged through {self.staging_pages} pages", namespace.digest)
        return _Pool(name, pool, layout, arena, namespace, tier, self.lookup_wait_s)

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

    def _kv(self) -> _Pool:
        kv = self._pools.get(KV)
        if kv is None:
            raise RuntimeError("kvtiers HiCache backend: register_mem_pool_host was not called")
        return kv

    # --- interface v1 ------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose every piece the tier holds."""
        return self._kv().prefix(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._kv().transfer("load", keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._kv().transfer("store", keys, host_indices)

    # --- interface v2 ------------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None,
                        extra_info: Any = None) -> Any:
        """The usable prefix: the KV pages' leading run, shrunk by each side pool's hit policy
        (SGLang's ``PoolHitPolicy``): ``all_pages``, every page of the prefix; ``trailing_pages``,
        the last ``len(transfer.keys)`` pages before it (a Mamba state, a window);
        ``block_groups``, whole groups of ``group_pages`` keys from the start, reported for the
        pool and never shrinking the KV prefix."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult

        kv_pages = self._kv().prefix(keys)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        final = kv_pages
        for t in pool_transfers or []:
            name = _pool_name(t.name)
            pool = self._pools.get(name)
            if final == 0:
                break
            present = pool.present(keys[:kv_pages]) if pool is not None else [False] * kv_pages
            policy = PoolHitPolicy(t.hit_policy)
            if policy is PoolHitPolicy.BLOCK_GROUPS:
                group = max(1, int(t.group_pages or 1))
                groups = 0
                while (groups + 1) * group <= kv_pages and all(present[groups * group:(groups + 1) * group]):
                    groups += 1
                if groups:
                    hits[name] = groups * group
                continue  # its own verdict: it never gates the KV hit
            if policy is PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                boundary = next((n for n in range(final, 0, -1) if all(present[max(0, n - window):n])), 0)
            else:  # ALL_PAGES
                boundary = next((i for i, ok in enumerate(present) if not ok), kv_pages)
            if boundary:
                hits[name] = boundary
            final = min(final, boundary)
        return PoolTransferResult(final, hits)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Read each transfer's pages from its pool's tier into that host pool."""
        return self._transfers_v2("load", transfers)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Write each transfer's pages from its host pool to its pool's tier."""
        return self._transfers_v2("store", transfers)

    def _transfers_v2(self, kind: str, transfers: list[Any]) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            pool = self._pools.get(_pool_name(t.name))
            if pool is None:
                log.error("kvtiers HiCache backend: host pool %r is not registered: its %d pages fail",
                          _pool_name(t.name), len(keys))
                out[t.name] = [False] * len(keys)
                continue
            try:
                out[t.name] = pool.transfer(kind, keys, t.host_indices)
            except Exception as e:  # a bad transfer fails its pages, never the others
                log.error("kvtiers HiCache backend: %s of %d pages of pool %r failed: %s", kind, len(keys),
                          pool.name, e)
                out[t.name] = [False] * len(keys)
        return out

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
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


#: SGLang's name of the KV pool (``PoolName.KV``)
KV = "kv"


def _pool_name(name: Any) -> str:
    return str(getattr(name, "value", name))


class _Pool:
    """One host pool on its tier instance: its layout, arena (the pool's memory or staging)
    and namespace; lookups and transfers of its pages."""

    def __init__(self, name: str, pool: Any, layout: PageLayout, arena: Any, namespace: Namespace,
                 tier: BlockingTier, lookup_wait_s: float) -> None:
        self.name, self.pool, self.layout, self.arena = name, pool, layout, arena
        self.namespace, self.tier, self.lookup_wait_s = namespace, tier, lookup_wait_s
        self._staging_lock = threading.Lock()

    def close(self) -> None:
        self.tier.close()

    def _keys(self, keys: list[str]) -> list[list[bytes]]:
        """The tier keys of each page: one per piece (zero-copy) or one for the page."""
        if self.layout.zero_copy:
            return [[page_key(h, j) for j in range(len(self.layout.pieces))] for h in keys]
        return [[page_key(h)] for h in keys]

    def present(self, keys: list[str]) -> list[bool]:
        """Whether the tier holds every piece of each page."""
        per_page = self._keys(keys)
        answers = iter(self.tier.lookup([k for ks in per_page for k in ks], self.lookup_wait_s))
        return [all([next(answers) is Lookup.HIT for _ in ks]) for ks in per_page]

    def prefix(self, keys: list[str]) -> int:
        """Number of leading pages whose every piece the tier holds."""
        present = self.present(keys)
        return present.index(False) if False in present else len(present)

    def transfer(self, kind: str, keys: list[str], host_indices: Any) -> list[bool]:
        layout = self.layout
        if not keys:
            return []
        ps = layout.page_size
        if host_indices is None or len(host_indices) != len(keys) * ps:
            n = 0 if host_indices is None else len(host_indices)
            raise ValueError(f"{len(keys)} pages need {len(keys) * ps} host indices, got {n}")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        m = len(layout.pieces)
        pages = [int(i) // ps for i in host_indices[::ps].tolist()]
        if layout.zero_copy:
            return self._zero_copy(kind, keys, pages, ptrs, m)
        return self._staged(kind, keys, ptrs, sizes, m)

    def _zero_copy(self, kind: str, keys: list[str], pages: list[int], ptrs: list[int], m: int) -> list[bool]:
        layout = self.layout
        size = layout.pieces[0]
        slots, tkeys = [], []
        for i, (page, ks) in enumerate(zip(pages, self._keys(keys), strict=True)):
            page_slots = layout.slots(page)
            for j, s in enumerate(page_slots):  # the pool's own pointers must be these slots
                if ptrs[i * m + j] != layout.base + s * size:
                    log.error("kvtiers HiCache backend: pool %r page %d piece %d is not where the layout put it",
                              self.name, page, j)
                    return [False] * len(keys)
            slots += page_slots
            tkeys += ks
        res = self.tier.run(kind, tkeys, slots)
        failed = set(res.failed_keys)
        if failed and res.error:
            log.info("kvtiers HiCache backend: %s of %d pages of pool %r: %d pieces failed: %s", kind, len(keys),
                     self.name, len(failed), res.error)
        return [not failed.intersection(ks) for ks in self._keys(keys)]

    def _staged(self, kind: str, keys: list[str], ptrs: list[int], sizes: list[int], m: int) -> list[bool]:
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
                res = self.tier.run(kind, tkeys, slots)
                failed = set(res.failed_keys)
                for i, k in zip(slots, tkeys, strict=True):
                    good = k not in failed
                    if kind == "load" and good:
                        p = (start + i) * m
                        copy_pieces(ptrs[p:p + m], sizes[p:p + m], self.arena[i], to_slot=False)
                    ok.append(good)
        return ok
