"""What a tier with a remote or slow backend remembers between lookups besides its HITs:
recent MISSes and the keys being probed. Shared by :class:`kvtiers.AsyncTier` and the p2p
tier; the caller holds its own lock around every call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .types import Lookup


class MissCache:
    """MISSes that expire, probes asked once per key, and a probe's MISS answered at least once.

    ``absent`` maps a key to when its MISS expires. A MISS a probe found is answered to the
    next lookup even when it expired already (``negative_ttl`` 0): otherwise a caller could
    ask forever and only ever see ``RETRY``.
    """

    __slots__ = ("absent", "probing", "unanswered")

    def __init__(self) -> None:
        self.absent: dict[bytes, float] = {}  # key -> when the MISS expires
        self.probing: set[bytes] = set()
        self.unanswered: set[bytes] = set()  # probed MISSes not yet answered

    def answer(self, keys: Sequence[bytes], hit: Callable[[bytes], bool], now: float,
               ) -> tuple[list[Lookup], list[bytes]]:  # fmt: skip
        """The answer per key (``HIT`` where ``hit(key)``, a remembered ``MISS``, else
        ``RETRY``) and the keys the caller must now probe (each once while in flight)."""
        out: list[Lookup] = []
        probe: list[bytes] = []
        absent, unanswered, probing = self.absent, self.unanswered, self.probing
        for k in keys:
            if hit(k):
                out.append(Lookup.HIT)
                continue
            expiry = absent.get(k)
            if expiry is not None and (expiry > now or k in unanswered):
                unanswered.discard(k)
                out.append(Lookup.MISS)
                continue
            if k not in probing:
                probing.add(k)
                probe.append(k)
            out.append(Lookup.RETRY)
        return out, probe

    def missing(self, key: bytes, until: float) -> None:
        """``key`` is known absent until ``until`` (a probe or an eviction said so)."""
        self.absent[key] = until
        self.unanswered.add(key)

    def present(self, key: bytes) -> None:
        """``key`` is known present: forget its MISS."""
        self.absent.pop(key, None)
        self.unanswered.discard(key)
