"""The ``adapter_params`` of the kvtiers L2 adapter, checked (no LMCache, no torch here).

::

    "adapter_params": {"tier": {"type": "fs", "root_dir": "/mnt/kv", "encrypt": {...}},
                       "namespace": {...}, "zero_copy": null, "staging_slots": 64,
                       "lookup_wait_ms": 2000}

``tier`` is a tier entry as everywhere in kvtiers (``type``: a registered name or
``pkg.module:Class``, the tier's options beside it, ``"encrypt"`` included); the rest are the
adapter's own, see :class:`AdapterParams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...config import parse_tier_entry
from ...errors import ConfigError
from ...options import check_options
from ...registry import get_registry

WHAT = "kvtiers L2 adapter"
#: the adapter's own keys of ``adapter_params``
OWN_KEYS = ("tier", "namespace", "zero_copy", "staging_slots", "lookup_wait_ms", "residency")


@dataclass(frozen=True)
class AdapterParams:
    """What the adapter was configured with.

    ``tier_type`` / ``tier_options``: the kvtiers tier and its options (``"encrypt"`` among
    them); ``namespace``: extra namespace fields (e.g. a deployment name); ``zero_copy``:
    None (where LMCache's L1 memory allows), True (required: an object the tier cannot reach
    in place fails), False (always copy through a staging arena); ``staging_slots``: slots
    of each staging arena; ``lookup_wait_ms``: how long a key the tier answers RETRY is asked
    again before it counts as a miss; ``residency``: ``"local"`` / ``"remote"`` to override
    what LMCache 0.5.7 is told of where the tier's bytes are (:mod:`.tags`).
    """

    tier_type: str
    tier_options: dict[str, Any] = field(default_factory=dict)
    namespace: dict[str, Any] = field(default_factory=dict)
    zero_copy: bool | None = None
    staging_slots: int = 64
    lookup_wait_ms: float = 2000.0
    residency: str | None = None

    @property
    def encrypted(self) -> bool:
        return self.tier_options.get("encrypt") is not None


def parse_params(d: Any) -> AdapterParams:
    """Check ``adapter_params``; a :class:`~kvtiers.ConfigError` (one line) names what is wrong.
    The tier's options are checked against its signature here, before any namespace opens."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{WHAT}: adapter_params must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(OWN_KEYS))
    if unknown:
        raise ConfigError(f"{WHAT}: unknown adapter_params key {unknown[0]!r}; expected one of {', '.join(OWN_KEYS)} "
                          f"(the tier's options go inside \"tier\")")
    entry = d.get("tier")
    if isinstance(entry, str) and entry:
        entry = {"type": entry}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{WHAT}: adapter_params needs \"tier\": a tier entry such as "
                          f"{{\"type\": \"fs\", \"root_dir\": \"/mnt/kv\"}}")
    tier = parse_tier_entry(dict(entry), "tier", WHAT)  # the same entry as in any kvtiers config
    info = get_registry().tier_info(tier.type)  # an unknown tier: one line now, not at the first chunk
    options = dict(tier.options)
    if "admit" in options:  # the manager's cascade applies it (docs/admission.md); this opens the tier itself
        raise ConfigError(f"{WHAT}: tier {tier.type!r}: option 'admit' is not applied under LMCache "
                          "(the adapter opens the tier itself, with no kvtiers cascade); remove it")
    encrypt = options.pop("encrypt", None)
    check_options(info.name, info.cls, options)
    if encrypt is not None:
        options["encrypt"] = encrypt
    ns = d.get("namespace") or {}
    if not isinstance(ns, Mapping):
        raise ConfigError(f"{WHAT}: \"namespace\" must be an object of extra namespace fields")
    zc = d.get("zero_copy")
    if zc is not None and not isinstance(zc, bool):
        raise ConfigError(f"{WHAT}: \"zero_copy\" must be true, false or null, got {zc!r}")
    slots = d.get("staging_slots", 64)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"{WHAT}: \"staging_slots\" must be an int >= 1, got {slots!r}")
    wait = d.get("lookup_wait_ms", 2000.0)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
        raise ConfigError(f"{WHAT}: \"lookup_wait_ms\" must be a number >= 0, got {wait!r}")
    residency = d.get("residency")
    if residency is not None and residency not in ("local", "remote"):
        raise ConfigError(f"{WHAT}: \"residency\" must be \"local\", \"remote\" or null, got {residency!r}")
    return AdapterParams(tier.type, options, dict(ns), zc, slots, float(wait), residency)
