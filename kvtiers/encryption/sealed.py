"""The sealed format of one chunk: :func:`seal_into` seals a chunk with AES-256-GCM,
:func:`open_into` checks and opens it, :func:`read_header` reads its header (for the
``kvtiers encrypt`` scan).

A sealed slot (``slot_bytes + 4096`` bytes)::

    header (144 bytes): magic "KVTSEAL1" | key-id length u8 | chunk-key length u8 | 6 zero
      bytes | payload length u64 | nonce (12) | 4 zero bytes | key id (32, zero-padded) |
      chunk key (64, zero-padded) | namespace digest (8)
    ciphertext (payload length) | GCM tag (16) | zeros to the end of the slot

The whole header is the associated data (followed by the chunk's tenant, if it has one:
:mod:`kvtiers.encryption.tenants` picks a key per tenant and binds the tenant in, never
storing it), and a load checks that its chunk key and
namespace digest are those asked for: a chunk copied to another key, namespace or key id
fails. The nonce is 12 fresh random bytes per store.

Layer 1: no torch, no engine. ``cryptography`` is the ``encrypt`` extra.
"""

from __future__ import annotations

import ctypes
import os
import struct

from ..types import PAGE
from ..types import buffer_address as _address
from .keys import MAX_KEY_ID, Keyring
from .tenants import tenant_aad

MAGIC = b"KVTSEAL1"
#: magic | kid len | chunk-key len | pad | payload len | nonce | pad | kid | chunk key | ns digest
HEADER = struct.Struct("<8sBB6xQ12s4x32s64s8s")
TAG_BYTES = 16
NONCE_BYTES = 12
#: bytes a sealed slot adds to ``slot_bytes`` (the header and tag, padded to a page)
OVERHEAD = PAGE
_ZEROS = bytes(OVERHEAD)


