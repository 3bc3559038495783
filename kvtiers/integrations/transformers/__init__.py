"""Hugging Face transformers: a prefix cache for any causal LM that keeps its KV in a ``DynamicCache``.

:class:`PrefixCache` stores the KV of a prompt's full chunks from a ``DynamicCache`` (or the
legacy tuple of ``(key, value)`` per layer) through the host arena to every tier of a kvtiers
config, and gives a later prompt that shares the prefix a ``DynamicCache`` holding it, so the
model runs only the rest. Copies go straight between the cache's tensors and the arena slots,
on CPU and on accelerators (side streams and events). See docs/transformers.md.

Importing this package imports torch and transformers.
"""

from .cache import PrefixCache
from .geometry import KVGeometry

__all__ = ["KVGeometry", "PrefixCache"]
