"""Starting a peer server in a child process (conformance, tests, bench, demo), through the
one launcher, :class:`kvtiers.launcher.ChildProcess`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtiers import TierError
from kvtiers.launcher import ChildProcess, file_text

_children: list[subprocess.Popen] = []  # every server process this process started


class ServerProcess(ChildProcess):
    """A running p2p server child (``python -m kvtiers_p2p serve``): the launcher's process,
    and the address it bound."""

    def __init__(self, argv: list[str], *, endpoint: str = "", **kwargs: Any) -> None:
        super().__init__(argv, name="p2p server", **kwargs)
        self.endpoint = endpoint

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


def _require_packages() -> None:
    """A one-line TierError unless pyzmq and msgpack import here (the server needs both)."""
    for module, dist in (("zmq", "pyzmq"), ("msgpack", "msgpack")):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise TierError(f"the p2p server needs {dist}, which is not installed: pip install 'kvtiers[p2p]'")


def start_server(*, bind: str = "tcp://127.0.0.1:0", capacity: int = 1 << 30, exit_when_missing: str | None = None,
                 extra: list[str] | None = None, timeout: float = 30.0, env: dict | None = None,
                 stderr: Any = None) -> ServerProcess:
    """Start ``python -m kvtiers_p2p serve`` and wait until it is bound. Port 0 (the
    default) lets the kernel choose a free port; the child writes the address it got.
    The child exits when this process dies, or when ``exit_when_missing`` disappears.
    ``stderr``: where its log and exit statistics go (a file object, ``subprocess.DEVNULL``;
    default: an unnamed file that ``log_tail()`` reads)."""
    _require_packages()
    fd, endpoint_file = tempfile.mkstemp(prefix="kvtiers-p2p-", suffix=".endpoint")
    os.close(fd)
    os.unlink(endpoint_file)
    args = [sys.executable, "-m", "kvtiers_p2p", "serve", "--bind", bind, "--capacity", str(capacity),
            "--endpoint-file", endpoint_file, "--parent-pid", str(os.getpid())]
    if exit_when_missing:
        args += ["--exit-when-missing", exit_when_missing]
    args += extra or []
    srv = ServerProcess(args, ready=file_text(endpoint_file), env=env, log=stderr)
    try:
        srv.start(timeout)
    finally:
        Path(endpoint_file).unlink(missing_ok=True)
        if srv.proc is not None:
            _children[:] = [p for p in _children if p.poll() is None] + [srv.proc]
    srv.endpoint = srv.ready_value
    return srv
