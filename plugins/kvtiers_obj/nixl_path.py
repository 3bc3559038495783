"""The optional NIXL data path (``backend: "nixl"``).

NIXL (``nixl-cu12``) moves bytes through its OBJ plugin. It is optional: without it,
``backend: "nixl"`` is a clear error at open.
"""

from __future__ import annotations

from kvtiers import TierError


def nixl_available() -> bool:
    """Whether ``nixl_cu12`` imports here."""
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception:
        return False
    return True


def check_nixl() -> None:
    """Raise :class:`TierError` unless the NIXL path can be used."""
    if not nixl_available():
        raise TierError(
            "tier 'obj': backend 'nixl' needs nixl-cu12: pip install 'kvtiers[nixl]' (or use backend 'aiobotocore')"
        )
    raise TierError("tier 'obj': backend 'nixl' is not implemented in this build; use backend 'aiobotocore'")
