"""The canary: NIXL's native calls tried in a child process before this process trusts them.

The child (``kvtiers_nixl.canary.main(["UCX"])``) makes two agents with the UCX backend,
registers a buffer with each, WRITEs 1 MiB from one to the other on loopback, checks the
bytes, tears both down (:func:`kvtiers_nixl.agents.teardown`) and exits normally, so that
the library destructors run too (where the RDMA-driver crash of docs/p2p.md strikes).
``OBJ`` makes an agent with the OBJ backend against a loopback HTTP endpoint of its own
that answers 404, registers DRAM and an object, and runs a READ that must fail cleanly.
The child prints one line per stage; the parent (:func:`run`) turns a signal, a hang past
the timeout or an error into a :class:`Verdict` naming the stage.

:func:`probe` caches the verdict per process, and per boot in a small JSON file keyed by
what could change the outcome (NIXL's build, the Python, ``UCX_*``/``NIXL_*``/RDMA and
linker variables, the RDMA driver config, the linker cache). Environment:

* ``KVTIERS_NIXL_CANARY_TIMEOUT``: seconds the child may take (default 30);
* ``KVTIERS_NIXL_CANARY_CACHE``: directory of the per-boot file, or ``off``;
* ``KVTIERS_NIXL_CANARY_FAULT``: read by the child only, for tests: ``segv``, ``abort``,
  ``hang`` or ``error`` at a stage (``segv`` alone: at exit, like the real crash;
  ``segv@transfer``: at that stage).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULT_ENV = "KVTIERS_NIXL_CANARY_FAULT"
TIMEOUT_ENV = "KVTIERS_NIXL_CANARY_TIMEOUT"
CACHE_ENV = "KVTIERS_NIXL_CANARY_CACHE"
DEFAULT_TIMEOUT = 30.0
BACKENDS = ("UCX", "OBJ")
_ENV_PREFIXES = ("UCX_", "NIXL_", "RDMAV_", "IBV_", "LD_", "KVTIERS_NIXL_")
_STAGE = "kvtiers-nixl-canary stage "
_OK = "kvtiers-nixl-canary ok"
_CHILD = "import sys; from kvtiers_nixl.canary import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class Verdict:
    """What the canary found: ``ok``, else ``cause`` (one line naming the signal or error
    and the stage), ``stage`` (the last one reached), ``seconds`` it took, and whether it
    came from the per-boot file (``cached``)."""

    backend: str
    ok: bool
    cause: str | None = None
    stage: str | None = None
    seconds: float = 0.0
    cached: bool = False


_verdicts: dict[tuple, Verdict] = {}  # (backend, the variables that matter) -> verdict
_lock = threading.Lock()


def timeout_s() -> float:
    """The canary's time limit (``KVTIERS_NIXL_CANARY_TIMEOUT``, default 30 s)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def probe(backend: str = "UCX") -> Verdict:
    """The verdict for ``backend`` in this process (for its current ``UCX_*``, ``NIXL_*``,
    RDMA and linker variables): the per-process one, else the per-boot file's, else a
    fresh :func:`run` (one at a time per boot file: concurrent processes wait for the first
    one's verdict)."""
    if backend not in BACKENDS:
        raise ValueError(f"canary backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from .agents import apply_safe_env

    apply_safe_env()  # as make_agent will, so the key and the child see the environment NIXL will run in
    key = (backend, _env_items())
    with _lock:
        if key in _verdicts:
            return _verdicts[key]
        path = _cache_path(backend)
        verdict = None
        if path is None:
            verdict = run(backend)
        else:
            with _locked(path + ".lock"):
                verdict = _read(path)
                if verdict is None:
                    verdict = run(backend)
                    _write(path, verdict)
        _verdicts[key] = verdict
        return verdict


def forget() -> None:
    """Drop this process's verdicts (tests; the per-boot file stays)."""
    with _lock:
        _verdicts.clear()


def run(backend: str = "UCX", timeout: float | None = None) -> Verdict:
    """Run the canary child for ``backend`` now and judge how it ended."""
    timeout = timeout_s() if timeout is None else timeout
    t0 = time.monotonic()
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, backend], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    hung = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    seconds = time.monotonic() - t0
    stages = [line[len(_STAGE):].strip() for line in out.splitlines() if line.startswith(_STAGE)]
    stage = stages[-1] if stages else "start"
    rc = proc.returncode
    if hung:
        cause = f"NIXL's {backend} canary hung for more than {timeout:g} s at '{stage}'"
    elif rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        cause = f"NIXL's {backend} canary process was killed by {name} at '{stage}'"
    elif rc != 0 or _OK not in out:
        last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), f"exit status {rc}")
        cause = f"NIXL's {backend} canary failed at '{stage}': {last[:300]}"
    else:
        return Verdict(backend, True, None, stage, seconds)
    return Verdict(backend, False, cause, stage, seconds)


# -- the per-boot file --------------------------------------------------------------------

def _env_items() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))


