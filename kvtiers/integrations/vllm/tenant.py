"""The tenant of a vLLM request (its ``cache_salt``), carried to kvtiers' secondary tiers.

vLLM's offloading scheduler builds one ``ReqContext`` per request
(``offloading.scheduler._create_req_context``) and hands it to every tier call: ``lookup``,
``on_new_request``, and each store and promotion job (``TransferJob.req_context``). The
context holds no ``cache_salt`` (vLLM 0.32 and 0.33), but it has per-request scratch space
keyed by type (``set_state`` / ``get_state``). :func:`install` wraps
``_create_req_context`` (``(req)`` on vLLM 0.32 and 0.33, ``(req, scheduler)`` on 0.34)
once per process so that the context of a request with a
``cache_salt`` also holds a :class:`Tenant`; :func:`tenant_of` reads it back. A context
without one (no salt, a peer's lookup, a vLLM whose scheduler lacks the function) has no
tenant: an encrypted tier then uses its default key, or offloads nothing when it has only
tenant keys (docs/security.md#tenants).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvtiers.integrations.vllm")

_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"


@dataclass(frozen=True)
class Tenant:
    """A request's tenant in its ``ReqContext`` (``get_state(Tenant)``): its ``cache_salt``."""

    name: str

    def __repr__(self) -> str:  # a cache_salt is a secret of its tenant's: never printed
        from ...encryption.tenants import tenant_label

        return f"Tenant({tenant_label(self.name)})"


def install() -> bool:
    """Make vLLM's offloading scheduler put each salted request's :class:`Tenant` into its
    ``ReqContext``; idempotent. False (logged) where this vLLM has no such function."""
    try:
        import importlib

        mod = importlib.import_module(_MODULE)
    except ImportError as e:
        log.info("kvtiers: no vLLM offloading scheduler (%s): requests carry no tenant", e)
        return False
    create = getattr(mod, "_create_req_context", None)
    if create is None:
        log.warning("kvtiers: this vLLM's offloading scheduler has no _create_req_context: requests carry no "
                    "tenant (cache_salt), so tenant keys of encrypted tiers go unused")
        return False
    if getattr(create, "_kvtiers_tenant", False):
        return True

    def create_with_tenant(req: Any, *args: Any, **kwargs: Any) -> Any:  # vLLM 0.34 also passes the scheduler
        ctx = create(req, *args, **kwargs)
        salt = getattr(req, "cache_salt", None)
        if salt and isinstance(salt, str):
            ctx.set_state(Tenant(salt))
        return ctx

    create_with_tenant._kvtiers_tenant = True  # type: ignore[attr-defined]
    create_with_tenant.__wrapped__ = create  # type: ignore[attr-defined]
    mod._create_req_context = create_with_tenant
    return True


def tenant_of(req_context: Any) -> str | None:
    """The tenant a ``ReqContext`` carries (its request's ``cache_salt``), or None."""
    get = getattr(req_context, "get_state", None)
    if get is None:
        return None
    t = get(Tenant)
    return t.name if isinstance(t, Tenant) else None
