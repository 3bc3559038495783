"""Engine keys as tier keys.

kvtiers keys are 1-64 bytes. vLLM's keys (a block hash and a 4-byte group index) and
SGLang's page hashes fit after at most a hex decode; a longer key is replaced by its
SHA-256 digest, so two distinct engine keys still never alias.
"""

from __future__ import annotations

import hashlib

from ..types import MAX_KEY_LEN


def tier_key(key: bytes) -> bytes:
    """``key`` itself when it is 1-64 bytes long, else its 32-byte SHA-256 digest."""
    key = bytes(key)
    if 1 <= len(key) <= MAX_KEY_LEN:
        return key
    return hashlib.sha256(b"kvtiers-long-key\0" + key).digest()


def page_key(page_hash: str, piece: int | None = None) -> bytes:
    """The tier key of an SGLang page hash (a hex string, usually SHA-256), and of one of
    its pieces (K, V, a layer's plane) when a page is stored piece by piece."""
    try:
        raw = bytes.fromhex(page_hash)
    except ValueError:
        raw = b""
    if not raw or len(raw) > MAX_KEY_LEN - 2:
        raw = hashlib.sha256(page_hash.encode()).digest()
    return raw if piece is None else raw + piece.to_bytes(2, "big")
