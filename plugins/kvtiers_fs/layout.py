"""Where chunks live under ``root_dir`` and what a chunk file holds.

Layout::

    root_dir/<namespace digest>/config.json          the namespace description
    root_dir/<namespace digest>/<h1>/<h2>/<key hex>.bin
    root_dir/<namespace digest>/<h1>/<h2>/<key hex>.<pid>@<host>.<rand>.tmp   (a store in flight)

``h1``/``h2`` are the first two and next two hex digits of xxh3-64 of the key, so short or
skewed keys still spread over 65536 directories. The file name is the full hex of the key:
no key can escape the root and two distinct keys never share a name.

A chunk file is the chunk's bytes at offset 0 (a multiple of 4096 long) followed by one
4096-byte trailer page, so both halves stay O_DIRECT-aligned and one ``preadv`` reads them
into [arena slot, trailer buffer]. The trailer (little-endian)::

    magic "KVTFSCH1" | version u32 | flags u32 | data_len u64 | key_len u32 | pad u32 |
    key (64 bytes, zero-padded) | xxh3-128 of the data (16 bytes) | xxh3-64 of the above (8)

followed by zeros up to 4096 bytes.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct

import xxhash

TRAILER_BYTES = 4096
MAGIC = b"KVTFSCH1"
VERSION = 1
CHUNK_SUFFIX = ".bin"
TEMP_SUFFIX = ".tmp"
CONFIG_NAME = "config.json"

_HEAD = struct.Struct("<8sIIQI4x64s16s")
_TAIL = struct.Struct("<Q")
TRAILER_USED = _HEAD.size + _TAIL.size

_HOST = socket.gethostname().split(".")[0].replace("@", "_")[:32] or "host"


def key_dirs(key: bytes) -> tuple[str, str]:
    """The two directory levels of ``key``: hex digits of a hash of the key."""
    h = xxhash.xxh3_64_hexdigest(key)
    return h[0:2], h[2:4]


def chunk_relpath(key: bytes) -> str:
    """``<h1>/<h2>/<key hex>.bin`` relative to the namespace directory."""
    h1, h2 = key_dirs(key)
    return f"{h1}/{h2}/{key.hex()}{CHUNK_SUFFIX}"


def chunk_path(nsdir: str, key: bytes) -> str:
    """The final path of ``key``'s chunk under namespace directory ``nsdir``."""
    return f"{nsdir}/{chunk_relpath(key)}"


def temp_path(final: str) -> str:
    """A unique temporary name next to ``final``: ``<key hex>.<pid>@<host>.<rand>.tmp``."""
    stem = final[: -len(CHUNK_SUFFIX)]
    return f"{stem}.{os.getpid()}@{_HOST}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def key_of_name(name: str) -> bytes | None:
    """The key of a chunk file name ``<key hex>.bin``, or ``None`` if it is not one."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    stem = name[: -len(CHUNK_SUFFIX)]
    if not stem or len(stem) > 128 or len(stem) % 2:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def temp_owner(name: str) -> tuple[int, str] | None:
    """``(pid, host)`` of a temporary file name, or ``None`` if it is not one of ours."""
    if not name.endswith(TEMP_SUFFIX):
        return None
    parts = name[: -len(TEMP_SUFFIX)].split(".")
    if len(parts) != 3 or "@" not in parts[1]:
        return None
    pid, _, host = parts[1].partition("@")
    try:
        return int(pid), host
    except ValueError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) writes nothing more
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def temp_is_stale(name: str, mtime: float, now: float, stale_after: float) -> bool:
    """A temporary file is stale when its writer (on this host) is gone, or it is older
    than ``stale_after`` seconds (writers on other hosts cannot be asked)."""
    owner = temp_owner(name)
    if owner is None:
        return False
    pid, host = owner
    if host == _HOST and pid != os.getpid() and not _pid_alive(pid):
        return True
    return now - mtime > stale_after


def pack_trailer(buf: memoryview, key: bytes, data_len: int, digest: bytes) -> None:
    """Write the trailer of a chunk of ``data_len`` bytes with xxh3-128 ``digest`` into
    ``buf`` (at least :data:`TRAILER_USED` bytes; the rest of the page must be zero)."""
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, 0, data_len, len(key), key, digest)
    _TAIL.pack_into(buf, _HEAD.size, xxhash.xxh3_64_intdigest(buf[: _HEAD.size]))


def check_trailer(buf: memoryview, key: bytes, data_len: int) -> bytes:
    """Return the data digest recorded in trailer ``buf`` if it describes ``key`` with
    ``data_len`` bytes; raise ``ValueError`` saying what is wrong otherwise."""
    magic, version, _flags, dlen, klen, kbuf, digest = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("bad magic (not a chunk file, or truncated)")
    if _TAIL.unpack_from(buf, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(buf[: _HEAD.size]):
        raise ValueError("trailer checksum mismatch")
    if version != VERSION:
        raise ValueError(f"unknown chunk format version {version}")
    if klen != len(key) or kbuf[:klen] != key:
        raise ValueError("trailer names a different key")
    if dlen != data_len:
        raise ValueError(f"chunk holds {dlen} bytes, slot is {data_len}")
    return digest


def data_digest(data: memoryview) -> bytes:
    """The checksum kept for a chunk's bytes (xxh3-128; releases the GIL)."""
    return xxhash.xxh3_128_digest(data)


def file_bytes(data_len: int) -> int:
    """On-disk size of a chunk file holding ``data_len`` bytes."""
    return data_len + TRAILER_BYTES


def ensure_namespace(root_dir: str, namespace) -> str:
    """Create ``root_dir/<digest>/`` and its ``config.json`` (atomically, once), or check
    the stored one describes ``namespace``; return the namespace directory.

    Raises ``ValueError`` when the digest's directory holds a different description.
    """
    nsdir = os.path.join(os.path.abspath(root_dir), namespace.digest)
    os.makedirs(nsdir, exist_ok=True)
    cfg = os.path.join(nsdir, CONFIG_NAME)
    try:
        with open(cfg, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        tmp = f"{cfg}.{os.getpid()}@{_HOST}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(namespace.document_bytes())
                f.flush()
                os.fsync(f.fileno())
            try:  # link, not rename: a description another instance wrote first wins
                os.link(tmp, cfg)
            except FileExistsError:
                pass
            except OSError:  # file systems without hard links
                if not os.path.exists(cfg):
                    os.rename(tmp, cfg)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        with open(cfg, "rb") as f:
            raw = f.read()
    namespace.check_document(raw, where=cfg)
    return nsdir
