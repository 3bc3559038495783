"""Where a chunk lives in the Mooncake pool and how its bytes are framed.

Object names (any Mooncake client can find a chunk from its key)::

    kvtiers/<namespace digest>/<key hex>

The key is written as its full lowercase hex, so no key escapes its namespace, no byte of a
key reaches Mooncake unescaped, and two distinct keys never alias.

Object format: the chunk's bytes followed by the 40-byte ``KVTOBJ02`` trailer the obj tier
uses (:func:`kvtiers.types.make_chunk_trailer`: magic, payload length, payload xxh3, key
xxh3, namespace digest), checked on every load. An object whose size is not
``slot_bytes + 40`` is not this arena's (a chunk of another size on the same namespace, or a
torn one): a failed key, left alone. A right-sized object whose trailer does not vouch for
its payload, key and namespace is corrupt: a failed key, removed from the pool.
"""

from __future__ import annotations

from kvtiers.types import (
    CHUNK_TRAILER_BYTES,
    CorruptChunk,
    check_chunk_trailer,
    chunk_trailer_length,
    make_chunk_trailer,
)

PREFIX = "kvtiers"
TRAILER_BYTES = CHUNK_TRAILER_BYTES  # 40

__all__ = ["PREFIX", "TRAILER_BYTES", "CorruptChunk", "check_chunk_trailer", "chunk_trailer_length",
           "key_from_name", "make_chunk_trailer", "object_name", "object_size"]


def object_name(digest: str, key: bytes) -> str:
    """The Mooncake key of chunk ``key`` in namespace ``digest``."""
    return f"{PREFIX}/{digest}/{key.hex()}"


def key_from_name(name: str, digest: str) -> bytes | None:
    """The chunk key of object ``name`` in namespace ``digest``, or ``None`` if it is not one."""
    head = f"{PREFIX}/{digest}/"
    if not name.startswith(head):
        return None
    try:
        key = bytes.fromhex(name[len(head):])
    except ValueError:
        return None
    return key if key and object_name(digest, key) == name else None


def object_size(payload_bytes: int) -> int:
    """Size of the object holding a payload of ``payload_bytes``."""
    return payload_bytes + TRAILER_BYTES