def _fingerprint(backend: str) -> str:
    parts: dict[str, object] = {"backend": backend, "python": sys.executable}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts["boot"] = f.read().strip()
    except OSError:
        parts["boot"] = None
    try:
        import importlib.util

        spec = importlib.util.find_spec("nixl_cu12")
        origin = spec.origin if spec is not None else None
        parts["nixl"] = [origin, os.stat(origin).st_mtime_ns] if origin else None
    except (ImportError, OSError, ValueError):
        parts["nixl"] = None
    parts["env"] = _env_items()
    for d in ("/etc/libibverbs.d", "/etc/ld.so.cache", "/dev/infiniband"):
        try:
            st = os.stat(d)
            parts[d] = [st.st_mtime_ns, sorted(os.listdir(d)) if os.path.isdir(d) else st.st_size]
        except OSError:
            parts[d] = None
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _cache_path(backend: str) -> str | None:
    where = os.environ.get(CACHE_ENV, "")
    if where.lower() == "off":
        return None
    if not where:
        where = os.path.join(tempfile.gettempdir(), f"kvtiers-nixl-canary-{os.getuid()}")
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return os.path.join(where, f"{backend.lower()}-{_fingerprint(backend)}.json")


@contextlib.contextmanager
def _locked(path: str):
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(path: str) -> Verdict | None:
    try:
        with open(path) as f:
            d = json.load(f)
        return Verdict(**{**d, "cached": True})
    except (OSError, ValueError, TypeError):
        return None


def _write(path: str, verdict: Verdict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(asdict(verdict), f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


# -- the child ----------------------------------------------------------------------------

def _stage(name: str, fault: str) -> None:
    print(_STAGE + name, flush=True)
    kind, _, at = fault.partition("@")
    if kind and at == name:
        _inject(kind)


def _inject(kind: str) -> None:
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "abort":
        os.abort()
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "error":
        raise RuntimeError("injected canary fault")
    raise SystemExit(f"{FAULT_ENV}: unknown fault {kind!r} (segv, abort, hang or error)")


def _ucx(fault: str) -> None:
    import numpy as np

    from .agents import make_agent, teardown

    _stage("agent", fault)
    a = make_agent("kvtiers-canary-a", "UCX")
    b = make_agent("kvtiers-canary-b", "UCX")
    src = np.random.default_rng().integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    _stage("register", fault)
    ra = a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM", ["UCX"])
    rb = b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM", ["UCX"])
    _stage("connect", fault)
    peer = a.add_remote_agent(b.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    _stage("transfer", fault)
    local = a.get_xfer_descs([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    remote = a.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    handle = a.initialize_xfer("WRITE", local, remote, peer, backends=["UCX"])
    state = a.transfer(handle)
    end = time.monotonic() + 60
    while state == "PROC" and time.monotonic() < end:
        b.get_new_notifs()
        state = a.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"loopback WRITE ended {state}")
    if not np.array_equal(src, dst):
        raise RuntimeError("loopback WRITE landed wrong bytes")
    _stage("teardown", fault)
    teardown(a, handles=[handle], remotes=[peer], regs=[(ra, ["UCX"])])
    teardown(b, regs=[(rb, ["UCX"])])


class _NotFound(BaseHTTPRequestHandler):
    """Answers every request 404 at once (a closed port would have the SDK retry for ~25 s)."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


def _obj(fault: str) -> None:
    import numpy as np

    from .agents import make_agent, teardown

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    _stage("agent", fault)
    params = {"bucket": "kvtiers-canary", "region": "us-east-1", "endpoint_override": f"http://127.0.0.1:{port}",
              "scheme": "http", "use_virtual_addressing": "false", "access_key": "canary", "secret_key": "canary",
              "req_checksum": "required"}  # fmt: skip
    a = make_agent("kvtiers-canary-obj", "OBJ", params)
    buf = np.zeros(8192, dtype=np.uint8)
    _stage("register", fault)
    reg = a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM", ["OBJ"])
    oreg = a.register_memory([(0, 4096, 1, "kvtiers-canary-object")], "OBJ", ["OBJ"])
    _stage("transfer", fault)
    local = a.get_xfer_descs([(buf.ctypes.data, 4096, 0)], "DRAM")
    remote = a.get_xfer_descs([(0, 4096, 1)], "OBJ")
    handle = a.initialize_xfer("READ", local, remote, a.name, backends=["OBJ"])
    try:
        state = a.transfer(handle)
        end = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < end:
            time.sleep(0.005)
            state = a.check_xfer_state(handle)
    except Exception:
        state = "ERR"  # expected: the object is not there
    if state == "PROC":
        raise RuntimeError("a READ from a closed port did not end")
    _stage("teardown", fault)
    teardown(a, handles=[handle], regs=[(oreg, ["OBJ"]), (reg, ["OBJ"])])
    server.shutdown()
    server.server_close()


def main(argv: list[str]) -> int:
    """The child: ``python -m kvtiers_nixl.canary UCX|OBJ``."""
    backend = argv[0] if argv else "UCX"
    if backend not in BACKENDS:
        print(f"canary backend must be one of {', '.join(BACKENDS)}, got {backend!r}", file=sys.stderr)
        return 2
    fault = os.environ.get(FAULT_ENV, "")
    if fault and "@" not in fault:
        fault += "@exit"
    _stage("import", fault)
    import nixl_cu12._api  # noqa: F401

    (_ucx if backend == "UCX" else _obj)(fault)
    _stage("exit", fault)
    print(_OK, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
