"""Cache events on their way from the manager's parts and the tiers to the listeners.

Tiers report removals from their own threads, so events wait in a deque (``append`` and
``popleft`` are thread-safe) and reach listeners only in :meth:`EventBus.flush`, which the
manager calls on the engine thread.

Observers that need more than the events (the KV event publisher of
:mod:`.kvevents`, the metrics of :mod:`kvtiers.metrics`) also register here: a store
observer sees each store call's keys and request (token ids and block hashes for
self-describing KV events), a flush hook runs at the end of every flush (one publish per
manager call), and closers run when the manager closes, after its last flush.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

from .types import CacheEvent

__all__ = ["HOST", "EventBus"]

# one logger for the manager and all its parts: the name users configure did not change with the split
log = logging.getLogger("kvtiers.engine.manager")

HOST = "host"  # the medium of the host arena; no tier may take this name


class EventBus:
    """The listeners and the :class:`CacheEvent` s not delivered yet."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[CacheEvent], None]] = []
        self._events: deque[CacheEvent] = deque()  # appended from any thread, flushed on ours
        self._evicted: list[bytes] = []  # host evictions, batched into one event per flush
        self.counts: Counter = Counter()  # (kind, medium) -> chunk keys delivered
        self._store_observers: list[Callable[[Sequence[bytes], Any, int], None]] = []
        self._flush_hooks: list[Callable[[], None]] = []
        self._closers: list[Callable[[], None]] = []

    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Deliver every later event to ``fn``."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop delivering events to ``fn``."""
        self._listeners.remove(fn)

    def add_store_observer(self, fn: Callable[[Sequence[bytes], Any, int], None]) -> None:
        """Call ``fn(keys, request, first_chunk)`` for every store call (before its events)."""
        self._store_observers.append(fn)

    def note_store(self, keys: Sequence[bytes], request: Any, first_chunk: int) -> None:
        """A store call: tell the store observers."""
        for fn in self._store_observers:
            try:
                fn(keys, request, first_chunk)
            except Exception:
                log.exception("kvtiers: store observer %r failed", fn)

    def add_flush_hook(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at the end of every :meth:`flush` (once per manager call)."""
        self._flush_hooks.append(fn)

    def add_closer(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` from :meth:`close` (closers run in reverse order of adding)."""
        self._closers.append(fn)

    def close(self) -> None:
        """Run the closers once, each even if an earlier one raised (logged)."""
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            try:
                fn()
            except Exception:
                log.exception("kvtiers: closing %r failed", fn)

    def emit(self, kind: str, keys: Sequence[bytes], medium: str, reason: str | None) -> None:
        """Queue an event for ``keys`` (none for no keys)."""
        if keys:
            self._events.append(CacheEvent(kind, tuple(keys), medium, reason))

    def host_evicted(self, key: bytes, slot: int) -> None:
        """The host cache's ``on_evict`` hook."""
        self._evicted.append(key)

    def tier_removed(self, medium: str) -> Callable[[Sequence[bytes], str], None]:
        """A tier context's removed-listener that queues ``"removed"`` events for ``medium``
        (callable from any thread)."""
        return lambda keys, reason: self._events.append(CacheEvent("removed", tuple(keys), medium, reason))

    def flush(self) -> None:
        """Deliver the queued events, in order. A listener that raises is logged and kept."""
        if self._evicted:
            self.emit("removed", self._evicted, HOST, "evicted")
            self._evicted = []
        while self._events:
            ev = self._events.popleft()
            self.counts[ev.kind, ev.medium] += len(ev.keys)
            for fn in list(self._listeners):
                try:
                    fn(ev)
                except Exception:
                    log.exception("kvtiers: cache event listener %r failed", fn)
        for hook in self._flush_hooks:
            try:
                hook()
            except Exception:
                log.exception("kvtiers: flush hook %r failed", hook)
