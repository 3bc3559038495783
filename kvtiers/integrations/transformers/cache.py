"""The prefix cache for transformers models: store a prompt's KV from its ``DynamicCache``, load
the longest stored prefix of a later prompt into a new ``DynamicCache``."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ...engine.closing import ClosesManager
from ...types import prefix_chunk_keys
from .copier import CacheCopier, chunk_layout
from .geometry import SUPPORTED_LAYERS, KVGeometry

__all__ = ["PrefixCache"]


class PrefixCache(ClosesManager):
    """KV prefixes of one transformers model in a kvtiers host arena and tier stack.

    Build it with :meth:`from_config`. Then, per prompt: ``cache, n = pc.load(ids)``, run the
    model on ``ids[n:]`` with ``past_key_values=cache`` (a fresh cache when ``cache`` is None),
    and ``pc.store(ids, cache)`` once the prompt's KV is computed. Chunk keys are
    :func:`kvtiers.prefix_chunk_keys` of the token ids (``salt`` mixed in); the namespace holds
    the model (name or path, revision, architecture), dtype, layers, KV heads, head size and
    tokens per chunk, so a different model or dtype never reads these chunks.

    One sequence at a time (batch size 1); calls from one thread at a time.
    """

    closed_message = "PrefixCache is closed"

    def __init__(self, manager: Any, model: Any, geometry: KVGeometry, tokens_per_chunk: int, copier: CacheCopier,
                 *, salt: bytes = b"", lookup_timeout: float = 5.0) -> None:
        self.manager = manager
        self.model = model
        self.geometry = geometry
        self.tokens_per_chunk = tokens_per_chunk
        self.salt = bytes(salt)
        self.lookup_timeout = lookup_timeout
        self._copier = copier
        self._closed = False

    @classmethod
    def from_config(cls, config: Any, model: Any, *, tokens_per_chunk: int = 256,
                    namespace_fields: Mapping[str, Any] | None = None, salt: bytes = b"",
                    lookup_timeout: float = 5.0, pin: bool | None = None) -> PrefixCache:
        """A prefix cache for ``model`` (a transformers causal LM) over the host arena and tiers of
        ``config`` (the usual kvtiers JSON config: a mapping, JSON text or a file path; see
        docs/configuration.md). The KV layout, dtype and namespace come from the model's config;
        ``namespace_fields`` adds to the namespace. ``tokens_per_chunk``: tokens per chunk (and
        per key). ``lookup_timeout``: how long :meth:`load` waits for tiers still finding out
        (an ``fs`` tier scanning its directory after a start)."""
        import operator

        from ...config import Config, load_config
        from ...engine.manager import TieringManager
        from ...errors import ConfigError

        tpc = operator.index(tokens_per_chunk)
        if tpc <= 0:
            raise ValueError(f"PrefixCache: tokens_per_chunk must be positive, got {tpc}")
        cfg = config if isinstance(config, Config) else load_config(config)
        if cfg.blocks_per_chunk != 1 or cfg.block_size is not None:
            raise ConfigError("PrefixCache: a chunk is tokens_per_chunk tokens; leave 'blocks_per_chunk' and "
                              f"'block_size' out of the config (got {cfg.blocks_per_chunk}, {cfg.block_size})")
        geometry = KVGeometry.from_model(model)
        if geometry.window is not None and geometry.window - 1 < tpc:
            raise ValueError(f"PrefixCache: tokens_per_chunk={tpc} does not fit below the model's sliding "
                             f"window of {geometry.window} tokens")
        fields = {**geometry.namespace_fields(tpc), **dict(namespace_fields or {})}
        made: list[CacheCopier] = []

        def make_copier(layout: Any, host: Any, blocks_per_chunk: int) -> CacheCopier:
            made.append(CacheCopier(host, geometry, tpc))
            return made[-1]

        mgr = TieringManager.from_config(cfg, None, layout=chunk_layout(geometry, tpc), namespace_fields=fields,
                                         tokens_per_block=tpc, pin=pin, dma=make_copier)
        return cls(mgr, model, geometry, tpc, made[0], salt=salt, lookup_timeout=lookup_timeout)

    # -- the API -------------------------------------------------------------------------
    def keys(self, token_ids: Any) -> list[bytes]:
        """The chunk keys of ``token_ids``: one per full chunk (:func:`kvtiers.prefix_chunk_keys`)."""
        return prefix_chunk_keys(_flat_ids(token_ids), self.tokens_per_chunk, salt=self.salt)

    def store(self, token_ids: Any, cache: Any) -> int:
        """Store the KV of the full chunks of ``token_ids`` from ``cache`` (a ``DynamicCache`` or
        the legacy tuple of ``(key, value)`` per layer, holding at least those tokens, batch size
        1) in the host arena; the tiers get them in the background (:meth:`close` waits for
        them). Chunks of a prefix already stored (in the arena or a tier) are not copied again.
        Returns the chunks accepted: new chunks not skipped for want of a free slot. Blocks until
        they are in the arena (the cache may change afterwards)."""
        self._check_open()
        ids = _flat_ids(token_ids)
        keys = prefix_chunk_keys(ids, self.tokens_per_chunk, salt=self.salt)
        if not keys:
            self.manager.poll()
            return 0
        layers = self._cache_tensors(cache, len(keys) * self.tokens_per_chunk)
        start = self.manager.lookup(keys).num_chunks  # a prefix stored already (e.g. the one loaded)
        if start == len(keys):
            return 0
        self._copier.target = layers
        try:
            tid = self.manager.store(keys[start:], [[c] for c in range(start, len(keys))])
            (res,) = self.manager.wait([tid], timeout=self.manager.tier_job_timeout + 60)
        finally:
            self._copier.target = None
        return len(keys) - start - len(res.skipped_keys)

    def load(self, token_ids: Any) -> tuple[Any, int]:
        """The longest stored prefix of ``token_ids``: ``(cache, n)``, a new ``DynamicCache``
        holding the KV of ``token_ids[:n]`` on the model's device, or ``(None, 0)``. ``n`` is a
        multiple of ``tokens_per_chunk`` and leaves at least one token to compute (the model
        needs one to give the next token's logits), so run the model on ``token_ids[n:]``. A
        chunk that fails to load (missing, corrupt) ends the prefix there: the rest is
        recomputed."""
        self._check_open()
        ids = _flat_ids(token_ids)
        tpc, g = self.tokens_per_chunk, self.geometry
        limit = (len(ids) - 1) // tpc if len(ids) else 0
        if g.window is not None:  # a sliding-window layer keeps window - 1 tokens
            limit = min(limit, (g.window - 1) // tpc)
        if limit <= 0:
            return None, 0
        keys = prefix_chunk_keys(ids[: limit * tpc], tpc, salt=self.salt)
        mgr = self.manager
        deadline = time.monotonic() + self.lookup_timeout
        pause = 0.0005
        while (look := mgr.lookup(keys)).retry and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        n = look.num_chunks
        if n == 0:
            return None, 0
        import torch

        shape = (1, g.kv_heads, n * tpc, g.head_dim)
        dst = [tuple(torch.empty(shape, dtype=g.dtype, device=g.device) for _kv in "KV")
               for _layer in range(g.num_layers)]
        self._copier.target = dst
        try:
            tid = mgr.load(keys[:n], [[c] for c in range(n)])
            (res,) = mgr.wait([tid], timeout=mgr.tier_job_timeout + 60)
        finally:
            self._copier.target = None
        if res.failed_keys:
            failed = set(res.failed_keys)
            n = next(i for i, k in enumerate(keys[:n]) if k in failed)
            if n == 0:
                return None, 0
            dst = [(k[:, :, : n * tpc], v[:, :, : n * tpc]) for k, v in dst]
        return self._dynamic_cache(dst), n * tpc

    # -- internals -----------------------------------------------------------------------
    def _cache_tensors(self, cache: Any, tokens: int) -> list[tuple[Any, Any]]:
        """Per layer ``(key, value)`` of ``cache``, checked against the model's geometry."""
        g = self.geometry
        if isinstance(cache, (tuple, list)):
            layers = [tuple(layer[:2]) for layer in cache]
            where = "legacy cache"
        else:
            cache_layers = getattr(cache, "layers", None)
            if cache_layers is None or type(cache).__name__ != "DynamicCache":
                raise TypeError(f"PrefixCache.store: expected a DynamicCache or a tuple of (key, value) per layer, "
                                f"got {type(cache).__name__}")
            layers = []
            for i, layer in enumerate(cache_layers):
                kind = type(layer).__name__
                if kind not in SUPPORTED_LAYERS:
                    raise TypeError(f"PrefixCache.store: layer {i} of the cache is a {kind}; only "
                                    f"{' and '.join(SUPPORTED_LAYERS)} layers are supported")
                held = 0 if layer.keys is None or layer.keys.dim() != 4 else layer.keys.shape[-2]
                if kind == "DynamicSlidingWindowLayer" and layer.cumulative_length != held:
                    raise ValueError(f"PrefixCache.store: layer {i} is a DynamicSlidingWindowLayer that kept only the "
                                     f"last {held} of {layer.cumulative_length} tokens (window "
                                     f"{layer.sliding_window}); a prefix past the window cannot be stored")
                layers.append((layer.keys, layer.values))
            where = "DynamicCache"
        if len(layers) != g.num_layers:
            raise ValueError(f"PrefixCache.store: the {where} has {len(layers)} layers, the model {g.num_layers}")
        want = (g.kv_heads, g.head_dim)
        for i, (k, v) in enumerate(layers):
            for name, t in (("key", k), ("value", v)):
                if t is None or not hasattr(t, "shape") or t.dim() != 4:
                    raise ValueError(f"PrefixCache.store: layer {i} {name} is not a [batch, heads, seq, head_dim] "
                                     f"tensor (an empty cache?)")
                if t.shape[0] != 1:
                    raise ValueError(f"PrefixCache.store: one sequence at a time; layer {i} {name} has batch size "
                                     f"{t.shape[0]}")
                if (t.shape[1], t.shape[3]) != want or t.dtype != g.dtype:
                    raise ValueError(f"PrefixCache.store: layer {i} {name} is {tuple(t.shape)} {t.dtype}; the model's "
                                     f"KV is [1, {g.kv_heads}, seq, {g.head_dim}] {g.dtype}")
                if t.shape[2] < tokens:
                    raise ValueError(f"PrefixCache.store: layer {i} {name} holds {t.shape[2]} tokens, fewer than the "
                                     f"{tokens} of the prompt's full chunks")
                if t.device != self._copier.device and not (t.device.type == self._copier.device.type == "cpu"):
                    raise ValueError(f"PrefixCache.store: layer {i} {name} is on {t.device}, the model on "
                                     f"{self._copier.device}")
        return layers

    def _dynamic_cache(self, tensors: Sequence[tuple[Any, Any]]) -> Any:
        """A ``DynamicCache`` of the model's layer types holding ``tensors`` as they are (no copy)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in zip(cache.layers, tensors, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if hasattr(layer, "cumulative_length"):  # a sliding-window layer: every token so far is held
                layer.cumulative_length = k.shape[-2]
        return cache


def _flat_ids(token_ids: Any) -> Any:
    """``token_ids`` as a flat sequence: a ``[1, n]`` tensor or array becomes ``[n]``."""
    shape = getattr(token_ids, "shape", None)
    if shape is not None and len(shape) == 2:
        if shape[0] != 1:
            raise ValueError(f"PrefixCache: one sequence at a time; token_ids has shape {tuple(shape)}")
        return token_ids[0]
    return token_ids
