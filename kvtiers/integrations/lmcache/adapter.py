"""KvtiersL2Adapter: any kvtiers tier as an L2 adapter of LMCache's server (LMCache 0.5.6 and 0.5.7).

``lmcache server`` loads it through its plugin seam::

    --l2-adapter '{"type": "plugin", "module_path": "kvtiers.integrations.lmcache",
                   "class_name": "KvtiersL2Adapter", "config_class_name": "KvtiersL2AdapterConfig",
                   "adapter_params": {"tier": {"type": "fs", "root_dir": "/mnt/kv"}}}'

==================================  =========================================================
LMCache (``L2AdapterInterface``)     kvtiers
==================================  =========================================================
``ObjectKey`` model, kv_rank,        the namespace (one tier instance each), with the group's
object_group_id + the group layout   shapes, dtypes and object bytes (:mod:`.mapping`)
``ObjectKey`` chunk_hash, cache_salt the tier key; the salt is also the tenant of an
                                     encrypted tier
``submit_store_task``                ``submit_store`` of kvtiers jobs; one ``L2StoreResult``
                                     (failed if any chunk failed; bytes of those stored)
``submit_lookup_and_lock_task``      ``lookup`` (RETRY asked again), ``touch`` of the hits;
                                     the bitmap: 1 for HIT
``submit_unlock``                    the lock count drops (kvtiers tiers pin nothing: a
                                     locked chunk the tier evicts is a load miss)
``submit_load_task``                 ``submit_load``; the bitmap: 1 for each chunk loaded intact
``submit_touch`` (0.5.7)              ``touch`` of the keys, on the adapter's thread
``delete``                           the keys are forgotten (locks, LMCache's byte count);
                                     the tier's own bound (``max_bytes``) frees the bytes:
                                     the tier contract has no delete
``get_memory_tags`` (0.5.7)          what the tier is (:mod:`.tags`): a shared fs root or a
                                     remote store is REMOTE, never LOCAL
``get_*_event_fd``                   three eventfds, signalled as tasks finish
``close``                            every tier closed, every task finished
==================================  =========================================================

What differs between LMCache 0.5.6 and 0.5.7 is found by capability: 0.5.7's abstract
``get_memory_tags`` and its ``submit_touch`` are defined here on both (0.5.6 never calls
them); ``MemoryTags`` is imported only where LMCache has it.

Memory: the tier's arena is LMCache's L1 region itself where ``L1MemoryDesc`` allows
(:mod:`.slots`), so stores and loads move bytes between the medium and LMCache's memory
objects without a copy; otherwise through a staging arena. Every tier call happens on the
adapter's own thread (:mod:`.runner`); LMCache's threads only queue and collect.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from .mapping import Layout, Space, tier_key_of
from .params import WHAT, AdapterParams, parse_params
from .runner import Item, Task, TierRunner, log
from .tags import memory_tags


def log_where_lmcache_logs() -> None:
    """Send kvtiers' log lines (the adapter's, its tiers' ``kvtiers.*``) where LMCache sends its
    own (``lmcache.logging.init_logger``: the server's stderr, at ``LMCACHE_LOG_LEVEL``), unless
    the process configured logging itself: else Python drops every line below WARNING."""
    if logging.getLogger("kvtiers").handlers or logging.getLogger().handlers:
        return
    try:
        from lmcache.logging import init_logger
    except ImportError:
        return
    init_logger("kvtiers")


class KvtiersL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's config: ``adapter_params`` checked by :func:`.params.parse_params`."""

    def __init__(self, params: AdapterParams) -> None:
        self.params = params

    @classmethod
    def from_dict(cls, d: dict) -> KvtiersL2AdapterConfig:
        return cls(parse_params(d))

    @classmethod
    def help(cls) -> str:
        return ("kvtiers L2 adapter (adapter_params):\n"
                "- tier (object): a kvtiers tier entry, e.g. {\"type\": \"fs\", \"root_dir\": \"/mnt/kv\"}; "
                "\"encrypt\" seals chunks, cache_salt is the tenant (required)\n"
                "- namespace (object): extra namespace fields (optional)\n"
                "- zero_copy (bool or null): null: in LMCache's L1 where it allows, else staged per object; "
                "false: always staged; true: in place or fail\n"
                "- staging_slots (int): slots of each staging arena (default 64)\n"
                "- lookup_wait_ms (number): how long a RETRY is asked again (default 2000)\n"
                "- residency (\"local\" or \"remote\"): overrides where LMCache is told the tier's bytes are")


class KvtiersL2Adapter(L2AdapterInterface):
    """A kvtiers tier behind LMCache's ``L2AdapterInterface`` (see the module)."""

    def __init__(self, config: KvtiersL2AdapterConfig | dict, l1_memory_desc: L1MemoryDesc | None = None) -> None:
        super().__init__()
        log_where_lmcache_logs()
        if not isinstance(config, KvtiersL2AdapterConfig):
            config = KvtiersL2AdapterConfig.from_dict(config)
        self.params = config.params
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._ids = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._layouts: dict[tuple[str, int, int], Layout] = {}  # last layout seen per (model, rank, group)
        self._locks: Counter[tuple[str, int, int, bytes]] = Counter()  # (model, rank, group, key)
        self._closed = False
        l1 = None
        if l1_memory_desc is not None and l1_memory_desc.ptr and l1_memory_desc.size > 0:
            l1 = (int(l1_memory_desc.ptr), int(l1_memory_desc.size), int(l1_memory_desc.align_bytes))
        self._runner = TierRunner(self.params, l1, self._done)
        log.info("%s: tier %r%s, %s", WHAT, self.params.tier_type, " (encrypted)" if self.params.encrypted else "",
                 "LMCache's L1 region given" if l1 else "no L1 region: staged")

    # --- event fds ----------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # --- tasks --------------------------------------------------------------------------
    def _next_id(self) -> L2TaskId:
        with self._lock:
            self._ids += 1
            return self._ids

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", keys, lambda: self._transfer_items(keys, objects))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", keys, lambda: self._transfer_items(keys, objects))

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        return self._submit("lookup", keys, lambda: self._lookup_items(keys, group_layout_descs or {}))

    def _submit(self, kind: str, keys: list[ObjectKey], items: Any) -> L2TaskId:
        tid = self._next_id()
        try:
            task = Task(kind, tid, items(), user=list(keys))
        except Exception as e:  # nothing reaches LMCache's thread: the task fails
            log.warning("%s: %s task of %d keys not accepted (failed): %s", WHAT, kind, len(keys), e)
            task = Task(kind, tid, [], user=[])
            task.ok = []
            self._done(task, total=len(keys))
            return tid
        self._runner.submit(task)
        return tid

    def _transfer_items(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> list[Item]:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys, {len(objects)} objects")
        items = []
        for k, obj in zip(keys, objects, strict=True):
            layout = _layout_of(obj)
            self._layouts[(k.model_name, k.kv_rank, k.object_group_id)] = layout
            buf = obj.byte_array
            if not isinstance(buf, memoryview):
                buf = memoryview(buf)
            items.append(Item(Space(k.model_name, k.kv_rank, k.object_group_id, layout),
                              tier_key_of(k.chunk_hash, k.cache_salt), k.cache_salt or None, buf.cast("B"),
                              int(obj.data_ptr)))
        return items

    def _lookup_items(self, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> list[Item]:
        items = []
        for k in keys:
            desc = descs.get(k.object_group_id)
            layout = (Layout.of(desc.shapes, desc.dtypes) if desc is not None and desc.shapes  # an empty one: a hint
                      else self._layouts.get((k.model_name, k.kv_rank, k.object_group_id)))  # left out (bench l2)
            if layout is None:  # no layout known for this group yet: nothing of it can be stored
                layout = _UNKNOWN
            items.append(Item(Space(k.model_name, k.kv_rank, k.object_group_id, layout),
                              tier_key_of(k.chunk_hash, k.cache_salt), k.cache_salt or None))
        return items

    def _done(self, task: Task, total: int | None = None) -> None:
        """The runner finished ``task`` (its thread, or a refusing caller's): keep the result,
        tell LMCache's listeners, signal the task's eventfd."""
        keys: list[ObjectKey] = task.user
        n = len(keys) if total is None else total
        ok = [bool(x) for x in task.ok] + [False] * (n - len(task.ok))
        if task.kind == "store":
            done = [(k, len(it.buf)) for k, it, good in zip(keys, task.items, ok, strict=False) if good]
            result = L2StoreResult(all(ok), sum(s for _, s in done))
            if done:
                self._notify_keys_stored([k for k, _ in done], [s for _, s in done])
            with self._lock:
                self._stores[task.task_id] = result
            efd = self._store_efd
        else:
            bitmap = Bitmap(n)
            for i, good in enumerate(ok):
                if good:
                    bitmap.set(i)
            hits = [k for k, good in zip(keys, ok, strict=False) if good]
            with self._lock:
                if task.kind == "lookup":
                    for it, good in zip(task.items, ok, strict=False):
                        if good:
                            self._locks[(it.space.model, it.space.kv_rank, it.space.group, it.key)] += 1
                    self._lookups[task.task_id] = bitmap
                else:
                    self._loads[task.task_id] = bitmap
            if hits and task.kind == "load":
                self._notify_keys_accessed(hits)
            efd = self._lookup_efd if task.kind == "lookup" else self._load_efd
        if not self._closed:
            efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        try:
            with self._lock:
                for k in keys:
                    ref = (k.model_name, k.kv_rank, k.object_group_id, tier_key_of(k.chunk_hash, k.cache_salt))
                    if self._locks[ref] > 1:
                        self._locks[ref] -= 1
                    else:
                        self._locks.pop(ref, None)
        except Exception as e:
            log.warning("%s: unlock of %d keys: %s", WHAT, len(keys), e)

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """LMCache 0.5.7: mark ``keys`` recently used in the tier (its ``touch``, on the adapter's
        thread, for the namespaces opened so far), and tell LMCache's listeners."""
        try:
            items = [it for it in self._lookup_items(keys, {}) if it.space.layout.nbytes > 0]
            self._runner.touch(items)
        except Exception as e:
            log.debug("%s: touch of %d keys: %s", WHAT, len(keys), e)
        self._notify_keys_accessed(keys)

    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache's eviction: the keys are forgotten here (their locks) and in LMCache's byte
        count (``on_l2_keys_deleted``). The tier contract has no delete: the tier's own bound
        (``max_bytes``) evicts the bytes (docs/lmcache.md)."""
        sizes = []
        with self._lock:
            for k in keys:
                self._locks.pop((k.model_name, k.kv_rank, k.object_group_id,
                                 tier_key_of(k.chunk_hash, k.cache_salt)), None)
                layout = self._layouts.get((k.model_name, k.kv_rank, k.object_group_id))
                sizes.append(layout.nbytes if layout is not None else 0)
        self._runner.stats["deleted"] += len(keys)
        if keys:
            self._notify_keys_deleted(list(keys), sizes)

    def get_memory_tags(self) -> Any:
        """LMCache 0.5.7: the tier's medium and whether its bytes are on this host (:mod:`.tags`)."""
        from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags

        segment, residency = memory_tags(self.params.tier_type, self.params.tier_options, self.params.residency)
        return MemoryTags(MemorySegment(segment), MemoryResidency(residency))

    def locked(self) -> int:
        """How many (namespace, key) locks are held now."""
        with self._lock:
            return sum(self._locks.values())

    # --- status and life cycle ----------------------------------------------------------
    def report_status(self) -> dict:
        spaces = {f"{s.model}/{s.kv_rank:#x}/{s.group}/{s.layout.nbytes}B": mode
                  for s, mode in self._runner.spaces().items()}
        return {"is_healthy": self._runner.alive() and not self._closed, "type": type(self).__name__,
                "tier": self.params.tier_type, "encrypted": self.params.encrypted, "namespaces": spaces,
                "locked": self.locked(), **dict(self._runner.stats)}

    def close(self) -> None:
        if self._closed:
            return
        self._runner.close()
        self._closed = True
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        log.info("%s closed", WHAT)


#: the layout of a group nothing told the adapter about (its lookups are misses)
_UNKNOWN = Layout((), (), 0)


def _layout_of(obj: MemoryObj) -> Layout:
    meta = obj.metadata
    if getattr(meta, "shapes", None) and getattr(meta, "dtypes", None):
        return Layout.of(meta.shapes, meta.dtypes)
    return Layout.of([meta.shape], [meta.dtype])
