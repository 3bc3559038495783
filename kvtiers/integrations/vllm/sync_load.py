"""Loads from the host arena within the step that schedules them (``kvtiers_sync_load``).

vLLM 0.32's ``OffloadingConnectorScheduler.get_num_new_matched_tokens`` answers
``load_kv_async=True`` whenever it has hits. vLLM's scheduler then parks the request in
``WAITING_FOR_REMOTE_KVS``: the worker copies its chunks after that step's forward pass and
the request is scheduled in the next step. So a request whose prefix is already in the host
arena waits one whole engine step (every running request's forward pass: about a second when
the step prefills a 1024-token prompt of a 100M-parameter model on CPU) for a copy of a few
milliseconds. That wait is vLLM's; the connector API lets a connector answer ``False``
instead, and vLLM's scheduler then schedules the request at once, counts the loaded tokens as
computed, and starts the step's loads *before* its forward pass
(``SchedulerOutput.has_sync_kv_loads``).

:func:`install` wraps, once per process, four methods of vLLM's offloading connector, acting
only for a scheduler whose manager came from ``KvtiersOffloadingSpec`` with the option on:

- scheduler ``get_num_new_matched_tokens``: a hit (every chunk answered HIT: ready in the
  arena; a pending promotion or a RETRY defers the request as before) answers
  ``load_kv_async=False``; the request is noted for this scheduling pass. A hit of the whole
  request (a prompt of whole chunks, all in the arena) stays asynchronous: vLLM's scheduler
  asserts a sync hit leaves a token to compute, and its asynchronous path recomputes the
  last token itself;
- scheduler ``update_state_after_alloc``: the load job vLLM made for a noted request is a
  sync load;
- scheduler ``build_connector_meta``: the step's sync load jobs travel to the workers in the
  metadata (``kvtiers_sync_loads``), and are counted (``vllm:kv_offload_kvtiers_loads{mode}``);
- worker ``start_kv_transfers`` / ``get_finished``: the worker waits for a sync job before
  the forward pass (vLLM's GPU worker copies on a stream of its own; kvtiers' CPU worker has
  copied when its submit returns), and never reports a sync load's request as
  ``finished_recving`` (it is running: vLLM's scheduler would take it for a finished one). The
  job itself is reported complete as before, so vLLM unpins its chunks.

vLLM 0.32 hashes (caches) a sync-loaded request's new device blocks as it allocates them, and
its load plan starts at the first new block *without* a hash, so for a sync load it would
plan nothing: the wrapped ``update_state_after_alloc`` shows it those blocks unhashed (vLLM
0.33 does the same for the sync loads it makes itself, ``sync_load_budget_bytes``; on such a
vLLM :func:`install` leaves vLLM's connector alone).

Not for models with recurrent-state (Mamba/SSM) KV cache groups: there a sync load gave
other greedy tokens than computing the prefix (the qwen3_next hybrid of
tests/test_vllm_engine_ssm.py; why is not known yet), so such models keep vLLM's asynchronous
loads (logged once).

``kvtiers_sync_load`` in ``kv_connector_extra_config``: ``true`` / ``false``; by default on
where kvtiers' CPU worker copies (vLLM's CPU platform) and off where vLLM's own worker does
(GPUs: not measured here).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from .compat import missing

log = logging.getLogger("kvtiers.integrations.vllm")

_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
#: the attribute of ``OffloadingConnectorMetadata`` that names the step's sync load jobs
META_ATTR = "kvtiers_sync_loads"
#: the attribute of a tiering manager that carries its :class:`SyncLoads`
MANAGER_ATTR = "kvtiers_sync_loads"

_installed = False
_install_lock = threading.Lock()


def enabled(extra_config: Any, default: bool) -> bool:
    """``kvtiers_sync_load`` of ``kv_connector_extra_config``; ``default`` when absent."""
    value = extra_config.get("kvtiers_sync_load", None) if extra_config else None
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"kvtiers_sync_load must be true or false, got {value!r}")
    return value


class SyncLoads:
    """One scheduler's sync-load book: requests answered sync in this scheduling pass, their
    load jobs, and the loads counted by mode since the last :meth:`take`."""

    def __init__(self) -> None:
        self.answered: set[str] = set()  # this pass: request ids answered load_kv_async=False
        self.jobs: set[int] = set()  # this pass: their load jobs
        self.counts: Counter[str] = Counter()  # "sync" / "async" load jobs, since the last take
        self.total: Counter[str] = Counter()
        self.state_groups: bool | None = None  # the model has recurrent-state groups (then: off); None: not known yet

    def count(self, sync: int, other: int) -> None:
        self.counts["sync"] += sync
        self.counts["async"] += other
        self.total["sync"] += sync
        self.total["async"] += other

    def take(self) -> Counter[str]:
        out, self.counts = self.counts, Counter()
        return out


class _Block:
    """A device block as vLLM's load plan reads it (id, null or not), with no hash yet."""

    __slots__ = ("block_id", "is_null")
    block_hash = None

    def __init__(self, block: Any) -> None:
        self.block_id = block.block_id
        self.is_null = block.is_null


