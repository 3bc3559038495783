"""Child processes a tier, a test or a command starts and must stop: one launcher.

The servers kvtiers starts for itself (the p2p tier's peer server, Mooncake's master and its
memory-only ``serve`` process, SeaweedFS for the obj tier) and a third-party tier's own
server in its ``conformance_config`` all go through :class:`ChildProcess`::

    srv = ChildProcess([sys.executable, "-m", "mytier.server", "--port", str(port)], name="mytier server",
                       ready=tcp_listening("127.0.0.1", port)).start(timeout=30)
    ...
    srv.stop()  # SIGTERM by its own PID, SIGKILL after a grace period

``start`` spawns the process and polls its ``ready`` check until that returns something
truthy (kept as :attr:`~ChildProcess.ready_value`); a child that exits first, is not ready in
time, or whose ready check raises, raises :class:`LaunchError` with the last line of its log
(the child and, with ``new_session``, every process of its group are killed then).
Its stdout and stderr go to ``log``: a path (appended to), an open file, ``subprocess.DEVNULL``,
or by default an unnamed temporary file (nothing left on disk) that :meth:`~ChildProcess.log_tail`
reads. Every child still running when this process exits is killed (SIGKILL by PID, its
process group with ``new_session``); ``die_with_parent`` also has the kernel kill it when this
process dies without running exit handlers.

With ``new_session`` the child leads a process group, and the group is what is signalled, also
once the leader has exited (a server that crashed, or exited before it was ready, leaving
helpers it started): the leader is left a zombie until :meth:`~ChildProcess.stop` or
:meth:`~ChildProcess.kill` reaps it, so its process group id cannot belong to anyone else
meanwhile, and it is reaped only after its group was sent SIGKILL. No torch, no command here.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .errors import TierError

__all__ = ["ChildProcess", "LaunchError", "file_text", "free_port", "http_answers", "tcp_listening"]

PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 8192


def inductor_cache_dir(tmpdir: str | None = None) -> str:
    """Where torch keeps its compile cache by default: ``torchinductor_<user>`` in ``tmpdir``
    (default: this process's temporary directory). A child given a temporary directory of its
    own gets this as ``TORCHINDUCTOR_CACHE_DIR``, so that the cache is still shared."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid_{os.getuid()}"
    name = "".join("_" if c in '\\/:*?"<>|' else c for c in name)
    return os.path.join(tmpdir or tempfile.gettempdir(), f"torchinductor_{name}")


class LaunchError(TierError):
    """A child process exited before it was ready, was not ready in time, or its ready check
    failed (it was killed).
    A :class:`~kvtiers.TierError`: the ``kvtiers`` command reports it in one line."""


class ChildProcess:
    """One child process: started, checked ready, stopped and killed by its own PID.

    ``argv``: the command line (subclasses may set it, or override :meth:`command`, before
    ``start``); ``name``: what it is, for messages; ``ready``: a function of no arguments
    polled after the start until it returns something truthy; ``env``: the child's whole
    environment (default: this one's); ``log``: where its output goes (see the module);
    ``new_session``: its own process group, and signals go to the whole group (a server that
    starts helpers of its own); ``die_with_parent``: SIGKILL from the kernel when the thread
    that started it exits (Linux; honoured when started from the main thread).
    ``stop_timeout``: the default grace period of :meth:`stop`; ``private_tmp``: each run gets
    a temporary directory of its own as ``TMPDIR`` (:attr:`tmp_dir` while it runs), removed
    once it has exited, for a server that leaves files there when stopped by a signal
    (vLLM's ZeroMQ sockets, SeaweedFS's); torch's compile cache stays where it was.
    """

    stop_timeout = 5.0

    def __init__(self, argv: Sequence[str] = (), *, name: str = "child process",
                 ready: Callable[[], Any] | None = None, env: Mapping[str, str] | None = None,
                 log: str | os.PathLike | IO | int | None = None, new_session: bool = False,
                 die_with_parent: bool = False, stop_timeout: float | None = None,
                 private_tmp: bool = False) -> None:
        self.argv = list(argv)
        self.name = name
        self.ready = ready
        self.env = dict(env) if env is not None else None
        self.log = log
        self.new_session = new_session
        self.die_with_parent = die_with_parent
        if stop_timeout is not None:
            self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self.ready_value: Any = None
        self._log_file: IO | None = None  # a file this object opened (and closes)
        self._tail = b""  # the log's last bytes, kept when its file is closed
        self._reaped = False  # the leader reaped here (its group killed first): nothing more to signal
        self.private_tmp = private_tmp
        self.tmp_dir: Path | None = None  #: the running child's TMPDIR, with ``private_tmp``

    # -- starting ---------------------------------------------------------------------

    def command(self) -> list[str]:
        """The command line ``start`` runs (``argv``)."""
        return list(self.argv)

    def start(self, timeout: float = 30.0) -> ChildProcess:
        """Spawn the process (unless it is running) and wait until it is ready."""
        if self.alive():
            return self
        if self.proc is not None and not self._reaped:
            self._reap()  # an exited run: its helpers, if any, go before the next one starts
        _reap()
        env = self._private_tmp_env() if self.private_tmp else self.env
        argv = self.command()
        out = self._open_log()
        main = threading.current_thread() is threading.main_thread()
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                close_fds=True, start_new_session=self.new_session,
                preexec_fn=die_with_parent if self.die_with_parent and main else None,
            )  # fmt: skip
        except OSError as e:
            self._close_log()
            self._drop_tmp_dir()
            raise LaunchError(f"{self.name}: cannot run {argv[0]!r}: {e}") from None
        self._reaped = False
        _running.append(self)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30.0) -> Any:
        """Poll the ``ready`` check until it returns something truthy, and return that (also
        kept as ``ready_value``). Raises :class:`LaunchError` if the process exits first,
        after ``timeout`` seconds, or if the check raises (the process, and its group with
        ``new_session``, is killed then)."""
        if self.ready is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.ready()
            except Exception as e:
                self.kill()
                raise LaunchError(f"{self.name}: its ready check failed: {type(e).__name__}: {e}"
                                  f"{self._last_line()}") from e
            if value:
                self.ready_value = value
                return value
            status = None if self.proc is None else self._exit_status()
            if self.proc is None or status is not None:
                why = f"{self.name} exited with status {status} before it was ready{self._last_line()}"
                if self.proc is not None:
                    self.kill()  # helpers it started die with it; its log file is closed now
                raise LaunchError(why)
            if time.monotonic() > deadline:
                self.kill()
                raise LaunchError(f"{self.name} was not ready within {timeout:g} s{self._last_line()}")
            time.sleep(0.02)

    # -- state ------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The child's process id (its process group's too, with ``new_session``)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        return None if self.proc is None else self._exit_status()

    def alive(self) -> bool:
        """Whether it was started and has not exited."""
        return self.proc is not None and self._exit_status() is None

    def _exit_status(self) -> int | None:
        """The exit status if it has exited, else None. With ``new_session`` the exited leader is
        not reaped here (it stays a zombie, holding its process group id, until :meth:`_reap`)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is not None or not self.new_session:
            return proc.poll()
        try:
            r = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by another (a SIGCHLD handler): as Popen sees it
            return proc.poll()
        if r is None:
            return None
        return -r.si_status if r.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else r.si_status

    def _group_alive(self) -> bool:
        """Whether a process of its group, other than the exited leader and zombies, still runs."""
        return bool(self._group_pids())

    def _group_pids(self) -> list[int]:
        """The processes of its group (``new_session``), zombies and the exited leader left out."""
        pgid, pids = self.pid, []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = _stat_fields(f"/proc/{entry}/stat")
            if fields is None or len(fields) < 3 or not fields[2].isdigit():
                continue
            state, pgrp = fields[0], fields[2]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                pids.append(int(entry))
        return pids

    def listens(self, host: str, port: int) -> bool:
        """Whether the child (with ``new_session``: a process of its group) holds a TCP socket
        listening on ``host:port`` (or on every address) now. A ready check that an answer
        from ``host:port`` cannot give: a free port is free only when it was picked, another
        process that binds it first answers there too, and the child then exits unable to
        bind it. Linux reads it from ``/proc``; elsewhere: whether ``host:port`` accepts a
        connection."""
        if not self.alive():
            return False
        inodes = _listening_inodes(host, port)
        if inodes is None:
            return tcp_listening(host, port)()
        if not inodes:
            return False
        pids = self._group_pids() if self.new_session else [self.pid]
        wanted = {f"socket:[{i}]" for i in inodes}
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                        return True
                except OSError:
                    continue
        return False

    # -- stopping ---------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child if running; with ``new_session`` to its process group,
        whether or not the leader still runs (helpers outlive a crashed leader), until reaped."""
        if self.proc is None or self._reaped:
            return
        try:
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            elif self.alive():
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL if it (with ``new_session``: any process of its group) has not
        exited within ``timeout`` seconds (default ``stop_timeout``); wait for it and return its
        exit status."""
        if self.proc is None:
            return None
        timeout = self.stop_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self.signal(signal.SIGCONT)  # a paused child could not act on SIGTERM
        self.signal(signal.SIGTERM)
        while self.alive() or (self.new_session and not self._reaped and self._group_alive()):
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        return self._reap()

    def kill(self) -> int | None:
        """SIGKILL (a crash: nothing of it runs any more); wait for it and return its status."""
        if self.proc is None:
            return None
        self.signal(signal.SIGKILL)
        return self._reap()

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP: the kernel still accepts its connections, nothing answers them. On Linux
        it returns once every thread of the child (with ``new_session``: of its group) is
        stopped, or after ``timeout`` seconds: the signal only marks them, and a thread busy
        in the kernel (a write to a loaded disk) runs on until it returns from there."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not self._all_stopped() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _all_stopped(self) -> bool:
        """Whether every thread of the child (its group's, with ``new_session``) is stopped
        (state ``T``); True where /proc does not say."""
        if self.proc is None or self._reaped or not os.path.isdir("/proc/self/task"):
            return True
        pids = self._group_pids() if self.new_session else [self.pid]
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # gone
            for tid in tids:
                fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                if fields and fields[0] not in ("T", "t", "Z", "X"):
                    return False
        return True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.signal(signal.SIGCONT)

    def _reap(self) -> int | None:
        """Wait for the leader (its group sent SIGKILL first, with ``new_session``: nothing of
        it outlives this), close its log, forget it; its exit status."""
        if self.new_session:
            self.signal(signal.SIGKILL)
        try:
            self.proc.wait(30)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            pass
        else:
            self._reaped = True
        self._close_log()
        if self in _running:
            _running.remove(self)
        if self._reaped:
            self._cleanup()
        return self.proc.poll()  # type: ignore[union-attr]

    def _cleanup(self) -> None:
        """What a run left, once the child is gone: its ``private_tmp`` directory, then
        :meth:`after_exit`."""
        self._drop_tmp_dir()
        self.after_exit()

    def after_exit(self) -> None:
        """Called once the child is gone (after :meth:`stop`, :meth:`kill`, a failed start, or
        a crash that the next :meth:`start` finds), its ``private_tmp`` directory removed: a
        subclass removes there what else a run of its server leaves behind. Nothing here."""

    def _private_tmp_env(self) -> dict[str, str]:
        """A fresh :attr:`tmp_dir` (short: unix socket paths in it must fit 107 bytes) and the
        child's environment with it as ``TMPDIR``."""
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="kvtiers-run-"))
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir(env.get("TMPDIR")))
        env["TMPDIR"] = str(self.tmp_dir)
        return env

    def _drop_tmp_dir(self) -> None:
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    # -- the log ----------------------------------------------------------------------

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the child wrote to its log ("" where it is not readable)."""
        data = self._read_tail()
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def _last_line(self) -> str:
        last = [x for x in self.log_tail(5).splitlines() if x.strip()]
        return f"; its log ends: {last[-1].strip()}" if last else ""

    def _read_tail(self) -> bytes:
        f = self._log_file if self._log_file is not None else self.log
        if isinstance(f, (str, os.PathLike)):
            return _file_tail(Path(f))
        fileno = getattr(f, "fileno", None)
        if fileno is None:  # DEVNULL, a bare descriptor, or an unnamed log already closed
            return self._tail
        try:
            fd = fileno()
            size = os.fstat(fd).st_size
            return os.pread(fd, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
        except (OSError, ValueError):  # closed, or opened write-only by its owner
            return self._tail

    def _open_log(self) -> Any:
        if self.log is None:  # an unnamed file: readable by us, gone from the disk already
            fd, path = tempfile.mkstemp(prefix="kvtiers-child-", suffix=".log")
            os.close(fd)
            self._log_file = open(path, "ab+")
            os.unlink(path)
            return self._log_file
        if isinstance(self.log, (str, os.PathLike)):
            self._log_file = open(self.log, "ab+")
            return self._log_file
        return self.log  # DEVNULL, a descriptor, or the caller's open file

    def _close_log(self) -> None:
        if self._log_file is not None:
            if self.log is None:
                self._tail = self._read_tail()
            self._log_file.close()
            self._log_file = None

    # -- a context manager: started on entry, stopped on exit ---------------------------

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "not started" if self.proc is None else ("running" if self.alive() else f"exited {self.returncode}")
        return f"<{type(self).__name__} {self.name} pid={self.proc.pid if self.proc else None} {state}>"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's choice), for a child that cannot bind
    port 0 and say which port it got."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# -- ready checks ------------------------------------------------------------------------

def file_text(path: str | os.PathLike) -> Callable[[], str | None]:
    """Ready once ``path`` holds text (a child that writes its address there when bound);
    the check returns that text, stripped."""

    def check() -> str | None:
        try:
            return Path(path).read_text().strip() or None
        except FileNotFoundError:
            return None

    return check


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and not yet reaped, does not); True
    where it cannot be told (another user's process)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is not None:
        return fields[0] not in ("Z", "X")
    try:  # no /proc entry: gone, or no /proc here
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/PID/stat`` (or ``/proc/PID/task/TID/stat``) after the command
    name, from the state on; None if it cannot be read (the process is gone)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _listening_inodes(host: str, port: int) -> set[str] | None:
    """The inodes of the TCP sockets listening on ``host:port`` or on every address (IPv4
    and IPv6, from ``/proc/net``); None where ``/proc/net/tcp`` cannot be read."""
    try:
        want = {socket.inet_aton(host), b"\0" * 4}
    except OSError:
        want = {b"\0" * 4}
    found: set[str] = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            if v6:
                continue
            return None
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            addr, _, hexport = fields[1].partition(":")
            if int(hexport, 16) != port:
                continue
            raw = bytes.fromhex(addr)  # in 32-bit words of host byte order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
            if v6:  # "::" listens on every address; "::ffff:a.b.c.d" is that IPv4 address
                if raw == b"\0" * 16:
                    found.add(fields[9])
                    continue
                if raw[:12] != b"\0" * 10 + b"\xff\xff":
                    continue
                raw = raw[12:]
            if raw in want:
                found.add(fields[9])
    return found


def tcp_listening(host: str, port: int) -> Callable[[], bool]:
    """Ready once ``host:port`` accepts a TCP connection."""

    def check() -> bool:
        try:
            socket.create_connection((host, port), 0.2).close()
            return True
        except OSError:
            return False

    return check


def http_answers(url: str) -> Callable[[], bool]:
    """Ready once ``url`` answers an HTTP request, with any status (a 403 is an answer)."""

    def check() -> bool:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    return check


# -- bookkeeping -------------------------------------------------------------------------

_running: list[ChildProcess] = []  # started here and not yet reaped


def flock_held(path: str) -> bool | None:
    """Whether some process holds a ``flock`` on ``path``: True (held), False (free), None
    (unknown: the file cannot be opened, or the file system has no locks). A missing file
    raises ``FileNotFoundError``. Never blocks: ``O_NONBLOCK`` open, non-blocking lock attempt;
    a lock taken here is released at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # and with it the lock just taken, if it was
    return False


def _file_tail(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - _TAIL_BYTES))
            return f.read()
    except OSError:
        return b""


def _reap() -> None:
    """Release what children that exited on their own still hold (their log files). A
    ``new_session`` child is left to its stop, kill or this process's exit: its helpers may
    still run, and they are its owner's to stop."""
    for child in list(_running):
        if child.proc is not None and not child.new_session and child.proc.poll() is not None:
            child._reap()


def die_with_parent() -> None:
    """A ``preexec_fn`` for processes that must not outlive this one (Linux: SIGKILL when
    the thread that started them exits; elsewhere nothing). Runs between fork and exec."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


@atexit.register
def _kill_running() -> None:
    children = list(_running)
    for child in children:
        child.signal(signal.SIGCONT)
        child.signal(signal.SIGKILL)
    for child in children:  # what they leave, once they are gone (a second at most each)
        try:
            child.proc.wait(1)  # type: ignore[union-attr]
            child._cleanup()
        except Exception:  # at exit: whatever is left stays
            pass
