"""Opening a tier encrypted: :class:`Sealing`, what :func:`kvtiers.registry.open_tier` needs
when a tier's options hold ``"encrypt"``: the keys, the tier's context on a *staging arena*
of slots one page bigger than the caller's (:func:`staging_slots`), its options with
``max_bytes`` scaled (:func:`scaled_bound`), and the :class:`~kvtiers.encryption.sealed_tier.SealedTier`
put in front of the opened tier.

Layer 1: no torch, no engine. ``cryptography`` is the ``encrypt`` extra.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from ..types import Arena, TierContext
from .keys import Keyring
from .sealed import sealed_bytes
from .sealed_tier import SealedTier
from .tenants import TenantKeys

log = logging.getLogger("kvtiers")

#: default budget of the staging arena (bytes), bounded by the caller's arena size
STAGING_BYTES = 256 << 20
MIN_STAGING_SLOTS = 8


def staging_slots(spec: Mapping[str, Any], arena: Arena) -> int:
    """How many staging slots: ``staging_bytes`` (default :data:`STAGING_BYTES`) worth,
    at least :data:`MIN_STAGING_SLOTS`, at most the caller's arena size."""
    budget = spec.get("staging_bytes", STAGING_BYTES)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ConfigError(f"encrypt: 'staging_bytes' expects a positive int (bytes), got {budget!r}")
    n = max(MIN_STAGING_SLOTS, budget // arena.slot_bytes)
    return max(1, min(len(arena), n))


def scaled_bound(options: Mapping[str, Any], slot_bytes: int) -> dict[str, Any]:
    """``options`` with ``max_bytes`` scaled by ``sealed_bytes(slot_bytes) / slot_bytes``:
    a bound counts chunks at the caller's slot size, so it holds as many chunks with
    encryption as without (each takes one page more on the medium)."""
    out = dict(options)
    cap = out.get("max_bytes")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
        out["max_bytes"] = -(-cap * sealed_bytes(slot_bytes) // slot_bytes)
    return out


class Sealing:
    """What :func:`kvtiers.registry.open_tier` needs to open a tier encrypted: the keys, the
    tier's context on a staging arena (``ctx``), its options (``options``: ``max_bytes``
    scaled), and :meth:`wrap` for the hooks around the opened tier. Built by :meth:`prepare`."""

    def __init__(self, keyring: Keyring | TenantKeys, ctx: TierContext, options: dict[str, Any],
                 outer: TierContext, threads: int) -> None:
        self.keyring = keyring
        self.ctx = ctx
        self.options = options
        self.outer = outer
        self.threads = threads

    @classmethod
    def prepare(cls, tier_name: str, spec: Any, options: Mapping[str, Any], ctx: TierContext,
                providers: Mapping[str, Callable[[dict], bytes]]) -> Sealing:
        """Load the keys of the ``"encrypt"`` object ``spec`` and allocate the staging arena;
        a one-line :class:`ConfigError` starting ``tier 'NAME': encrypt: ...``."""
        try:
            keyring = TenantKeys.from_spec(spec, providers=providers)
            n = staging_slots(spec, ctx.arena)
            threads = spec.get("threads", 4)
            if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
                raise ConfigError(f"encrypt: 'threads' expects an int 1-64, got {threads!r}")
        except ConfigError as e:
            raise ConfigError(f"tier {tier_name!r}: {e}") from None
        staging = Arena.allocate(n, sealed_bytes(ctx.arena.slot_bytes))
        inner = TierContext(staging, ctx.namespace, removed=ctx.removed)
        default = keyring.default
        log.info("kvtiers: tier %s encrypted (key id %s, %d retired; %d tenant key(s), unknown tenants: %s; "
                 "%d staging slots of %d bytes)", tier_name, default.current if default else "-",
                 len(default.retired) if default else 0, len(keyring.tenants), keyring.unknown, n,
                 staging.slot_bytes)
        return cls(keyring, inner, scaled_bound(options, ctx.arena.slot_bytes), ctx, threads)

    def wrap(self, inner: Any) -> SealedTier:
        """The hooks around ``inner``, the ``TierHandle`` of the tier opened on :attr:`ctx`."""
        return SealedTier(inner, self.outer, self.keyring, threads=self.threads)
