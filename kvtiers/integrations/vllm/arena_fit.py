"""Whether ``cpu_bytes_to_use`` holds what concurrent requests pin: one warning at start-up.

vLLM's CPU primary tier (the host arena) pins a chunk's row while a request loads it into the
device cache (from ``prepare_load`` to the load's completion) and while it is stored from the
device cache. The requests that can load at once are bounded by the engine's ``max_num_seqs``
(each up to ``max_model_len`` tokens) and by the device KV cache itself (a load fills device
blocks). When the arena has fewer rows than that, requests that arrive together cannot all
load their prefixes from it: a promotion from a secondary tier finds no free row (a MISS, the
prefix is computed again) and requests wait for each other's pins (vLLM's
``lookup_async_delay``). On a real ``vllm serve`` of SmolLM2-135M's shape with 1024-token
prefixes at C=4, a 64 MiB arena in front of fs (less than 4 x 22.5 MiB) served 0.56-0.71 of the
all-in-device ceiling where a 256 MiB one served 0.73 (docs/vllm-serving.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtiers.integrations.vllm")

_MIB = 1 << 20


@dataclass(frozen=True)
class ArenaFit:
    """What the arena holds against what concurrent requests may pin, in chunks (rows)."""

    rows: int  # rows of the arena (cpu_bytes_to_use / bytes per chunk)
    row_bytes: int
    tokens_per_chunk: int
    groups: int  # KV cache groups: a chunk of each per chunk of tokens
    max_num_seqs: int
    max_model_len: int
    device_tokens: int  # tokens the device KV cache holds
    pinned_rows: int  # rows the requests that can load at once pin

    @property
    def fits(self) -> bool:
        return self.rows >= self.pinned_rows

    def message(self) -> str:
        need = self.pinned_rows * self.row_bytes
        return (f"kvtiers: cpu_bytes_to_use holds {self.rows} chunks ({self.rows * self.row_bytes / _MIB:.0f} MiB) "
                f"but concurrent requests can pin {self.pinned_rows} ({need / _MIB:.0f} MiB): up to "
                f"{self.max_num_seqs} requests (max_num_seqs) of up to {self.max_model_len} tokens, "
                f"{self.device_tokens} tokens in the device KV cache, {self.tokens_per_chunk} tokens per chunk"
                f"{f' in each of {self.groups} KV cache groups' if self.groups > 1 else ''}. Requests that arrive "
                f"together then miss chunks the arena cannot hold for them and wait for each other's pins; give "
                f"cpu_bytes_to_use at least {math.ceil(need / _MIB)} MiB "
                f"(docs/vllm-serving.md, 'Sizing the host arena')")


def arena_fit(spec: Any, vllm_config: Any, kv_cache_config: Any) -> ArenaFit | None:
    """The arena of ``spec`` (vLLM's CPU offloading spec) against the engine's limits; None where
    a figure is missing (a vLLM that names them otherwise)."""
    try:
        rows, row_bytes = int(spec.num_chunks), int(spec.kv_bytes_per_chunk)
        tokens_per_block = max(int(t) for t in spec.tokens_per_block)
        tokens_per_chunk = int(spec.blocks_per_chunk) * tokens_per_block
        groups = max(1, len(spec.config.groups))
        seqs = int(vllm_config.scheduler_config.max_num_seqs)
        max_len = int(vllm_config.model_config.max_model_len)
        device = int(kv_cache_config.num_blocks) * tokens_per_block
    except (AttributeError, TypeError, ValueError):
        return None
    if rows <= 0 or tokens_per_chunk <= 0:
        return None
    tokens = min(seqs * max_len, device)
    return ArenaFit(rows=rows, row_bytes=row_bytes, tokens_per_chunk=tokens_per_chunk, groups=groups,
                    max_num_seqs=seqs, max_model_len=max_len, device_tokens=device,
                    pinned_rows=math.ceil(tokens / tokens_per_chunk) * groups)


def warn_if_small(spec: Any, vllm_config: Any, kv_cache_config: Any) -> ArenaFit | None:
    """Log one warning when the arena holds fewer rows than concurrent requests can pin."""
    fit = arena_fit(spec, vllm_config, kv_cache_config)
    if fit is not None and not fit.fits:
        log.warning(fit.message())
    return fit


_installed = False


def install() -> bool:
    """Make vLLM's offloading connector scheduler call :func:`warn_if_small` once it is built,
    for a spec that asks for it (``kvtiers_check_arena``); idempotent. False where this vLLM
    has no such scheduler."""
    global _installed
    if _installed:
        return True
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod
    except ImportError:
        return False
    cls = getattr(mod, "OffloadingConnectorScheduler", None)
    if cls is None:
        return False
    init = cls.__init__

    def __init__(self: Any, spec: Any, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, spec, vllm_config, kv_cache_config, *args, **kwargs)
        if getattr(spec, "kvtiers_check_arena", False):
            try:
                warn_if_small(spec, vllm_config, kv_cache_config)
            except Exception as e:  # a check must never stop an engine
                log.debug("kvtiers: the arena check failed: %s", e)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    _installed = True
    return True
