"""Where a chunk lives in the bucket and how its bytes are framed.

Object names (any S3 client can find a chunk from its key)::

    <prefix>/<namespace digest>/<h1>/<h2>/<key hex>.bin
    <prefix>/<namespace digest>/config.json

``h1`` and ``h2`` are the first two and the next two hex digits of ``sha256(key)``, so
short or skewed keys still spread evenly; the file name is the full lowercase hex of the
key, so no key escapes its namespace and no two keys alias. An empty ``prefix`` drops the
leading ``<prefix>/``.

Object format: the chunk's bytes followed by a 40-byte trailer (all integers
little-endian unsigned)::

    offset 0        payload          N bytes (the arena slot)
    offset N+0      magic            8 bytes  b"KVTOBJ02"
    offset N+8      payload length   u64      N
    offset N+16     payload xxh3_64  u64      xxhash.xxh3_64(payload, seed=0)
    offset N+24     key xxh3_64      u64      xxhash.xxh3_64(key, seed=0)
    offset N+32     namespace        8 bytes  the namespace digest (16 hex digits) as bytes

An object is valid only if its size is ``N + 40``, the magic matches, the length is
``N``, the namespace is the reader's and both hashes match. The trailer sits after the
payload so a load streams the payload straight into the slot and any data path
(aiobotocore, NIXL) can write it as a second piece. An object whose size is not ``N + 40``
but whose last 40 bytes are a valid trailer for the same key and namespace holds a chunk of
another size (an arena of another slot size on the same namespace): a reader leaves it
alone (:func:`tail_payload_length`). Objects of the first format (``KVTOBJ01``, a 32-byte
trailer without the namespace) are treated as corrupt.
"""

from __future__ import annotations

import hashlib

from kvtiers.types import (
    CHUNK_TRAILER,
    CHUNK_TRAILER_BYTES,
    CHUNK_TRAILER_MAGIC,
    CorruptChunk,
    check_chunk_trailer,
    chunk_trailer_length,
    make_chunk_trailer,
    namespace_bytes,
)

# the trailer code is the SDK's (kvtiers.types), shared with the mooncake tier; these names stay
MAGIC = CHUNK_TRAILER_MAGIC
TRAILER = CHUNK_TRAILER
TRAILER_BYTES = CHUNK_TRAILER_BYTES  # 40
CONFIG_NAME = "config.json"
SUFFIX = ".bin"
CorruptObject = CorruptChunk  # an object that is short, long, or fails its trailer checks
make_trailer = make_chunk_trailer
check_trailer = check_chunk_trailer
tail_payload_length = chunk_trailer_length
__all__ = ["CorruptObject", "SizeMismatch", "check_trailer", "make_trailer", "namespace_bytes",
           "tail_payload_length"]


class SizeMismatch(CorruptObject):
    """An object whose size is not the expected one (``size``: its size, when known): corrupt,
    or a chunk of another size; :func:`tail_payload_length` on its last bytes tells which."""

    def __init__(self, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.size = size


def normalise_prefix(prefix: str) -> str:
    """``prefix`` without leading/trailing slashes; rejects empty or ``.``/``..`` segments."""
    p = prefix.strip("/")
    if p and any(seg in ("", ".", "..") for seg in p.split("/")):
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    return p


def namespace_dir(prefix: str, digest: str) -> str:
    """``<prefix>/<digest>/`` (or ``<digest>/`` for an empty prefix)."""
    return f"{prefix}/{digest}/" if prefix else f"{digest}/"


def config_name(prefix: str, digest: str) -> str:
    """The name of the namespace document."""
    return namespace_dir(prefix, digest) + CONFIG_NAME


def object_name(prefix: str, digest: str, key: bytes) -> str:
    """The object name of chunk ``key``."""
    h = hashlib.sha256(key).hexdigest()
    return f"{namespace_dir(prefix, digest)}{h[0:2]}/{h[2:4]}/{key.hex()}{SUFFIX}"


def key_from_name(name: str) -> bytes | None:
    """The key of a chunk object name, or ``None`` if ``name`` is not one."""
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(base[: -len(SUFFIX)])
    except ValueError:
        return None
    if not key or object_name("", "", key).rsplit("/", 3)[-3:] != name.rsplit("/", 3)[-3:]:
        return None
    return key


def object_size(payload_bytes: int) -> int:
    """Size of the object holding a payload of ``payload_bytes``."""
    return payload_bytes + TRAILER_BYTES
