"""Starting a real ``mooncake_master`` on loopback (``kvtiers mooncake master``, tests, demos).

The master keeps the pool's metadata in memory: objects, leases, segments. It listens on an
RPC port and a metrics port; either one taken kills it at start, so :func:`start_master`
picks free ports and tries again with new ones if the master exits early. It is started,
stopped by its own PID (:meth:`MasterProcess.stop`) and killed when the process that started it
exits (``atexit``, and the kernel's parent-death signal where it was started from the main
thread) by the one launcher, :class:`kvtiers.launcher.ChildProcess`.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtiers import TierError
from kvtiers.launcher import ChildProcess, LaunchError, free_port


def master_binary() -> str:
    """The ``mooncake_master`` executable of the installed Mooncake wheel."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    found = shutil.which("mooncake_master")
    if found:
        return found
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.origin:
            inside = Path(spec.origin).parent / "mooncake_master"
            if inside.exists():
                return str(inside)
    except (ImportError, ValueError):
        pass
    raise FileNotFoundError("mooncake_master not found: pip install 'kvtiers[mooncake]'")


class MasterProcess(ChildProcess):
    """A running ``mooncake_master`` (the launcher's process) and its ports."""

    def __init__(self, argv: Sequence[str], *, host: str, rpc_port: int, metrics_port: int, **kwargs: Any) -> None:
        # its own listener, not only an answer: a port taken by another process between our
        # probe and the master's bind answers as well (the master then exits: new ports)
        super().__init__(argv, name="mooncake_master", ready=lambda: self.listens(host, rpc_port), **kwargs)
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port

    @property
    def address(self) -> str:
        """``host:rpc_port``, what clients take as ``master_server_address``."""
        return f"{self.host}:{self.rpc_port}"


def start_master(*, host: str = "127.0.0.1", rpc_port: int = 0, metrics_port: int = 0,
                 client_ttl: float | None = None, default_kv_lease_ttl: int | None = None,
                 eviction_high_watermark_ratio: float | None = None, eviction_ratio: float | None = None,
                 extra: Sequence[str] = (), quiet: bool = True, timeout: float = 30.0,
                 stderr: Any = None) -> MasterProcess:
    """Start ``mooncake_master`` bound to ``host`` and wait until its RPC port answers.

    Port 0 (the default) picks a free one; with both ports chosen here a start that loses a
    port race is retried with new ports (three tries). ``client_ttl`` (seconds a client is
    alive after its last heartbeat) and ``default_kv_lease_ttl`` (milliseconds) short make
    failure tests fast; ``extra``: more ``--flag=value`` arguments for the master.
    ``stderr``: where its output goes (default: an unnamed file that ``log_tail()`` reads).
    """
    from .client import missing

    why = missing()
    if why is not None:
        raise TierError(f"mooncake_master: {why}")
    args_fixed = [f"--rpc_address={host}", f"--metrics_host={host}"]
    if client_ttl is not None:
        args_fixed.append(f"--client_ttl={int(client_ttl) if float(client_ttl).is_integer() else client_ttl}")
    if default_kv_lease_ttl is not None:
        args_fixed.append(f"--default_kv_lease_ttl={int(default_kv_lease_ttl)}")
    if eviction_high_watermark_ratio is not None:
        args_fixed.append(f"--eviction_high_watermark_ratio={eviction_high_watermark_ratio}")
    if eviction_ratio is not None:
        args_fixed.append(f"--eviction_ratio={eviction_ratio}")
    if quiet:
        args_fixed.append("--minloglevel=2")
    args_fixed += list(extra)
    binary = master_binary()
    tries = 3 if rpc_port == 0 and metrics_port == 0 else 1
    last: LaunchError | None = None
    for _ in range(tries):
        rp = rpc_port or free_port(host)
        mp = metrics_port or free_port(host)
        while mp == rp:
            mp = free_port(host)
        master = MasterProcess([binary, f"--rpc_port={rp}", f"--metrics_port={mp}", *args_fixed], host=host,
                               rpc_port=rp, metrics_port=mp, log=stderr, die_with_parent=True)
        try:
            return master.start(timeout)
        except LaunchError as e:
            if master.returncode is None or master.returncode < 0:  # not ready in time (killed): no retry
                raise
            last = e  # exited early: a port taken between our probe and its bind; new ports
    raise last or LaunchError("mooncake_master did not start")
