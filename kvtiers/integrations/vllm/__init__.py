"""Any kvtiers tier as a vLLM secondary tier; see docs/vllm.md.

``KvtiersTier`` is the adapter. ``kvtiers_<name>`` (e.g. ``kvtiers_fs``) is the adapter for
the registered kvtiers tier ``name``, made on first access, so vLLM's
``getattr(import_module("kvtiers.integrations.vllm"), type)`` finds it by the same name the
entry point registers; ``kvtiers`` is ``KvtiersTier`` itself (name the tier with ``tier``).

``KvtiersOffloadingSpec`` (``"spec_name": "KvtiersOffloadingSpec", "spec_module_path":
"kvtiers.integrations.vllm"``) is vLLM's tiering spec with a worker on vLLM's CPU platform as
well; it is imported on first access, as it pulls in vLLM's worker side.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.kv_offload.base import Medium

from .plugin import GENERIC, PREFIX, register
from .tier import MEDIUM, KvtiersTier, primary_arena

_classes: dict[str, type[KvtiersTier]] = {}
_lock = threading.Lock()


def tier_class(name: str) -> type[KvtiersTier]:
    """The ``KvtiersTier`` subclass for kvtiers tier ``name`` (one class per name, cached)."""
    with _lock:
        cls = _classes.get(name)
        if cls is None:
            attrs = {"kvtiers_tier": name, "medium": MEDIUM.get(name, Medium.STORAGE), "__module__": __name__,
                     "__doc__": f"The kvtiers tier {name!r} as a vLLM secondary tier."}
            cls = _classes[name] = type(PREFIX + name, (KvtiersTier,), attrs)
        return cls


def __getattr__(attr: str) -> Any:
    if attr == GENERIC:
        return KvtiersTier
    if attr == "KvtiersOffloadingSpec":
        from .spec import KvtiersOffloadingSpec

        return KvtiersOffloadingSpec
    if attr.startswith(PREFIX) and len(attr) > len(PREFIX):
        from ...registry import get_registry

        name = attr[len(PREFIX):]
        if any(info.name == name for info in get_registry().tiers()):
            return tier_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["KvtiersOffloadingSpec", "KvtiersTier", "primary_arena", "register", "tier_class"]
