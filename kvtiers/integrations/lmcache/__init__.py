"""Any kvtiers tier as an L2 adapter of LMCache's server (``lmcache server``); docs/lmcache.md.

::

    lmcache server --l1-size-gb 1 --eviction-policy LRU --l2-adapter '{"type": "plugin",
        "module_path": "kvtiers.integrations.lmcache", "class_name": "KvtiersL2Adapter",
        "config_class_name": "KvtiersL2AdapterConfig",
        "adapter_params": {"tier": {"type": "fs", "root_dir": "/mnt/kv"}}}'

This package imports without LMCache; :class:`KvtiersL2Adapter` and
:class:`KvtiersL2AdapterConfig` (subclasses of LMCache's own) import it when first named,
and where it is missing that is one line saying what to install.
"""

from __future__ import annotations

from typing import Any

from .mapping import Layout, Space, tier_key_of
from .params import AdapterParams, parse_params

__all__ = ["AdapterParams", "KvtiersL2Adapter", "KvtiersL2AdapterConfig", "Layout", "Space", "parse_params",
           "tier_key_of"]

#: what installs LMCache next to kvtiers (torch pinned beside it: docs/lmcache.md)
INSTALL = "pip install lmcache==0.5.6 'torch==2.13.0' (make .venv-lmcache/.installed builds such an environment)"
_LAZY = ("KvtiersL2Adapter", "KvtiersL2AdapterConfig")


class MissingLMCache(ImportError):
    """LMCache is not installed where the adapter is asked for (one line: what to install)."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from . import adapter
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lmcache":
            raise
        raise MissingLMCache(f"the kvtiers L2 adapter needs LMCache, which is not installed: {INSTALL}") from None
    return getattr(adapter, name)
