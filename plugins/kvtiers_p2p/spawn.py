"""Starting a peer server in a child process (conformance, tests, bench, demo)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

_children: list[subprocess.Popen] = []


@dataclass
class ServerProcess:
    """A running ``kvtiers_p2p.server`` child: its process, address and port."""

    proc: subprocess.Popen
    endpoint: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def start_server(*, bind: str = "tcp://127.0.0.1:0", capacity: int = 1 << 30, exit_when_missing: str | None = None,
                 extra: list[str] | None = None, timeout: float = 30.0, env: dict | None = None,
                 stderr: Any = subprocess.DEVNULL) -> ServerProcess:
    """Start ``python -m kvtiers_p2p.server`` and wait until it is bound. Port 0 (the
    default) lets the kernel choose a free port; the child writes the address it got.
    The child exits when this process dies, or when ``exit_when_missing`` disappears.
    ``stderr``: where its log and exit statistics go (a file object; default: nowhere)."""
    _reap()
    fd, endpoint_file = tempfile.mkstemp(prefix="kvtiers-p2p-", suffix=".endpoint")
    os.close(fd)
    os.unlink(endpoint_file)
    args = [sys.executable, "-m", "kvtiers_p2p.server", "--bind", bind, "--capacity", str(capacity),
            "--endpoint-file", endpoint_file, "--parent-pid", str(os.getpid())]
    if exit_when_missing:
        args += ["--exit-when-missing", exit_when_missing]
    args += extra or []
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                            close_fds=True)
    _children.append(proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with open(endpoint_file) as f:
                    endpoint = f.read().strip()
                if endpoint:
                    return ServerProcess(proc, endpoint)
            except FileNotFoundError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"p2p server exited with status {proc.returncode} before binding {bind}")
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"p2p server did not bind {bind} within {timeout:g} s")
            time.sleep(0.02)
    finally:
        try:
            os.unlink(endpoint_file)
        except FileNotFoundError:
            pass


def _reap() -> None:
    for p in list(_children):
        if p.poll() is not None:
            _children.remove(p)


@atexit.register
def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            p.kill()
