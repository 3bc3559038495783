"""LMCache's object keys as kvtiers keys and namespaces (no LMCache, no torch here).

An LMCache ``ObjectKey`` is ``(chunk_hash, model_name, kv_rank, object_group_id,
cache_salt)``. The adapter splits it in two:

- the **namespace** (:class:`Space`, one kvtiers tier instance each): the model, the
  ``kv_rank`` (LMCache packs world size and rank into it), the object group and the group's
  memory layout (shapes, dtypes, bytes per object), plus the adapter's extra ``namespace``
  fields. Chunks of two models, two ranks, two groups or two layouts never share one;
- the **tier key** (:func:`tier_key_of`): the chunk hash as it is (1-64 bytes), or, with a
  ``cache_salt``, a digest over salt and hash, so two salts never share a chunk in any tier.
  For an encrypted tier the salt is also the chunk's tenant (docs/security.md#tenants).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import tier_key

#: the namespace field that says which engine wrote the chunks
ENGINE = "lmcache"


@dataclass(frozen=True)
class Layout:
    """The bytes of one object of a group: its tensors' shapes and dtypes (``str(dtype)``)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> Layout:
        """From parallel lists of shapes and torch dtypes (anything with ``itemsize``)."""
        if len(shapes) != len(dtypes) or not shapes:
            raise ValueError(f"a layout needs one dtype per shape, got {len(shapes)} shapes, {len(dtypes)} dtypes")
        nbytes = sum(math.prod(int(x) for x in s) * int(d.itemsize) for s, d in zip(shapes, dtypes, strict=True))
        return cls(tuple(tuple(int(x) for x in s) for s in shapes), tuple(str(d) for d in dtypes), nbytes)


@dataclass(frozen=True)
class Space:
    """One namespace: what LMCache's key and the group's layout say about a chunk's bytes."""

    model: str
    kv_rank: int
    group: int
    layout: Layout

    def fields(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The kvtiers namespace fields (``extra`` added, never replacing these)."""
        fields = dict(extra or {})
        fields.update({
            "engine": ENGINE,
            "model": self.model,
            "kv_rank": self.kv_rank,
            "object_group": self.group,
            "shapes": [list(s) for s in self.layout.shapes],
            "dtypes": list(self.layout.dtypes),
            "object_bytes": self.layout.nbytes,
        })  # fmt: skip
        return fields


def tier_key_of(chunk_hash: bytes, cache_salt: str) -> bytes:
    """The kvtiers key of a chunk: its hash (a digest when longer than 64 bytes), or with a
    salt, a 32-byte digest over both (a salted key never equals another salt's)."""
    if not cache_salt:
        return tier_key(bytes(chunk_hash))
    salt = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"kvtiers lmcache salted key\0" + len(salt).to_bytes(4, "big") + salt
                          + bytes(chunk_hash)).digest()
