"""The host cache: which chunk key lives in which arena slot, and which slots are pinned.

A slot is *pinned* (reference-counted) while a transfer or a request uses it: a device
copy into or out of it, a tier store reading it, a promotion writing it, a load waiting
for it. Pinned slots are never evicted, also when the request that pinned them was
cancelled: the pin is released when the transfer ends. Unpinned, ready slots are evicted
in the order an :mod:`~kvtiers.engine.policies` policy chooses, skipping keys a *lifetime*
pin holds (``held``, set by the manager from :mod:`~kvtiers.engine.pins`; a different thing
from these transfer pins).

An entry is in one of three states:

- ``"storing"``: a device -> arena copy is filling the slot (not loadable yet);
- ``"loading"``: a promotion from a secondary tier is filling the slot (lookups answer RETRY);
- ``"ready"``: the slot holds the chunk's bytes.

``store_threshold`` (see :meth:`HostCache.offer`) admits a chunk only once it was offered
that many times, so one-off prefixes do not churn the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .policies import EvictionPolicy

STORING = "storing"
LOADING = "loading"
READY = "ready"
STATES = (STORING, LOADING, READY)
WRITE_BACKS_PER_EVICTION = 16  # write-backs one allocation may start before it takes a clean slot or none


class HostCache:
    """Key -> slot map over ``num_slots`` arena slots with pinning and eviction."""

    def __init__(
        self,
        num_slots: int,
        policy: EvictionPolicy,
        *,
        store_threshold: int = 1,
        on_evict: Callable[[bytes, int], None] | None = None,
        max_offer_keys: int | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if store_threshold < 1:
            raise ValueError(f"store_threshold must be >= 1, got {store_threshold}")
        self.num_slots = num_slots
        self.policy = policy
        self.store_threshold = store_threshold
        self.on_evict = on_evict
        self._slot_of: dict[bytes, int] = {}
        self._state: dict[bytes, str] = {}
        self._key_of: list[bytes | None] = [None] * num_slots
        self._refs: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._orphans: set[int] = set()  # dropped while pinned: freed at the last unpin
        self._offers: OrderedDict[bytes, int] = OrderedDict()
        self._max_offer_keys = max_offer_keys or max(1024, 8 * num_slots)
        self.evictions = 0
        #: ``write_back(key, slot) -> bool``: asked before ``key`` is evicted; True when it pinned the
        #: slot to copy the chunk down first (write-back admission, kvtiers.engine.admission)
        self.write_back: Callable[[bytes, int], bool] | None = None
        self.is_dirty: Callable[[bytes], bool] = lambda key: False  # waiting for write-back
        #: ``held(key)``: a lifetime pin holds ``key`` (kvtiers.engine.pins): never a victim before its time.
        #: Apart from the transfer pins above (``pin``/``unpin``: reference counts on slots)
        self.held: Callable[[bytes], bool] = lambda key: False
        self._held_seen: list[bytes] = []

    # -- queries ---------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def state(self, key: bytes) -> str | None:
        """``"storing"``, ``"loading"``, ``"ready"``, or ``None`` when absent."""
        return self._state.get(key)

    def slot(self, key: bytes) -> int | None:
        """The slot of ``key`` in any state, or ``None``."""
        return self._slot_of.get(key)

    def refs(self, slot: int) -> int:
        """How many pins hold ``slot``."""
        return self._refs[slot]

    def is_pinned(self, slot: int) -> bool:
        return self._refs[slot] > 0

    def free_slots(self) -> int:
        """Slots holding no key and no orphaned pin."""
        return len(self._free)

    def pinned_slots(self) -> int:
        return sum(1 for r in self._refs if r)

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    # -- admission -------------------------------------------------------------------
    def offer(self, key: bytes) -> bool:
        """Count one offer of ``key`` for storing; True once it reached ``store_threshold``.

        Offer counts are kept for a bounded number of recent keys (least recently offered
        forgotten first).
        """
        if self.store_threshold <= 1:
            return True
        n = self._offers.pop(key, 0) + 1
        if n >= self.store_threshold:
            return True
        self._offers[key] = n
        while len(self._offers) > self._max_offer_keys:
            self._offers.popitem(last=False)
        return False

    def _evictable(self, key: bytes) -> bool:
        return self._state.get(key) == READY and self._refs[self._slot_of[key]] == 0 and not self.held(key)

    def _clean_evictable(self) -> Callable[[bytes], bool]:
        """:meth:`_evictable`, asking ``write_back`` first: a chunk it starts copying down is
        pinned, so skipped (at most :data:`WRITE_BACKS_PER_EVICTION` started per eviction)."""
        started = 0

        def evictable(key: bytes) -> bool:
            nonlocal started
            if not self._evictable(key):
                return False
            if started >= WRITE_BACKS_PER_EVICTION:  # more dirty ones wait for the next eviction
                return not self.is_dirty(key)
            if self.write_back(key, self._slot_of[key]):
                started += 1
                return False
            return True

        return evictable

    def _skip_held(self, evictable: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
        """``evictable``, noting the keys a lifetime pin held: the policy is told they were
        used once it has chosen (``policy.touch``), so the next search does not walk past
        them again (with half the slots pinned at the LRU end, every eviction would)."""
        held = self._held_seen = []

        def check(key: bytes) -> bool:
            if self.held(key):
                held.append(key)
                return False
            return evictable(key)

        return check

    def allocate(self, key: bytes, state: str) -> int | None:
        """Give ``key`` (absent) a slot in ``state`` with one pin, evicting if needed.

        Returns the slot, or ``None`` when every slot is pinned or filling (nothing is
        changed then). Each eviction is reported to ``on_evict(key, slot)``.
        """
        if key in self._slot_of:
            raise ValueError(f"key {key!r} already has slot {self._slot_of[key]}")
        if state not in (STORING, LOADING):
            raise ValueError(f"a new entry is {STORING!r} or {LOADING!r}, not {state!r}")
        self.policy.insert(key)
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.policy.victim(self._skip_held(
                self._evictable if self.write_back is None else self._clean_evictable()))
            for k in self._held_seen:  # (after the search: a policy's order must not change during it)
                self.policy.touch(k)
            if victim is None:
                self.policy.remove(key)
                return None
            if not self._evictable(victim):  # a plugin policy broke the interface
                self.policy.remove(key)
                raise RuntimeError(f"eviction policy {type(self.policy).__name__} chose a pinned key {victim!r}")
            slot = self._slot_of.pop(victim)
            del self._state[victim]
            self._key_of[slot] = None
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim, slot)
        self._slot_of[key] = slot
        self._state[key] = state
        self._key_of[slot] = key
        self._refs[slot] = 1
        return slot

    # -- pins and states -------------------------------------------------------------
    def pin(self, key: bytes) -> int:
        """Add a pin to the slot of ``key`` (present) and return the slot."""
        slot = self._slot_of[key]
        self._refs[slot] += 1
        return slot

    def unpin(self, slot: int) -> None:
        """Drop one pin of ``slot``; an orphaned slot is freed at its last unpin."""
        if self._refs[slot] <= 0:
            raise ValueError(f"slot {slot} is not pinned")
        self._refs[slot] -= 1
        if self._refs[slot] == 0 and slot in self._orphans:
            self._orphans.discard(slot)
            self._free.append(slot)

    def mark_ready(self, key: bytes) -> None:
        """The slot of ``key`` now holds its bytes."""
        if key not in self._slot_of:
            raise KeyError(key)
        self._state[key] = READY

    def touch(self, key: bytes) -> None:
        """Tell the policy that ``key`` was used (no-op when absent)."""
        if key in self._slot_of:
            self.policy.touch(key)

    def drop(self, key: bytes) -> bool:
        """Forget ``key`` (a failed fill, an invalidation). Its slot is freed now, or at the
        last unpin when pinned. Returns whether it was present."""
        slot = self._slot_of.pop(key, None)
        if slot is None:
            return False
        del self._state[key]
        self._key_of[slot] = None
        self.policy.remove(key)
        if self._refs[slot]:
            self._orphans.add(slot)
        else:
            self._free.append(slot)
        return True
