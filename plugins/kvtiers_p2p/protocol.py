"""The p2p wire protocol (version 1): msgpack headers over ZMQ ROUTER/DEALER, checked
before use.

Every message is a header frame, a msgpack array ``[op, request_id, ...]``, followed by
one data frame for the ops that carry a chunk. Client to server::

    [HELLO,  rid, version, namespace_digest, chunk_bytes, max_bytes|None(, {"nixl": {...}})]
    [LOOKUP, rid, [key, ...]]                       -> [OK, rid, bytes with one 0/1 per key]
    [GET,    rid, [key, ...]]                       -> per key [CHUNK, rid, i, xxh3] + data
                                                       or [MISSING, rid, i]; then [DONE, rid]
    [PUT,    rid, key, xxh3] + data                 -> [OK, rid, [evicted key, ...]]
    [GETN,   rid, [key, ...], [slot index, ...]]    -> as GET, but each chunk is written with
                                                       NIXL into the client's arena slot
                                                       first; CHUNK then has no data frame
    [CANCEL, rid, target_rid]                       (no answer to a GET: it stops streaming; a
                                                       GETN is answered [DONE, target_rid] once
                                                       no write it posted can still land)
    [BYE,    rid]                                   (no answer: the session ends)
    [CORRUPT, rid, namespace_digest, key]           -> [OK, rid, [offset, ...]] ([] if not stored);
                                                       test servers only (``--test-faults``)
    [PIN,    rid, [key, ...], seconds|None, owner]  -> [OK, rid, {"new": [key, ...]}] (the keys this
                                                       owner had not pinned) or [OK, rid, {"why": reason}]
                                                       (refused whole); only to a server whose HELLO
                                                       answer says ``"pins": true``
    [UNPIN,  rid, [key, ...]|None, owner]           -> [OK, rid, pins ended] (None: all of the owner's)

A refusal is ``[ERR, rid, code, message]``. ROUTER/DEALER because one server answers many
clients with pipelined, interleaved replies and a GET streams many chunks: REQ/REP would
allow one outstanding request per socket, PUB/SUB has no way back.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import xxhash

try:  # the tier module imports without the extra (``kvtiers tiers`` lists it); opening one needs it
    import msgpack
except ImportError:  # pragma: no cover - exercised by the wheel test without extras
    msgpack = None

from kvtiers.types import MAX_KEY_LEN

VERSION = 1

HELLO, LOOKUP, GET, PUT, CANCEL, BYE, GETN = 1, 2, 3, 4, 5, 6, 7
CORRUPT = 8  #: fault injection for tests: flip bytes of a stored chunk, keep its xxh3 (no session needed)
PIN, UNPIN = 9, 10  #: lifetime pins (docs/pins.md): an owner is a client instance's token
OK, CHUNK, MISSING, DONE, ERR = 16, 17, 18, 19, 20
REQUEST_OPS = {HELLO: "HELLO", LOOKUP: "LOOKUP", GET: "GET", PUT: "PUT", CANCEL: "CANCEL", BYE: "BYE",
               GETN: "GETN", CORRUPT: "CORRUPT", PIN: "PIN", UNPIN: "UNPIN"}

_BOOT: list[str | None] = []


def boot_id() -> str | None:
    """This host's boot id (Linux), so a peer can tell it runs on the same host; None elsewhere."""
    if not _BOOT:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _BOOT.append(f.read().strip())
        except OSError:
            _BOOT.append(None)
    return _BOOT[0]


MAX_HEADER = 256 * 1024  #: a request header longer than this is malformed
MAX_REPLY_HEADER = 1 << 20  #: a reply lists at most MAX_BATCH keys (evicted ones), or one 0/1 per key
MAX_BATCH = 1024  #: keys per LOOKUP or GET
MAX_RID = (1 << 63) - 1

