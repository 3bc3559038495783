"""NIXL agents made and torn down the one way native code survives.

:func:`make_agent` creates a ``nixl_agent`` (no progress thread, no backend but the one
asked for) after :func:`apply_safe_env`; :func:`teardown` destroys it in the process that
made it, in this order: transfer handles released, remote agents removed (UCX endpoints
closed while the worker is alive), memory deregistered (while the buffers still exist),
then the native agent dropped. Agents still alive at interpreter exit are torn down by an
``atexit`` hook in the creating process (never in a forked child), through their owner's
``close`` when one was given, before Python starts freeing modules and buffers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("kvtiers.nixl")

#: Set in the environment (where not set already) before UCX is first loaded; see
#: docs/p2p.md "NIXL and RDMA drivers": nixl-cu12 1.5.1's UCX EFA module (``libuct_ib_efa``)
#: links the system's ``libefa.so.1``, which pulls the system libibverbs and libnl next to
#: the wheel's own copies; the two libnl-route copies crash the process at exit.
SAFE_ENV = {"UCX_MODULES": "^efa"}

_lock = threading.Lock()
_live: dict[int, tuple[Any, int, Callable[[], Any] | None]] = {}  # id(agent) -> (agent, pid, owner close)


def installed() -> str | None:
    """``None`` when ``nixl_cu12`` imports here, else why not (with the pip command)."""
    try:
        from nixl_cu12._api import nixl_agent  # noqa: F401
    except ImportError as e:
        return f"nixl-cu12 is not installed ({e}); pip install 'kvtiers[nixl]'"
    return None


def apply_safe_env() -> None:
    """Put :data:`SAFE_ENV` into ``os.environ`` where the user has not set those names."""
    for name, value in SAFE_ENV.items():
        os.environ.setdefault(name, value)


def make_agent(prefix: str, backend: str, params: dict[str, str] | None = None, *,
               owner_close: Callable[[], Any] | None = None) -> Any:  # fmt: skip
    """A ``nixl_agent`` named ``prefix-<random>`` with ``backend`` created (``"UCX"`` or
    ``"OBJ"``) with ``params``, and NIXL's progress thread off (it spins a whole core even
    when idle). ``owner_close`` (kept weakly if a bound method) is called at exit if the
    agent is still alive then. Raises ``RuntimeError`` if this NIXL lacks the plugin."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    apply_safe_env()
    if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs INFO lines to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    agent = nixl_agent(f"{prefix}-{uuid.uuid4().hex[:12]}", nixl_agent_config(enable_prog_thread=False, backends=[]))
    if backend not in agent.get_plugin_list():
        teardown(agent)
        raise RuntimeError(f"this nixl-cu12 has no {backend} plugin")
    closer: Callable[[], Any] | None = None
    if owner_close is not None:
        closer = weakref.WeakMethod(owner_close) if hasattr(owner_close, "__self__") else (lambda: owner_close)
    with _lock:
        _live[id(agent)] = (agent, os.getpid(), closer)
    try:
        agent.create_backend(backend, dict(params or {}))
    except BaseException:
        teardown(agent)
        raise
    return agent


def teardown(agent: Any, *, handles: Iterable[Any] = (), remotes: Iterable[str] = (),
             regs: Iterable[tuple[Any, list[str]]] = ()) -> None:  # fmt: skip
    """Destroy ``agent`` now, in the safe order: ``handles`` (transfer handles) released,
    ``remotes`` (remote agent names) removed, ``regs`` (``(registration, backends)``)
    deregistered, then the native agent dropped. Failures of one step are logged and do
    not stop the others. Only from the process that made the agent (a forked child leaves
    it alone). Call it only when no transfer of the agent can still be running."""
    if agent is None:
        return
    with _lock:
        rec = _live.pop(id(agent), None)
    if rec is not None and rec[1] != os.getpid():
        return
    for h in handles:
        _quiet("release a transfer", lambda h=h: h.release())
    for name in remotes:
        _quiet(f"remove remote agent {name}", lambda name=name: agent.remove_remote_agent(name))
    for reg, backends in regs:
        _quiet("deregister memory", lambda reg=reg, backends=backends: agent.deregister_memory(reg, backends))
    native = getattr(agent, "agent", None)
    for h in list(getattr(agent, "_leaked_xfer_handles", ())):
        _quiet("release a leaked transfer", lambda h=h: native.releaseXferReq(h))
    if hasattr(agent, "_leaked_xfer_handles"):
        agent._leaked_xfer_handles.clear()
    agent.backends = {}
    agent.agent = native = None  # the native agent goes now (unless a live transfer handle still holds it)


def live_agents() -> int:
    """How many agents this process made and has not torn down."""
    pid = os.getpid()
    with _lock:
        return sum(1 for _, p, _ in _live.values() if p == pid)


def _quiet(what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as e:
        log.debug("nixl: %s failed: %s", what, e)


def _at_exit() -> None:
    pid = os.getpid()
    with _lock:
        recs = [r for r in _live.values() if r[1] == pid]
    for agent, _, closer in recs:
        owner_close = closer() if closer is not None else None
        if owner_close is not None:
            _quiet("close an agent's owner at exit", owner_close)
        teardown(agent)  # no-op if the owner's close tore it down


atexit.register(_at_exit)
