"""Keys of the ``"encrypt"`` option: where a key comes from (``key_file``, ``key_env``, a
registered provider), its id, and :class:`Keyring`, the current key and the retired ones
(docs/security.md). No key material is ever printed: errors, logs and ``repr`` name sources
and ids only.

Layer 1: no torch, no engine. ``cryptography`` is the ``encrypt`` extra.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

log = logging.getLogger("kvtiers")

KEY_BYTES = 32
MAX_KEY_ID = 32
_KEY_ID = re.compile(r"^[A-Za-z0-9._:-]{1,32}$")
_SPEC_FIELDS = ("key_file", "key_env", "provider", "key_id", "retired", "staging_bytes", "threads", "tenants",
                "unknown_tenant")
_KEY_FIELDS = ("key_file", "key_env", "provider")
EXTRA_HINT = "pip install 'kvtiers[encrypt]'"


def _aesgcm() -> Any:
    """The AESGCM class, or a one-line :class:`ConfigError` naming the extra."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ConfigError(f"encrypt: needs the 'cryptography' package: {EXTRA_HINT}") from None
    return AESGCM


# -- keys ---------------------------------------------------------------------------------

#: the key of :func:`key_digest`: random per process, so a digest is comparable within one
#: process only and says nothing about the key anywhere else
_DIGEST_KEY = os.urandom(32)


def key_digest(key: bytes) -> bytes:
    """A keyed digest of ``key`` (HMAC-SHA-256 under a random per-process key): equal for
    equal keys, so two configured keys can be compared without keeping or showing either."""
    return hmac.new(_DIGEST_KEY, key, hashlib.sha256).digest()


def key_fingerprint(key: bytes) -> str:
    """The default key id of ``key``: ``fp-`` and 16 hex digits of an HMAC of a constant
    under the key (reveals nothing about the key; the same key gives the same id)."""
    return "fp-" + hmac.new(key, b"kvtiers key id v1", hashlib.sha256).hexdigest()[:16]


def _parse_key_bytes(raw: bytes, what: str) -> bytes:
    """32 raw bytes, or 64 hex digits (whitespace around them ignored). Never echoes the content.
    32 bytes that are all printable text are refused: a passphrase or half a hex key, not
    32 random bytes (which are all printable once in about 10^14 keys)."""
    if len(raw) == KEY_BYTES:
        if all(32 <= b < 127 for b in raw):
            raise ConfigError(f"encrypt: {what} holds 32 bytes of text: expected 32 random raw bytes "
                              "or 64 hex digits (e.g. from 'openssl rand -hex 32')")
        return bytes(raw)
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ConfigError(f"encrypt: {what} holds {len(raw)} bytes: expected 32 raw bytes or 64 hex digits")


