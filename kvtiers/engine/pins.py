"""Pins with a lifetime: chunks an engine or an operator keeps from eviction for a time.

These are not the host cache's *transfer* pins (reference counts a device copy or a tier job
holds on a slot while it runs, :mod:`.hostcache`): a lifetime pin is taken by
:meth:`kvtiers.engine.manager.TieringManager.pin` for a prefix (a system prompt, a document
many requests share) and held until its time ends (a *soft* pin, with a TTL) or until
:meth:`~kvtiers.engine.manager.TieringManager.unpin` (a *hard* pin). The host cache skips a
key pinned here when it looks for a victim; tiers that implement the optional ``pin`` hook
keep their own (docs/pins.md).

A pin never makes a bound overflow: the keys pinned at once are capped at ``max_share`` of
the host cache's slots, so eviction can always make room, and a pin that would pass the cap
is refused whole, with the reason. Time comes from ``clock`` (``time.monotonic`` unless a test
gives another); expired pins are counted when :meth:`LifetimePins.expire` finds them.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..misscache import Deadlines

DEFAULT_MAX_TTL = 86400.0  # seconds: the longest soft pin, unless the options say otherwise
DEFAULT_MAX_SHARE = 0.5  # of the host slots (and of a bounded tier's bytes) pinned at most


@dataclass(frozen=True)
class PinResult:
    """What :meth:`~kvtiers.engine.manager.TieringManager.pin` did.

    ``keys``: the keys asked for; ``until``: when the pin ends on the manager's clock (``None``:
    a hard pin, until unpinned); ``host``: ``None`` when the host cache pinned the keys, else
    why it refused; ``tiers``: per tier that was asked, ``None`` when it pinned them, else why
    not (a tier without the optional ``pin`` hook says so)."""

    keys: tuple[bytes, ...]
    until: float | None
    host: str | None
    tiers: dict[str, str | None] = field(default_factory=dict)

    @property
    def pinned(self) -> list[str]:
        """The media that pinned the keys: ``"host"`` and tier names."""
        return (["host"] if self.host is None else []) + [t for t, why in self.tiers.items() if why is None]

    @property
    def refused(self) -> dict[str, str]:
        """The media that refused, with their reasons."""
        out = {} if self.host is None else {"host": self.host}
        out.update({t: why for t, why in self.tiers.items() if why is not None})
        return out


def check_ttl(ttl: float | None, hard: bool, max_ttl: float) -> float | None:
    """The pin's lifetime in seconds (``None``: hard); a ``ValueError`` of one line for a bad one."""
    if hard:
        if ttl is not None:
            raise ValueError(f"pin: a hard pin has no ttl (got ttl={ttl!r}); it holds until unpin")
        return None
    if ttl is None:
        raise ValueError("pin: a soft pin needs ttl=<seconds> (or hard=True to hold until unpin)")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise ValueError(f"pin: ttl must be a finite number of seconds, got {ttl!r}")
    if ttl <= 0:
        raise ValueError(f"pin: ttl must be positive, got {ttl!r}")
    if ttl > max_ttl:
        raise ValueError(f"pin: ttl {ttl:g} s is longer than max_ttl {max_ttl:g} s")
    return float(ttl)


def parse_pin_options(options: Mapping[str, Any] | None) -> tuple[float, float]:
    """``{"max_ttl": seconds, "max_share": fraction}`` -> ``(max_ttl, max_share)``; one-line
    :class:`~kvtiers.errors.ConfigError` for an unknown field or a bad value."""
    opts = dict(options or {})
    unknown = sorted(set(opts) - {"max_ttl", "max_share"})
    if unknown:
        raise ConfigError(f"pins: unknown option(s) {', '.join(unknown)} (known: max_ttl, max_share)")
    max_ttl = opts.get("max_ttl", DEFAULT_MAX_TTL)
    share = opts.get("max_share", DEFAULT_MAX_SHARE)
    if isinstance(max_ttl, bool) or not isinstance(max_ttl, (int, float)) or not max_ttl > 0:
        raise ConfigError(f"pins: max_ttl must be a positive number of seconds, got {max_ttl!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ConfigError(f"pins: max_share must be a fraction in [0, 1), got {share!r}")
    return float(max_ttl), float(share)


class LifetimePins:
    """Keys pinned for a time (``math.inf``: hard), at most ``cap`` at once.

    ``held(key)`` is what the host cache asks before it evicts ``key``. Counts: ``pinned``
    (keys newly pinned or renewed), ``unpinned``, ``expired``, ``refused`` (keys of refused pins),
    for the host cache; ``tier_counts`` for the tiers.
    """

    def __init__(self, cap: int, *, max_ttl: float = DEFAULT_MAX_TTL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.max_ttl = max_ttl
        self.clock = clock
        self._until: Deadlines[bytes] = Deadlines()
        self.pinned = self.unpinned = self.expired = self.refused = 0
        #: chunk keys per ``(tier, event)`` (``pinned``, ``refused``, ``unpinned``: asked to unpin), as the
        #: manager saw the tiers answer; a tier's own expiries are its own (the fs tier: ``pins.expired``)
        self.tier_counts: Counter[tuple[str, str]] = Counter()

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, key: bytes) -> bool:
        return self.held(key)

    def held(self, key: bytes) -> bool:
        """Whether ``key`` is pinned now (an expired pin no longer holds, counted or not yet)."""
        return self._until.held(key, self.clock())

    def until(self, key: bytes) -> float | None:
        """The deadline of ``key``'s pin (``math.inf``: hard), or ``None``."""
        return self._until.get(key)

    def add(self, keys: Sequence[bytes], ttl: float | None) -> str | None:
        """Pin ``keys`` for ``ttl`` seconds (``None``: hard). A key pinned already keeps the
        later deadline. Returns ``None``, or why the whole pin was refused (the cap)."""
        self.expire()
        new = [k for k in dict.fromkeys(keys) if k not in self._until]
        if len(self._until) + len(new) > self.cap:
            self.refused += len(keys)
            return (f"pinning {len(new)} more chunk(s) would hold {len(self._until) + len(new)} of at most {self.cap} "
                    f"(max_share of the host slots): unpin some, or pin fewer")
        until = math.inf if ttl is None else self.clock() + ttl
        for k in dict.fromkeys(keys):
            self._until.extend(k, until)
            self.pinned += 1
        return None

    def remove(self, keys: Sequence[bytes]) -> int:
        """Unpin ``keys`` (soft or hard); returns how many were pinned."""
        n = sum(self._until.pop(k) is not None for k in dict.fromkeys(keys))
        self.unpinned += n
        return n

    def expire(self) -> list[bytes]:
        """Forget the pins whose time has come; return their keys."""
        gone = self._until.due(self.clock())
        self.expired += len(gone)
        return gone
