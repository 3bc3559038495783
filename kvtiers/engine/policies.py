"""Eviction policies of the host cache: ``lru``, ``arc``, and those plugins register.

A policy orders the keys resident in the host cache and names the next victim. It never
frees anything itself; the host cache asks it for a victim among the keys it may evict
(slots not pinned by a transfer or a request). The interface is four methods:

- ``insert(key)``: ``key`` became resident (called before the cache looks for a victim to
  make room for it, so ARC can adapt to ghost hits first).
- ``touch(key)``: ``key`` was used (a lookup hit, a load).
- ``remove(key)``: ``key`` left the cache for a reason other than eviction (a failed fill,
  an explicit drop); the policy forgets it without remembering it as evicted.
- ``victim(evictable) -> key | None``: choose a resident key for which ``evictable(key)``
  is true, forget it as evicted (ARC keeps a ghost), and return it; ``None`` when no
  resident key may be evicted.

Plugins add policies through the ``register_eviction_policies(register)`` hook, calling
``register(name, policy_class)``; the class is constructed as ``policy_class(capacity)``
with the number of host slots. A config may also name a class as ``pkg.module:Class``.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ..errors import ConfigError

Evictable = Callable[[bytes], bool]


@runtime_checkable
class EvictionPolicy(Protocol):
    """The interface the host cache drives (see the module docstring)."""

    def insert(self, key: bytes) -> None: ...

    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victim(self, evictable: Evictable) -> bytes | None: ...


class LRUPolicy:
    """Least recently used first out; pinned keys are skipped, not reordered."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Evictable) -> bytes | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    ``T1`` holds keys seen once recently, ``T2`` keys seen at least twice; ``B1`` and
    ``B2`` are ghosts (keys only) of what was evicted from each. A ghost hit in ``B1``
    grows the target size ``p`` of ``T1`` (recency was undervalued), one in ``B2`` shrinks
    it (frequency was undervalued). Victims come from the LRU end of ``T1`` while
    ``|T1| > p`` (or ``|T1| == p`` after a ``B2`` ghost hit), else from ``T2``; pinned keys
    are skipped, falling back to the other list when one has no evictable key.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self._last_from_b2 = False

    def insert(self, key: bytes) -> None:
        c = self.capacity
        self._last_from_b2 = False
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        if key in self.b1:  # recency ghost hit: favour T1
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # frequency ghost hit: favour T2
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
            self._last_from_b2 = True
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while (self.b1 or self.b2) and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 if self.b2 else self.b1).popitem(last=False)

    def touch(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def victim(self, evictable: Evictable) -> bytes | None:
        n1 = len(self.t1)
        prefer_t1 = n1 > 0 and (n1 > self.p or (self._last_from_b2 and n1 == int(self.p)))
        order = ((self.t1, self.b1), (self.t2, self.b2))
        if not prefer_t1:
            order = order[::-1]
        for live, ghost in order:
            for key in live:
                if evictable(key):
                    del live[key]
                    ghost[key] = None
                    self._trim_ghosts()
                    return key
        return None

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


BUILTIN_POLICIES: dict[str, type] = {"lru": LRUPolicy, "arc": ARCPolicy}


def policy_class(name: str) -> type:
    """Resolve a policy name: built-in, registered by a plugin, or ``pkg.module:Class``."""
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    from ..registry import get_registry

    registered = get_registry().eviction_policies()
    if name in registered:
        return registered[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(mod)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"eviction_policy {name!r}: cannot import ({e})") from None
        return obj
    known = ", ".join(sorted(set(BUILTIN_POLICIES) | set(registered)))
    raise ConfigError(f"unknown eviction_policy {name!r} (known: {known}; or use 'pkg.module:Class')")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Construct the policy ``name`` for a cache of ``capacity`` slots; check its interface."""
    cls = policy_class(name)
    try:
        policy = cls(capacity)
    except Exception as e:
        raise ConfigError(f"eviction_policy {name!r}: could not construct: {type(e).__name__}: {e}") from e
    missing = [m for m in ("insert", "touch", "remove", "victim") if not callable(getattr(policy, m, None))]
    if missing:
        raise ConfigError(f"eviction_policy {name!r}: missing method(s) {', '.join(missing)}")
    return policy
