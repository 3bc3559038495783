"""Whose calls these are: the tenant a caller passes with the calls it makes on one encrypted
tier (:func:`kvtiers.encryption.tenants.as_tenant`, docs/security.md#tenants).

The scope lives in a :class:`contextvars.ContextVar`, not in a thread-local: each thread, and
each asyncio task, has a context of its own, so two tasks of one loop, each inside its own
block and awaiting inside it, keep their own tenant. What else carries it is what carries a
context: a callback scheduled inside a block (``loop.call_soon``, ``call_later``,
``create_task``, ``asyncio.to_thread``) is that block's tenant's, even when it runs after the
block ended; a thread (``threading.Thread``, ``loop.run_in_executor``) starts with a context
of its own, so its calls carry no tenant unless it runs under the block's context
(``contextvars.copy_context().run``).

Layer 1: no torch, no engine.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType

#: scope id -> ``(tenant,)`` of every scope entered in this context; one variable for all
#: scopes (a ContextVar per tier would stay referenced by every context that ever set it)
_SCOPES: ContextVar[Mapping[int, tuple[str | None]]] = ContextVar("kvtiers_tenant_scopes",
                                                                   default=MappingProxyType({}))
_ids = itertools.count(1)


class TenantScope:
    """The tenant of the calls made inside :meth:`enter` on one tier, per context (thread,
    asyncio task, or a callback's copied context)."""

    __slots__ = ("_id",)

    def __init__(self) -> None:
        self._id = next(_ids)

    @contextlib.contextmanager
    def enter(self, tenant: str | None) -> Iterator[None]:
        """Inside the block, :meth:`current` in this context is ``(tenant,)``; the block's
        end restores what was before it."""
        token = _SCOPES.set(MappingProxyType({**_SCOPES.get(), self._id: (tenant,)}))
        try:
            yield
        finally:
            _SCOPES.reset(token)

    def current(self) -> tuple[str | None] | None:
        """``(tenant,)`` inside a block of this context (tenant None: no tenant's), or None
        outside every block."""
        return _SCOPES.get().get(self._id)
