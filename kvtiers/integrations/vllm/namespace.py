"""The namespace of a vLLM secondary tier: what changes a chunk's bytes, from vLLM's config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def namespace_fields(offloading_spec: Any, chunk_bytes: int, extra: Mapping[str, Any] | None = None) -> dict:
    """Namespace fields from a vLLM ``OffloadingSpec`` (its normalised ``OffloadingConfig``).

    Model, KV dtype, tokens per hash, blocks per chunk, the KV cache groups (tokens per
    block and layer names), the bytes of one chunk row (every worker's shard side by side,
    padded to a page), the KV cache layout, and the parallel layout unless vLLM says the
    bytes are parallelism-agnostic (then instances with other TP/PP sizes share the cache,
    as vLLM's own fs tier does). ``extra`` (the tier's ``namespace`` option) is merged in,
    for facts vLLM does not pass to tiers, such as the prefix-caching hash seed.
    """
    cfg = offloading_spec.config
    fields: dict[str, Any] = {
        "engine": "vllm",
        "model": cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "kv_groups": [
            {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)} for g in cfg.groups
        ],
        "chunk_bytes": chunk_bytes,
    }
    par = cfg.parallel
    if cfg.replicated_layout:
        fields["replicated_layout"] = True
    elif not par.is_parallelism_agnostic:
        fields["parallel"] = {"tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size}
    if cfg.canonical_layout:
        fields["kv_layout"] = f"canonical:{cfg.kv_cache_layout}"
    elif cfg.kv_cache_layout:
        fields["kv_layout"] = cfg.kv_cache_layout
    if extra:
        fields.update(extra)
    return fields
