"""The services plugins attach to a manager through the config blocks they register
(``register_manager_blocks``; e.g. ``kvtiers_p2p``'s ``serve``), and the guard around every
call the manager makes into one.

A service is the object a block's ``attach(manager, block)`` returned: the manager calls its
``poll()`` each step, on the engine thread, and its ``close()`` once, before the arena goes.
A plugin must not be able to break the engine through it:

- ``poll()`` raises: the service is reported (one error, with its traceback), counted in
  :attr:`ServiceSet.errors` (the metric ``kvtiers_service_errors_total{service,phase}``),
  closed and dropped; the engine's call goes on as if it had not been there.
- ``close()`` raises: reported and counted the same way; everything else still closes.
- ``close()`` hangs: each close runs on a daemon thread of its own and is waited for until a
  deadline, then abandoned with a warning (:attr:`ServiceSet.abandoned`: the manager then
  keeps the arena, which such a service may still read).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from .events import log

__all__ = ["DROP_CLOSE_S", "ServiceSet"]

DROP_CLOSE_S = 5.0  # seconds the close() of a service dropped for a failed poll() gets, then it is abandoned


class ServiceSet:
    """The attached services by block name, and the fault accounting of every call into them."""

    def __init__(self) -> None:
        self.services: dict[str, Any] = {}  # block name -> service (the manager's ``services``)
        self.errors: Counter[tuple[str, str]] = Counter()  # (service, phase) -> calls that raised
        self.abandoned: list[str] = []  # services whose close() had not returned by its deadline

    def failed(self, name: str, phase: str, e: BaseException, then: str) -> None:
        """Count and report, loudly, that service ``name`` raised in ``phase``; ``then``: what
        the manager does about it."""
        self.errors[(name, phase)] += 1
        log.error("kvtiers: service %r (a plugin's config block): %s() raised %s: %s; %s", name, phase,
                  type(e).__name__, e, then, exc_info=(type(e), e, e.__traceback__))

    def poll(self) -> None:
        """Poll every service (engine thread). One that raises is reported, closed (at most
        :data:`DROP_CLOSE_S` seconds) and dropped."""
        for name, service in list(self.services.items()):
            if not self._call(name, service, "poll", "closing and dropping it; the manager goes on without it"):
                del self.services[name]
                self.wait(self.start_close({name: service}), time.monotonic() + DROP_CLOSE_S)

    def start_close(self, services: dict[str, Any] | None = None) -> list[tuple[str, threading.Thread]]:
        """Start closing ``services`` (name -> service; default: every attached one), each on a
        daemon thread of its own; :meth:`wait` for them."""
        closing = []
        services = dict(self.services) if services is None else services
        for name, service in services.items():
            th = threading.Thread(target=self._close_one, args=(name, service), name=f"kvtiers-close-service-{name}",
                                  daemon=True)
            th.start()
            closing.append((name, th))
        return closing

    def wait(self, closing: list[tuple[str, threading.Thread]], end: float) -> list[str]:
        """Wait for the closes :meth:`start_close` started, until ``end`` (``time.monotonic()``);
        those still running then are abandoned with a warning. Returns their names."""
        stuck = []
        for name, th in closing:
            th.join(max(0.0, end - time.monotonic()))
            if th.is_alive():
                stuck.append(name)
                self.abandoned.append(name)
                log.warning("kvtiers: service %r (a plugin's config block): close() had not returned by its deadline; "
                            "abandoned (its thread is left running, the host arena is kept)", name)
        return stuck

    def _close_one(self, name: str, service: Any) -> None:
        self._call(name, service, "close", "the manager closes the rest")

    def _call(self, name: str, service: Any, phase: str, then: str) -> bool:
        """Call the service's ``phase`` method (``poll``, ``close``) where it has one; False
        when it raised (reported through :meth:`failed`, with ``then``)."""
        fn = getattr(service, phase, None)
        if fn is None:
            return True
        try:
            fn()
        except Exception as e:
            self.failed(name, phase, e, then)
            return False
        return True
