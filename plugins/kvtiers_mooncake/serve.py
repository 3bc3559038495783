"""A process that only contributes memory to a Mooncake pool (``kvtiers mooncake serve``).

It sets up a Mooncake client with a ``global_segment_size`` segment and no engine, as
Mooncake's own store service does, so engine clients can run with ``global_segment_size: 0``
and an engine restart loses nothing. It prints ``ready <hostname>`` once mounted, and runs
until SIGTERM/SIGINT (then unmounts: its objects leave the pool), until ``--parent-pid``
exits, or until ``--exit-when-missing`` disappears. :func:`start_serve` starts one as a
child process (tests, demos, the conformance suite).

    python -m kvtiers_mooncake.serve --master 127.0.0.1:50051 --segment 8GiB
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_children: list[subprocess.Popen] = []


def parse_size(text: str | int) -> int:
    """``1048576``, ``512K``, ``64MiB``, ``8GiB`` -> bytes (binary units); ``ValueError`` else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512K, 64MiB, 8GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def serve(master: str, segment: int, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
          device_name: str = "", metadata_server: str = "P2PHANDSHAKE", parent_pid: int | None = None,
          exit_when_missing: str | None = None, out=None) -> int:
    """Mount a ``segment``-byte segment on ``master`` and hold it until told to stop."""
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
    print(f"ready {local_hostname} segment={segment} master={master}", file=out, flush=True)
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


@dataclass
class ServeProcess:
    """A running ``serve`` child: its process and what it contributes."""

    proc: subprocess.Popen
    master: str
    segment: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (it unmounts its segment), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the segment dies with its objects (the master learns after client_ttl)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def start_serve(master: str, segment: int, *, exit_when_missing: str | None = None, timeout: float = 60.0,
                extra: list[str] | None = None, stderr=subprocess.DEVNULL) -> ServeProcess:
    """Start ``python -m kvtiers_mooncake.serve`` and wait until its segment is mounted. The
    child exits when this process does (``--parent-pid``) or ``exit_when_missing`` goes."""
    args = [sys.executable, "-m", "kvtiers_mooncake.serve", "--master", master, "--segment", str(segment),
            "--parent-pid", str(os.getpid())]
    if exit_when_missing:
        args += ["--exit-when-missing", exit_when_missing]
    args += extra or []
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env,
                            close_fds=True, text=True)
    _children.append(proc)
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = box[0] if box else ""
    if not line.startswith("ready"):
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"mooncake serve for {master} did not mount its segment within {timeout:g} s "
                           f"(status {proc.returncode})")
    proc.stdout.close()
    return ServeProcess(proc, master, segment)


@atexit.register
def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            p.kill()


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
    a = ap.parse_args(argv)
    try:
        segment = parse_size(a.segment)
    except ValueError as e:
        ap.error(f"--segment: {e}")
    if segment <= 0:
        ap.error("--segment must be > 0 (a serve process only contributes memory)")
    return serve(a.master, segment, local_hostname=a.local_hostname, protocol=a.protocol,
                 device_name=a.device_name, metadata_server=a.metadata_server, parent_pid=a.parent_pid,
                 exit_when_missing=a.exit_when_missing)


if __name__ == "__main__":
    sys.exit(main())
