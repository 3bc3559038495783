"""What a transformers model's KV cache looks like: layers, KV heads, head size, dtype, device,
sliding windows, and the namespace fields that say so (read from the model and its config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KVGeometry"]

#: the cache layer classes PrefixCache copies (transformers.cache_utils): full attention, and
#: sliding-window attention while it still holds every token
SUPPORTED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache of one decoder model: per layer one K and one V tensor ``[batch, kv_heads,
    seq, head_dim]`` of ``dtype`` on ``device``. ``window``: the smallest sliding window of its
    layers in tokens (None: full attention only); a stored or loaded prefix stays below it."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    model: str
    revision: str | None
    arch: str
    window: int | None = None

    @classmethod
    def from_model(cls, model: Any) -> KVGeometry:
        """Read the geometry from a transformers ``PreTrainedModel`` (its config, dtype and device).

        Raises ``ValueError`` naming the layer class when the model's ``DynamicCache`` would hold
        layers other than full or sliding-window attention (linear attention, SSM state, ...)."""
        import torch
        from transformers import DynamicCache

        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "dtype"):
            raise TypeError(f"PrefixCache: expected a transformers model, got {type(model).__name__}")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = _attr(text, "num_attention_heads")
        layers = _attr(text, "num_hidden_layers")
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or _attr(text, "hidden_size") // heads
        probe = DynamicCache(config=config)
        kinds = [type(layer).__name__ for layer in probe.layers]
        other = sorted({k for k in kinds if k not in SUPPORTED_LAYERS})
        if other:
            raise ValueError(f"PrefixCache: {type(model).__name__}'s DynamicCache has {', '.join(other)} layers; "
                             f"only {' and '.join(SUPPORTED_LAYERS)} (full and sliding-window attention) are supported")
        if len(kinds) != layers:
            raise ValueError(f"PrefixCache: {type(model).__name__}'s DynamicCache has {len(kinds)} layers for "
                             f"{layers} hidden layers")
        windows = [layer.sliding_window for layer in probe.layers if hasattr(layer, "sliding_window")]
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None) or type(model).__name__
        return cls(
            num_layers=int(layers), kv_heads=int(kv_heads), head_dim=int(head_dim), dtype=model.dtype, device=device,
            model=str(name), revision=getattr(config, "_commit_hash", None),
            arch=str(getattr(text, "model_type", type(model).__name__)), window=min(windows) if windows else None,
        )

    @property
    def dtype_name(self) -> str:
        """The dtype as a string, e.g. ``"bfloat16"``."""
        return str(self.dtype).removeprefix("torch.")

    def tensor_bytes(self, tokens: int) -> int:
        """Bytes of one layer's K (or V) for ``tokens`` tokens."""
        import torch

        return self.kv_heads * tokens * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def namespace_fields(self, tokens_per_chunk: int) -> dict[str, Any]:
        """What changes a chunk's bytes, for the tiers' namespace."""
        return {
            "engine": "transformers", "model": self.model, "revision": self.revision, "arch": self.arch,
            "dtype": self.dtype_name, "layers": self.num_layers, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "tokens_per_chunk": tokens_per_chunk,
        }


def _attr(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"PrefixCache: the model config ({type(config).__name__}) has no positive {name!r}")
    return value
