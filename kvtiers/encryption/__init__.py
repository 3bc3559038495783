"""Encryption at rest for any tier: the ``"encrypt"`` option, keys, and the sealing wrapper.

Any tier's options accept ``"encrypt": {...}`` (docs/security.md).
:func:`kvtiers.registry.open_tier` takes the option out, so the tier never sees it, and with
a :class:`Sealing` opens the tier on a *staging arena* of slots one page bigger than the
caller's, and puts a :class:`SealedTier` in front of it. A store seals ``arena[slot]`` into a
staging slot with AES-256-GCM and hands the staging slot to the tier; a load lets the tier
fill a staging slot, then decrypts it into ``arena[slot]``; a key whose tag fails has its
slot zeroed before the job is reported (never another tenant's plaintext). The tier stores
and loads opaque slots, as always.

The modules, by what they hold:

- :mod:`~kvtiers.encryption.keys`: where a key comes from, its id, :class:`Keyring`;
- :mod:`~kvtiers.encryption.tenants`: which key a tenant's chunk gets, ``as_tenant``;
- :mod:`~kvtiers.encryption.scope`: the tenant of the calls inside ``as_tenant``, per
  thread and asyncio task;
- :mod:`~kvtiers.encryption.sealed`: the sealed format of one chunk (``seal_into``,
  ``open_into``, ``read_header``);
- :mod:`~kvtiers.encryption.sealed_tier`: :class:`SealedTier`, the wrapper's hooks;
- :mod:`~kvtiers.encryption.sealing`: :class:`Sealing`, opening a tier encrypted.

This package re-exports their public names.

Layer 1: no torch, no engine. ``cryptography`` is the ``encrypt`` extra.
"""

from __future__ import annotations

from .keys import EXTRA_HINT, KEY_BYTES, Keyring, KeySpec, key_fingerprint
from .sealed import (
    HEADER,
    MAGIC,
    NONCE_BYTES,
    OVERHEAD,
    TAG_BYTES,
    OpenFailed,
    open_into,
    read_header,
    seal_into,
    sealed_bytes,
)
from .sealed_tier import INLINE_BYTES, PIECE_BYTES, SealedTier
from .sealing import MIN_STAGING_SLOTS, STAGING_BYTES, Sealing, scaled_bound, staging_slots
from .tenants import TenantKeys

__all__ = [
    "EXTRA_HINT", "HEADER", "INLINE_BYTES", "KEY_BYTES", "MAGIC", "MIN_STAGING_SLOTS", "NONCE_BYTES", "OVERHEAD",
    "PIECE_BYTES", "STAGING_BYTES", "TAG_BYTES", "KeySpec", "Keyring", "OpenFailed", "SealedTier", "Sealing",
    "TenantKeys", "key_fingerprint", "open_into", "read_header", "scaled_bound", "seal_into", "sealed_bytes",
    "staging_slots",
]
