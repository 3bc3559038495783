"""The ``vllm.general_plugins`` entry point: names every installed kvtiers tier to vLLM.

vLLM calls :func:`register` in each of its processes at start-up. It registers, with
vLLM's ``SecondaryTierFactory``, the type ``kvtiers`` (the tier named by a ``tier`` key)
and ``kvtiers_<name>`` for each tier in kvtiers' registry (``kvtiers_fs``,
``kvtiers_memory``, ``kvtiers_obj``, third-party tiers), so a config needs no
``module_path``. The prefix keeps them apart from vLLM's own ``fs``, ``obj`` and ``p2p``.
Registering twice in one process is harmless, and a name vLLM already knows is left alone.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvtiers.integrations.vllm")

MODULE = "kvtiers.integrations.vllm"
GENERIC = "kvtiers"
PREFIX = "kvtiers_"


def vllm_type_names() -> list[str]:
    """The vLLM tier types kvtiers provides: ``kvtiers`` and ``kvtiers_<name>`` per registered tier."""
    from ...registry import get_registry

    return [GENERIC] + [PREFIX + info.name for info in get_registry().tiers()]


def register() -> None:
    """Register the kvtiers tiers with vLLM's ``SecondaryTierFactory`` (vLLM calls this)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        names = vllm_type_names()
    except Exception as e:  # a broken kvtiers plugin must not stop vLLM from starting
        log.warning("kvtiers: could not list tiers for vLLM: %s", e)
        names = [GENERIC]
    for name in names:
        try:
            SecondaryTierFactory.register_tier(name, MODULE, name)
        except ValueError:
            pass  # already registered: this process loaded the plugin before