class OpenFailed(Exception):
    """A staged chunk that is not an authentic sealed copy of its key: ``reason`` is a
    bounded metric label (format, mismatch, unknown_key, auth)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def sealed_bytes(slot_bytes: int) -> int:
    """The size of a sealed slot for chunks of ``slot_bytes``."""
    return slot_bytes + OVERHEAD


def _ns_bytes(digest: str) -> bytes:
    return bytes.fromhex(digest)[:8]


def seal_into(keyring: Keyring, digest8: bytes, key: bytes, data: memoryview, out: memoryview,
              tenant: str | None = None) -> None:
    """Seal ``data`` (the chunk of ``key``) into ``out`` (``sealed_bytes(len(data))`` long)
    under the current key, with a fresh nonce; ``tenant`` (if any) is bound into the
    associated data (:func:`~kvtiers.encryption.tenants.tenant_aad`), never stored."""
    n = len(data)
    nonce = os.urandom(NONCE_BYTES)
    kid = keyring.current_kid
    header = HEADER.pack(MAGIC, len(kid), len(key), n, nonce, kid, key, digest8)
    h = HEADER.size
    out[:h] = header
    end = h + n + TAG_BYTES
    cipher = keyring.cipher(keyring.current)
    aad = header + tenant_aad(tenant)
    if hasattr(cipher, "encrypt_into"):
        cipher.encrypt_into(nonce, data, aad, out[h:end])
    else:  # cryptography < 44: one more copy
        out[h:end] = cipher.encrypt(nonce, data.tobytes(), aad)
    out[end:] = _ZEROS[:len(out) - end]


def read_header(buf: memoryview | bytes) -> tuple[str, bytes, int, str] | None:
    """``(key id, chunk key, payload length, namespace digest)`` of a sealed chunk's first
    bytes, or None if they are no sealed header (for the ``kvtiers encrypt`` scan)."""
    if len(buf) < HEADER.size or bytes(buf[:8]) != MAGIC:
        return None
    magic, klen, keylen, n, _nonce, kid, key, ns = HEADER.unpack(bytes(buf[:HEADER.size]))
    if not 1 <= klen <= MAX_KEY_ID or not 1 <= keylen <= 64:
        return None
    try:
        return kid[:klen].decode("ascii"), key[:keylen], n, ns.hex()
    except UnicodeDecodeError:
        return None


def open_into(keyring: Keyring, digest8: bytes, key: bytes, sealed: memoryview, out: memoryview,
              tenant: str | None = None) -> str:
    """Check and decrypt the sealed copy of ``key`` (sealed for ``tenant``) into ``out``;
    return the key id it was sealed under. Raises :class:`OpenFailed`: a chunk sealed for
    another tenant, or for none, fails authentication.

    A chunk that fails leaves ``out`` zeroed, never holding the plaintext of a chunk sealed for
    someone else under the same key: GCM decrypts before it checks the tag, so the bytes it
    wrote are wiped before this raises. The caller's slot is the tier's until the job is
    reported (rule 6), so nobody reads it in between, and a load that succeeds costs no copy."""
    n = len(out)
    h = HEADER.size
    head = bytes(sealed[:h])
    if head[:8] != MAGIC:
        raise OpenFailed("format", "not a sealed chunk (no KVTSEAL1 header: stored without encryption?)")
    _m, klen, keylen, plen, nonce, kid_raw, skey, ns = HEADER.unpack(head)
    if plen != n or not 1 <= klen <= MAX_KEY_ID:
        raise OpenFailed("format", f"sealed header says {plen} bytes, slot holds {n}")
    if skey[:keylen] != key or keylen != len(key) or skey[keylen:].strip(b"\0"):
        raise OpenFailed("mismatch", "sealed for another chunk key")
    if ns != digest8:
        raise OpenFailed("mismatch", f"sealed in another namespace ({ns.hex()})")
    try:
        kid = kid_raw[:klen].decode("ascii")
    except UnicodeDecodeError:
        raise OpenFailed("format", "sealed header holds no valid key id") from None
    cipher = keyring.cipher(kid)
    if cipher is None:
        raise OpenFailed("unknown_key", f"sealed under key id {kid!r}, which is not configured")
    end = h + n + TAG_BYTES
    if sealed[end:].tobytes() != _ZEROS[:len(sealed) - end]:  # zeros after the tag: no byte unchecked
        raise OpenFailed("auth", "sealed chunk failed authentication (bytes after the tag)")
    aad = head + tenant_aad(tenant)
    try:
        if hasattr(cipher, "decrypt_into"):
            try:
                cipher.decrypt_into(nonce, sealed[h:end], aad, out)
            except Exception:  # the cipher wrote plaintext before it checked the tag: gone
                _wipe(out)
                raise
        else:  # decrypt() returns nothing unless the tag verifies
            _copy(out, memoryview(cipher.decrypt(nonce, sealed[h:end].tobytes(), aad)))
    except Exception as e:  # cryptography's InvalidTag
        raise OpenFailed("auth", f"sealed chunk failed authentication under key id {kid!r} "
                                 f"(tampered, another key under that id, or sealed for another tenant)") from e
    return kid


#: copies of at least this many bytes go through ``memmove`` with the GIL released
_MEMMOVE_BYTES = 64 << 10


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; a big copy without holding the GIL (opening runs on several threads)."""
    n = len(src)
    if n != len(dst):
        raise ValueError(f"copy of {n} bytes into {len(dst)}")
    if n >= _MEMMOVE_BYTES and not dst.readonly and not src.readonly and dst.contiguous and src.contiguous:
        try:
            ctypes.memmove(_address(dst), _address(src), n)
            return
        except (TypeError, ValueError, BufferError):  # a buffer ctypes cannot address: copy in Python
            pass
    dst[:] = src


def _wipe(buf: memoryview) -> None:
    """Zero ``buf``."""
    if len(buf) >= _MEMMOVE_BYTES and buf.contiguous and not buf.readonly:
        try:
            ctypes.memset(_address(buf), 0, len(buf))
            return
        except (TypeError, ValueError, BufferError):
            pass
    buf[:] = bytes(len(buf))
