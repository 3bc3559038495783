"""The aiobotocore side: client configuration, a zero-copy request body, error helpers.

Imported only when an ``obj`` tier is opened, so the plugin module (and ``kvtiers
tiers``) work where aiobotocore is not installed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp.payload
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from botocore import UNSIGNED
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

__all__ = [
    "AioSession", "BotoCoreError", "ChunkBody", "ClientError", "chain_credentials", "client_config", "error_code",
    "get_session", "shared_session", "timeout_kind",
]  # fmt: skip

PIECE = 1 << 20
_session: AioSession | None = None
#: seconds an empty answer of the credential chain is believed (same ``AWS_*`` environment)
NO_CREDENTIALS_TTL = 60.0
_none_found: tuple[float, int] | None = None  # (believed until, hash of the AWS_* environment)


def shared_session() -> AioSession:
    """One aiobotocore session per process: it caches the S3 service model (loading it
    takes ~0.1 s) and the credentials the chain found across tier instances (an empty
    answer is kept by :func:`chain_credentials`)."""
    global _session
    if _session is None:
        _session = get_session()
    return _session


async def chain_credentials(session: AioSession) -> Any | None:
    """The default AWS credential chain's credentials, or None when it finds none.

    botocore keeps credentials it found, but walks the whole chain again each time it found
    none, the instance metadata service included: 70-100 ms per tier opened unsigned here,
    seconds where nothing answers at 169.254.169.254. So "none" is believed for
    :data:`NO_CREDENTIALS_TTL` seconds while the ``AWS_*`` environment stays the same
    (credentials set there are used at the next open). One answer is kept per process: pass
    :func:`shared_session`."""
    global _none_found
    env = hash(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    if _none_found is not None and _none_found[1] == env and time.monotonic() < _none_found[0]:
        return None
    creds = await session.get_credentials()
    _none_found = None if creds is not None else (time.monotonic() + NO_CREDENTIALS_TTL, env)
    return creds


# From Python 3.12 the selector transport may keep a reference to unsent memory instead of
# copying it; a cancelled upload must not read the slot after its job is reported, so
# there each piece is copied (1 MiB at a time) before it is handed to the transport.
_COPY_PIECES = sys.version_info >= (3, 12)


class ChunkBody(aiohttp.payload.Payload):
    """A request body made of buffers sent back to back, without joining them.

    botocore sees a sized, "seekable" body (so retries resend it); aiohttp sends each
    buffer in 1 MiB pieces straight from the arena slot.
    """

    def __init__(self, parts: Sequence[memoryview | bytes]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        super().__init__(None, content_type="application/octet-stream")
        self._size = sum(len(p) for p in self._parts)

    def __len__(self) -> int:
        return self._size

    def seek(self, offset: int, whence: int = 0) -> int:  # botocore rewinds bodies before a retry
        return 0

    def tell(self) -> int:
        return 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a chunk body is binary")

    async def write(self, writer) -> None:
        for part in self._parts:
            for off in range(0, len(part), PIECE):
                piece = part[off : off + PIECE]
                await writer.write(bytes(piece) if _COPY_PIECES else piece)


def client_config(
    *,
    max_pool_connections: int,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
    addressing_style: str,
    unsigned: bool = False,
) -> AioConfig:
    """The client settings the tier (and the bench's baseline) use.

    Payload signing and botocore's own request/response checksums are off: every object
    carries its own xxh3 trailer, verified on load. ``parameter_validation`` is off so the
    zero-copy :class:`ChunkBody` passes as a body.
    """
    kwargs = {}
    if unsigned:
        kwargs["signature_version"] = UNSIGNED
    return AioConfig(
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"max_attempts": max_attempts, "mode": "standard"},
        s3={"addressing_style": addressing_style, "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        parameter_validation=False,
        tcp_keepalive=True,
        **kwargs,
    )


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ``ClientError`` (``NoSuchKey``, ``404``, ...), else ``""``."""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code", "") or "")
        if not code:
            code = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return code
    return ""


def http_status(exc: BaseException) -> int:
    """The HTTP status of a ``ClientError``, else 0."""
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def is_missing(exc: BaseException) -> bool:
    """A 404 for an object."""
    return error_code(exc) in ("NoSuchKey", "404", "NotFound") or http_status(exc) == 404


def is_exists(exc: BaseException) -> bool:
    """A failed ``If-None-Match: *`` precondition: the object is already there."""
    return error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict") or http_status(exc) in (
        409,
        412,
    )


def timeout_kind(exc: BaseException) -> str | None:
    """``"read"`` or ``"connect"`` for botocore's timeout errors (after its retries), else ``None``."""
    if isinstance(exc, ReadTimeoutError):
        return "read"
    if isinstance(exc, ConnectTimeoutError):
        return "connect"
    return None
