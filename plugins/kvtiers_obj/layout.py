"""Where a chunk lives in the bucket and how its bytes are framed.

Object names (any S3 client can find a chunk from its key)::

    <prefix>/<namespace digest>/<h1>/<h2>/<key hex>.bin
    <prefix>/<namespace digest>/config.json

``h1`` and ``h2`` are the first two and the next two hex digits of ``sha256(key)``, so
short or skewed keys still spread evenly; the file name is the full lowercase hex of the
key, so no key escapes its namespace and no two keys alias. An empty ``prefix`` drops the
leading ``<prefix>/``.

Object format: the chunk's bytes followed by a 32-byte trailer (all integers
little-endian unsigned)::

    offset 0        payload          N bytes (the arena slot)
    offset N+0      magic            8 bytes  b"KVTOBJ01"
    offset N+8      payload length   u64      N
    offset N+16     payload xxh3_64  u64      xxhash.xxh3_64(payload, seed=0)
    offset N+24     key xxh3_64      u64      xxhash.xxh3_64(key, seed=0)

An object is valid only if its size is ``N + 32``, the magic matches, the length is
``N``, and both hashes match. The trailer sits after the payload so a load streams the
payload straight into the slot and any data path (aiobotocore, NIXL) can write it as a
second piece.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

MAGIC = b"KVTOBJ01"
TRAILER = struct.Struct("<8sQQQ")
TRAILER_BYTES = TRAILER.size  # 32
CONFIG_NAME = "config.json"
SUFFIX = ".bin"


class CorruptObject(ValueError):
    """An object that is short, long, or fails its trailer checks."""


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


def make_trailer(key: bytes, payload: memoryview | bytes) -> bytes:
    """The 32-byte trailer for ``payload`` stored under ``key``."""
    return TRAILER.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload), xxhash.xxh3_64_intdigest(key))


def check_trailer(key: bytes, payload: memoryview | bytes, trailer: bytes | bytearray | memoryview) -> None:
    """Raise :class:`CorruptObject` unless ``trailer`` vouches for ``payload`` under ``key``."""
    if len(trailer) != TRAILER_BYTES:
        raise CorruptObject(f"trailer is {len(trailer)} bytes, expected {TRAILER_BYTES}")
    magic, length, digest, key_digest = TRAILER.unpack(trailer)
    if magic != MAGIC:
        raise CorruptObject(f"bad magic {magic!r}")
    if length != len(payload):
        raise CorruptObject(f"trailer says {length} payload bytes, object holds {len(payload)}")
    if key_digest != xxhash.xxh3_64_intdigest(key):
        raise CorruptObject("trailer belongs to another key")
    if digest != xxhash.xxh3_64_intdigest(payload):
        raise CorruptObject("payload checksum mismatch")
