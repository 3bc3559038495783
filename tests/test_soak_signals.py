"""How the soaks end when told to: a SIGTERM is Ctrl-C inside ``terminated_is_interrupt``
(the soak stops through its own cleanup and keeps what it sampled), and a process started
with ``die_with_parent`` in a session of its own (vLLM's client in ``bench serve --soak``)
does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from test_fs_helpers import wait_for


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_inside_is_a_keyboard_interrupt_and_the_handler_comes_back():
    code = textwrap.dedent("""
        import os, signal, time
        from kvtiers.commands.bench.soak import terminated_is_interrupt
        try:
            with terminated_is_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        print("default again", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["interrupted", "default again True"]


def test_a_child_in_its_own_session_dies_with_its_parent():
    code = textwrap.dedent("""
        import subprocess, sys, time
        from kvtiers.launcher import die_with_parent
        p = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=die_with_parent)
        print(p.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait(30)
        wait_for(lambda: not _alive(child), timeout=30, what="the child to die with its parent")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        parent.stdout.close()
