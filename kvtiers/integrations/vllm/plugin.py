"""The ``vllm.general_plugins`` entry point: names every installed kvtiers tier to vLLM.

vLLM calls :func:`register` in each of its processes at start-up. It registers, with
vLLM's ``SecondaryTierFactory``, the type ``kvtiers`` (the tier named by a ``tier`` key)
and ``kvtiers_<name>`` for each tier in kvtiers' registry (``kvtiers_fs``,
``kvtiers_memory``, ``kvtiers_obj``, third-party tiers), so a config needs no
``module_path``. The prefix keeps them apart from vLLM's own ``fs``, ``obj`` and ``p2p``.
It also registers the model load format ``kvtiers`` (:mod:`.loader`: publish a model's weights
to the tiers as it loads, or start from weights another engine published; docs/vllm-weights.md),
and the primary-tier policy ``kvtiers_bip`` (:mod:`.policy`: hits under cyclic reuse).
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


def register_load_format() -> None:
    """Register the ``kvtiers`` model load format with vLLM (once per process); a vLLM where
    that fails (no ``register_model_loader``) is named in one log line and left alone."""
    try:
        from vllm.model_executor import model_loader

        from .loader import KvtiersModelLoader
        from .loader_config import LOAD_FORMAT

        known = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
        if known.get(LOAD_FORMAT) is not KvtiersModelLoader:
            model_loader.register_model_loader(LOAD_FORMAT)(KvtiersModelLoader)
    except Exception as e:  # noqa: BLE001 - the tiers must register whatever this does
        log.warning("kvtiers: the load format 'kvtiers' is unavailable in this vLLM: %s", e)


def register() -> None:
    """Register the kvtiers tiers with vLLM's ``SecondaryTierFactory``, and the ``kvtiers`` load
    format (vLLM calls this)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    register_load_format()
    try:  # the frontend's side of the load format (kvtiers.integrations.vllm.frontend)
        from .frontend import install

        install()
    except Exception as e:  # noqa: BLE001 - as for the load format
        log.warning("kvtiers: the frontend hooks of the load format 'kvtiers' are unavailable in this vLLM: %s", e)

    try:  # "eviction_policy": "kvtiers_bip" for vLLM's primary tier
        from .policy import register as register_policy

        register_policy()
    except Exception as e:  # noqa: BLE001 - as for the load format
        log.warning("kvtiers: the primary-tier policy 'kvtiers_bip' is unavailable in this vLLM: %s", e)

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
