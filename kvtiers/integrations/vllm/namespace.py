"""The namespace of a vLLM secondary tier: what changes a chunk's bytes, from vLLM's config.

Chunks of different byte layouts must never share a namespace: a tier would hand one
engine's bytes to another that reads them differently, and the engine would answer wrong
tokens without any error. So the parallel layout (TP, PP, PCP, DCP) is always in it, except
under ``canonical_layout`` where vLLM certifies the bytes rank-independent. vLLM's own
``is_parallelism_agnostic`` is not enough: it is also set for the plain (direct) layout, whose
rows hold each worker's shard side by side, so a TP=2 row is not a TP=1 row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from .model_identity import digest_cache_enabled, model_identity

log = logging.getLogger("kvtiers.integrations.vllm")

#: the ``kv_connector_extra_config`` key that keeps deployments of one model apart on purpose
DEPLOYMENT = "deployment"


def rank_independent(cfg: Any) -> bool:
    """Whether a chunk's bytes are the same under any parallel layout: only vLLM's canonical
    layout with every layer certified parallelism-agnostic."""
    return bool(cfg.canonical_layout and cfg.parallel.is_parallelism_agnostic)


def namespace_fields(offloading_spec: Any, chunk_bytes: int, extra: Mapping[str, Any] | None = None) -> dict:
    """Namespace fields from a vLLM ``OffloadingSpec`` (its normalised ``OffloadingConfig``).

    The model's identity (a digest of its config and weights, so the same checkpoint reached
    by another path or name shares the cache; the name as given where the files cannot be
    read), KV dtype, tokens per hash, blocks per chunk, the KV cache groups (tokens per block,
    layer names, sliding window), the bytes of one chunk row, the KV cache layout, and the
    parallel layout unless the bytes are rank-independent (:func:`rank_independent`).
    ``kv_connector_extra_config["deployment"]`` (a string) keeps deployments of one model apart
    on purpose. ``extra`` (the tier's ``namespace`` option) is merged in, for facts vLLM does
    not pass to tiers, such as the prefix-caching hash seed.
    """
    cfg = offloading_spec.config
    identity = model_identity(cfg.model.name, use_cache=digest_cache_enabled(offloading_spec.extra_config))
    if identity is None:
        log.info("kvtiers: model %r: no local config and weights to identify it by; the namespace keeps the name",
                 cfg.model.name)
    groups = []
    for g in cfg.groups:
        group: dict[str, Any] = {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
        window = getattr(g, "sliding_window_size_in_chunks", None)
        if window is not None:
            group["window_chunks"] = window
        groups.append(group)
    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": identity or cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "kv_groups": groups,
        "chunk_bytes": chunk_bytes,
    }
    par = cfg.parallel
    if cfg.replicated_layout:
        fields["replicated_layout"] = True
    if not rank_independent(cfg):
        fields["parallel"] = {"tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size}
    if cfg.canonical_layout:
        fields["kv_layout"] = f"canonical:{cfg.kv_cache_layout}"
    elif cfg.kv_cache_layout:
        fields["kv_layout"] = cfg.kv_cache_layout
    deployment = (offloading_spec.extra_config or {}).get(DEPLOYMENT)
    if deployment is not None:
        if not isinstance(deployment, str) or not deployment:
            raise ConfigError(f"kv_connector_extra_config: {DEPLOYMENT!r} expects a non-empty string, "
                              f"got {type(deployment).__name__} {deployment!r}")
        fields[DEPLOYMENT] = deployment
    if extra:
        fields.update(extra)
    return fields
