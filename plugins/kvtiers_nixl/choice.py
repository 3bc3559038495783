"""Whether a user of NIXL in this process gets it, and which data path each one uses.

:func:`use_nixl` is called where a tier, server or ``serve`` block opens its NIXL path:
it runs (or reuses) the canary; a failed canary means the caller takes its fallback, with
one warning per caller and cause naming both, or, with ``strict``, a ``TierError`` at open.
:func:`data_paths` says what each caller in this process ended up with.
"""

from __future__ import annotations

import logging
import threading

from kvtiers import TierError

from .agents import installed
from .canary import probe

log = logging.getLogger("kvtiers.nixl")

_lock = threading.Lock()
_paths: dict[str, str] = {}  # user -> data path in use
_warned: set[tuple[str, str]] = set()


def use_nixl(user: str, *, fallback: str, backend: str = "UCX", strict: bool = False) -> bool:
    """True if ``user`` (e.g. ``"tier 'p2p'"``) may use NIXL's ``backend`` here, False if
    it must take ``fallback`` (e.g. ``"ZMQ"``) because NIXL's canary crashed, hung or failed
    in a child process. Raises :class:`~kvtiers.TierError` if nixl-cu12 is missing, or if the
    canary failed and ``strict`` is set."""
    why = installed()
    if why is not None:
        raise TierError(f"{user}: backend 'nixl': {why}")
    verdict = probe(backend)
    if verdict.ok:
        record(user, "nixl")
        return True
    if strict:
        raise TierError(f"{user}: NIXL is unsafe in this process ({verdict.cause}); "
                        f"nixl_strict is set, so this is an error instead of a fall back to {fallback}")  # fmt: skip
    with _lock:
        first = (user, verdict.cause or "") not in _warned
        _warned.add((user, verdict.cause or ""))
    if first:
        log.warning("%s: NIXL is off in this process: %s; using %s instead (docs/p2p.md, 'NIXL and RDMA drivers')",
                    user, verdict.cause, fallback)
    record(user, fallback.lower())
    return False


def record(user: str, path: str) -> None:
    """Note that ``user`` uses data path ``path`` in this process."""
    with _lock:
        _paths[user] = path


def data_paths() -> dict[str, str]:
    """Each NIXL-capable user of this process and the data path it uses (``"nixl"``, or its
    fallback: ``"zmq"``, ``"aiobotocore"``)."""
    with _lock:
        return dict(_paths)


class PathGauge:
    """The gauge ``kvtiers_tier_data_path{tier, path}`` of one tier: 1 for the data path it
    uses. :meth:`report` is cheap and may be called from a hook on every call: it sets the
    gauge at most once a second (the tier's name is known only once a manager has it)."""

    def __init__(self, ctx: object, path: str) -> None:
        from kvtiers.metrics import tier_metrics

        self.path = path
        self._gauge = tier_metrics(ctx).gauge(
            "kvtiers_tier_data_path", "1 for the data path the tier uses (nixl or its fallback)", ["path"]
        ).labels(path=path)
        self._next = 0.0

    def report(self) -> None:
        """Set the gauge (at most once a second)."""
        import time

        now = time.monotonic()
        if now >= self._next:
            self._next = now + 1.0
            self._gauge.set(1)
