"""A process that only contributes memory to a Mooncake pool (``kvtiers mooncake serve``).

It sets up a Mooncake client with a ``global_segment_size`` segment and no engine, as
Mooncake's own store service does, so engine clients can run with ``global_segment_size: 0``
and an engine restart loses nothing. It prints ``ready <hostname>`` once mounted, and runs
until SIGTERM/SIGINT (then unmounts: its objects leave the pool), until ``--parent-pid``
exits, or until ``--exit-when-missing`` disappears. :func:`start_serve` starts one as a
child process (tests, demos, the conformance suite) through :class:`kvtiers.launcher.ChildProcess`.

    python -m kvtiers_mooncake.serve --master 127.0.0.1:50051 --segment 8GiB
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvtiers import TierError
from kvtiers.config import parse_size
from kvtiers.launcher import ChildProcess, file_text


def serve(master: str, segment: int, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
          device_name: str = "", metadata_server: str = "P2PHANDSHAKE", parent_pid: int | None = None,
          exit_when_missing: str | None = None, out=None, ready_file: str | None = None) -> int:
    """Mount a ``segment``-byte segment on ``master`` and hold it until told to stop.
    ``ready_file`` receives the ``ready`` line too, written atomically."""
    from .client import code_name, load_store_module

    out = out or sys.stdout
    store = load_store_module().MooncakeDistributedStore()
    rc = store.setup(local_hostname, metadata_server, segment, 16 << 20, protocol, device_name, master)
    if rc != 0:
        print(f"kvtiers mooncake serve: setup against master {master} failed: {code_name(rc)}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = f"ready {local_hostname} segment={segment} master={master}"
    print(ready, file=out, flush=True)
    if ready_file:
        tmp = f"{ready_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(ready + "\n")
        os.replace(tmp, ready_file)
    while not stop.wait(0.2):
        if parent_pid is not None and not _alive(parent_pid):
            break
        if exit_when_missing is not None and not os.path.exists(exit_when_missing):
            break
    store.close()  # unmounts the segment: the master drops its objects now
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class ServeProcess(ChildProcess):
    """A running ``serve`` child (the launcher's process) and what it contributes."""

    stop_timeout = 10.0  # SIGTERM unmounts its segment: a graceful Mooncake close takes ~2 s

    def __init__(self, argv: list[str], *, master: str, segment: int, **kwargs: Any) -> None:
        super().__init__(argv, name=f"mooncake serve for {master}", **kwargs)
        self.master = master
        self.segment = segment


def start_serve(master: str, segment: int, *, exit_when_missing: str | None = None, timeout: float = 60.0,
                extra: list[str] | None = None, stderr: Any = None) -> ServeProcess:
    """Start ``python -m kvtiers_mooncake.serve`` and wait until its segment is mounted. The
    child exits when this process does (``--parent-pid``) or ``exit_when_missing`` goes.
    ``stderr``: where its output goes (default: an unnamed file that ``log_tail()`` reads)."""
    from .client import missing

    why = missing()
    if why is not None:
        raise TierError(f"mooncake serve: {why}")
    fd, ready_file = tempfile.mkstemp(prefix="kvtiers-mooncake-serve-", suffix=".ready")
    os.close(fd)
    os.unlink(ready_file)
    args = [sys.executable, "-m", "kvtiers_mooncake.serve", "--master", master, "--segment", str(segment),
            "--parent-pid", str(os.getpid()), "--ready-file", ready_file]
    if exit_when_missing:
        args += ["--exit-when-missing", exit_when_missing]
    args += extra or []
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    srv = ServeProcess(args, master=master, segment=segment, ready=file_text(ready_file), env=env, log=stderr)
    try:
        return srv.start(timeout)
    finally:
        Path(ready_file).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtiers_mooncake.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="master_server_address, host:port")
    ap.add_argument("--segment", default="1GiB", help="bytes this process contributes (e.g. 8GiB)")
    ap.add_argument("--local-hostname", default="127.0.0.1")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    ap.add_argument("--device-name", default="")
    ap.add_argument("--metadata-server", default="P2PHANDSHAKE")
    ap.add_argument("--parent-pid", type=int)
    ap.add_argument("--exit-when-missing")
    ap.add_argument("--ready-file", help="a file that receives the 'ready' line once the segment is mounted")
    a = ap.parse_args(argv)
    try:
        segment = parse_size(a.segment)
    except ValueError as e:
        ap.error(f"--segment: {e}")
    if segment <= 0:
        ap.error("--segment must be > 0 (a serve process only contributes memory)")
    return serve(a.master, segment, local_hostname=a.local_hostname, protocol=a.protocol,
                 device_name=a.device_name, metadata_server=a.metadata_server, parent_pid=a.parent_pid,
                 exit_when_missing=a.exit_when_missing, ready_file=a.ready_file)


if __name__ == "__main__":
    sys.exit(main())