class _Unhashed:
    """``KVCacheBlocks`` whose blocks past the request's local prefix hit read as unhashed."""

    def __init__(self, blocks: Any, local_tokens: int, config: Any) -> None:
        out = []
        for g, group in enumerate(blocks.blocks):
            first = -(-local_tokens // _tokens_per_block(config, g))
            out.append([b if i < first else _Block(b) for i, b in enumerate(group)])
        self.blocks = tuple(out)


def _tokens_per_block(config: Any, group_idx: int) -> int:
    for gc in config.kv_group_configs:
        if gc.group_idx == group_idx:
            return int(gc.tokens_per_block)
    return int(config.kv_group_configs[0].tokens_per_block)


def _book(scheduler: Any) -> SyncLoads | None:
    """The scheduler's book, or None where sync loads are off for it (not kvtiers' spec, the
    option off, or a model with state groups)."""
    book = getattr(getattr(scheduler, "manager", None), MANAGER_ATTR, None)
    if book is None:
        return None
    if book.state_groups is None:
        book.state_groups = _has_state_groups(scheduler)
        if book.state_groups:
            log.info("kvtiers: this model has recurrent-state (Mamba/SSM) KV cache groups: loads stay asynchronous")
    return None if book.state_groups else book


def _has_state_groups(scheduler: Any) -> bool:
    """Whether any offloaded KV cache group holds recurrent state (vLLM's ``MambaSpec``): a sync
    load of such a group gave other greedy tokens than computing it (tests/test_vllm_engine_ssm.py),
    so those models keep vLLM's asynchronous loads."""
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:
        return True
    groups = getattr(getattr(scheduler, "config", None), "kv_group_configs", None)
    if groups is None:
        return True
    return any(isinstance(getattr(g, "kv_cache_spec", None), MambaSpec) for g in groups)


def install() -> bool:
    """Wrap vLLM's offloading connector scheduler and worker (see the module); idempotent.
    False (logged) where this vLLM lacks the methods."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            import importlib

            sched_mod = importlib.import_module(_SCHEDULER)
            worker_mod = importlib.import_module(_WORKER)
        except ImportError as e:
            log.info("kvtiers: no vLLM offloading connector (%s): loads stay asynchronous", e)
            return False
        sched = getattr(sched_mod, "OffloadingConnectorScheduler", None)
        worker = getattr(worker_mod, "OffloadingConnectorWorker", None)
        need_s = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")
        need_w = ("start_kv_transfers", "get_finished")
        lacks = ([f"OffloadingConnectorScheduler.{n}" for n in (missing(sched, need_s) if sched else need_s)] +
                 [f"OffloadingConnectorWorker.{n}" for n in (missing(worker, need_w) if worker else need_w)])
        if lacks:
            log.warning("kvtiers: this vLLM's offloading connector has no %s: kvtiers_sync_load is off, "
                        "loads stay asynchronous", ", ".join(lacks))
            return False
        if hasattr(sched, "_reserve_sync_load"):  # vLLM 0.33 and 0.34: sync loads of its own
            log.info("kvtiers: this vLLM loads within the step itself (sync_load_budget_bytes in "
                     "kv_connector_extra_config); kvtiers_sync_load is not needed")
            return False
        _wrap_scheduler(sched)
        _wrap_worker(worker)
        _installed = True
        return True


def _wrap_scheduler(cls: Any) -> None:
    matched, after_alloc, build_meta = (cls.get_num_new_matched_tokens, cls.update_state_after_alloc,
                                        cls.build_connector_meta)

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int, *args: Any,
                                   **kwargs: Any) -> tuple[int | None, bool]:
        hits, load_async = matched(self, request, num_computed_tokens, *args, **kwargs)
        book = _book(self)
        if book is None:
            return hits, load_async
        # every chunk answered HIT: ready in the host arena. Not when the hit covers the whole
        # request: vLLM's scheduler needs a token left to compute for a sync hit (it asserts
        # so), and its asynchronous path recomputes the last token of such a hit itself
        if hits and load_async and num_computed_tokens + hits < request.num_tokens:
            book.answered.add(request.request_id)
            return hits, False
        book.answered.discard(request.request_id)
        return hits, load_async

    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        book = _book(self)
        if book is None or request.request_id not in book.answered:
            return after_alloc(self, request, blocks, num_external_tokens)
        book.answered.discard(request.request_id)
        if not num_external_tokens:
            return after_alloc(self, request, blocks, num_external_tokens)
        # vLLM cached (hashed) the request's new blocks as it allocated them, as it does for
        # every sync load; its load plan starts at the first new block without a hash, so it
        # is shown the new blocks as they are before caching (what vLLM 0.33 does for its own
        # sync loads)
        status = self._req_status[request.request_id]
        out = after_alloc(self, request, _Unhashed(blocks, status.num_locally_computed_tokens, self.config),
                          num_external_tokens)
        book.jobs.update(j for j in status.transfer_jobs if j in self._current_batch_load_jobs)
        return out

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        book = _book(self)
        loads = set(getattr(self, "_current_batch_load_jobs", None) or ())
        # vLLM 0.32 builds no store job for a request with a load pending (it asserts the
        # request's jobs are stores): a sync-loaded request that computes new chunks in this
        # step stores them too, after its load (stores start at the next step), so its load
        # reads as a store while vLLM builds the step's jobs (vLLM 0.33 allows it for its own
        # sync loads)
        marked = [self._jobs[j] for j in (book.jobs & loads if book is not None else ()) if j in self._jobs]
        for status in marked:
            status.is_store = True
        try:
            meta = build_meta(self, scheduler_output)
        finally:
            for status in marked:
                status.is_store = False
        if book is not None:
            sync = frozenset(book.jobs & loads)
            if sync:
                setattr(meta, META_ATTR, sync)
            book.count(len(sync), len(loads) - len(sync))
            book.jobs.clear()
            book.answered.clear()  # answered but not scheduled this pass: asked again next pass
        return meta

    for f, name in ((get_num_new_matched_tokens, "get_num_new_matched_tokens"),
                    (update_state_after_alloc, "update_state_after_alloc"),
                    (build_connector_meta, "build_connector_meta")):
        f.__wrapped__ = getattr(cls, name)  # type: ignore[attr-defined]
        f.__doc__ = getattr(cls, name).__doc__
        setattr(cls, name, f)


def _wrap_worker(cls: Any) -> None:
    start, finished = cls.start_kv_transfers, cls.get_finished

    def start_kv_transfers(self: Any, metadata: Any) -> Any:
        out = start(self, metadata)
        sync = getattr(metadata, META_ATTR, None)
        if sync:
            mine = self.__dict__.setdefault("_kvtiers_sync", {})
            mine.update({j: self._load_jobs[j] for j in sync if j in self._load_jobs})
            self.worker.wait(set(sync))  # before the forward pass reads the blocks
        return out

    def get_finished(self: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = finished(self, finished_req_ids)
        mine = self.__dict__.get("_kvtiers_sync")
        if mine:
            for j in [j for j in mine if j not in self._load_jobs]:  # reported complete just now
                recving.discard(mine.pop(j))
        return sending, recving

    for f, name in ((start_kv_transfers, "start_kv_transfers"), (get_finished, "get_finished")):
        f.__wrapped__ = getattr(cls, name)  # type: ignore[attr-defined]
        f.__doc__ = getattr(cls, name).__doc__
        setattr(cls, name, f)
