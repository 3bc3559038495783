"""Tenant keys for encryption at rest: which key seals a chunk, chosen by the chunk's tenant.

An ``"encrypt"`` option may hold, besides the default key, a key per tenant
(docs/security.md#tenants)::

    "encrypt": {"tenants": {"alice": {"key_file": "/etc/kvtiers/alice.key"},
                            "bob": {"key_env": "KV_KEY_BOB", "key_id": "bob-2"}},
                "unknown_tenant": "skip"}

A tenant is a string the engine knows per request (vLLM: the request's ``cache_salt``;
:class:`kvtiers.engine.manager.TieringManager`: the ``tenant=`` of ``lookup``, ``store`` and
``load``). The engine passes it with every lookup and job it makes on a tier
(:func:`as_tenant`: the job's keys are that tenant's, or no tenant's, for as long as the job
runs, however many waves it takes); a caller driving a tier itself may instead note keys'
tenants (:func:`note_tenant`) in the wrapper's bounded :class:`TenantBook` right before it
submits them. :meth:`TenantKeys.keyring_for` picks the keys: the tenant's own, or for a
tenant with none, per ``unknown_tenant``, nothing (``"skip"``: the chunk is not offloaded,
and a load of it fails) or the default key (``"default"``). The tenant is bound into the
chunk's associated data, so a chunk sealed for one tenant fails authentication for any
other, whatever key both use. Tenant names never reach logs, errors at run time, metrics or
the medium: :func:`tenant_label` stands for them.

Layer 1: no torch, no engine.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .keys import Keyring

#: the fields of ``"encrypt"`` this module reads
TENANT_FIELDS = ("tenants", "unknown_tenant")
#: what a tenant with no key of its own gets: no offloading, or the default key
UNKNOWN_POLICIES = ("skip", "default")
#: what the core's own fields of ``"encrypt"`` may not be in a tenant's entry
_NOT_IN_ENTRY = ("staging_bytes", "threads", *TENANT_FIELDS)
#: a key noted for two different tenants: offloaded for neither
CONFLICT = object()
#: the fewest keys a :class:`TenantBook` remembers
MIN_BOOK_KEYS = 1 << 16


def tenant_label(tenant: str) -> str:
    """What logs and errors show for ``tenant``: ``t-`` and 12 hex digits of a hash of it
    (the same tenant gives the same label; a vLLM ``cache_salt`` is never printed)."""
    return "t-" + hashlib.sha256(b"kvtiers tenant label\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def tenant_aad(tenant: str | None) -> bytes:
    """What a chunk's associated data adds for ``tenant`` after the sealed header: nothing
    without one (the format of chunks sealed before tenants existed)."""
    if tenant is None:
        return b""
    return b"\0kvtiers tenant v1\0" + tenant.encode("utf-8", "surrogatepass")


def check_tenant(tenant: Any) -> str | None:
    """``tenant`` if it is None or a non-empty str; else a ``TypeError`` / ``ValueError``."""
    if tenant is None:
        return None
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
    if not tenant:
        raise ValueError("tenant must be a non-empty str (None: no tenant)")
    return tenant


class TenantKeys:
    """The keys of one ``"encrypt"`` option by tenant: ``default`` (a :class:`Keyring` or
    None), one keyring per configured tenant, and ``unknown`` (``"skip"`` or ``"default"``)
    for tenants with none. ``repr`` shows labels and key ids, never names or keys."""

    def __init__(self, default: Keyring | None, tenants: Mapping[str, Keyring] | None = None,
                 unknown: str = "default") -> None:
        self.default = default
        self.tenants = dict(tenants or {})
        self.unknown = unknown

    def keyring_for(self, tenant: str | None) -> Keyring | None:
        """The keys that seal and open ``tenant``'s chunks, or None: not offloaded. No tenant
        (None): the default key."""
        if tenant is None:
            return self.default
        kr = self.tenants.get(tenant)
        if kr is not None:
            return kr
        return self.default if self.unknown == "default" else None

    def __repr__(self) -> str:
        tenants = {tenant_label(t): kr.current for t, kr in self.tenants.items()}
        return f"TenantKeys(default={self.default!r}, tenants={tenants!r}, unknown_tenant={self.unknown!r})"

    @classmethod
    def from_spec(cls, spec: Any, *, providers: Mapping[str, Callable[[dict], bytes]] | None = None) -> TenantKeys:
        """Load the keys of an ``"encrypt"`` object: the default key (``key_file``,
        ``key_env`` or ``provider``, optional once ``tenants`` is given) and each tenant's.
        A one-line :class:`ConfigError` for anything wrong, never quoting key material."""
        from .keys import _KEY_FIELDS, Keyring

        if not isinstance(spec, Mapping):
            raise ConfigError(f"encrypt: expects an object, got {type(spec).__name__}")
        tenants_spec = spec.get("tenants")
        unknown = spec.get("unknown_tenant", "default" if tenants_spec is None else "skip")
        if unknown not in UNKNOWN_POLICIES:
            raise ConfigError(f"encrypt: 'unknown_tenant' expects one of {', '.join(map(repr, UNKNOWN_POLICIES))}, "
                              f"got {unknown!r}")
        base = {k: v for k, v in spec.items() if k not in TENANT_FIELDS}
        if tenants_spec is None or any(k in base for k in _KEY_FIELDS):
            default: Keyring | None = Keyring.from_spec(base, providers=providers)
        else:
            stray = [k for k in ("key_id", "retired") if k in base]
            if stray:
                raise ConfigError(f"encrypt: {stray[0]!r} belongs to a default key: give key_file, key_env or "
                                  "provider beside it, or move it into a tenant's entry")
            if unknown == "default":
                raise ConfigError("encrypt: 'unknown_tenant': 'default' needs a default key (key_file, key_env "
                                  "or provider)")
            default = None
        tenants: dict[str, Keyring] = {}
        if tenants_spec is not None:
            if not isinstance(tenants_spec, Mapping) or not tenants_spec:
                raise ConfigError("encrypt: 'tenants' expects a non-empty object of tenant name -> key object, "
                                  f"got {type(tenants_spec).__name__}")
            for name, entry in tenants_spec.items():
                tenants[name] = _tenant_keyring(name, entry, providers)
        _check_distinct(default, tenants)
        return cls(default, tenants, unknown)


def _tenant_keyring(name: Any, entry: Any, providers: Mapping[str, Callable[[dict], bytes]] | None) -> Keyring:
    from .keys import Keyring

    if not isinstance(name, str) or not name:
        raise ConfigError(f"encrypt: tenants: a tenant name must be a non-empty string, got {name!r}")
    where = f"encrypt: tenants[{name[:40]!r}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expects a key object, got {type(entry).__name__}")
    bad = [k for k in entry if k in _NOT_IN_ENTRY]
    if bad:
        raise ConfigError(f"{where}: {bad[0]!r} is set for the whole 'encrypt' object, not per tenant")
    try:
        return Keyring.from_spec(entry, providers=providers)
    except ConfigError as e:
        raise ConfigError(f"{where}: {str(e).removeprefix('encrypt: ')}") from None


def _check_distinct(default: Keyring | None, tenants: Mapping[str, Keyring]) -> None:
    """Every key belongs to one owner (the default key or one tenant), by its id and by its
    bytes (compared by :func:`~kvtiers.encryption.keys.key_digest`, never shown): a key
    shared by two owners, under any ids, current or retired, would not keep them apart."""
    owner: dict[str, str] = {}
    by_digest: dict[bytes, tuple[str, str]] = {}
    rings: list[tuple[str, Keyring]] = [("the default key", default)] if default is not None else []
    rings += [(f"tenant {t[:40]!r}", kr) for t, kr in tenants.items()]
    for who, kr in rings:
        for kid in kr.specs:
            if kid in owner:
                raise ConfigError(f"encrypt: key id {kid!r} is configured for {owner[kid]} and for {who}: "
                                  "give each tenant a key (and key id) of its own")
            owner[kid] = who
        for kid, digest in kr.digests.items():
            first = by_digest.get(digest)
            if first is not None and first[0] != who:
                raise ConfigError(f"encrypt: one key is configured for {first[0]} (key id {first[1]!r}) and for "
                                  f"{who} (key id {kid!r}): give each tenant a key of its own")
            by_digest.setdefault(digest, (who, kid))


class TenantBook:
    """Chunk key -> tenant, as noted (:meth:`note`, and every call inside
    :func:`as_tenant`), for the sealing wrapper to find keys noted for two tenants and, for
    calls made without :func:`as_tenant`, to look a key's tenant up when it stores or loads
    it. Bounded (least recently noted first out) at ``capacity`` keys. A key noted for two
    different tenants is :data:`CONFLICT` (offloaded for neither) until it is forgotten."""

    def __init__(self, capacity: int = MIN_BOOK_KEYS) -> None:
        self.capacity = max(1, capacity)
        self._map: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self.conflicts = 0

    def note(self, keys: Iterable[bytes], tenant: str) -> None:
        m = self._map
        for k in keys:
            old = m.get(k)
            if old is None:
                m[k] = tenant
            else:
                if old is not CONFLICT and old != tenant:
                    m[k] = CONFLICT
                    self.conflicts += 1
                m.move_to_end(k)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def get(self, key: bytes) -> Any:
        """The tenant noted for ``key``, :data:`CONFLICT`, or None (never noted)."""
        return self._map.get(key)

    def __len__(self) -> int:
        return len(self._map)


@contextlib.contextmanager
def as_tenant(handle: Any, tenant: str | None) -> Iterator[None]:
    """Inside the block, the lookups and jobs the caller makes on the tier behind ``handle``
    (a :class:`kvtiers.registry.TierHandle`) are ``tenant``'s (None: no tenant's): an
    encrypted tier seals and opens them for that tenant, whatever its book remembers. How the
    engine passes each job's tenant with the job; a no-op for a tier that is not encrypted.
    The scope is per thread and per asyncio task, and callbacks scheduled inside the block
    inherit it; threads started inside do not (:mod:`kvtiers.encryption.scope`)."""
    check_tenant(tenant)
    scope = getattr(getattr(handle, "hooks", None), "tenant_scope", None)
    if scope is None:
        yield
        return
    with scope(tenant):
        yield


def note_tenant(handle: Any, keys: Iterable[bytes], tenant: str | None) -> None:
    """Tell the tier behind ``handle`` (a :class:`kvtiers.registry.TierHandle`) that ``keys``
    are ``tenant``'s, for the lookups and jobs that follow without :func:`as_tenant` (the
    tier's book is bounded: note right before submitting); a no-op for a tier that is not
    encrypted, and for ``tenant`` None."""
    if tenant is None:
        return
    note = getattr(getattr(handle, "hooks", None), "note_tenant", None)
    if note is not None:
        note(keys, tenant)