def _read_key_file(path: Any) -> bytes:
    """The key in the regular file ``path``. Opened without blocking (``O_NONBLOCK``: a FIFO
    or a device opens at once) and checked to be a regular file before a byte is read, so
    a FIFO, a socket or a terminal is a one-line error, never a hang."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"encrypt: 'key_file' expects a path, got {type(path).__name__}")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"encrypt: cannot read key_file {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"encrypt: key_file {path!r} is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(4 * KEY_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"encrypt: cannot read key_file {path!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if st.st_mode & 0o077:
        log.warning("kvtiers encrypt: key_file %s is readable by group or others (mode %o)", path,
                    stat.S_IMODE(st.st_mode))
    return _parse_key_bytes(raw, f"key_file {path!r}")


def _read_key_env(name: Any) -> bytes:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"encrypt: 'key_env' expects an environment variable name, got {type(name).__name__}")
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"encrypt: environment variable {name!r} (key_env) is not set")
    return _parse_key_bytes(value.encode("utf-8", "replace"), f"environment variable {name!r}")


def _from_provider(spec: Mapping[str, Any], providers: Mapping[str, Callable[[dict], bytes]] | None) -> bytes:
    name = spec["provider"]
    providers = providers or {}
    if not isinstance(name, str) or name not in providers:
        known = ", ".join(sorted(providers)) or "none registered"
        raise ConfigError(f"encrypt: unknown key provider {name!r} (registered: {known})")
    fields = {k: v for k, v in spec.items() if k not in ("provider", "key_id")}
    try:
        key = providers[name](fields)
    except ConfigError:
        raise
    except Exception as e:  # the provider's message is its author's: one line, no traceback
        raise ConfigError(f"encrypt: key provider {name!r} failed: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        n = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ConfigError(f"encrypt: key provider {name!r} returned {n}: expected 32 bytes")
    return bytes(key)


@dataclass(frozen=True)
class KeySpec:
    """One key as configured: where it comes from (never the key itself)."""

    key_id: str
    source: str  # "key_file '/etc/kvtiers/key'", "key_env 'KV_KEY'", "provider 'kms'"

    def __repr__(self) -> str:
        return f"KeySpec({self.key_id!r}, {self.source})"


class Keyring:
    """The keys of one ``"encrypt"`` option: the current one (new stores) and the retired
    ones (loads only), by key id. The key bytes live only inside the AESGCM objects and are
    never printed: ``repr`` shows ids and sources."""

    def __init__(self, current: str, ciphers: Mapping[str, Any], specs: Mapping[str, KeySpec],
                 digests: Mapping[str, bytes] | None = None) -> None:
        self.current = current
        self._ciphers = dict(ciphers)
        self.specs = dict(specs)
        self.current_kid = current.encode("ascii")
        #: key id -> :func:`key_digest` of its key (to tell one key configured twice)
        self.digests = dict(digests or {})

    @property
    def retired(self) -> list[str]:
        """Key ids configured for loads only."""
        return [k for k in self.specs if k != self.current]

    def cipher(self, key_id: str) -> Any | None:
        return self._ciphers.get(key_id)

    def __repr__(self) -> str:
        return f"Keyring(current={self.current!r}, retired={self.retired!r})"

    @classmethod
    def from_spec(cls, spec: Any, *, providers: Mapping[str, Callable[[dict], bytes]] | None = None) -> Keyring:
        """Load the keys of an ``"encrypt"`` object; a one-line :class:`ConfigError` for
        anything wrong (never quoting key material)."""
        if not isinstance(spec, Mapping):
            raise ConfigError(f"encrypt: expects an object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(_SPEC_FIELDS))
        if unknown and "provider" not in spec:  # a provider's own fields go to the provider
            raise ConfigError(f"encrypt: unknown field {unknown[0]!r} (fields: {', '.join(_SPEC_FIELDS)})")
        AESGCM = _aesgcm()
        retired = spec.get("retired", [])
        if not isinstance(retired, list):
            raise ConfigError(f"encrypt: 'retired' expects a list of key objects, got {type(retired).__name__}")
        current_spec = {k: v for k, v in spec.items() if k not in _SPEC_FIELDS or k in (*_KEY_FIELDS, "key_id")}
        ciphers: dict[str, Any] = {}
        specs: dict[str, KeySpec] = {}
        digests: dict[str, bytes] = {}
        current = ""
        for i, one in enumerate([current_spec, *retired]):
            where = "encrypt" if i == 0 else f"encrypt: retired[{i - 1}]"
            if not isinstance(one, Mapping):
                raise ConfigError(f"{where}: expects a key object, got {type(one).__name__}")
            kid, key, source = _load_one(one, where, providers)
            if kid in specs:
                raise ConfigError(f"{where}: key id {kid!r} is configured twice")
            ciphers[kid] = AESGCM(key)
            specs[kid] = KeySpec(kid, source)
            digests[kid] = key_digest(key)
            if i == 0:
                current = kid
        return cls(current, ciphers, specs, digests)


def _load_one(one: Mapping[str, Any], where: str,
              providers: Mapping[str, Callable[[dict], bytes]] | None) -> tuple[str, bytes, str]:
    sources = [k for k in _KEY_FIELDS if k in one]
    if len(sources) != 1:
        what = "none" if not sources else " and ".join(sources)
        raise ConfigError(f"{where}: give exactly one of key_file, key_env, provider (got {what})")
    src = sources[0]
    if src != "provider":
        extra = sorted(set(one) - {src, "key_id"})
        if extra:
            raise ConfigError(f"{where}: unknown field {extra[0]!r} beside {src!r}")
    if src == "key_file":
        key, source = _read_key_file(one["key_file"]), f"key_file {one['key_file']!r}"
    elif src == "key_env":
        key, source = _read_key_env(one["key_env"]), f"key_env {one['key_env']!r}"
    else:
        key, source = _from_provider(one, providers), f"provider {one['provider']!r}"
    kid = one.get("key_id")
    if kid is None:
        kid = key_fingerprint(key)
    elif not isinstance(kid, str) or not _KEY_ID.match(kid):
        raise ConfigError(f"{where}: 'key_id' expects 1-32 of A-Z a-z 0-9 . _ : -, got {kid!r}")
    return kid, key, source