# error codes of [ERR, rid, code, message]
E_MALFORMED = "malformed"
E_HELLO = "hello-first"
E_MISMATCH = "mismatch"
E_VERSION = "version"
E_BUSY = "busy"
E_FULL = "full"
E_TOO_BIG = "too-big"
E_CORRUPT = "corrupt"
E_CAPACITY = "capacity"
E_NONIXL = "no-nixl"
E_FORBIDDEN = "forbidden"
E_TOO_SMALL = "too-small"


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the message says what was wrong."""


def checksum(data: Any) -> int:
    """The xxh3-64 of a chunk (any buffer)."""
    return xxhash.xxh3_64_intdigest(data)


def pack(*items: Any) -> bytes:
    """One header frame."""
    return msgpack.packb(list(items), use_bin_type=True)


def unpack(frame: bytes | memoryview, *, reply: bool = False) -> list[Any]:
    """Decode a header frame into a list whose first two items are ``op`` and ``rid``;
    raise :class:`ProtocolError` for anything else. ``reply``: a server's answer, whose
    list of evicted keys may be long."""
    limit = MAX_REPLY_HEADER if reply else MAX_HEADER
    if len(frame) > limit:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {limit}")
    try:
        hdr = msgpack.unpackb(
            frame, raw=False, use_list=True, strict_map_key=True,
            max_bin_len=limit, max_str_len=4096, max_array_len=limit // 2 if reply else MAX_BATCH + 8,
            max_map_len=64, max_ext_len=0,
        )  # fmt: skip
    except Exception as e:  # msgpack raises many types for garbage
        raise ProtocolError(f"header is not msgpack ({type(e).__name__})") from None
    if not isinstance(hdr, list) or len(hdr) < 2:
        raise ProtocolError("header is not an array [op, request_id, ...]")
    op, rid = hdr[0], hdr[1]
    if type(op) is not int or type(rid) is not int or not 0 <= rid <= MAX_RID:
        raise ProtocolError("op and request_id must be non-negative integers")
    return hdr


def check_key(key: Any) -> bytes:
    if type(key) is not bytes or not 1 <= len(key) <= MAX_KEY_LEN:
        raise ProtocolError(f"a key must be 1-{MAX_KEY_LEN} bytes")
    return key


def check_keys(keys: Any) -> list[bytes]:
    if type(keys) is not list or len(keys) > MAX_BATCH:
        raise ProtocolError(f"keys must be a list of at most {MAX_BATCH}")
    return [check_key(k) for k in keys]


def check_hash(h: Any) -> int:
    if type(h) is not int or not 0 <= h < (1 << 64):
        raise ProtocolError("checksum must be an unsigned 64-bit integer")
    return h


def check_owner(owner: Any) -> str:
    if type(owner) is not str or not 1 <= len(owner) <= 64:
        raise ProtocolError("a pin's owner must be a string of 1-64 characters")
    return owner


def check_seconds(seconds: Any) -> float | None:
    """A pin's lifetime: ``None`` (until unpinned) or a positive finite number of seconds."""
    if seconds is None:
        return None
    if type(seconds) not in (int, float) or not 0 < seconds < float("inf"):
        raise ProtocolError("a pin's seconds must be a positive number or nil")
    return float(seconds)


def expect_len(hdr: list, n: int, name: str) -> None:
    if len(hdr) != n:
        raise ProtocolError(f"{name} header has {len(hdr)} items, expected {n}")


# -- endpoints -------------------------------------------------------------------------

_TCP = re.compile(r"tcp://(\[[^\]]+\]|[^:/\[\]]+|\*):(\d+|\*)")


@dataclass(frozen=True)
class Endpoint:
    """A parsed ``tcp://HOST:PORT`` (or ``ipc://PATH``)."""

    url: str
    host: str
    port: int | None

    @property
    def loopback(self) -> bool:
        """True for ipc:// and for tcp on 127.0.0.0/8, ::1 or localhost."""
        if self.url.startswith("ipc://"):
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name or '*': assume reachable from outside


def parse_endpoint(url: str) -> Endpoint:
    """Parse a bind or connect address; raise ``ValueError`` naming what is accepted."""
    if isinstance(url, str) and url.startswith("ipc://") and len(url) > 6:
        return Endpoint(url, "", None)
    m = _TCP.fullmatch(url) if isinstance(url, str) else None
    if not m:
        raise ValueError(f"endpoint {url!r} is not tcp://HOST:PORT or ipc://PATH")
    port = None if m.group(2) == "*" else int(m.group(2))
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"endpoint {url!r}: port out of range")
    return Endpoint(url, m.group(1), port)


def tcp_url(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 hosts bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
