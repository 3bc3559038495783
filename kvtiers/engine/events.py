"""Cache events on their way from the manager's parts and the tiers to the listeners.

Tiers report removals from their own threads, so events wait in a deque (``append`` and
``popleft`` are thread-safe) and reach listeners only in :meth:`EventBus.flush`, which the
manager calls on the engine thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

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

    def add_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Deliver every later event to ``fn``."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Stop delivering events to ``fn``."""
        self._listeners.remove(fn)

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
            for fn in list(self._listeners):
                try:
                    fn(ev)
                except Exception:
                    log.exception("kvtiers: cache event listener %r failed", fn)
