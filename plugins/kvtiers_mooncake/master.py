"""Starting a real ``mooncake_master`` on loopback (``kvtiers mooncake master``, tests, demos).

The master keeps the pool's metadata in memory: objects, leases, segments. It listens on an
RPC port and a metrics port; either one taken kills it at start, so :func:`start_master`
picks free ports and tries again with new ones if the master exits early. It is stopped by
its own PID (:meth:`MasterProcess.stop`), and killed when the process that started it exits
(``atexit``, and the kernel's parent-death signal where it was started from the main thread).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_children: list[subprocess.Popen] = []
PR_SET_PDEATHSIG = 1


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class MasterProcess:
    """A running ``mooncake_master``: its process and ports."""

    proc: subprocess.Popen
    host: str
    rpc_port: int
    metrics_port: int

    @property
    def address(self) -> str:
        """``host:rpc_port``, what clients take as ``master_server_address``."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (a crash: every object's metadata is lost)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 0.2).close()
        return True
    except OSError:
        return False


def start_master(*, host: str = "127.0.0.1", rpc_port: int = 0, metrics_port: int = 0,
                 client_ttl: float | None = None, default_kv_lease_ttl: int | None = None,
                 eviction_high_watermark_ratio: float | None = None, eviction_ratio: float | None = None,
                 extra: Sequence[str] = (), quiet: bool = True, timeout: float = 30.0,
                 stderr=subprocess.DEVNULL) -> MasterProcess:
    """Start ``mooncake_master`` bound to ``host`` and wait until its RPC port answers.

    Port 0 (the default) picks a free one; with both ports chosen here a start that loses a
    port race is retried with new ports (three tries). ``client_ttl`` (seconds a client is
    alive after its last heartbeat) and ``default_kv_lease_ttl`` (milliseconds) short make
    failure tests fast; ``extra``: more ``--flag=value`` arguments for the master.
    """
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
    main = threading.current_thread() is threading.main_thread()
    last = ""
    for _ in range(tries):
        rp = rpc_port or free_port(host)
        mp = metrics_port or free_port(host)
        while mp == rp:
            mp = free_port(host)
        proc = subprocess.Popen([binary, f"--rpc_port={rp}", f"--metrics_port={mp}", *args_fixed],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                                close_fds=True, preexec_fn=_pdeathsig if main else None)
        _children.append(proc)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and not _listening(host, rp):
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise RuntimeError(f"mooncake_master did not listen on {host}:{rp} within {timeout:g} s")
            time.sleep(0.01)
        if proc.poll() is None:
            return MasterProcess(proc, host, rp, mp)
        last = f"mooncake_master exited with status {proc.returncode} (ports {rp}, {mp})"
    raise RuntimeError(last or "mooncake_master did not start")


@atexit.register
def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
